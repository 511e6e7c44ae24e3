"""The PIC planner end to end over real caches: bit-exactness of the first segment, seam as
wide as every segment = full recompute, order and offset independence by hit counters,
naive addition measurably off, accounting, and the SWA seam rule."""
from __future__ import annotations

import pytest
import torch

from engine.models.config import FULL, GDN, GLA, LIGHTNING, MAMBA2, SWA
from engine.runtime.planner import ApplyStep

from engine.models.layers.linear_ops import naive_recurrence
from pic_testlib import execute, layer0_inputs, make_request, plain_prefill, rand_ids

MIXES = {
    "gdn": [GDN, FULL, GDN],
    "gla": [GLA, FULL],
    "lightning": [LIGHTNING, FULL],
    "mamba2": [MAMBA2, SWA, FULL],
    "swa": [SWA, FULL, SWA],
}


@pytest.mark.parametrize("bos_in_first", [False, True])
@pytest.mark.parametrize("mix", list(MIXES))
def test_one_cached_segment_cold_and_warm_equals_plain_prefill_bit_for_bit(mix, bos_in_first, model_of, runner_of,
                                                                          planner_of):
    model = model_of(MIXES[mix])
    doc, q = rand_ids(23, 1), rand_ids(5, 2)
    planner = planner_of(model, seam=4)
    runner = runner_of(model)
    ref = plain_prefill(runner, [256] + doc + q, [1 + len(doc), 1 + len(doc) + len(q)])
    cold = execute(planner, runner, make_request([(doc, True), (q, False)], bos_in_first=bos_in_first))
    warm = execute(planner, runner, make_request([(doc, True), (q, False)], bos_in_first=bos_in_first))
    assert torch.equal(cold.logits, ref.logits)
    assert torch.equal(warm.logits, ref.logits)
    stats = planner.cache.stats()
    assert (stats.misses, stats.hits, stats.puts) == (1, 1, 1)


@pytest.mark.parametrize("mix", list(MIXES))
def test_seam_as_wide_as_every_segment_equals_full_recompute(mix, model_of, runner_of, planner_of):
    model = model_of(MIXES[mix])
    docs = [rand_ids(n, 10 + n) for n in (17, 12, 15)]
    q = rand_ids(6, 3)
    request = make_request([(d, True) for d in docs] + [(q, False)])
    planner = planner_of(model, seam=max(map(len, docs)))
    runner = runner_of(model)
    pic = execute(planner, runner, request)
    full = plain_prefill(runner, request.prompt_token_ids, [request.num_prompt_tokens])
    torch.testing.assert_close(pic.logits[-1], full.logits[-1], rtol=1e-5, atol=1e-5)
    report = planner.take_report(request.request_id)
    assert report.seam_tokens == sum(map(len, docs[1:]))  # every later segment fully recomputed


def test_same_segments_in_another_order_and_offset_hit_the_same_signatures(model_of, runner_of, planner_of):
    model = model_of([GDN, FULL])
    a, b, c = rand_ids(20, 4), rand_ids(18, 5), rand_ids(22, 6)
    planner = planner_of(model, seam=3)
    runner = runner_of(model)
    execute(planner, runner, make_request([(a, True), (b, True), (c, True), (rand_ids(4, 7), False)]))
    s1 = planner.cache.stats()
    assert (s1.hits, s1.misses, s1.puts) == (0, 3, 3)
    second = make_request([(c, True), (a, True), (b, True), (rand_ids(5, 8), False)])
    execute(planner, runner, second)
    s2 = planner.cache.stats()
    assert (s2.hits, s2.misses, s2.puts) == (3, 3, 3)
    # another offset: a behind an uncached prefix, and twice in one prompt
    third = make_request([(rand_ids(9, 9), False), (a, True), (b, True), (a, True), (rand_ids(3, 1), False)])
    execute(planner, runner, third)
    s3 = planner.cache.stats()
    assert (s3.hits, s3.misses, s3.puts) == (5, 3, 3)
    report = planner.take_report(second.request_id)
    assert report.miss_segments == 0 and report.hit_segments == 3
    assert report.reused_tokens + report.recomputed_tokens == second.num_prompt_tokens
    assert report.reused_tokens == 1 + len(c) + (len(a) - 3) + (len(b) - 3)


def test_cold_request_accounting_counts_alone_passes_seams_and_suffix(model_of, runner_of, planner_of):
    model = model_of([LIGHTNING, FULL])
    a, b, q = rand_ids(11, 1), rand_ids(13, 2), rand_ids(4, 3)
    planner = planner_of(model, seam=5)
    req = make_request([(a, True), (b, True), (q, False)])
    execute(planner, runner_of(model), req)
    r = planner.take_report(req.request_id)
    assert r.miss_tokens == (1 + len(a)) + (1 + len(b))  # anchor included in each alone pass
    assert (r.seam_tokens, r.suffix_tokens, r.reused_tokens) == (5, len(q), 0)
    assert r.recomputed_tokens == r.miss_tokens + r.seam_tokens + r.suffix_tokens
    assert r.complete and r.miss_ms > 0 and r.suffix_ms > 0 and r.load_compose_ms > 0


def _logit_gap(method, seam, model, runner_of, planner_of, docs, q):
    request = make_request([(d, True) for d in docs] + [(q, False)])
    runner = runner_of(model)
    got = execute(planner_of(model, method=method, seam=seam), runner, request)
    full = plain_prefill(runner, request.prompt_token_ids, [request.num_prompt_tokens])
    return (got.logits[-1] - full.logits[-1]).abs().max().item()


@pytest.mark.parametrize("mix", ["gdn", "lightning"])
def test_naive_addition_differs_measurably_from_full_recompute_and_pic_is_closer(mix, model_of, runner_of, planner_of):
    model = model_of(MIXES[mix], seed=3)
    docs = [rand_ids(n, 30 + n) for n in (24, 20, 26)]
    q = rand_ids(6, 4)
    naive = _logit_gap("naive", 0, model, runner_of, planner_of, docs, q)
    pic = _logit_gap("pic", 8, model, runner_of, planner_of, docs, q)
    assert naive > 1e-3
    assert pic < naive


def test_naive_plan_has_no_seam_and_splices_every_segment_in_one_step(model_of, runner_of, planner_of):
    model = model_of([GDN, FULL])
    docs = [rand_ids(n, n) for n in (9, 8, 7)]
    planner = planner_of(model, method="naive")
    req = make_request([(d, True) for d in docs] + [(rand_ids(3, 0), False)])
    execute(planner, runner_of(model), req)
    report = planner.take_report(req.request_id)
    assert report.seam_tokens == 0
    splices = [s for s in req.plan.steps if isinstance(s, ApplyStep) and s.label == "load"]
    assert len(splices) == 1 and (splices[0].start, splices[0].end) == (0, req.num_prompt_tokens - 3)


def test_swa_window_seam_makes_the_second_swa_layer_ring_match_full_recompute(model_of, runner_of, planner_of):
    # window 6: under the "seam" policy with seam 2, b's tokens 2..4 are spliced although
    # their first-layer window reaches into a, so their second-layer K is off; the
    # "window" policy recomputes b's first 6 tokens and the spliced ring is exact.
    model = model_of([SWA, SWA, FULL])
    a, b = rand_ids(20, 1), rand_ids(8, 2)
    ids = [256] + a + b
    ring_positions = torch.arange(len(ids) - 6, len(ids))

    def ring_gap(policy, seam):
        runner = runner_of(model)
        planner = planner_of(model, seam=seam, swa_seam=policy)
        got = execute(planner, runner, make_request([(a, True), (b, True), ([1], False)]), skip_last_compute=True)
        full = plain_prefill(runner, ids, [len(ids)])
        ring = runner.cache.layer(1)
        return (ring.read(got.seq.slot, ring_positions)[0] - ring.read(full.seq.slot, ring_positions)[0]).abs().max().item()

    assert ring_gap("window", 2) < 1e-5
    assert ring_gap("seam", 2) > 1e-4


def test_prefix_caching_matches_full_recompute_when_the_prefix_matches(model_of, runner_of, planner_of):
    model = model_of([GDN, SWA, FULL])
    a, b, c = rand_ids(14, 1), rand_ids(16, 2), rand_ids(12, 3)
    planner = planner_of(model, method="prefix", prefix_checkpoints="every")
    runner = runner_of(model, num_slots=8)
    execute(planner, runner, make_request([(a, True), (b, True), (rand_ids(4, 4), False)]))
    second = make_request([(a, True), (b, True), (rand_ids(5, 5), False)])
    got = execute(planner, runner, second)
    full = plain_prefill(runner, second.prompt_token_ids, [second.num_prompt_tokens])
    torch.testing.assert_close(got.logits[-1], full.logits[-1], rtol=1e-5, atol=1e-5)
    assert got.logits[-1].argmax() == full.logits[-1].argmax()
    report = planner.take_report(second.request_id)
    assert report.reused_tokens == 1 + len(a) + len(b) and report.hit_segments == 2
    third = make_request([(a, True), (c, True), (rand_ids(3, 6), False)])  # only `a` matches
    got3 = execute(planner, runner, third)
    full3 = plain_prefill(runner, third.prompt_token_ids, [third.num_prompt_tokens])
    torch.testing.assert_close(got3.logits[-1], full3.logits[-1], rtol=1e-5, atol=1e-5)
    assert planner.take_report(third.request_id).reused_tokens == 1 + len(a)
    assert planner.tree.stats()["nodes"] == 3


def test_signatures_without_end_states_place_the_first_segment_like_a_later_one(model_of, runner_of, planner_of):
    model = model_of([GDN, FULL])
    a, b, q = rand_ids(15, 1), rand_ids(13, 2), rand_ids(4, 3)
    planner = planner_of(model, seam=4, keep_end_state=False)
    runner = runner_of(model)
    req = make_request([(a, True), (b, True), (q, False)])
    got = execute(planner, runner, req)
    report = planner.take_report(req.request_id)
    assert report.seam_tokens == 4 + 4 and report.suffix_tokens == 1 + len(q)  # the anchor is computed too
    sigs = [sig for sig, _ in planner.cache._entries.values()]
    assert all(not sig.has_end_state and sig.bytes_by_part()["linear_state"] == 0 for sig in sigs)
    family, inp = layer0_inputs(model, req.prompt_token_ids)
    _, truth = naive_recurrence(family, inp)
    state = runner.cache.layer(0).state[got.seq.slot]
    assert ((state - truth[0]).norm() / truth[0].norm()).item() < 1e-5


def test_edge_layouts_plan_validly_and_match_full_recompute(model_of, runner_of, planner_of):
    # a cached segment that ends the prompt is computed (its last token's logits are the
    # first output); empty segments are skipped; an all-uncached prompt is computed whole
    model = model_of([GDN, FULL])
    a, b = rand_ids(10, 1), rand_ids(12, 2)
    planner = planner_of(model, seam=3)
    runner = runner_of(model, num_slots=8)
    for segments in ([(a, True), (b, True)], [(a, True), ([], True), (b, False)], [(a, False), (b, False)],
                     [([], False), (a, True), (rand_ids(2, 3), False)]):
        for _ in ("cold", "warm"):
            req = make_request(segments)
            got = execute(planner, runner, req)
            full = plain_prefill(runner, req.prompt_token_ids, [req.num_prompt_tokens])
            torch.testing.assert_close(got.logits[-1], full.logits[-1], rtol=1e-4, atol=1e-4)
            runner.cache.free(got.seq)
            runner.cache.free(full.seq)
        report = planner.take_report(req.request_id)  # the warm run
        assert report.miss_tokens == 0
        assert report.reused_tokens + report.recomputed_tokens == req.num_prompt_tokens


def test_bf16_stored_states_stay_close_to_float32_ones(model_of, runner_of, planner_of):
    model = model_of([GDN, GLA, FULL])
    docs, q = [rand_ids(n, 40 + n) for n in (16, 18)], rand_ids(4, 5)
    out = {}
    for dtype in ("float32", "bfloat16"):
        planner = planner_of(model, seam=4, state_dtype=dtype)
        out[dtype] = execute(planner, runner_of(model), make_request([(d, True) for d in docs] + [(q, False)])).logits
        sig = next(iter(planner.cache._entries.values()))[0]
        assert sig.layers[0].state.dtype == getattr(torch, dtype)
    torch.testing.assert_close(out["bfloat16"], out["float32"], rtol=0, atol=1e-3)


def test_prefix_caching_keeps_states_at_prefix_ends_and_branch_points(model_of, runner_of, planner_of):
    model = model_of([GDN, SWA, FULL])
    a, b, c, d = rand_ids(14, 1), rand_ids(16, 2), rand_ids(12, 3), rand_ids(13, 7)
    planner = planner_of(model, method="prefix")  # prefix_checkpoints="branch", the default
    runner = runner_of(model, num_slots=8)

    def run(segs, q_seed):
        req = make_request([(s, True) for s in segs] + [(rand_ids(4, q_seed), False)])
        got = execute(planner, runner, req)
        full = plain_prefill(runner, req.prompt_token_ids, [req.num_prompt_tokens])
        torch.testing.assert_close(got.logits[-1], full.logits[-1], rtol=1e-5, atol=1e-5)
        return planner.take_report(req.request_id)

    def with_state():
        return sorted((n.checkpoint.start, n.checkpoint.end) for n in planner.tree._nodes()
                      if n.checkpoint.with_state)

    assert run([a, b, c], 4).reused_tokens == 0
    ends = {1 + len(a), 1 + len(a) + len(b), 1 + len(a) + len(b) + len(c)}
    assert {n.checkpoint.end for n in planner.tree._nodes()} == ends  # K/V at every boundary
    assert with_state() == [(1 + len(a) + len(b), 1 + len(a) + len(b) + len(c))]  # states at the end only
    # the same three documents: resumed at the end of the cached prefix
    assert run([a, b, c], 5).reused_tokens == 1 + len(a) + len(b) + len(c)
    # leaves the cached path after `a`: nothing to resume from yet; `a` becomes a branch point
    assert run([a, d], 6).reused_tokens == 0
    assert (0, 1 + len(a)) in with_state()
    # a third request through the branch point resumes there
    rep = run([a, b, d], 8)
    assert rep.reused_tokens == 1 + len(a) and rep.hit_segments == 1
