"""Position-independent caching on Hugging Face checkpoints (Qwen3-Next, Qwen3.5 dense
and MoE, Gemma 3, Nemotron-H; tiny random weights): with a seam as wide as every segment
PIC equals full recompute, cold and warm (the first segment a hit, the others at new
offsets)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import hf_testlib as H  # noqa: E402
from engine.pic.config import PicConfig  # noqa: E402
from engine.pic.planner import make_planner  # noqa: E402


# the one-pass (fused) prefill for every architecture; the step-by-step plan (pinned equal
# to it by tests/engine/pic/test_fused.py) for one delta-rule and one scalar-decay model
@pytest.mark.parametrize("arch, fused", [(a, True) for a in H.ARCHS] + [("qwen3_next", False), ("nemotron_h", False)])
def test_pic_with_whole_segment_seams_equals_full_recompute(checkpoint, arch, fused):
    engine = H.new_engine(checkpoint(arch))
    tok, runner = engine.tokenizer, engine.runner
    seam = max(len(tok.encode(d)) for d in H.DOCS)
    planner = make_planner(PicConfig(method="pic", seam=seam, fused=fused, miss_path="alone"), runner.model,
                           engine.loaded_model.fingerprint, tok)
    # cold, then warm: the first segment (the only one a wide seam does not recompute) is a
    # hit and spliced; the others move to new offsets
    for n, order in enumerate([(0, 1, 2), (0, 2, 1)]):
        request = H.make_request(tok, H.segments(order), f"r{n}")
        pic = H.execute_plan(planner, runner, request)
        full = H.full_logits(runner, request.prompt_token_ids)
        torch.testing.assert_close(pic, full, rtol=1e-4, atol=1e-4)
        report = planner.take_report(request.request_id)
        assert report.seam_tokens == sum(len(tok.encode(H.DOCS[i])) for i in order[1:])
        assert (report.hit_segments, report.miss_segments) == ((0, 1) if n == 0 else (1, 0))
        assert (report.reused_tokens > 0) == (n == 1)


@pytest.mark.parametrize("how", [dict(fused=True, seam_chain="off", miss_path="alone"),
                                 dict(fused=True, seam_chain="on", miss_path="alone"),
                                 dict(fused=False, miss_path="alone"),
                                 dict(fused=True, seam_chain="off", miss_path="context", miss_signatures="context")],
                         ids=["fused", "seam-chain-kernel", "stepwise", "captured-in-context"])
def test_ring_linear_segment_states_are_rotated_to_their_offsets(checkpoint, how):
    """Ring-linear's linear layers apply RoPE inside the recurrence, so a segment's end state
    computed alone moves with its offset (R_d E). The first layer's inputs are the tokens'
    embeddings, so with a narrow seam its state after PIC is still exact: it equals full
    recompute only if every spliced E is rotated to where the segment now sits: computed
    alone (fused torch composition, the seam-chain kernel's tables, step-by-step splice),
    or captured in context by the cold fused pass (rotated back to its alone positions
    when kept)."""
    engine = H.new_engine(checkpoint("bailing_moe_linear"))
    tok, runner = engine.tokenizer, engine.runner
    assert runner.model.mixer(0).uses_positions
    planner = make_planner(PicConfig(method="pic", seam=2, **how), runner.model,
                           engine.loaded_model.fingerprint, tok)
    for n, order in enumerate([(0, 1, 2), (2, 0, 1)]):
        request = H.make_request(tok, H.segments(order), f"r{n}")
        pic = H.first_layer_state(runner, request, planner)
        report = planner.take_report(request.request_id)
        full = H.first_layer_state(runner, H.make_request(tok, H.segments(order), f"f{n}"))
        assert float(full.abs().max()) > 0.1
        torch.testing.assert_close(pic, full, rtol=1e-4, atol=1e-4)
    assert report.hit_segments == 3 and report.reused_tokens > 0  # warm: every segment spliced, two moved
