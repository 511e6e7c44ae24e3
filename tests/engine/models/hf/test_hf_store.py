"""Segment signatures of Hugging Face checkpoints (Qwen3-Next, Qwen3.5 dense and MoE,
Gemma 3, Nemotron-H; tiny random weights) through a REAL kvstore daemon: a second engine
on the same checkpoint hits every segment the first one stored and generates what
in-process PIC generates."""
from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import hf_testlib as H  # noqa: E402
from engine.pic.config import PicConfig  # noqa: E402
from engine.runtime.sampling import SamplingParams  # noqa: E402

GREEDY = SamplingParams(max_new_tokens=4, ignore_eos=True)


def _run(engine, segs, request_id):
    engine.add_request(segs, GREEDY, request_id=request_id)
    while True:
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                return out


@pytest.mark.parametrize("arch", H.ARCHS)
def test_signatures_round_trip_through_a_real_daemon(checkpoint, arch, tmp_path):
    from engine.connector.attach import attach_store
    from engine.connector.config import StoreConnectorConfig
    from engine.pic.run import attach_planner
    from kvstore.testing import DaemonProcess

    d = checkpoint(arch)
    prompts = [H.segments((0, 1, 2)), H.segments((2, 1, 0))]
    memory = H.new_engine(d)
    attach_planner(memory, PicConfig(miss_path="alone"))
    want = [_run(memory, p, f"ref{i}").token_ids for i, p in enumerate(prompts)]

    daemon = DaemonProcess(tmp_path / "d", entry="kvstore.server").start()
    planners = []
    try:
        cfg = StoreConnectorConfig(socket=str(daemon.socket), rpc_timeout_s=5.0)
        first = H.new_engine(d)
        planners.append(attach_store(first, PicConfig(miss_path="alone"), cfg))
        assert _run(first, prompts[0], "a").token_ids == want[0]
        assert planners[0].take_report("a").miss_segments == 3
        assert planners[0].store.flush()
        second = H.new_engine(d)  # another engine: only the daemon holds the signatures
        planners.append(attach_store(second, PicConfig(miss_path="alone"), cfg))
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
