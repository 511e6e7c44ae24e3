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
