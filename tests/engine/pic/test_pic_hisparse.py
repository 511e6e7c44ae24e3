"""PIC with HiSparse (engine/pic/fused.py and splice.py over an `ExternalKVCache`): spliced
segments' full-attention K/V and the computed seams and suffix are written through the
HiSparse layer cache (blocks sealed into its host mirror) instead of the paged pool. With a
top-k and a hot buffer that hold every block, a cold and a warm PIC request then give
exactly PIC's logits and greedy tokens, in the one-pass and the step-by-step plan, with a
large and a tiny hot buffer (blocks evicted and fetched back during decode)."""
from __future__ import annotations

import pytest
import torch

from engine.cache.manager import CacheConfig, CacheManager, cache_specs
from engine.hisparse import HiSparseConfig, HiSparseOffload
from engine.models.config import FULL, GDN
from engine.runtime.runner import ModelRunner

from pic_testlib import execute, make_request, rand_ids

STEPS = 5


def _hisparse_runner(model, hot: int):
    cfg = HiSparseConfig(enabled=True, block_size=4, topk=256, hot_blocks=hot, min_context=0)
    off = HiSparseOffload(cfg, None, 4, 1024, torch.device("cpu"), torch.float32)
    manager = CacheManager(cache_specs(model), CacheConfig(block_size=4, num_blocks=0, num_slots=4), "cpu",
                           torch.float32, external_kv=off.layer_cache)
    return ModelRunner(model, manager, backend="torch", cuda_graphs=False), off


def _run(runner, planner, segments):
    cold = execute(planner, runner, make_request(segments))
    warm_req = make_request(segments)
    warm = execute(planner, runner, warm_req)
    logits = [cold.logits[-1], warm.logits[-1]]
    tokens = []
    last = int(warm.logits[-1].argmax())
    for _ in range(STEPS):
        out = runner.decode([warm.seq], [last])
        logits.append(out[0])
        last = int(out[0].argmax())
        tokens.append(last)
    report = planner.take_report(warm_req.request_id)
    return logits, tokens, report, warm.seq, len(warm_req.prompt_token_ids)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("hot", [0, 2])
def test_pic_through_hisparse_holding_every_block_gives_pic_tokens(fused, hot, model_of, runner_of, planner_of):
    model = model_of([GDN, FULL, GDN])
    segments = [(rand_ids(n, 30 + n), True) for n in (17, 12, 15)] + [(rand_ids(6, 3), False)]
    want_logits, want_tokens, want_report, _, _ = _run(runner_of(model), planner_of(model, fused=fused, seam=4),
                                                        segments)
    runner, off = _hisparse_runner(model, hot)
    got_logits, got_tokens, got_report, seq, n = _run(runner, planner_of(model, fused=fused, seam=4), segments)
    assert got_report.hit_segments == want_report.hit_segments == 3  # the warm request spliced every segment
    assert got_tokens == want_tokens
    for g, w in zip(got_logits, want_logits):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-4)
    cache = off.layers[0]
    k, _ = cache.context_kv(seq.slot)
    assert k.shape[0] == n + STEPS  # every prompt position went through the HiSparse cache
    snap = off.snapshot()
    assert snap["decode_steps"] == STEPS
    if hot == 2:
        assert snap["blocks_fetched"] > 0 and snap["blocks_evicted"] > 0


def test_engine_takes_pic_without_exact_prefixes_and_refuses_planners_that_fill_the_paged_pool():
    from engine.builder import EngineConfig, build_engine
    from engine.errors import InvalidRequestError
    from engine.pic.config import PicConfig
    from engine.pic.planner import make_planner

    engine = build_engine("qwen3next-tiny", EngineConfig(device="cpu", max_num_seqs=2, hisparse=HiSparseConfig(
        enabled=True, block_size=4)))
    model, fp, tok = engine.runner.model, engine.loaded_model.fingerprint, engine.tokenizer
    for config in (PicConfig(method="pic"), PicConfig(method="prefix")):  # exact prefixes on / prefix caching
        with pytest.raises(InvalidRequestError, match="fills the paged KV cache directly"):
            engine.set_planner(make_planner(config, model, fp, tok))
    engine.set_planner(make_planner(PicConfig(method="pic", exact_prefix=False), model, fp, tok))
    assert engine.planner.supports_external_kv
