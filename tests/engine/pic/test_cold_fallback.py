"""Cold fallback (PicConfig.cold_full_fraction): a request whose misses hold at least the
configured share of its prompt is prefilled by full recompute (same logits as the `full`
planner, nothing reused), its misses are queued, `help_idle` computes them alone later,
and the next request with those segments is a warm PIC request; below the threshold
the misses are computed alone and spliced as before."""
from __future__ import annotations

import pytest
import torch

from engine.models.config import FULL, GDN, SWA
from engine.pic.config import PicConfig
from engine.pic.errors import PicConfigError

from pic_testlib import execute, make_request, rand_ids

LAYERS = [GDN, FULL, SWA, GDN]


def _segments(seed: int = 0):
    docs = [rand_ids(n, seed + n) for n in (18, 14, 16)]
    return [(d, True) for d in docs] + [(rand_ids(6, seed + 99), False)]


def test_a_cold_request_is_served_by_full_recompute_with_the_same_logits(model_of, runner_of, planner_of):
    model = model_of(LAYERS)
    runner = runner_of(model)
    segments = _segments()
    full = execute(planner_of(model, method="full"), runner, make_request(segments))
    planner = planner_of(model, fused=True, seam=4, cold_full_fraction=0.5)
    req = make_request(segments)
    run = execute(planner, runner, req)
    rep = planner.take_report(req.request_id)
    torch.testing.assert_close(run.logits[-1], full.logits[-1], rtol=1e-5, atol=1e-5)
    assert rep.cold_full and rep.deferred_segments == 3
    assert rep.reused_tokens == 0 and rep.recomputed_tokens == rep.prompt_tokens == len(req.prompt_token_ids)
    assert rep.miss_segments == 0 and len(planner.deferred) == 3
    assert planner.cache.stats().entries == 0  # nothing was computed alone yet


def test_idle_help_computes_the_deferred_segments_and_the_next_request_hits(model_of, runner_of, planner_of):
    model = model_of(LAYERS)
    runner = runner_of(model)
    segments = _segments(1)
    # signatures only: without exact prefixes the warm repeat splices what the idle pass computed
    planner = planner_of(model, fused=True, seam=4, cold_full_fraction=0.5, exact_prefix=False)
    assert planner.idle_poll_s is not None
    execute(planner, runner, make_request(segments))
    assert planner.help_idle(runner) == 3  # one packed batch: all three fit the token budget
    assert not planner.deferred and planner.help_idle(runner) == 0
    req = make_request(segments)
    warm = execute(planner, runner, req)
    rep = planner.take_report(req.request_id)
    assert not rep.cold_full and rep.hit_segments == 3 and rep.miss_segments == 0 and rep.reused_tokens > 0
    # the same signatures as a planner that computed them in the request (no fallback)
    plain = planner_of(model, fused=True, seam=4, exact_prefix=False)
    execute(plain, runner, make_request(segments))
    again = execute(plain, runner, make_request(segments))
    torch.testing.assert_close(warm.logits[-1], again.logits[-1], rtol=1e-5, atol=1e-5)


def test_below_the_threshold_misses_are_computed_alone_and_spliced(model_of, runner_of, planner_of):
    model = model_of(LAYERS)
    runner = runner_of(model)
    segments = _segments(2)
    planner = planner_of(model, fused=True, seam=4, cold_full_fraction=0.5)
    execute(planner, runner, make_request(segments))
    planner.help_idle(runner)
    new_doc = rand_ids(9, 77)  # one small cold segment among warm ones: well under half the prompt
    req = make_request(segments[:2] + [(new_doc, True)] + segments[2:])
    execute(planner, runner, req)
    rep = planner.take_report(req.request_id)
    assert not rep.cold_full and rep.miss_segments == 1 and rep.hit_segments == 3
    assert not planner.deferred


def test_the_fallback_is_off_by_default_and_the_fraction_is_validated(model_of, planner_of):
    planner = planner_of(model_of(LAYERS), fused=True)
    assert planner.config.cold_full_fraction is None and planner.idle_poll_s is None
    for bad in (0, 1.5, -0.1, True, "half"):
        with pytest.raises(PicConfigError, match="cold_full_fraction"):
            PicConfig(cold_full_fraction=bad)


def test_auto_state_dtype_follows_a_half_precision_model_and_keys_name_it(model_of, planner_of):
    from engine.pic.compute import resolve_state_dtype

    assert resolve_state_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert resolve_state_dtype("auto", torch.float16) == torch.float16
    assert resolve_state_dtype("auto", torch.float32) == torch.float32 and resolve_state_dtype("auto", None) == torch.float32
    assert resolve_state_dtype("float32", torch.bfloat16) == torch.float32
    model = model_of(LAYERS)  # float32: auto keeps float32 states and the float32 keys
    auto, f32 = planner_of(model, fused=True), planner_of(model, fused=True, state_dtype="float32")
    bf16 = planner_of(model, fused=True, state_dtype="bfloat16")
    assert auto.state_dtype == torch.float32 and auto.key([5, 6, 7], 4) == f32.key([5, 6, 7], 4)
    assert bf16.state_dtype == torch.bfloat16 and bf16.key([5, 6, 7], 4) != f32.key([5, 6, 7], 4)


def test_the_cost_policy_falls_back_from_the_measured_break_even(model_of, runner_of, planner_of):
    """cold_full_policy="cost": the configured fraction until both paths are measured,
    then full / alone cost per token (capped by the fraction)."""
    model = model_of([GDN, FULL, GDN])
    runner = runner_of(model)
    planner = planner_of(model, fused=True, seam=4, cold_full_fraction=0.5, cold_full_policy="cost")
    assert planner.cold_full_threshold() == 0.5  # nothing measured yet
    segments = _segments(3)
    execute(planner, runner, make_request(segments))  # every segment cold: warms the cache
    planner.help_idle(runner)

    def one_new(seed):  # one 10-token miss in a ~60-token prompt: below the fraction
        return segments[:2] + [(rand_ids(10, seed), True)] + segments[2:]

    req = make_request(one_new(77))
    execute(planner, runner, req)
    rep = planner.take_report(req.request_id)
    assert rep.miss_segments == 1 and not rep.cold_full  # the fraction rule: computed alone in the request
    planner.costs._add("alone", 1000, 2000.0)  # alone passes 20x dearer per token than full ones
    planner.costs._add("full", 1000, 100.0)
    assert planner.cold_full_threshold() == pytest.approx(0.05)
    req = make_request(one_new(78))
    execute(planner, runner, req)
    rep = planner.take_report(req.request_id)
    assert rep.cold_full and rep.deferred_segments == 1  # the same small miss now takes the fallback
    planner.costs._ms_per_token["alone"] = 0.01  # alone passes cheap: the fraction caps the threshold
    assert planner.cold_full_threshold() == 0.5


def test_path_costs_average_per_token_and_skip_short_passes():
    from engine.pic.costs import PathCosts

    costs = PathCosts(torch.device("cpu"), smoothing=0.5, min_tokens=10)
    assert costs.break_even() is None
    with costs.measure("alone", 5):  # too short to count
        pass
    assert costs.ms_per_token("alone") is None
    costs._add("alone", 100, 100.0)
    costs._add("alone", 100, 300.0)
    assert costs.ms_per_token("alone") == pytest.approx(2.0)  # 1.0, then halfway to 3.0
    with costs.measure("full", 1000):
        sum(range(1000))
    assert costs.ms_per_token("full") > 0 and 0 < costs.break_even() < 1
    snap = costs.snapshot()
    assert snap["alone_passes"] == 2 and snap["full_passes"] == 1
    with pytest.raises(ValueError, match="kind"):
        with costs.measure("other", 100):
            pass


def test_a_bad_cold_full_policy_is_refused():
    with pytest.raises(PicConfigError, match="cold_full_policy"):
        PicConfig(cold_full_fraction=0.5, cold_full_policy="sometimes")


def test_an_idle_pass_gives_way_between_layers_and_resumes_where_it_stopped(model_of, runner_of, planner_of):
    from engine.pic.compute import compute_signatures
    from engine.pic.errors import AlonePassStopped

    model = model_of(LAYERS)
    runner = runner_of(model)
    planner = planner_of(model, fused=True, seam=4, cold_full_fraction=0.5)
    execute(planner, runner, make_request(_segments(5)))
    queued = list(planner.deferred)
    calls = []
    assert planner.help_idle(runner, should_stop=lambda: calls.append(1) or len(calls) >= 2) == 0
    assert len(calls) == 2  # asked between layers (never before the first), stopped at the second ask
    assert planner.idle_stopped == 1 and planner.idle_pass is not None
    items, alone = planner.idle_pass
    assert [c.job.key for c in items] == queued and alone.layer == 2 and not planner.deferred
    assert planner.cache.stats().entries == 0  # nothing half-computed is stored
    calls.clear()  # resumed: runs at least one layer before it is asked again
    assert planner.help_idle(runner, should_stop=lambda: calls.append(1) or True) == 0
    assert calls == [1] and alone.layer == 3 and planner.idle_stopped == 2
    assert planner.help_idle(runner, should_stop=lambda: False) == 3 and planner.idle_pass is None
    want = compute_signatures(model, [(c.job.token_ids, c.job.split) for c in items], planner.anchor_ids,
                              state_dtype=planner.state_dtype)
    for c, w in zip(items, want):  # the resumed pass stored what one uninterrupted pass computes
        got = planner.cache.get(c.job.key)
        for pg, pw in zip(got.layers, w.layers):
            for name, x in vars(pw).items():
                if isinstance(x, torch.Tensor):
                    assert torch.equal(getattr(pg, name), x), name
    assert planner.costs.snapshot()["alone_passes"] == 0  # a resumed pass measures no cost
    with pytest.raises(AlonePassStopped, match="layer 1"):
        compute_signatures(model, [(rand_ids(9, 1), 2)], [256], should_stop=lambda: True)


def test_without_idle_resume_a_pass_that_gives_way_is_dropped_and_queued_again(model_of, runner_of, planner_of):
    model = model_of(LAYERS)
    runner = runner_of(model)
    planner = planner_of(model, fused=True, seam=4, cold_full_fraction=0.5, idle_resume=False)
    execute(planner, runner, make_request(_segments(5)))
    queued = list(planner.deferred)
    assert planner.help_idle(runner, should_stop=lambda: True) == 0
    assert planner.idle_pass is None and list(planner.deferred) == queued and planner.idle_stopped == 1
    assert planner.cache.stats().entries == 0
    assert planner.help_idle(runner) == 3 and not planner.deferred
    with pytest.raises(PicConfigError, match="idle_resume"):
        PicConfig(idle_resume="yes")


def test_repeated_idle_alone_passes_sign_a_segment_on_its_second_miss(model_of, runner_of, planner_of):
    model = model_of(LAYERS)
    runner = runner_of(model, num_slots=8)
    segments = _segments(7)
    planner = planner_of(model, fused=True, seam=4, cold_full_fraction=0.5, exact_prefix=False,
                         idle_alone_passes="repeated", idle_batch_tokens=40)
    assert planner.deferred.batch_tokens == 40 and planner.deferred.repeated_only
    req = make_request(segments)
    execute(planner, runner, req)
    rep = planner.take_report(req.request_id)
    assert rep.cold_full and rep.deferred_segments == 0 and planner.deferred.declined == 3
    assert not planner.deferred and planner.help_idle(runner) == 0  # seen once: no alone pass
    req = make_request(segments)  # the second sighting: computed in context again, now queued
    execute(planner, runner, req)
    rep = planner.take_report(req.request_id)
    assert rep.cold_full and rep.deferred_segments == 3 and planner.deferred.declined == 3
    assert planner.help_idle(runner) == 2 and planner.help_idle(runner) == 1  # 18 + 14 tokens, then 16
    req = make_request(segments)
    third = execute(planner, runner, req)
    rep = planner.take_report(req.request_id)
    assert not rep.cold_full and rep.hit_segments == 3 and rep.miss_segments == 0
    plain = planner_of(model, fused=True, seam=4, exact_prefix=False)  # signatures computed in the request
    execute(plain, runner, make_request(segments))
    again = execute(plain, runner, make_request(segments))
    torch.testing.assert_close(third.logits[-1], again.logits[-1], rtol=1e-5, atol=1e-5)


def test_the_deferred_queues_record_of_keys_seen_is_bounded_and_cleared(monkeypatch):
    from engine.pic import deferred as deferred_mod
    from engine.pic.deferred import DeferredQueue
    from engine.pic.segment_store import SegmentJob

    monkeypatch.setattr(deferred_mod, "MAX_SEEN", 2)
    q = DeferredQueue(repeated_only=True)
    job = {k: SegmentJob(k, (1, 2, 3), 1, 4.0) for k in (b"a", b"b", b"c")}
    assert q.add([job[b"a"], job[b"b"]]) == 0 and q.declined == 2 and not q
    assert q.add([job[b"c"]]) == 0  # a is forgotten (the record holds two keys)
    assert q.add([job[b"b"], job[b"c"], job[b"a"]]) == 2 and list(q) == [b"b", b"c"] and q.declined == 4
    assert q.add([job[b"b"]]) == 1 and list(q) == [b"c", b"b"]  # queued already: moved to the back
    assert q.clear() == 2 and not q and q.add([job[b"c"]]) == 0  # the record went too
    plain = DeferredQueue()
    assert plain.add([job[b"a"]]) == 1 and plain.declined == 0


def test_idle_alone_passes_and_idle_batch_tokens_are_validated():
    with pytest.raises(PicConfigError, match="idle_alone_passes='twice' must be one of all, repeated"):
        PicConfig(idle_alone_passes="twice")
    for bad in (0, -5, True, 1.5, "4096"):
        with pytest.raises(PicConfigError, match="idle_batch_tokens=.* must be a positive integer"):
            PicConfig(idle_batch_tokens=bad)
