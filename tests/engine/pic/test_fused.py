"""The one-pass PIC prefill (engine.pic.fused) equals the step-by-step plan: last-token
logits and every cache it leaves (paged K/V of every position, window rings, linear
states, conv tails), for every layer kind, with uncached segments in the middle, naive
addition, and signatures without end states; and the plan is one step after the
lookups."""
from __future__ import annotations

import pytest
import torch

from engine.cache.layer_caches import PagedKVCache, StateSlotCache, WindowRingCache
from engine.models.config import FULL, GDN, GLA, LIGHTNING, MAMBA2, SWA
from engine.pic.errors import SplicePlacementError
from engine.pic.fused import FusedItem, fused_prefill
from engine.runtime.planner import ApplyStep, FusedStep
from engine.runtime.sequence import Sequence

from pic_testlib import execute, make_request, rand_ids

from test_planner import MIXES  # one layer mix per linear family, and SWA


def _caches(runner, seq, n):
    out = []
    for cache in runner.cache.layers:
        if isinstance(cache, PagedKVCache):
            slots = runner.cache.flat_slots(seq, 0, n)
            out.append(cache.gather(slots))
        elif isinstance(cache, WindowRingCache):
            out.append((cache.k[seq.slot].clone(), cache.v[seq.slot].clone()))
        elif isinstance(cache, StateSlotCache):
            tail = None if cache.conv_tail is None else cache.conv_tail[seq.slot].clone()
            out.append((cache.state[seq.slot].clone(), tail))
    return out


def _run_both(model, runner_of, planner_of, segments, **kw):
    runner = runner_of(model)
    got = {}
    for fused in (False, True):
        planner = planner_of(model, fused=fused, **kw)
        execute(planner, runner, make_request(segments))  # cold: computes and caches signatures
        req = make_request(segments)
        run = execute(planner, runner, req)
        got[fused] = (run.logits[-1], _caches(runner, run.seq, len(req.prompt_token_ids)), req.plan,
                      planner.take_report(req.request_id))
        got["planner"] = planner
    return got


def _assert_same(got):
    (l0, c0, _, r0), (l1, c1, _, r1) = got[False], got[True]
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-5)
    for i, (a, b) in enumerate(zip(c0, c1)):
        for x, y in zip(a, b):
            if x is None:
                assert y is None, f"layer {i}"
                continue
            torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-5, msg=lambda m: f"layer {i}: {m}")
    for f in ("reused_tokens", "recomputed_tokens", "seam_tokens", "suffix_tokens", "hit_segments"):
        assert getattr(r0, f) == getattr(r1, f), f


@pytest.mark.parametrize("mix", list(MIXES))
def test_fused_prefill_equals_the_step_by_step_plan(mix, model_of, runner_of, planner_of):
    model = model_of(MIXES[mix])
    docs = [rand_ids(n, 30 + n) for n in (17, 12, 15)]
    segments = [(d, True) for d in docs] + [(rand_ids(6, 3), False)]
    got = _run_both(model, runner_of, planner_of, segments, seam=4)
    _assert_same(got)
    plan = got[True][2]
    assert [type(s) for s in plan.steps] == [ApplyStep, ApplyStep, FusedStep]
    assert plan.steps[-1].compute_tokens == got[True][3].seam_tokens + got[True][3].suffix_tokens


@pytest.mark.parametrize("mix", ["gdn", "mamba2", "swa"])
def test_fused_prefill_with_an_uncached_segment_between_cached_ones(mix, model_of, runner_of, planner_of):
    model = model_of(MIXES[mix])
    segments = [(rand_ids(14, 1), True), (rand_ids(9, 2), False), (rand_ids(16, 3), True),
                (rand_ids(11, 4), True), (rand_ids(5, 5), False)]
    _assert_same(_run_both(model, runner_of, planner_of, segments, seam=3))


@pytest.mark.parametrize("kw", [dict(method="naive"), dict(seam=5, keep_end_state=False)],
                         ids=["naive", "no-end-state"])
def test_fused_prefill_equals_steps_for_naive_addition_and_without_end_states(kw, model_of, runner_of, planner_of):
    model = model_of([GDN, SWA, FULL, MAMBA2])
    segments = [(rand_ids(n, 50 + n), True) for n in (13, 18, 10)] + [(rand_ids(4, 9), False)]
    _assert_same(_run_both(model, runner_of, planner_of, segments, **kw))


def test_fused_prefill_rejects_items_that_do_not_tile_or_end_in_a_splice(model_of, runner_of):
    model = model_of([GDN, FULL])
    runner = runner_of(model)
    seq = runner.cache.allocate(Sequence("bad"))
    ids = rand_ids(10, 1)
    with pytest.raises(SplicePlacementError, match="covers"):
        fused_prefill(model, runner.cache, seq, ids, [FusedItem(0, 4), FusedItem(5, 10)])
    with pytest.raises(SplicePlacementError, match="at least one"):
        fused_prefill(model, runner.cache, seq, ids, [])
    assert seq.num_computed_tokens == 0
    logits = fused_prefill(model, runner.cache, seq, ids, [FusedItem(0, 4), FusedItem(4, 10)])
    ref_seq = runner.cache.allocate(Sequence("ref"))
    ref = runner.prefill(ref_seq, ids)
    torch.testing.assert_close(logits, ref, rtol=1e-5, atol=1e-5)
    assert seq.num_computed_tokens == 10


@pytest.mark.parametrize("kind", [GDN, GLA, LIGHTNING, MAMBA2])
def test_fused_prefill_equals_steps_when_some_heads_forgot_their_prefix(kind, model_of, runner_of, planner_of):
    from test_compose import strengthen_decay

    model = model_of([kind, FULL])
    strengthen_decay(model, kind)
    segments = [(rand_ids(n, 70 + n), True) for n in (100, 120, 90)] + [(rand_ids(4, 9), False)]
    got = _run_both(model, lambda m: runner_of(m, num_blocks=512), planner_of, segments, seam=4)
    _assert_same(got)
    if kind == GDN:  # the partly-live dense operators took the indexed path
        sigs = [s for s, _ in got["planner"].cache._entries.values()]
        assert any(0 < len(s.layers[0].live_heads) < s.layers[0].num_heads for s in sigs)


@pytest.mark.parametrize("policy", ["every", "branch"])
@pytest.mark.parametrize("mix", ["gdn", "mamba2", "swa"])
def test_prefix_caching_in_one_pass_takes_the_same_checkpoints_and_logits(mix, policy, model_of, runner_of,
                                                                          planner_of):
    model = model_of(MIXES[mix])
    docs = [rand_ids(n, 80 + n) for n in (13, 17, 11)]
    q = rand_ids(5, 4)
    runner = runner_of(model)
    got = {}
    for fused in (False, True):
        planner = planner_of(model, method="prefix", fused=fused, prefix_checkpoints=policy)
        first = execute(planner, runner, make_request([(d, True) for d in docs] + [(q, False)]))
        # a second request sharing the first two documents restores their checkpoints
        second = execute(planner, runner, make_request([(docs[0], True), (docs[1], True), (q, False)]))
        nodes = sorted(planner.tree._nodes(), key=lambda n: n.checkpoint.end)
        got[fused] = (first.logits[-1], second.logits[-1], [n.checkpoint for n in nodes],
                      planner.take_report(second.seq.seq_id))
    (a1, a2, acps, _), (b1, b2, bcps, rep) = got[False], got[True]
    torch.testing.assert_close(b1, a1, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b2, a2, rtol=1e-5, atol=1e-5)
    assert [(c.start, c.end, c.with_state) for c in bcps] == [(c.start, c.end, c.with_state) for c in acps]
    assert len(bcps) == 3
    for x, y in zip(acps, bcps):
        for name in ("kv", "ring", "states"):
            dx, dy = getattr(x, name), getattr(y, name)
            assert dx.keys() == dy.keys(), name
            for layer in dx:
                for tx, ty in zip(dx[layer], dy[layer]):
                    if isinstance(tx, torch.Tensor):
                        torch.testing.assert_close(ty, tx, rtol=1e-5, atol=1e-5)
                    else:
                        assert tx == ty
    if policy == "every":  # the second request resumes after the first two documents
        assert rep.reused_tokens == 1 + len(docs[0]) + len(docs[1])
        assert all(c.with_state for c in bcps)
    else:  # states only at the first request's prefix end; the second makes its end a branch point
        assert rep.reused_tokens == 0
        assert [c.with_state for c in bcps] == [False, True, True]


# seam chain (kernels.seam_chain): each linear layer's recurrences and compositions in one
# call; "torch" is its reference, "triton" the kernel (the interpreter on the CPU)
CHAIN_KERNELS = pytest.mark.parametrize("kernel", ["torch", "triton"])


@CHAIN_KERNELS
@pytest.mark.parametrize("mix", ["gdn", "gla", "lightning", "mamba2"])
def test_fused_prefill_with_the_seam_chain_equals_the_step_by_step_plan(mix, kernel, model_of, runner_of,
                                                                         planner_of):
    model = model_of(MIXES[mix])
    segments = [(rand_ids(14, 1), True), (rand_ids(9, 2), False), (rand_ids(16, 3), True),
                (rand_ids(11, 4), True), (rand_ids(5, 5), False)]
    _assert_same(_run_both(model, runner_of, planner_of, segments, seam=3, seam_chain="on", kernel=kernel))


@CHAIN_KERNELS
@pytest.mark.parametrize("kw", [dict(method="naive"), dict(seam=5, keep_end_state=False)],
                         ids=["naive", "no-end-state"])
def test_seam_chain_equals_steps_for_naive_addition_and_without_end_states(kw, kernel, model_of, runner_of,
                                                                           planner_of):
    model = model_of([GDN, SWA, FULL, MAMBA2])
    segments = [(rand_ids(n, 50 + n), True) for n in (13, 18, 10)] + [(rand_ids(4, 9), False)]
    _assert_same(_run_both(model, runner_of, planner_of, segments, seam_chain="on", kernel=kernel, **kw))


@pytest.mark.parametrize("kernel", ["torch"])  # the kernel's forgotten rows: tests/kernels/test_seam_chain.py
def test_seam_chain_equals_steps_when_some_delta_heads_forgot_their_prefix(kernel, model_of, runner_of,
                                                                         planner_of):
    from test_compose import strengthen_decay

    model = model_of([GDN, FULL])
    strengthen_decay(model, GDN)
    segments = [(rand_ids(n, 70 + n), True) for n in (100, 120, 90)] + [(rand_ids(4, 9), False)]
    got = _run_both(model, lambda m: runner_of(m, num_blocks=512), planner_of, segments, seam=4,
                    seam_chain="on", kernel=kernel)
    _assert_same(got)
    sigs = [s for s, _ in got["planner"].cache._entries.values()]
    assert any(0 < len(s.layers[0].live_heads) < s.layers[0].num_heads for s in sigs)


def test_seam_chain_auto_policy_and_a_bad_mode_is_rejected(model_of, runner_of):
    from engine.pic.seam_chain_layer import chain_on as _chain_on
    from engine.pic.config import PicConfig
    from engine.pic.errors import PicConfigError

    model = model_of([GDN, FULL])
    mixer = model.blocks[0].mixer
    assert not _chain_on("auto", mixer, torch.device("cpu"))
    assert _chain_on("on", mixer, torch.device("cpu"))
    # on CUDA, auto takes the chain for every family (the delta rule's too, since its
    # composition is chunked), within the kernel's dims
    from kernels.backend import HAS_TRITON

    cuda = torch.device("cuda")
    assert _chain_on("auto", mixer, cuda) == HAS_TRITON
    assert not _chain_on("off", mixer, cuda)
    assert _chain_on("auto", model_of([LIGHTNING, FULL]).blocks[0].mixer, cuda) == HAS_TRITON
    assert _chain_on("auto", model_of([GLA, FULL]).blocks[0].mixer, cuda) == HAS_TRITON
    with pytest.raises(PicConfigError, match="seam_chain"):
        PicConfig(seam_chain="always")
    runner = runner_of(model)
    seq = runner.cache.allocate(Sequence("bad-mode"))
    with pytest.raises(SplicePlacementError, match="chain"):
        fused_prefill(model, runner.cache, seq, rand_ids(5, 1), [FusedItem(0, 5)], chain="yes")


@pytest.mark.parametrize("method", ["pic", "prefix"])
def test_offline_runs_read_every_question_logit_from_the_one_pass(method, model_of, runner_of, planner_of):
    from engine.pic.offline import prefill_with_plan, release

    model = model_of([GDN, SWA, FULL])
    segments = [(rand_ids(n, 90 + n), True) for n in (15, 12)] + [(rand_ids(7, 5), False)]
    runner = runner_of(model)
    got = {}
    for fused in (False, True):
        planner = planner_of(model, method=method, fused=fused, seam=4)
        release(planner, runner, prefill_with_plan(planner, runner, make_request(segments)).request)  # warm
        res = prefill_with_plan(planner, runner, make_request(segments))
        n = res.logits.shape[0]
        got[fused] = (res.logits[n - 7:], res.logits_start + n - 7)
        release(planner, runner, res.request)
    torch.testing.assert_close(got[True][0], got[False][0], rtol=1e-5, atol=1e-5)
    assert got[True][1] == got[False][1]
