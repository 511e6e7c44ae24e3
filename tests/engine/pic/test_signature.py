"""SegmentSignature: what compute_signature extracts equals what a plain prefill writes,
the named-tensor form round-trips, byte accounting, and format errors."""
from __future__ import annotations

import pytest
import torch

from engine.models.config import FULL, GDN, GLA, KDA, LIGHTNING, MAMBA2, SWA
from engine.pic.compute import compute_signature
from engine.pic.errors import SignatureFormatError
from engine.pic.signature import AttentionPart, LinearPart, SegmentSignature
from pic_testlib import fla_emulated, plain_prefill, rand_ids

ALL_KINDS = [FULL, SWA, GDN, GLA, LIGHTNING, MAMBA2]


def test_alone_pass_holds_exactly_what_a_plain_prefill_writes(model_of, runner_of):
    model = model_of(ALL_KINDS)
    seg = rand_ids(17, 1)
    sig = compute_signature(model, seg, [256], split=5)
    runner = runner_of(model)
    ran = plain_prefill(runner, [256] + seg, [18])
    cache, slot = runner.cache, ran.seq.slot
    for i, part in enumerate(sig.layers):
        layer = cache.layer(i)
        if isinstance(part, AttentionPart) and part.kind == "full":
            k, v = layer.gather(cache.flat_slots(ran.seq, 0, 18))
            assert torch.equal(part.k, k) and torch.equal(part.v, v)
        elif isinstance(part, AttentionPart):
            pos = torch.arange(part.first_pos, 18)
            k, v = layer.read(slot, pos)
            assert part.num_rows == 6 and torch.equal(part.k, k) and torch.equal(part.v, v)
        else:
            assert torch.equal(part.state, layer.state[slot])
            if layer.conv_tail is not None:
                assert torch.equal(part.conv_tail, layer.conv_tail[slot])


def test_named_tensor_form_round_trips_every_part(model_of):
    model = model_of(ALL_KINDS)
    sig = compute_signature(model, rand_ids(12, 2), [256], split=4)
    tensors, meta, layer_of = sig.to_tensors()
    assert all(name.startswith(f"L{layer_of[name]}.") for name in tensors)
    back = SegmentSignature.from_tensors({k: v.clone() for k, v in tensors.items()}, meta)
    assert (back.num_tokens, back.anchor_len, back.split) == (12, 1, 4)
    for a, b in zip(sig.layers, back.layers):
        assert type(a) is type(b)
        if isinstance(a, AttentionPart):
            assert a.first_pos == b.first_pos and torch.equal(a.k, b.k) and torch.equal(a.v, b.v)
        else:
            assert a.family == b.family and a.live_heads == b.live_heads
            assert torch.equal(a.state, b.state) and torch.equal(a.tail_state, b.tail_state)
            assert torch.equal(a.transition_f32(), b.transition_f32())
    assert back.nbytes() == sig.nbytes()


def test_bytes_by_part_counts_a_shared_tail_state_once(model_of):
    model = model_of([GDN, FULL])
    shared = compute_signature(model, rand_ids(10, 3), [], split=0)  # tail = the whole alone pass
    part: LinearPart = shared.layers[0]
    assert part.tail_state_is_state and part.tail_state is part.state
    parts = shared.bytes_by_part()
    assert parts["linear_tail_state"] == 0 and parts["linear_state"] == part.state.numel() * 4
    assert parts["full_kv"] == 2 * 10 * 2 * 8 * 4
    assert sum(parts.values()) == shared.nbytes()
    tensors, _, _ = shared.to_tensors()
    assert "L0.tail_state" not in tensors


def test_signature_of_a_segment_no_longer_than_its_seam_has_no_tail(model_of):
    sig = compute_signature(model_of([GLA, FULL]), rand_ids(4, 1), [256], split=6)
    assert sig.tail_len == 0
    assert sig.layers[0].tail_state is None and sig.layers[0].tail_transition is None


def test_format_errors_name_the_problem(model_of):
    sig = compute_signature(model_of([GDN, FULL]), rand_ids(5, 1), [256], split=2)
    tensors, meta, _ = sig.to_tensors()
    with pytest.raises(SignatureFormatError, match="format"):
        SegmentSignature.from_tensors(tensors, {**meta, "format": "other-v9"})
    del tensors["L1.v"]
    with pytest.raises(SignatureFormatError, match="'L1.v' is missing"):
        SegmentSignature.from_tensors(tensors, meta)
    with pytest.raises(SignatureFormatError, match="at least one token"):
        compute_signature(model_of([GDN, FULL]), [], [256], 0)


def test_signature_without_end_states_round_trips_and_saves_the_state_bytes(model_of):
    model = model_of([GDN, LIGHTNING, FULL])
    ids = rand_ids(12, 4)
    full = compute_signature(model, ids, [256], split=3)
    lean = compute_signature(model, ids, [256], split=3, keep_end_state=False)
    assert not lean.has_end_state and full.has_end_state
    assert full.nbytes() - lean.nbytes() == full.bytes_by_part()["linear_state"]
    tensors, meta, _ = lean.to_tensors()
    back = SegmentSignature.from_tensors(tensors, meta)
    assert not back.has_end_state and torch.equal(back.layers[0].tail_state, full.layers[0].tail_state)
    with pytest.raises(SignatureFormatError, match="needs a tail"):
        compute_signature(model, ids, [256], split=12, keep_end_state=False)


def _same_signature(a, b):
    assert (a.num_tokens, a.anchor_len, a.split) == (b.num_tokens, b.anchor_len, b.split)
    for i, (pa, pb) in enumerate(zip(a.layers, b.layers)):
        assert type(pa) is type(pb), i
        for name, x in vars(pa).items():
            y = getattr(pb, name)
            if isinstance(x, torch.Tensor):
                torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-6, msg=lambda m: f"layer {i} {name}: {m}")
            else:
                assert x == y, (i, name)


@pytest.mark.parametrize("layers", [[GDN, FULL, SWA], [GLA, FULL], [LIGHTNING, SWA], [MAMBA2, FULL]],
                         ids=["gdn", "gla", "lightning", "mamba2"])
@pytest.mark.parametrize("keep_end_state", [True, False])
def test_several_segments_in_one_pass_equal_each_computed_alone(layers, keep_end_state, model_of):
    from engine.pic.compute import compute_signatures

    model = model_of(layers)
    # splits: inside, zero (tail from the start), whole segment (no tail), and a short segment
    segs = [(rand_ids(19, 1), 4), (rand_ids(9, 2), 0), (rand_ids(6, 3), 6), (rand_ids(2, 4), 1)]
    if not keep_end_state:
        segs = [(t, s) for t, s in segs if s < len(t)]
    got = compute_signatures(model, segs, [256], keep_end_state=keep_end_state)
    assert len(got) == len(segs)
    for (toks, split), sig in zip(segs, got):
        _same_signature(compute_signature(model, toks, [256], split, keep_end_state=keep_end_state), sig)


def test_several_segments_keep_forgotten_delta_heads_out_of_the_operator(model_of):
    from engine.pic.compute import compute_signatures
    from test_compose import strengthen_decay

    model = model_of([GDN, FULL])
    strengthen_decay(model, GDN)
    segs = [(rand_ids(120, 5), 4), (rand_ids(7, 6), 2), (rand_ids(100, 7), 3)]
    got = compute_signatures(model, segs, [256])
    alone = [compute_signature(model, t, [256], s) for t, s in segs]
    for a, b in zip(alone, got):
        _same_signature(a, b)
    assert any(0 < len(s.layers[0].live_heads) < s.layers[0].num_heads for s in got)


@pytest.mark.parametrize("tail_states", ["direct", "fla"])
@pytest.mark.parametrize("layers", [[GDN, FULL, SWA], [GLA, FULL], [LIGHTNING, FULL], [KDA, FULL]],
                         ids=["gdn", "gla", "lightning", "kda"])
def test_the_fla_branches_fused_tails_and_settled_heads_match_the_torch_pass(layers, tail_states, model_of,
                                                                              monkeypatch):
    """On fla the delta tails' E_tail and T come from ONE call started at [0 | I] with
    values [v | 0], every delta layer's live heads are read once at the end of the pass,
    and scalar/diagonal tails' E_tail is one sum each (PicConfig.tail_states="direct") or a
    second varlen call ("fla"): the signatures equal the torch backend's, packed and single."""
    from engine.models.layers import fla_backend
    from engine.pic.compute import AlonePass, compute_signature, compute_signatures

    model = model_of(layers)
    segs = [(rand_ids(19, 1), 4), (rand_ids(9, 2), 0), (rand_ids(6, 3), 6), (rand_ids(12, 4), 3)]
    want = compute_signatures(model, segs, [256], backend="torch")
    want_one = compute_signature(model, segs[0][0], [256], segs[0][1], backend="torch")
    monkeypatch.setattr(fla_backend, "fla_chunk", fla_emulated)
    got = compute_signatures(model, segs, [256], backend="fla", tail_states=tail_states)
    for g, w in zip(got, want):
        _same_signature(g, w)
    _same_signature(compute_signature(model, segs[0][0], [256], segs[0][1], backend="fla"), want_one)
    alone = AlonePass(model, segs, [256], backend="fla", tail_states=tail_states)
    assert alone.run()
    linear = sum(1 for p in alone.parts[0] if hasattr(p, "live_heads"))
    if layers[0] in (GDN, KDA):  # one pending operator set per dense-transition layer until signatures() settles them
        assert len(alone.pending) == linear and all(p.live_heads is None for p in alone.parts[0][:1])
        alone.signatures()
        assert not alone.pending and alone.parts[0][0].live_heads


@pytest.mark.parametrize("tail_states", ["direct", "fla"])
def test_kda_on_an_fla_without_kda_kernels_takes_the_torch_forms(tail_states, model_of, runner_of, planner_of,
                                                                monkeypatch):
    """An fla-core without `fla.ops.kda`: on the fla backend the kda layers never call fla
    (the packed alone pass, its tails, the one-pass PIC prefill with its short recurrent
    ranges all take the torch forms) and give the torch backend's signatures and logits."""
    from engine.models.layers import fla_backend
    from engine.pic.compute import compute_signatures
    from pic_testlib import execute, make_request

    def no_fla(*args, **kwargs):
        raise AssertionError("fla called for a kda layer")

    monkeypatch.setattr(fla_backend, "fla_has_kda", lambda: False)
    monkeypatch.setattr(fla_backend, "fla_chunk", no_fla)
    monkeypatch.setattr(fla_backend, "fla_recurrent", no_fla)
    model = model_of([KDA, FULL, KDA])
    segs = [(rand_ids(19, 1), 4), (rand_ids(9, 2), 0), (rand_ids(12, 4), 3)]
    want = compute_signatures(model, segs, [256], backend="torch")
    for g, w in zip(compute_signatures(model, segs, [256], backend="fla", tail_states=tail_states), want):
        _same_signature(g, w)
    docs, question = [rand_ids(n, 30 + n) for n in (11, 7, 13)], rand_ids(5, 9)
    logits = {}
    for backend in ("torch", "fla"):
        runner = runner_of(model)
        runner.backend = backend
        planner = planner_of(model, fused=True, seam=4)
        for order in ((0, 1, 2), (2, 0, 1)):
            got = execute(planner, runner, make_request([(docs[i], True) for i in order] + [(question, False)]))
            logits[backend, order] = got.logits[-1]
    for order in ((0, 1, 2), (2, 0, 1)):
        torch.testing.assert_close(logits["fla", order], logits["torch", order], rtol=1e-5, atol=1e-5)
