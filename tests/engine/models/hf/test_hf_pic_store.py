"""Position-independent caching on Hugging Face checkpoints (Qwen3-Next, Qwen3.5 dense
and MoE, Gemma 3, Nemotron-H; tiny random weights): with a seam as wide as every segment PIC equals
full recompute, cold and warm (segments hit in another order); and segment signatures go
through a REAL kvstore daemon: a second engine on the same checkpoint hits every segment
the first one stored and generates what in-process PIC generates."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import hf_testlib as H  # noqa: E402
from engine.builder import EngineConfig, build_engine  # noqa: E402
from engine.pic.config import PicConfig  # noqa: E402
from engine.pic.planner import make_planner  # noqa: E402
from engine.runtime.sampling import SamplingParams  # noqa: E402

ARCHS = ["qwen3_next", "qwen3_5", "qwen3_5_moe", "gemma3", "nemotron_h"]
GREEDY = SamplingParams(max_new_tokens=4, ignore_eos=True)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    made = {}

    def get(arch: str):
        if arch not in made:
            d = tmp_path_factory.mktemp(arch)
            H.build(arch, d)
            made[arch] = d
        return made[arch]
    return get


def new_engine(directory):
    return build_engine(str(directory), EngineConfig(device="cpu", dtype="float32", max_num_seqs=2,
                                                     kv_cache_tokens=2048))


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("arch", ARCHS)
def test_pic_with_whole_segment_seams_equals_full_recompute(checkpoint, arch, fused):
    engine = new_engine(checkpoint(arch))
    tok, runner = engine.tokenizer, engine.runner
    seam = max(len(tok.encode(d)) for d in H.DOCS)
    planner = make_planner(PicConfig(method="pic", seam=seam, fused=fused), runner.model,
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


def _run(engine, segs, request_id):
    engine.add_request(segs, GREEDY, request_id=request_id)
    while True:
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                return out


@pytest.mark.parametrize("arch", ARCHS)
def test_signatures_round_trip_through_a_real_daemon(checkpoint, arch, tmp_path):
    from engine.connector.attach import attach_store
    from engine.connector.config import StoreConnectorConfig
    from engine.pic.run import attach_planner
    from kvstore.testing import DaemonProcess

    d = checkpoint(arch)
    prompts = [H.segments((0, 1, 2)), H.segments((2, 1, 0))]
    memory = new_engine(d)
    attach_planner(memory, PicConfig())
    want = [_run(memory, p, f"ref{i}").token_ids for i, p in enumerate(prompts)]

    daemon = DaemonProcess(tmp_path / "d", entry="kvstore.server").start()
    planners = []
    try:
        cfg = StoreConnectorConfig(socket=str(daemon.socket), rpc_timeout_s=5.0)
        first = new_engine(d)
        planners.append(attach_store(first, PicConfig(), cfg))
        assert _run(first, prompts[0], "a").token_ids == want[0]
        assert planners[0].take_report("a").miss_segments == 3
        assert planners[0].store.flush()
        second = new_engine(d)  # another engine: only the daemon holds the signatures
        planners.append(attach_store(second, PicConfig(), cfg))
        assert second.loaded_model.fingerprint == first.loaded_model.fingerprint
        out = _run(second, prompts[1], "b")
        report, store = planners[1].take_report("b"), planners[1].take_store_report("b")
        assert report.hit_segments == 3 and report.miss_segments == 0
        assert store.hits_by_tier["cpu"] == 3 and store.computed == 0
        assert out.token_ids == want[1]
    finally:
        for p in planners:
            p.store.close(timeout=10.0)
        daemon.cleanup()
