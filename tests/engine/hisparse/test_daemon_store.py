"""HiSparse blocks in a REAL kvstore daemon (subprocess, unix socket, shared-memory arena,
LMDB): blocks are readable while their put is queued and after it (zero-copy from the CPU
tier), carry record kind "hisparse-block" under their own key prefix, show apart in
`kvstore inspect`, and leave with their sequence. An engine decoding with a tiny hot
buffer (blocks fetched back every step, from the layer caches' pinned host mirror; the
daemon receives every sealed block asynchronously) gives dense decoding's tokens, also when
the daemon is restarted mid-sequence: decoding continues from the mirror (nothing is
recomputed), and blocks sealed after the restart reach the new daemon."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from engine.builder import EngineConfig, build_engine
from engine.hisparse import KEY_PREFIX, HiSparseConfig
from engine.hisparse.daemon_store import DaemonBlockStore
from engine.hisparse.store import BlockMeta
from engine.runtime.sampling import SamplingParams
from kvstore.testing import DaemonProcess


@pytest.fixture
def daemon(tmp_path: Path):
    d = DaemonProcess(tmp_path / "d", entry="kvstore.server")
    d.start()
    yield d
    d.cleanup()


def test_blocks_round_trip_through_the_daemon_and_show_apart_in_inspect(daemon):
    store = DaemonBlockStore(daemon.socket)
    gen = torch.Generator().manual_seed(0)
    blocks = {bytes([i]) * 4: (torch.randn(8, 2, 16, generator=gen), torch.randn(8, 2, 16, generator=gen))
              for i in range(5)}
    keys = [KEY_PREFIX + k for k in blocks]
    for key, (k, v) in zip(keys, blocks.values()):
        store.put(key, k, v, BlockMeta(layer=3, block=0, tokens=8))
    dk, dv = torch.zeros(5, 8, 2, 16), torch.zeros(5, 8, 2, 16)
    store.read_into(keys, dk, dv, range(5))  # some may still be queued: served from their host copies
    store.flush()
    dk2, dv2 = torch.zeros(5, 8, 2, 16), torch.zeros(5, 8, 2, 16)
    store.read_into(keys, dk2, dv2, range(5))  # from the daemon's CPU tier
    for i, (k, v) in enumerate(blocks.values()):
        assert torch.equal(dk[i], k) and torch.equal(dv[i], v)
        assert torch.equal(dk2[i], k) and torch.equal(dv2[i], v)
    snap = store.metrics.snapshot()
    assert snap["read_bytes"]["cpu"] >= 5 * 2 * 8 * 2 * 16 * 4  # the second read: every block from the CPU tier
    assert snap["blocks_stored"] == 5 and snap["put_failures"] == 0
    with daemon.client() as kv:
        objs = kv.list(prefix=KEY_PREFIX)
        assert len(objs) == 5 and all(o.meta.extra["kind"] == "hisparse-block" for o in objs)
    res = daemon.cli("inspect", "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["objects_by_kind"] == {"hisparse-block": 5}
    store.discard(keys)
    store.flush()
    with daemon.client() as kv:
        assert kv.list(prefix=KEY_PREFIX) == []
    store.close()


def _engine(hisparse: bool, socket=None):
    cfg = EngineConfig(device="cpu", dtype="float32", max_num_seqs=2, cuda_graphs=False, max_model_len=512,
                       hisparse=HiSparseConfig(enabled=hisparse, block_size=8, topk=64, hot_blocks=2, min_context=0),
                       hisparse_store=None if socket is None else str(socket))
    return build_engine("qwen3next-tiny", cfg)


PROMPTS = ["Q: what is the capital of the country where the river flows?\nA:", "## doc 7\nalpha beta gamma delta"]


def _run(engine, steps_then=None, after=0):
    """Greedy-generate both prompts together; call `steps_then()` after `after` steps."""
    params = SamplingParams(max_new_tokens=16, temperature=0.0)
    ids = [engine.add_request(p, params) for p in PROMPTS]
    outs, step = {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out.token_ids
        step += 1
        if steps_then is not None and step == after:
            steps_then()
    return [outs[i] for i in ids]


def test_decoding_with_the_daemon_equals_dense_and_continues_across_a_daemon_restart(daemon, caplog):
    torch.set_num_threads(1)
    want = _run(_engine(False))
    engine = _engine(True, daemon.socket)
    assert _run(engine) == want
    engine.kv_offload.flush()
    snap = engine.kv_offload.snapshot()
    assert snap["blocks_fetched"] > 0 and snap["read_bytes"].get("mirror", 0) > 0 and snap["recomputes"] == 0
    assert snap["write_bytes"].get("cpu", 0) > 0 and snap["put_failures"] == 0  # sealed blocks reached the daemon

    def restart():
        engine.kv_offload.flush()
        daemon.kill()
        daemon.start()

    with caplog.at_level(logging.WARNING, logger="engine.engine"):
        got = _run(engine, restart, after=8)
    assert got == want
    engine.kv_offload.flush()
    snap2 = engine.kv_offload.snapshot()
    assert snap2["recomputes"] == 0 and snap2["write_bytes"]["cpu"] > snap["write_bytes"]["cpu"]
    engine.kv_offload.close()


def test_blocks_spill_to_nvme_when_the_cpu_tier_is_full_and_read_back_exactly(tmp_path):
    d = DaemonProcess(tmp_path / "small", entry="kvstore.server", cpu_capacity="1MiB")
    d.start()
    try:
        store = DaemonBlockStore(d.socket)
        gen = torch.Generator().manual_seed(3)
        blocks = [(torch.randn(64, 4, 64, generator=gen), torch.randn(64, 4, 64, generator=gen)) for _ in range(12)]
        keys = [KEY_PREFIX + i.to_bytes(4, "little") for i in range(12)]  # 12 x 128 KiB: over the 1 MiB CPU tier
        for key, (k, v) in zip(keys, blocks):
            store.put(key, k, v, BlockMeta(layer=0, block=0, tokens=64))
        store.flush()
        with d.client() as kv:
            objs = kv.list(prefix=KEY_PREFIX)
        assert len(objs) == 12 and "nvme" in {o.tier for o in objs}
        dk, dv = torch.zeros(12, 64, 4, 64), torch.zeros(12, 64, 4, 64)
        store.read_into(keys, dk, dv, range(12))
        for i, (k, v) in enumerate(blocks):
            assert torch.equal(dk[i], k) and torch.equal(dv[i], v)
        snap = store.metrics.snapshot()
        assert snap["read_bytes"].get("nvme", 0) > 0 and snap["put_failures"] == 0
        store.close()
    finally:
        d.cleanup()
