"""The PIC planner inside the real LLMEngine (scheduler hook): concurrent chunked
prefills and preemption (re-planning from empty caches) change no token."""
from __future__ import annotations

import pytest
import torch

from engine.builder import EngineConfig, build_engine
from engine.models.config import FULL, GDN, SWA
from engine.models.weights import build_model, save_model
from engine.pic.config import PicConfig
from engine.pic.run import attach_planner
from engine.runtime.sampling import SamplingParams
from pic_testlib import pic_config

DOCS = [f"## doc {i}\n" + "".join(f"k{i}{j}: v{j}{i}\n" for j in range(4)) for i in range(4)]
PROMPTS = [[{"text": DOCS[a], "cache": True}, {"text": DOCS[b], "cache": True},
            {"text": f"Q: value of k{b}1?\nA: ", "cache": False}] for a, b in ((0, 1), (1, 0), (2, 1), (3, 2))]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("model")
    save_model(build_model(pic_config([GDN, SWA, FULL], name="pic-engine-test"), "cpu", torch.float32, seed=2), d)
    return d


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def engine_with_pic(model_dir, **kw):
    cfg = dict(device="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=256, prefill_chunk_size=16,
               kv_cache_tokens=2048)
    cfg.update(kw)
    engine = build_engine(str(model_dir), EngineConfig(**cfg))
    return engine, attach_planner(engine, PicConfig(method="pic", seam=4, miss_path="alone"))


def test_concurrent_pic_requests_match_each_alone(model_dir):
    engine, planner = engine_with_pic(model_dir)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    alone = [engine.generate([p], params)[0].token_ids for p in PROMPTS]
    together = engine.generate(PROMPTS, params)
    assert [o.token_ids for o in together] == alone
    assert all(o.num_reused_tokens > 0 for o in together)
    assert planner.cache.stats().misses == 4  # four distinct documents, each computed alone once
    assert engine.cache_usage() == 0.0


def test_preemption_replans_from_empty_caches_and_changes_no_token(model_dir):
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    roomy, _ = engine_with_pic(model_dir)
    expected = [o.token_ids for o in roomy.generate(PROMPTS, params)]
    tight, planner = engine_with_pic(model_dir, kv_cache_tokens=192)
    outs = tight.generate(PROMPTS, params)
    assert tight.stats.num_preemptions > 0
    assert [o.token_ids for o in outs] == expected
    assert tight.cache_usage() == 0.0
