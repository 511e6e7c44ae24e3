"""PicConfig.miss_signatures="context" (engine.pic.capture): the signatures of misses
computed in context are taken from the request's own fused pass, stored at once, and no
alone pass runs. Pinned: spliced back into the same context a captured signature gives
exactly what computing the segment in context gives (every part: re-rotated K, window rows,
E_tail, T_tail, conv tail); a first placement's capture is its alone signature; the fla
path (emulated) captures what the torch path captures; hits elsewhere; keys kept apart."""
from __future__ import annotations

import pytest
import torch

from engine.models.config import FULL, GDN, GLA, KDA, LIGHTNING, MAMBA2, SWA
from engine.pic.capture import ORIGIN
from engine.pic.compute import compute_signature
from engine.pic.errors import PicConfigError
from engine.pic.signature import AttentionPart

from pic_testlib import BOS, execute, fla_emulated, make_request, rand_ids

MIXES = {"gdn-full-swa": [GDN, FULL, SWA, GDN], "gla-full": [GLA, FULL, GLA], "lightning-swa": [LIGHTNING, SWA, FULL],
         "mamba2-full": [MAMBA2, FULL, MAMBA2], "swa-full": [SWA, SWA, FULL]}


def _ctx(planner_of, model, **kw):
    kw.setdefault("seam", 4)
    kw.setdefault("exact_prefix", False)  # idle work here is the captures' alone (exact prefixes: test_exact_prefix)
    return planner_of(model, fused=True, miss_path="context", miss_signatures="context", **kw)


def _docs(seed: int):
    return [rand_ids(n, seed + n) for n in (18, 14, 16)]


@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize("where", [0, 1, 2])
def test_a_captured_signature_spliced_back_into_its_context_gives_the_in_context_computation(
        mix, where, model_of, runner_of, planner_of):
    model = model_of(MIXES[mix])
    runner = runner_of(model)
    planner = _ctx(planner_of, model)
    docs, question = _docs(10 * where), rand_ids(6, 99)
    layout = [(d, True) for d in docs] + [(question, False)]
    for d in docs[:where] + docs[where + 1:]:  # every doc cached but the one at `where`
        execute(planner, runner, make_request([(d, True), (rand_ids(5, 7), False)]))
    cold = make_request(layout)
    first = execute(planner, runner, cold)
    rep = planner.take_report(cold.request_id)
    assert rep.miss_segments == 1 and rep.captured_segments == 1 and rep.deferred_segments == 0
    # its signature is kept after its first token: at the next plan() or idle call, no alone pass
    assert len(planner.captured) == 1 and planner.idle_poll_s is not None
    assert not planner.deferred and planner.help_idle(runner) == 1 and planner.help_idle(runner) == 0
    assert planner.idle_poll_s is None  # nothing left: the engine need not poll for idle work
    warm = make_request(layout)
    again = execute(planner, runner, warm)
    rep2 = planner.take_report(warm.request_id)
    assert rep2.miss_segments == 0 and rep2.hit_segments == 3
    torch.testing.assert_close(again.logits[-1], first.logits[-1], rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("n", [21, 5], ids=["with-tail", "no-tail"])  # 5 tokens: all seam (6), no tail
def test_a_first_placement_capture_is_the_alone_signature(n, model_of, runner_of, planner_of):
    model = model_of([GDN, FULL, SWA, GLA])
    runner = runner_of(model)
    planner = _ctx(planner_of, model)
    doc, question = rand_ids(n, 3), rand_ids(6, 4)
    execute(planner, runner, make_request([(doc, True), (question, False)]))
    split = min(n, planner.seam)  # the window rule: max(4, window 6)
    assert planner.keep_captured() == 1
    got = planner.cache.get(planner.key(doc, split))
    assert got is not None and got.meta["origin"] == ORIGIN and got.has_end_state
    ref = compute_signature(model, doc, [BOS], split=split)
    assert (got.num_tokens, got.anchor_len, got.split) == (ref.num_tokens, ref.anchor_len, ref.split)
    for i, (a, b) in enumerate(zip(got.layers, ref.layers)):
        if isinstance(b, AttentionPart):
            assert (a.kind, a.first_pos) == (b.kind, b.first_pos), i
            torch.testing.assert_close(a.k, b.k, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(a.v, b.v, rtol=1e-5, atol=1e-5)
            continue
        for name in ("state", "tail_state", "tail_transition", "conv_tail"):
            x, y = getattr(a, name), getattr(b, name)
            assert (x is None) == (y is None), (i, name)
            if y is not None:
                torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5, msg=lambda m: f"layer {i} {name}: {m}")
        assert a.live_heads == b.live_heads


@pytest.mark.parametrize("layers", [[GDN, FULL, GDN], [SWA, FULL, SWA]], ids=["gdn", "attention-only"])
def test_a_later_capture_is_never_spliced_whole_at_the_start(layers, model_of, runner_of, planner_of):
    """A context signature of a later placement keeps only its tail's rows (and no E: the
    state after anchor + segment alone is not in the pass), so a request that starts with
    that segment computes anchor and seam and splices the tail; with an attention-only
    model (no E to miss) too. Spliced back into its own context after the anchor, that
    equals computing the segment there."""
    from engine.pic.errors import SplicePlacementError
    from engine.pic.splice import SplicePiece

    model = model_of(layers)
    runner = runner_of(model)
    planner = _ctx(planner_of, model)
    a, b, question = rand_ids(15, 1), rand_ids(19, 2), rand_ids(6, 3)
    execute(planner, runner, make_request([(a, True), (b, True), (question, False)]))
    assert planner.keep_captured() == 2
    sig = planner.cache.get(planner.key(b, planner.seam))
    assert sig is not None and not sig.placeable_first and sig.meta["origin"] == ORIGIN
    with pytest.raises(SplicePlacementError, match="placed first"):
        SplicePiece(sig, 1, first=True).validate()
    req = make_request([(b, True), (question, False)])
    run = execute(planner, runner, req)
    rep = planner.take_report(req.request_id)
    assert rep.hit_segments == 1 and rep.miss_segments == 0
    plain = planner_of(model, fused=True, seam=4)  # the same prompt with nothing cacheable
    runner2 = runner_of(model)
    ref = execute(plain, runner2, make_request([(b, False), (question, False)]))
    head = 1 + planner.seam  # anchor and seam: computed in context by both, so equal
    full = [i for i, kind in enumerate(layers) if kind == FULL][0]
    k, v = runner.cache.layers[full].gather(runner.cache.flat_slots(run.seq, 0, head))
    k2, v2 = runner2.cache.layers[full].gather(runner2.cache.flat_slots(ref.seq, 0, head))
    torch.testing.assert_close(k, k2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(v, v2, rtol=1e-5, atol=1e-5)
    assert (run.logits[-1] - ref.logits[-1]).abs().max() > 0  # the tail came from the other context


@pytest.mark.parametrize("layers", [[GDN, FULL, GDN], [GLA, FULL], [LIGHTNING, FULL], [KDA, FULL, KDA]],
                         ids=["gdn", "gla", "lightning", "kda"])
def test_the_fla_path_captures_what_the_torch_path_captures(layers, model_of, runner_of, planner_of, monkeypatch):
    """On fla (emulated by the torch recurrence) the tails come from one varlen call per
    layer for every capture (the delta rule's operators from the same call), through the
    seam chain; the signatures equal the torch path's."""
    from engine.models.layers import fla_backend

    monkeypatch.setattr(fla_backend, "fla_chunk", fla_emulated)
    model = model_of(layers)
    docs, question = _docs(3), rand_ids(6, 5)
    new = [rand_ids(n, 700 + n) for n in (20, 15)]
    layout = [(docs[0], True), (new[0], True), (docs[1], True), (new[1], True), (question, False)]
    sigs = {}
    for backend in ("torch", "fla"):
        runner = runner_of(model)
        runner.backend = backend
        planner = _ctx(planner_of, model, seam_chain="on" if backend == "fla" else "off")
        for d in docs[:2]:
            execute(planner, runner, make_request([(d, True), (question, False)]))
        req = make_request(layout)
        execute(planner, runner, req)
        assert planner.take_report(req.request_id).captured_segments == 2
        planner.keep_captured()
        sigs[backend] = [planner.cache.get(planner.key(n, 4)) for n in new]
    for s_t, s_f in zip(sigs["torch"], sigs["fla"]):
        tt, _, _ = s_t.to_tensors()
        tf, _, _ = s_f.to_tensors()
        assert tt.keys() == tf.keys()
        for name in tt:
            torch.testing.assert_close(tf[name], tt[name], rtol=1e-4, atol=1e-4, msg=lambda m: f"{name}: {m}")


def test_captured_signatures_hit_at_other_offsets_and_in_the_cold_fallback(model_of, runner_of, planner_of):
    model = model_of([GDN, FULL, SWA])
    runner = runner_of(model)
    planner = _ctx(planner_of, model, cold_full_fraction=0.5)
    docs, question = _docs(40), rand_ids(6, 41)
    cold = make_request([(d, True) for d in docs] + [(question, False)])
    execute(planner, runner, cold)
    rep = planner.take_report(cold.request_id)
    assert rep.cold_full and rep.captured_segments == 3 and rep.deferred_segments == 0 and not planner.deferred
    shuffled = make_request([(docs[2], True), (docs[0], True), (docs[1], True), (question, False)])
    execute(planner, runner, shuffled)
    rep2 = planner.take_report(shuffled.request_id)
    assert rep2.hit_segments == 3 and rep2.miss_segments == 0 and not rep2.cold_full


def test_context_keys_never_mix_with_alone_keys_and_the_option_is_validated(model_of, planner_of):
    model = model_of([GDN, FULL])
    doc = rand_ids(12, 0)
    alone = planner_of(model, fused=True, seam=4, miss_path="context")
    assert alone.config.miss_signatures == "alone"
    assert _ctx(planner_of, model).key(doc, 4) != alone.key(doc, 4)
    with pytest.raises(PicConfigError, match="miss_path='context'"):
        planner_of(model, fused=True, miss_signatures="context")
    with pytest.raises(PicConfigError, match="miss_signatures"):
        planner_of(model, fused=True, miss_path="context", miss_signatures="later")


@pytest.mark.parametrize("layers", [[GDN, FULL, GDN], [GLA, SWA, FULL], [LIGHTNING, FULL], [KDA, FULL, KDA]],
                         ids=["gdn", "gla", "lightning", "kda"])
def test_on_fla_a_captured_signature_spliced_back_into_its_context_gives_the_in_context_computation(
        layers, model_of, runner_of, planner_of, monkeypatch):
    """The CUDA path's structure (fla emulated, seam chain on, long ranges): the batched
    tails (one sum for scalar/diagonal decay, one varlen call for the delta rule) splice
    back exactly."""
    from engine.models.layers import fla_backend
    from engine.pic import seam_chain_layer

    monkeypatch.setattr(fla_backend, "fla_chunk", fla_emulated)
    monkeypatch.setattr(seam_chain_layer, "CHAIN_MAX_TOKENS", 8)  # misses of 15-20 tokens are long ranges
    model = model_of(layers)
    runner = runner_of(model)
    runner.backend = "fla"
    planner = _ctx(planner_of, model, seam_chain="on")
    docs, question = _docs(50), rand_ids(6, 51)
    new = [rand_ids(n, 800 + n) for n in (20, 15)]
    layout = [(docs[0], True), (new[0], True), (docs[1], True), (new[1], True), (question, False)]
    for d in docs[:2]:
        execute(planner, runner, make_request([(d, True), (question, False)]))
    cold = make_request(layout)
    first = execute(planner, runner, cold)
    assert planner.take_report(cold.request_id).captured_segments == 2
    warm = make_request(layout)
    again = execute(planner, runner, warm)
    assert planner.take_report(warm.request_id).hit_segments == 4
    torch.testing.assert_close(again.logits[-1], first.logits[-1], rtol=5e-5, atol=5e-5)


def test_captured_signatures_hold_their_own_bytes(model_of, runner_of, planner_of):
    """The capture gathers every capture's rows in one batch per layer; the signatures it
    returns are compacted (one buffer per dtype each), so a cache keeping one keeps only
    its bytes, and its accounting (nbytes) is what it holds."""
    model = model_of([GDN, FULL, SWA])
    runner = runner_of(model)
    planner = _ctx(planner_of, model)
    docs, question = _docs(60), rand_ids(6, 61)
    execute(planner, runner, make_request([(d, True) for d in docs] + [(question, False)]))
    assert planner.keep_captured() == len(docs)
    sigs = [planner.cache.get(planner.key(d, planner.seam)) for d in docs]
    storages = []
    for sig in sigs:
        tensors, _, _ = sig.to_tensors()
        ptrs = {t.untyped_storage().data_ptr() for t in tensors.values()}
        assert len(ptrs) == len({t.dtype for t in tensors.values()})  # one buffer per dtype
        assert sum(t.untyped_storage().nbytes() for t in {t.untyped_storage().data_ptr(): t
                                                          for t in tensors.values()}.values()) == sig.nbytes()
        storages.append(ptrs)
    assert not set.intersection(*storages)  # nothing shared between the request's signatures


def test_on_fla_tails_after_hits_are_taken_from_the_layers_own_long_range_call(
        model_of, runner_of, planner_of, monkeypatch):
    """Each captured miss follows a hit: the planner keeps its tail a range of its own, the
    delta layer's shared varlen call for its long ranges gives their (T, E), and the capture
    runs no call of its own (one delta_operators call per layer, not two). A run of two
    misses is not split: it stays one long range (one plain fla call), and the capture makes
    the layer's one delta_operators call."""
    from engine.models.layers import fla_backend
    from engine.pic import long_ranges, seam_chain_layer

    monkeypatch.setattr(fla_backend, "fla_chunk", fla_emulated)
    monkeypatch.setattr(seam_chain_layer, "CHAIN_MAX_TOKENS", 8)
    calls = []
    real = long_ranges.delta_operators
    monkeypatch.setattr(long_ranges, "delta_operators", lambda inp, ranges, *rest: calls.append(len(ranges)) or
                        real(inp, ranges, *rest))
    model = model_of([GDN, FULL, GDN])
    docs, question = _docs(70), rand_ids(6, 71)
    new = [rand_ids(n, 900 + n) for n in (20, 15)]
    for layout, per_layer in (([(docs[0], True), (new[0], True), (docs[1], True), (new[1], True), (question, False)], 1),
                              ([(docs[0], True), (new[0], True), (new[1], True), (question, False)], 1)):
        runner = runner_of(model)
        runner.backend = "fla"
        planner = _ctx(planner_of, model, seam_chain="on")
        for d in docs[:2]:
            execute(planner, runner, make_request([(d, True), (question, False)]))
        planner.keep_captured()
        calls.clear()
        cold = make_request(layout)
        first = execute(planner, runner, cold)
        assert planner.take_report(cold.request_id).captured_segments == 2
        assert calls == [2] * 2 * per_layer, layout  # two delta layers, each call over both tails
        warm = make_request(layout)
        again = execute(planner, runner, warm)
        torch.testing.assert_close(again.logits[-1], first.logits[-1], rtol=5e-5, atol=5e-5)
