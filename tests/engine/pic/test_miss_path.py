"""PicConfig.miss_path="context": a request's uncached segments are computed in context
inside its fused pass (the logits of a request whose missing segments are simply not
cacheable), queued, computed alone by `help_idle` later, and then hit like any other;
"alone" (the default) keeps computing them alone in the request."""
from __future__ import annotations

import pytest
import torch

from engine.models.config import FULL, GDN, GLA, LIGHTNING, SWA
from engine.pic.config import PicConfig
from engine.pic.errors import PicConfigError

from pic_testlib import execute, fla_emulated, make_request, rand_ids

LAYERS = [GDN, FULL, SWA, GDN]


def _docs(seed: int):
    return [rand_ids(n, seed + n) for n in (18, 14, 16)]


def _warm(planner, runner, docs, question):
    """Cache every doc: one request, then idle help for what it queued (miss_path="context")."""
    execute(planner, runner, make_request([(d, True) for d in docs] + [(question, False)]))
    while planner.help_idle(runner):
        pass
    assert planner.cache.stats().entries == len(docs) and not planner.deferred


@pytest.mark.parametrize("where", [0, 1, 3])  # the first placement (anchor + segment), a middle one, the last cached
def test_a_miss_is_computed_in_context_exactly_as_an_uncacheable_segment(model_of, runner_of, planner_of, where):
    model = model_of(LAYERS)
    runner = runner_of(model)
    docs, question, new = _docs(where), rand_ids(6, 99), rand_ids(12, 500 + where)
    planner = planner_of(model, fused=True, seam=4, miss_path="context")
    _warm(planner, runner, docs, question)
    layout = [(d, True) for d in docs]
    req = make_request(layout[:where] + [(new, True)] + layout[where:] + [(question, False)])
    run = execute(planner, runner, req)
    rep = planner.take_report(req.request_id)
    assert rep.miss_segments == 1 and rep.deferred_segments == 1 and rep.hit_segments == 3 and rep.miss_tokens == 0
    assert rep.reused_tokens + rep.recomputed_tokens == rep.prompt_tokens
    assert len(planner.deferred) == 1 and planner.cache.stats().entries == 3  # queued, not computed alone yet

    reference, runner2 = planner_of(model, fused=True, seam=4), runner_of(model)  # the new segment not cacheable
    _warm(reference, runner2, docs, question)
    ref_req = make_request(layout[:where] + [(new, False)] + layout[where:] + [(question, False)])
    ref = execute(reference, runner2, ref_req)
    torch.testing.assert_close(run.logits[-1], ref.logits[-1], rtol=1e-5, atol=1e-5)
    ref_rep = reference.take_report(ref_req.request_id)
    assert (rep.reused_tokens, rep.recomputed_tokens) == (ref_rep.reused_tokens, ref_rep.recomputed_tokens)


def test_idle_help_computes_in_context_misses_alone_and_the_next_request_hits(model_of, runner_of, planner_of):
    model = model_of(LAYERS)
    runner = runner_of(model)
    docs, question, new = _docs(5), rand_ids(6, 98), rand_ids(11, 321)
    planner = planner_of(model, fused=True, seam=4, miss_path="context")
    assert planner.config.cold_full_fraction is None and planner.idle_poll_s is not None
    _warm(planner, runner, docs, question)
    segments = [(docs[0], True), (new, True), (new, True), (docs[1], True), (question, False)]  # one miss, twice
    first = make_request(segments)
    execute(planner, runner, first)
    rep1 = planner.take_report(first.request_id)
    assert rep1.miss_segments == 1 and rep1.deferred_segments == 1 and rep1.hit_segments == 2
    assert rep1.reused_tokens + rep1.recomputed_tokens == rep1.prompt_tokens  # both placements computed
    assert planner.help_idle(runner) == 1 and not planner.deferred
    second = make_request(segments)
    warm = execute(planner, runner, second)
    rep2 = planner.take_report(second.request_id)
    assert rep2.miss_segments == 0 and rep2.deferred_segments == 0 and rep2.hit_segments == 4
    # the signature idle help made is the one the alone path makes in a request
    alone, runner2 = planner_of(model, fused=True, seam=4), runner_of(model)
    _warm(alone, runner2, docs, question)
    execute(alone, runner2, make_request(segments))
    again = execute(alone, runner2, make_request(segments))
    torch.testing.assert_close(warm.logits[-1], again.logits[-1], rtol=1e-5, atol=1e-5)


def test_the_cold_fallback_still_takes_requests_above_its_fraction(model_of, runner_of, planner_of):
    model = model_of(LAYERS)
    runner = runner_of(model)
    planner = planner_of(model, fused=True, seam=4, miss_path="context", cold_full_fraction=0.5)
    req = make_request([(d, True) for d in _docs(7)] + [(rand_ids(6, 97), False)])
    execute(planner, runner, req)
    rep = planner.take_report(req.request_id)
    assert rep.cold_full and rep.deferred_segments == 3 and rep.reused_tokens == 0


def test_context_is_the_default_and_miss_path_is_validated(model_of, planner_of):
    assert PicConfig().miss_path == "context" and PicConfig().cold_full_fraction is None
    planner = planner_of(model_of(LAYERS), fused=True, miss_path="alone")
    assert planner.config.miss_path == "alone" and planner.idle_poll_s is None
    with pytest.raises(PicConfigError, match="miss_path"):
        planner_of(model_of(LAYERS), fused=True, miss_path="later")
    with pytest.raises(PicConfigError, match="fused=True"):
        planner_of(model_of(LAYERS), fused=False, miss_path="context")


@pytest.mark.parametrize("layers", [[GDN, FULL, GDN], [GLA, FULL], [LIGHTNING, FULL]], ids=["gdn", "gla", "lightning"])
def test_long_in_context_misses_share_varlen_calls_per_delta_layer_and_match_one_call_each(
        layers, model_of, runner_of, planner_of, monkeypatch):
    """engine.pic.long_ranges: on fla (emulated here by the torch recurrence), a delta-rule
    seam-chain layer's long computed ranges run as one call from zero and one more from
    their start states instead of one call each (PicConfig.batch_long_ranges, the
    default), with the same logits and caches; scalar/diagonal decay keep one call per
    range either way."""
    from engine.models.layers import fla_backend
    from engine.pic import seam_chain_layer
    from test_fused import _caches

    calls = []

    def counted(family, inp, initial_state, cu_seqlens=None):
        calls.append(family)
        return fla_emulated(family, inp, initial_state, cu_seqlens)

    monkeypatch.setattr(fla_backend, "fla_chunk", counted)
    monkeypatch.setattr(seam_chain_layer, "CHAIN_MAX_TOKENS", 8)  # the misses (15-20 tokens) are long ranges
    assert PicConfig().batch_long_ranges
    model = model_of(layers)
    docs, question = _docs(7), rand_ids(6, 99)
    new = [rand_ids(n, 600 + n) for n in (20, 15, 17)]
    layout = [(docs[0], True), (new[0], True), (docs[1], True), (new[1], True), (docs[2], True), (new[2], True),
              (question, False)]
    got = {}
    for batch in (True, False):
        runner = runner_of(model)
        runner.backend = "fla"
        # exact_prefix off: its idle passes would run fla's recurrent kernel, which is not emulated here
        planner = planner_of(model, fused=True, seam=4, miss_path="context", seam_chain="on",
                             batch_long_ranges=batch, exact_prefix=False)
        _warm(planner, runner, docs, question)
        calls.clear()
        req = make_request(layout)
        run = execute(planner, runner, req)
        assert planner.take_report(req.request_id).miss_segments == 3
        got[batch] = (run.logits[-1], _caches(runner, run.seq, len(req.prompt_token_ids)), len(calls))
    linear = sum(1 for kind in layers if kind in (GDN, GLA, LIGHTNING))
    calls_per_layer = 2 if layers[0] == GDN else 3  # 3 long ranges per layer
    assert got[True][2] == calls_per_layer * linear and got[False][2] == 3 * linear
    torch.testing.assert_close(got[True][0], got[False][0], rtol=1e-5, atol=1e-5)
    for i, (a, b) in enumerate(zip(got[False][1], got[True][1])):
        for x, y in zip(a, b):
            if x is not None:
                torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-5, msg=lambda m: f"layer {i}: {m}")


def test_the_long_range_and_tail_state_settings_are_validated():
    assert (PicConfig().batch_long_ranges, PicConfig().tail_states) == (True, "fla")
    with pytest.raises(PicConfigError, match="batch_long_ranges='yes'"):
        PicConfig(batch_long_ranges="yes")
    with pytest.raises(PicConfigError, match="tail_states='sum'"):
        PicConfig(tail_states="sum")
