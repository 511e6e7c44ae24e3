"""The mixture-of-experts MLP (engine/models/layers/moe.py): routing (softmax, top-k,
renormalised or not, gated shared expert) against a per-token reference, the grouped
expert GEMMs equal to the expert-by-expert loop, the loop (and the gathered
form used while a CUDA graph is captured) taking over where grouped_mm cannot take the operands, and on CUDA (bf16) the grouped path inside a CUDA graph."""
from __future__ import annotations

import copy
import pytest
import torch
import torch.nn.functional as F

from engine.models.config import MoEConfig
from engine.models.layers.moe import SparseMoE


def make_moe(hidden=32, inter=16, experts=6, top_k=2, shared=24, gate=True, norm=True, seed=0, device="cpu",
             dtype=torch.float32):
    torch.manual_seed(seed)
    moe = SparseMoE(hidden, MoEConfig(num_experts=experts, top_k=top_k, intermediate_size=inter,
                                      shared_intermediate_size=shared, shared_expert_gate=gate,
                                      norm_topk_prob=norm))
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.2)
    return moe.to(device=device, dtype=dtype)


def reference(moe: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token, choice by choice, straight from the definition."""
    out = torch.zeros_like(x)
    for n in range(x.shape[0]):
        probs = torch.softmax(moe.router(x[n]).float(), -1)
        top, ids = torch.topk(probs, moe.top_k)
        if moe.norm_topk_prob:
            top = top / top.sum()
        for w, e in zip(top.tolist(), ids.tolist()):
            gate, up = F.linear(x[n], moe.experts_gate_up[e]).chunk(2)
            out[n] += w * F.linear(F.silu(gate) * up, moe.experts_down[e])
        if moe.shared is not None:
            s = moe.shared(x[n])
            out[n] += torch.sigmoid(moe.shared_gate(x[n]))[0] * s if moe.shared_gate is not None else s
    return out


@pytest.mark.parametrize("kw", [{}, dict(norm=False), dict(gate=False), dict(shared=0), dict(top_k=1)])
@torch.no_grad()
def test_moe_matches_the_per_token_definition(kw):
    moe = make_moe(**kw)
    x = torch.randn(13, 32, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(moe(x), reference(moe, x), rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_grouped_expert_gemms_equal_the_expert_loop_and_odd_shapes_take_the_loop():
    import engine.models.layers.moe as moe_mod

    moe = make_moe()
    x = torch.randn(40, 32, generator=torch.Generator().manual_seed(2))
    weights, ids = moe.route(x)
    assert moe_mod.grouped_gemm_ok(x, moe.experts_gate_up, moe.experts_down)  # fp32 rows of 16 B multiples
    grouped = moe.experts(x, weights, ids)
    order = torch.argsort(ids.reshape(-1), stable=True)
    looped = torch.zeros_like(x).index_add_(
        0, order // moe.top_k, moe.loop(x[order // moe.top_k], ids.reshape(-1)[order]) * weights.reshape(-1)[order, None])
    torch.testing.assert_close(grouped, looped, rtol=1e-5, atol=1e-5)
    sorted_x, sorted_ids = x[order // moe.top_k], ids.reshape(-1)[order]
    torch.testing.assert_close(moe.gathered(sorted_x, sorted_ids), moe.loop(sorted_x, sorted_ids), rtol=1e-5,
                               atol=1e-5)  # the graph-capture fallback
    odd = make_moe(hidden=30, inter=7)  # 7 * 4 bytes: grouped_mm refuses; the loop runs
    xo = torch.randn(9, 30, generator=torch.Generator().manual_seed(3))
    assert not moe_mod.grouped_gemm_ok(xo, odd.experts_gate_up, odd.experts_down)
    torch.testing.assert_close(odd(xo), reference(odd, xo), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@torch.no_grad()
def test_moe_on_cuda_matches_the_definition_and_replays_in_a_cuda_graph(dtype):
    """bf16: the grouped GEMMs; fp32 (grouped_mm takes no fp32 on CUDA): the gathered form
    while capturing."""
    moe = make_moe(hidden=256, inter=128, experts=16, top_k=4, shared=128, device="cuda")
    x = torch.randn(64, 256, device="cuda")
    moe, x = moe.to(dtype), x.to(dtype)
    ref = reference(copy.deepcopy(moe).float(), x.float())  # the definition on the same (rounded) weights
    scale = float(ref.abs().max())
    tol = 0.02 * scale if dtype == torch.bfloat16 else 1e-4
    if dtype == torch.bfloat16:
        # Grouped GEMMs against the expert loop on the same routing (bf16 both).
        w, ids = moe.route(x)
        order = torch.argsort(ids.reshape(-1), stable=True)
        tok = order // moe.top_k
        looped = torch.zeros_like(x).index_add_(
            0, tok, (moe.loop(x[tok], ids.reshape(-1)[order]) * w.reshape(-1)[order, None]).to(x.dtype))
        torch.testing.assert_close(moe.experts(x, w, ids).float(), looped.float(), rtol=0, atol=tol)
        # Against the definition where bf16 routing picked the same experts as fp32 routing
        # (a near tie may flip one token's choice under bf16 logits; that is rounding, not
        # the grouped path).
        ids32 = torch.topk(torch.softmax(copy.deepcopy(moe).float().router(x.float()), -1), moe.top_k).indices
        same = (ids.sort(-1).values == ids32.sort(-1).values).all(-1)
        assert float(same.float().mean()) > 0.8
        torch.testing.assert_close(moe(x).float()[same], ref[same], rtol=0.05, atol=tol)
    else:
        torch.testing.assert_close(moe(x).float(), ref, rtol=tol, atol=tol)
    static = x.clone()
    moe(static)  # warm up outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe(static)
    static.copy_(torch.randn_like(static))
    graph.replay()
    torch.testing.assert_close(out.float(), moe(static).float(), rtol=tol, atol=tol)


def test_combine_choices_equals_the_per_token_sum_in_expert_order():
    """combine_choices (a gather back to pair order, then a sum over k) against index_add_
    of each sorted row onto its token, on fresh random routing."""
    from engine.models.layers.moe import combine_choices

    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    n, k, d, experts = 37, 4, 24, 9
    ids = torch.randint(0, experts, (n, k), generator=gen)
    order = torch.argsort(ids.reshape(-1), stable=True)
    y = torch.randn(n * k, d, generator=gen, dtype=torch.float64)
    want = torch.zeros(n, d, dtype=torch.float64).index_add_(0, order // k, y)
    torch.testing.assert_close(combine_choices(y, order, n, k), want, rtol=1e-12, atol=1e-12)
