"""Splicing a signature into a request's caches: re-rotated keys equal keys computed at the
true position, the Triton kernels (interpreter) write what the torch references write,
models without RoPE, placement errors, and the one dispatch table by layer kind."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.cache.manager import CacheConfig, CacheManager
from engine.models.config import FULL, GDN, MAMBA2, SWA
from engine.pic.compute import compute_signature
from engine.pic.errors import SplicePlacementError
from engine.pic.fused import FUSED_LAYERS
from engine.pic.splice import SPLICE_LAYERS, SplicePiece, splice
from engine.runtime.sequence import Sequence
from kernels import apply_rope_reference
from kernels.backend import INTERPRET
from pic_testlib import ATTN, execute, make_request, plain_prefill, rand_ids


def _keys_at(model, tokens, positions, layer=0, dtype=torch.float32):
    """Layer `layer`'s keys of `tokens` (context-free at layer 0) at `positions`, unrotated
    and rotated by the model."""
    with torch.no_grad():
        h = model.blocks[layer].mixer_norm(model.embed(torch.tensor(tokens)))
        mixer = model.mixer(layer)
        _, k0, _, _ = mixer.project(h, torch.zeros(len(tokens), dtype=torch.long))  # unrotated
        _, k, _, _ = mixer.project(h, positions)
    return k0, k


@pytest.mark.parametrize("offset", [37, 5003])
def test_rerotated_keys_equal_keys_computed_at_the_true_position(offset, model_of):
    model = model_of([FULL, GDN])
    seg = rand_ids(24, 3)
    split = 5
    sig = compute_signature(model, seg, [256], split)
    manager = CacheManager.for_model(model, CacheConfig(block_size=16, num_blocks=400, num_slots=1))
    seq = manager.allocate(Sequence("s"))
    manager.ensure_capacity(seq, offset + len(seg))
    seq.num_computed_tokens = offset + split  # the seam positions are not looked at here
    splice(manager, model, seq, [SplicePiece(sig, offset)])
    true_pos = torch.arange(offset + split, offset + len(seg))
    got, _ = manager.layer(0).gather(manager.flat_slots(seq, offset + split, offset + len(seg)))
    k0, k_model = _keys_at(model, seg[split:], true_pos)
    mixer = model.mixer(0)
    exact = apply_rope_reference(k0, true_pos, 2 * mixer.inv_freq.numel(), mixer.inv_freq, torch.float64)
    torch.testing.assert_close(got.double(), exact, rtol=0, atol=2e-6)
    # the model's own float32 angle at p is off by up to ~p * 2**-24 rad
    torch.testing.assert_close(got, k_model, rtol=0, atol=2e-6 + offset * 2 ** -22)


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 (set by tests/conftest.py on a CPU machine)")
def test_triton_kernels_under_the_interpreter_splice_what_the_torch_references_splice(model_of):
    model = model_of([FULL, SWA, GDN])
    a, b = rand_ids(9, 1), rand_ids(13, 2)
    sig_a = compute_signature(model, a, [256], 3)
    sig_b = compute_signature(model, b, [256], 3)
    out = {}
    for kernel in ("torch", "triton"):
        manager = CacheManager.for_model(model, CacheConfig(block_size=4, num_blocks=16, num_slots=1))
        seq = manager.allocate(Sequence(kernel))
        splice(manager, model, seq, [SplicePiece(sig_a, 1, first=True)], kernel=kernel)
        seq.num_computed_tokens += 3  # stands for b's seam
        splice(manager, model, seq, [SplicePiece(sig_b, 1 + len(a))], kernel=kernel)
        out[kernel] = manager
    t, g = out["torch"], out["triton"]
    torch.testing.assert_close(g.layer(0).k_pages, t.layer(0).k_pages, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(g.layer(0).v_pages, t.layer(0).v_pages)
    torch.testing.assert_close(g.layer(1).k, t.layer(1).k, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(g.layer(2).state, t.layer(2).state, rtol=1e-6, atol=1e-6)
    assert g.layer(2).state.abs().sum() > 0


def test_model_without_rope_splices_keys_unchanged(model_of, runner_of, planner_of):
    attn = dataclasses.replace(ATTN, rotary_dim=0)
    model = model_of([MAMBA2, FULL], attention=attn)
    docs, q = [rand_ids(14, 1), rand_ids(11, 2)], rand_ids(4, 3)
    request = make_request([(d, True) for d in docs] + [(q, False)])
    runner = runner_of(model)
    got = execute(planner_of(model, seam=11), runner, request)
    full = plain_prefill(runner, request.prompt_token_ids, [request.num_prompt_tokens])
    torch.testing.assert_close(got.logits[-1], full.logits[-1], rtol=1e-5, atol=1e-5)


def test_splice_refuses_pieces_that_do_not_start_where_the_caches_end(model_of):
    model = model_of([FULL, GDN])
    sig = compute_signature(model, rand_ids(10, 1), [256], 2)
    manager = CacheManager.for_model(model, CacheConfig(block_size=4, num_blocks=16, num_slots=1))
    seq = manager.allocate(Sequence("s"))
    with pytest.raises(SplicePlacementError, match="starts at position 22"):
        splice(manager, model, seq, [SplicePiece(sig, 20)])
    with pytest.raises(SplicePlacementError, match="right behind the anchor"):
        splice(manager, model, seq, [SplicePiece(sig, 0, first=True)])
    seq.num_computed_tokens = 12
    short = compute_signature(model, rand_ids(2, 1), [256], 2)
    with pytest.raises(SplicePlacementError, match="tail is empty"):
        splice(manager, model, seq, [SplicePiece(short, 10)])


def test_splice_and_the_fused_pass_dispatch_on_the_same_layer_kinds(model_of):
    model = model_of([FULL, SWA, GDN, MAMBA2])
    manager = CacheManager.for_model(model, CacheConfig(block_size=4, num_blocks=16, num_slots=1))
    kinds = {type(c) for c in manager.layers}
    assert len(kinds) == 3 and set(SPLICE_LAYERS) == set(FUSED_LAYERS) == kinds


def test_a_layer_cache_without_a_splice_entry_is_refused_by_name(model_of):
    class OddCache:
        pass

    model = model_of([FULL, GDN])
    sig = compute_signature(model, rand_ids(10, 1), [256], 2)
    manager = CacheManager.for_model(model, CacheConfig(block_size=4, num_blocks=16, num_slots=1))
    seq = manager.allocate(Sequence("s"))
    seq.num_computed_tokens = 12
    manager.layers[1] = OddCache()
    with pytest.raises(SplicePlacementError, match="layer 1: cache OddCache has no splice"):
        splice(manager, model, seq, [SplicePiece(sig, 10)])
    assert seq.num_computed_tokens == 12
