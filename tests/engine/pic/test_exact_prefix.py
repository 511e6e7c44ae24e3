"""PIC subsumes prefix caching (engine.pic.exact_prefix): an exact repeat restores the
exact state at its deepest matched boundary and computes only its last segment, with the
logits of prefix caching and of full recompute; a partial match restores the matched
prefix exactly and splices the rest; the cold fallback takes the checkpoints in its own
pass; the idle pass of a multi-turn chat computes only the new turn."""
from __future__ import annotations

import pytest
import torch

from engine.models.config import FULL, GDN, MAMBA2, SWA
from engine.runtime.planner import ApplyStep
from pic_testlib import execute, make_request, plain_prefill, rand_ids

MIXES = {"gdn": [GDN, SWA, FULL], "mamba2": [MAMBA2, FULL, SWA]}


def _pic(planner_of, model, **kw):
    kw.setdefault("seam", 4)
    return planner_of(model, fused=True, **kw)


def _layout(docs, q):
    return [(d, True) for d in docs] + [(q, False)]


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_an_exact_repeat_computes_only_its_suffix_with_prefix_cachings_and_full_recomputes_logits(
        mix, model_of, runner_of, planner_of):
    model = model_of(MIXES[mix])
    runner = runner_of(model, num_slots=8)
    docs, q = [rand_ids(n, 30 + n) for n in (17, 13, 15)], rand_ids(5, 3)
    pic = _pic(planner_of, model)
    cold = make_request(_layout(docs, q))
    execute(pic, runner, cold)
    assert pic.take_report(cold.request_id).prefix_tokens == 0  # nothing exact yet: spliced
    assert pic.exact.pending and pic.idle_poll_s is not None
    assert pic.help_idle(runner) == 1 and not pic.exact.pending  # the exact pass of its cacheable prefix
    assert pic.idle_poll_s is None
    warm = make_request(_layout(docs, q))
    got = execute(pic, runner, warm)
    rep = pic.take_report(warm.request_id)
    prefix_end = 1 + sum(len(d) for d in docs)
    assert rep.prefix_tokens == rep.reused_tokens == prefix_end
    assert rep.recomputed_tokens == rep.suffix_tokens == len(q) and rep.seam_tokens == 0 and rep.miss_tokens == 0
    full = plain_prefill(runner, warm.prompt_token_ids, [warm.num_prompt_tokens])
    torch.testing.assert_close(got.logits[-1], full.logits[-1], rtol=1e-5, atol=1e-5)
    prefix = planner_of(model, method="prefix", fused=True)
    execute(prefix, runner, make_request(_layout(docs, q)))
    again = execute(prefix, runner, make_request(_layout(docs, q)))
    torch.testing.assert_close(got.logits[-1], again.logits[-1], rtol=1e-5, atol=1e-5)


def test_repeated_passes_queue_a_prefix_only_on_its_second_sighting(model_of, runner_of, planner_of):
    model = model_of(MIXES["gdn"])
    runner = runner_of(model, num_slots=8)
    docs, q = [rand_ids(n, 130 + n) for n in (17, 13, 15)], rand_ids(5, 3)
    pic = _pic(planner_of, model, exact_prefix_passes="repeated")
    execute(pic, runner, make_request(_layout(docs, q)))
    other = make_request(_layout(docs[::-1], q))  # the same documents in another order: another prefix
    execute(pic, runner, other)
    assert not pic.exact.pending and pic.exact.declined == 2 and pic.idle_poll_s is None
    again = make_request(_layout(docs, q))  # the first prompt's prefix, seen a second time
    execute(pic, runner, again)
    assert pic.take_report(again.request_id).prefix_tokens == 0 and pic.exact.pending
    assert pic.help_idle(runner) == 1
    third = make_request(_layout(docs, q))
    got = execute(pic, runner, third)
    assert pic.take_report(third.request_id).prefix_tokens == 1 + sum(map(len, docs))
    full = plain_prefill(runner, third.prompt_token_ids, [third.num_prompt_tokens])
    torch.testing.assert_close(got.logits[-1], full.logits[-1], rtol=1e-5, atol=1e-5)
    assert pic.exact.clear() > 0 and not pic.exact.seen and pic.exact.tree.num_nodes == 0


def test_a_partial_prefix_match_restores_the_prefix_exactly_and_splices_the_rest(model_of, runner_of, planner_of):
    model = model_of(MIXES["gdn"])
    runner = runner_of(model, num_slots=8)
    a, b, c, d = (rand_ids(n, 50 + n) for n in (14, 16, 12, 13))
    pic = _pic(planner_of, model, prefix_checkpoints="every")
    execute(pic, runner, make_request(_layout([a, b, c, d], rand_ids(4, 1))))
    assert pic.help_idle(runner) == 1
    req = make_request(_layout([a, b, d, c], rand_ids(5, 2)))  # first two equal, the rest reordered
    got = execute(pic, runner, req)
    rep = pic.take_report(req.request_id)
    end = 1 + len(a) + len(b)
    assert rep.prefix_tokens == end
    # c and d spliced from their signatures behind a seam each, the question computed
    assert rep.hit_segments == 2 + 2 and rep.miss_segments == 0
    assert rep.seam_tokens == 2 * pic.seam and rep.suffix_tokens == 5
    assert rep.reused_tokens == end + len(d) + len(c) - 2 * pic.seam
    # the restored positions hold exactly what full recompute computes there
    full = plain_prefill(runner, req.prompt_token_ids, [req.num_prompt_tokens])
    for i, cache in enumerate(runner.cache.layers):
        if hasattr(cache, "k_pages"):
            k_got, _ = cache.gather(runner.cache.flat_slots(got.seq, 0, end))
            k_ref, _ = cache.gather(runner.cache.flat_slots(full.seq, 0, end))
            torch.testing.assert_close(k_got, k_ref, rtol=1e-5, atol=1e-5)
    # with exact prefixes off, the same request is spliced from its first segment on
    plain = _pic(planner_of, model, exact_prefix=False)
    execute(plain, runner, make_request(_layout([a, b, c, d], rand_ids(4, 1))))
    plain.help_idle(runner)
    req2 = make_request(_layout([a, b, d, c], rand_ids(5, 2)))
    execute(plain, runner, req2)
    rep2 = plain.take_report(req2.request_id)
    assert rep2.prefix_tokens == 0 and rep2.seam_tokens == 3 * plain.seam


def test_branch_checkpoints_make_a_shared_prefix_exact_after_the_requests_leave_it(model_of, runner_of, planner_of):
    model = model_of(MIXES["gdn"])
    runner = runner_of(model, num_slots=8)
    a, b, c, d = (rand_ids(n, 70 + n) for n in (14, 16, 12, 13))
    pic = _pic(planner_of, model)  # prefix_checkpoints="branch"
    execute(pic, runner, make_request(_layout([a, b, c], rand_ids(4, 1))))
    pic.help_idle(runner)
    first = make_request(_layout([a, b, d], rand_ids(4, 2)))  # leaves the path after b: nothing usable yet
    execute(pic, runner, first)
    assert pic.take_report(first.request_id).prefix_tokens == 0
    pic.help_idle(runner)  # the new prefix's pass keeps states at the branch point b
    second = make_request(_layout([a, b, c, d], rand_ids(4, 3)))
    got = execute(pic, runner, second)
    assert pic.take_report(second.request_id).prefix_tokens in (1 + len(a) + len(b) + len(c), 1 + len(a) + len(b))
    assert got.logits.isfinite().all()


def test_the_cold_fallback_takes_the_exact_checkpoints_in_its_own_pass(model_of, runner_of, planner_of):
    model = model_of(MIXES["mamba2"])
    runner = runner_of(model, num_slots=8)
    docs, q = [rand_ids(n, 90 + n) for n in (15, 18)], rand_ids(6, 4)
    pic = _pic(planner_of, model, cold_full_fraction=0.5)
    cold = make_request(_layout(docs, q))
    first = execute(pic, runner, cold)
    assert pic.take_report(cold.request_id).cold_full
    assert not pic.exact.pending  # nothing to compute later: the pass was exact
    warm = make_request(_layout(docs, q))
    got = execute(pic, runner, warm)
    rep = pic.take_report(warm.request_id)
    assert rep.prefix_tokens == 1 + sum(map(len, docs)) and rep.recomputed_tokens == len(q)
    torch.testing.assert_close(got.logits[-1], first.logits[-1], rtol=1e-5, atol=1e-5)
    assert any(isinstance(s, ApplyStep) and s.label == "load" and s.end == rep.prefix_tokens
               for s in warm.plan.steps)


def test_the_next_chat_turn_is_computed_from_the_last_turns_exact_state(model_of, runner_of, planner_of):
    model = model_of(MIXES["gdn"])
    runner = runner_of(model, num_slots=8)
    system, u1, a1, u2 = (rand_ids(n, 110 + n) for n in (20, 9, 11, 7))
    pic = _pic(planner_of, model)
    execute(pic, runner, make_request([(system, True), (u1, False)]))
    pic.help_idle(runner)
    turn2 = make_request([(system, True), (u1, True), (a1, True), (u2, False)])
    execute(pic, runner, turn2)
    assert pic.take_report(turn2.request_id).prefix_tokens == 1 + len(system)
    computed_before = pic.exact.computed
    pic.help_idle(runner)  # from the checkpoint after `system`: only u1 and a1 go through the model
    assert pic.exact.computed == computed_before + 1
    turn2_again = make_request([(system, True), (u1, True), (a1, True), (u2, False)])
    got = execute(pic, runner, turn2_again)
    rep = pic.take_report(turn2_again.request_id)
    assert rep.prefix_tokens == 1 + len(system) + len(u1) + len(a1) and rep.recomputed_tokens == len(u2)
    full = plain_prefill(runner, turn2_again.prompt_token_ids, [turn2_again.num_prompt_tokens])
    torch.testing.assert_close(got.logits[-1], full.logits[-1], rtol=1e-5, atol=1e-5)


def test_exact_prefix_is_validated_and_off_for_naive(planner_of, model_of):
    from engine.pic.config import PicConfig
    from engine.pic.errors import PicConfigError

    with pytest.raises(PicConfigError, match="exact_prefix"):
        PicConfig(exact_prefix="yes")
    with pytest.raises(PicConfigError, match="exact_prefix_store='sometimes' must be one of reused, always"):
        PicConfig(exact_prefix_store="sometimes")
    with pytest.raises(PicConfigError, match="exact_prefix_passes='twice' must be one of all, repeated"):
        PicConfig(exact_prefix_passes="twice")
    assert planner_of(model_of(MIXES["gdn"]), method="naive").exact is None


def test_forget_drops_a_prompts_exact_prefixes_but_not_pinned_ones(model_of, runner_of, planner_of):
    from engine.pic.prefix import prefix_bounds

    model = model_of(MIXES["gdn"])
    runner = runner_of(model, num_slots=8)
    docs, q = [rand_ids(n, 130 + n) for n in (12, 14)], rand_ids(4, 5)
    pic = _pic(planner_of, model)
    req = make_request(_layout(docs, q))
    execute(pic, runner, req)
    pic.help_idle(runner)
    ids, bounds = req.prompt_token_ids, prefix_bounds(req.prefill_segments())
    node = pic.exact.tree.walk([tuple(ids[lo:hi]) for lo, hi in bounds])[0]
    node.pins += 1  # in use by a live request: kept
    assert pic.exact.forget(ids, bounds) == 0 and pic.exact.tree.num_nodes == 2
    node.pins -= 1
    assert pic.exact.forget(ids, bounds) == 2
    assert pic.exact.tree.num_nodes == 0 and pic.exact.tree.bytes == 0
    again = make_request(_layout(docs, q))
    execute(pic, runner, again)
    assert pic.take_report(again.request_id).prefix_tokens == 0  # cold again
    # a prompt sharing the first document: forgetting it keeps the other's checkpoints usable
    pic.help_idle(runner)
    other_docs = [docs[0], rand_ids(11, 150)]
    other = make_request(_layout(other_docs, q))
    execute(pic, runner, other)
    pic.help_idle(runner)  # its own exact pass: the first document's node is a branch point now
    assert pic.exact.forget(ids, bounds) == 1  # only the second document's node goes
    first = pic.exact.tree.walk([tuple(ids[lo:hi]) for lo, hi in bounds[:1]])[0]
    assert not first.checkpoint.with_state and first.children
    cold = make_request(_layout(docs, q))
    execute(pic, runner, cold)
    assert pic.take_report(cold.request_id).prefix_tokens == 0
    warm_other = make_request(_layout(other_docs, q))
    execute(pic, runner, warm_other)
    assert pic.take_report(warm_other.request_id).prefix_tokens == 1 + sum(map(len, other_docs))


def test_an_idle_exact_pass_gives_way_to_a_request_between_layers_and_is_redone_later(
        model_of, runner_of, planner_of):
    model = model_of(MIXES["gdn"])
    runner = runner_of(model, num_slots=8)
    docs, q = [rand_ids(n, 70 + n) for n in (17, 13)], rand_ids(5, 3)
    pic = _pic(planner_of, model)
    execute(pic, runner, make_request(_layout(docs, q)))
    assert pic.exact.pending
    free = (runner.cache.slots.num_free, runner.cache.blocks.num_free)
    asked = []

    def due_at_layer_two() -> bool:  # asked once before the pass starts, then before each layer
        asked.append(1)
        return len(asked) > 3

    assert pic.help_idle(runner, should_stop=due_at_layer_two) == 0
    assert len(asked) == 4 and pic.exact.stopped == 1 and pic.idle_stopped == 1
    assert pic.exact.pending and pic.exact.computed == 0  # requeued, nothing kept
    assert (runner.cache.slots.num_free, runner.cache.blocks.num_free) == free  # the scratch sequence went back
    warm = make_request(_layout(docs, q))
    assert pic.help_idle(runner) == 1 and not pic.exact.pending and pic.exact.computed == 1
    execute(pic, runner, warm)
    assert pic.take_report(warm.request_id).prefix_tokens == 1 + sum(len(d) for d in docs)
