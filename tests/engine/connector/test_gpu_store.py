"""The connector's CUDA paths (skipped without CUDA): signatures copied from the pinned
CPU arena on a side stream, read zero-copy from the daemon's GPU tier over CUDA IPC,
and put straight into the GPU tier; each generates exactly what in-process PIC does on
the same GPU, and every lease ends. The engine's own device cache of signatures
(`device_cache_bytes`, on by default on CUDA) is off here: with it, the second request's
segments come from that cache and these paths would not run."""
from __future__ import annotations

import pytest
import torch

from connector_testlib import prompt, run_one, wait_until
from engine.pic.run import attach_planner

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the GPU box)")


def cuda_engine():
    from connector_testlib import new_engine

    return new_engine(device="cuda", dtype="float32")


def test_loads_from_the_cpu_arena_and_the_gpu_tier_match_in_process_pic_on_cuda(start_daemon):
    from engine.connector.attach import attach_store
    from engine.connector.config import StoreConnectorConfig
    from engine.pic.config import PicConfig

    d = start_daemon(gpu_capacity="256MiB")
    ref = cuda_engine()
    ref_planner = attach_planner(ref, PicConfig(miss_path="alone"))
    prompts = [prompt((0, 1, 2)), prompt((2, 0, 1)), prompt((1, 2, 0))]
    want = [run_one(ref, ref_planner, p, f"ref{i}")[0].token_ids for i, p in enumerate(prompts)]
    engine = cuda_engine()
    planner = attach_store(engine, PicConfig(miss_path="alone"), StoreConnectorConfig(socket=str(d.socket), device_cache_bytes=0))
    try:
        got = [run_one(engine, planner, prompts[0], "cold")]
        assert planner.store.flush()
        got.append(run_one(engine, planner, prompts[1], "cpu"))  # host -> device copies
        assert got[1][2].hits_by_tier["cpu"] == 3
        with d.client() as kv:
            objs = kv.list(fingerprint=engine.loaded_model.fingerprint)
            assert kv.prefetch([o.key for o in objs], tier="gpu") == len(objs)
        got.append(run_one(engine, planner, prompts[2], "gpu"))  # zero copy over CUDA IPC
        assert got[2][2].hits_by_tier["gpu"] == 3
        assert [g[0].token_ids for g in got] == want
        with d.client() as kv:
            wait_until(lambda: kv.stats()["leases"] == 0, what="leases released")
    finally:
        planner.store.close()


def test_puts_into_the_gpu_tier_round_trip(start_daemon):
    from engine.connector.attach import attach_store
    from engine.connector.config import StoreConnectorConfig
    from engine.pic.config import PicConfig

    d = start_daemon(gpu_capacity="256MiB")
    engine = cuda_engine()
    planner = attach_store(engine, PicConfig(miss_path="alone"), StoreConnectorConfig(socket=str(d.socket), put_tier="gpu", device_cache_bytes=0))
    try:
        first = run_one(engine, planner, prompt((0, 1)), "a")
        assert planner.store.flush()
        assert planner.store.metrics.snapshot()["puts_stored"] == 2
        second = run_one(engine, planner, prompt((0, 1)), "b")
        assert second[2].hits_by_tier["gpu"] == 2 and second[0].token_ids == first[0].token_ids
    finally:
        planner.store.close()
