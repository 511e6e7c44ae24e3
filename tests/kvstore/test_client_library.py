"""kvstore/client/: sync and asyncio clients against a real daemon process: round trips
per tier, zero-copy views, sharing across processes, checksums, leases under eviction
pressure, capacity errors, concurrency, and the no-daemon message."""

from __future__ import annotations

import asyncio
import mmap
import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import torch

from kvstore.client import AsyncKVStoreClient, KVStoreClient
from kvstore.errors import BadObject, CapacityExhausted, DaemonNotRunning, InvalidRequest, UnknownKey
from kvstore.client.regions import RegionMapper
from kvstore.rpc import kvstore_pb2 as pb
from kvstore.rpc.codec import region_from_pb
from kvstore.rpc.service import KVStoreStub
from kvstore.testing import REPO_ROOT

import grpc

CUDA = torch.cuda.is_available()


def _payload(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_put_get_round_trip_per_tier(daemon, tier):
    data = _payload(300_000, seed=1)
    with daemon.client() as kv:
        res = kv.put(f"rt/{tier}", data, tier=tier, fingerprint="fp-rt", token_count=7, cost=0.5)
        assert (res.status, res.tier, res.size) == ("stored", tier, len(data))
        assert kv.lookup([f"rt/{tier}"])[0].tier == tier
        with kv.get(f"rt/{tier}", promote=False) as view:
            assert view.tier == tier and view.size == len(data)
            assert view.memoryview.readonly
            assert view.memoryview.tobytes() == data
            assert view.meta.fingerprint == "fp-rt" and view.meta.token_count == 7
            view.verify()


@pytest.mark.skipif(not CUDA, reason="the GPU tier needs CUDA (not present on this machine)")
def test_put_get_round_trip_gpu_tier(start_daemon):
    d = start_daemon(gpu_capacity="64MiB", entry="kvstore.server")  # GPU hosts may lack the CLI's typer
    t = {"k": torch.randn(4, 128, device="cuda"), "v": torch.randn(4, 128, device="cuda").half()}
    with d.client() as kv:
        assert kv.put_tensors("rt/gpu", t, fingerprint="fp", token_count=4, tier="gpu").tier == "gpu"
        with kv.get_tensors("rt/gpu") as (header, got):
            assert got["k"].is_cuda and torch.equal(got["k"], t["k"]) and torch.equal(got["v"], t["v"])
        kv.put("rt/gpu-bytes", b"abc" * 1000, tier="gpu")
        with kv.get("rt/gpu-bytes") as view:
            assert view.tobytes() == b"abc" * 1000


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_tensor_blob_round_trip_is_zero_copy_views(daemon, tier):
    tensors = {"k": torch.randn(3, 4, 16), "v": torch.randn(3, 4, 16).to(torch.bfloat16),
               "state": torch.arange(10, dtype=torch.int64)}
    with daemon.client() as kv:
        kv.put_tensors(f"blob/{tier}", tensors, fingerprint="model-x", token_count=3, tier=tier,
                       layers={"k": 0, "v": 0, "state": 1}, meta={"seam": 4})
        with kv.get_tensors(f"blob/{tier}", verify=True) as (header, got):
            assert header.fingerprint == "model-x" and header.token_count == 3 and header.meta == {"seam": 4}
            for name, t in tensors.items():
                assert got[name].dtype == t.dtype and torch.equal(got[name], t)
            assert [p.layer for p in header.parts] == [0, 0, 1]
        shown = kv.show(f"blob/{tier}")
        assert shown.is_blob and [p["name"] for p in shown.parts] == ["k", "v", "state"]


def test_get_view_aliases_the_shared_memory_arena(daemon):
    """Write through a second, independent mapping of the arena file: the view sees it."""
    with daemon.client() as kv:
        kv.put(b"alias", b"A" * 8192, tier="cpu")
        with kv.get(b"alias") as view:
            region = view.lease.region
            assert region.kind == "shm"
            fd = os.open(region.path, os.O_RDWR)
            try:
                with mmap.mmap(fd, 0) as other:
                    other[region.offset: region.offset + 5] = b"hello"
                    assert view.memoryview[:5].tobytes() == b"hello"
                    assert view.tensor()[:5].tolist() == list(b"hello")
                    with pytest.raises(BadObject, match="hash to"):
                        view.verify()  # the client can detect bytes changed under it
                    other[region.offset: region.offset + 5] = b"AAAAA"
            finally:
                os.close(fd)
            view.verify()


def test_tensors_from_get_tensors_alias_the_arena(daemon):
    with daemon.client() as kv:
        kv.put_tensors(b"alias-t", {"x": torch.zeros(1024)}, fingerprint="f", token_count=1, tier="cpu")
        with kv.get_tensors(b"alias-t") as (header, got):
            view = kv.get(b"alias-t")
            region = view.lease.region
            fd = os.open(region.path, os.O_RDWR)
            try:
                with mmap.mmap(fd, 0) as other:
                    off = region.offset + header.part("x").offset
                    other[off: off + 4] = np.float32(7.5).tobytes()
            finally:
                os.close(fd)
            assert got["x"][0].item() == 7.5
            view.release()


def test_two_client_processes_share_an_object_put_by_one(daemon):
    data = _payload(1 << 20, seed=2)
    child = textwrap.dedent(f"""
        import sys, hashlib
        from kvstore.client import KVStoreClient
        with KVStoreClient(socket={str(daemon.socket)!r}) as kv:
            if sys.argv[1] == "put":
                kv.put(b"shared/by-child", bytes(range(256)) * 4096, tier="cpu")
            else:
                with kv.get(b"shared/by-parent") as v:
                    print(hashlib.sha256(v.memoryview).hexdigest())
    """)
    env = dict(daemon.env)
    with daemon.client() as kv:
        kv.put(b"shared/by-parent", data, tier="cpu")
        out = subprocess.run([sys.executable, "-c", child, "get"], capture_output=True, env=env, cwd=REPO_ROOT,
                             timeout=120, check=True)
        import hashlib

        assert out.stdout.decode().strip() == hashlib.sha256(data).hexdigest()
        subprocess.run([sys.executable, "-c", child, "put"], env=env, cwd=REPO_ROOT, timeout=120, check=True)
        with kv.get(b"shared/by-child") as v:
            assert v.memoryview.tobytes() == bytes(range(256)) * 4096


def test_commit_with_a_wrong_checksum_is_bad_object_and_nothing_is_visible(daemon):
    with daemon.client() as kv, grpc.insecure_channel(f"unix:{daemon.socket}") as ch:
        stub = KVStoreStub(ch)
        res = stub.Reserve(pb.ReserveRequest(key=b"bad-sum", size=4096, tier="cpu", client_id="t"), timeout=10)
        RegionMapper().write(region_from_pb(res.region), memoryview(b"z" * 4096))
        with pytest.raises(grpc.RpcError) as exc:
            stub.Commit(pb.CommitRequest(reservation_id=res.reservation_id, checksum=12345, client_id="t"),
                        timeout=10)
        assert exc.value.code() == grpc.StatusCode.DATA_LOSS
        assert "checksum mismatch" in exc.value.details()
        assert kv.lookup([b"bad-sum"])[0].hit is False
        with pytest.raises(UnknownKey):
            kv.get(b"bad-sum")
        kv.put(b"bad-sum", b"z" * 4096)  # the key is free again for a correct put
        assert kv.lookup([b"bad-sum"])[0].hit


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_large_put_hashes_while_copying_and_round_trips(daemon, tier):
    import xxhash

    from kvstore.client.common import FUSED_HASH_MIN

    blob = np.random.default_rng(7).integers(0, 256, FUSED_HASH_MIN + 12345, dtype=np.uint8)
    with daemon.client() as kv:
        res = kv.put(f"fused/{tier}".encode(), blob, tier=tier)
        assert res.status == "stored" and res.checksum == xxhash.xxh3_64_intdigest(blob)
        with kv.get(f"fused/{tier}".encode(), promote=False) as v:
            assert v.lease.tier == tier and np.array_equal(v.array, blob)
        kv.delete([f"fused/{tier}".encode()])


def test_put_of_a_non_buffer_or_empty_buffer_is_a_clear_error(daemon):
    with daemon.client() as kv:
        with pytest.raises(InvalidRequest, match="use put_tensors"):
            kv.put(b"t", torch.zeros(4))
        with pytest.raises(InvalidRequest, match="0 bytes"):
            kv.put(b"t", b"")
        kv.put(b"typed", np.arange(4, dtype=np.float32))  # any contiguous buffer, as raw bytes
        with kv.get(b"typed") as v:
            assert np.frombuffer(v.memoryview, dtype=np.float32).tolist() == [0, 1, 2, 3]


def test_client_raises_bad_object_when_its_checksum_does_not_match(daemon, monkeypatch):
    import kvstore.client.ops as ops  # the put flow both client faces share

    monkeypatch.setattr(ops.xxhash, "xxh3_64_intdigest", lambda mv: 42)
    with daemon.client() as kv:
        with pytest.raises(BadObject, match="checksum mismatch"):
            kv.put(b"client-bad-sum", b"q" * 100)
        assert kv.lookup([b"client-bad-sum"])[0].hit is False


def test_leased_object_survives_eviction_pressure(start_daemon):
    d = start_daemon(cpu_capacity="1MiB", nvme_capacity="8MiB")
    chunk = _payload(200_000, seed=3)
    with d.client() as kv:
        kv.put(b"pinned", chunk, tier="cpu")
        view = kv.get(b"pinned")
        for i in range(20):  # 4 MB through a 1 MiB arena: everything unleased is demoted
            kv.put(f"filler/{i}", _payload(200_000, seed=10 + i), tier="cpu")
        assert kv.lookup([b"pinned"])[0].tier == "cpu"
        assert view.memoryview.tobytes() == chunk
        view.verify()
        st = kv.stats()
        assert st["demotions"] > 0
        # the 1 MiB arena holds at most 5 of these; which ones stayed depends on the
        # background write-back's timing (it pins what it is copying), not on the lease
        tiers = [e.tier for e in kv.lookup([f"filler/{i}" for i in range(20)])]
        assert tiers.count("nvme") >= 15 and set(tiers) <= {"cpu", "nvme"}
        view.release()
        assert kv.evict("cpu") >= 1
        assert kv.lookup([b"pinned"])[0].tier == "nvme"


def test_capacity_exhaustion_gives_a_clear_error(start_daemon):
    d = start_daemon(cpu_capacity="1MiB", nvme_capacity="0")
    with d.client() as kv:
        with pytest.raises(InvalidRequest, match="exceeds the 'cpu' tier's capacity"):
            kv.put(b"too-big", b"x" * (2 << 20))
        views = []
        for i in range(4):
            kv.put(f"held/{i}", _payload(250_000, seed=i))
            views.append(kv.get(f"held/{i}"))
        with pytest.raises(CapacityExhausted) as exc:
            kv.put(b"one-more", _payload(250_000, seed=99))
        assert "cpu" in str(exc.value)
        kv.release_many(views)
        kv.put(b"one-more", _payload(250_000, seed=99))  # unleased objects can now be evicted
        assert kv.lookup([b"one-more"])[0].hit


def test_concurrent_puts_of_the_same_key_end_with_one_object_and_no_error(daemon):
    data = _payload(2 << 20, seed=5)
    results, errors = [], []

    def put() -> None:
        try:
            with daemon.client() as kv:
                results.append(kv.put(b"race", data, tier="cpu").status)
        except Exception as exc:  # pragma: no cover - the assertion below reports it
            errors.append(exc)

    threads = [threading.Thread(target=put) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert results.count("stored") == 1 and results.count("exists") == 3
    with daemon.client() as kv:
        assert [o.key for o in kv.list(prefix=b"race")] == [b"race"]
        with kv.get(b"race") as v:
            assert v.memoryview.tobytes() == data


def test_dropped_views_release_their_leases_via_the_keepalive(start_daemon):
    d = start_daemon(lease_ttl=0.6)
    with d.client() as kv:
        kv.put(b"drop-me", b"x" * 100)
        kv.get(b"drop-me")  # never released explicitly: the view is garbage at once
        held = kv.get(b"drop-me")
        deadline = time.monotonic() + 10
        while kv.stats()["leases"] != 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert kv.stats()["leases"] == 1, "the dropped view's lease was not released"
        time.sleep(1.0)  # > ttl: the held lease lives on because the keepalive renews it
        assert held.memoryview.tobytes() == b"x" * 100
        assert kv.stats()["leases"] == 1
        held.release()
        assert kv.stats()["leases"] == 0


def test_get_many_release_many_delete_prefetch_and_list_filters(daemon):
    with daemon.client() as kv:
        for i in range(3):
            kv.put(f"batch/{i}", f"v{i}".encode(), tier="nvme", fingerprint="fp-batch")
        views = kv.get_many(["batch/0", "batch/missing", "batch/2"], promote=False)
        assert views[1] is None and [v.tobytes() for v in (views[0], views[2])] == [b"v0", b"v2"]
        kv.release_many([v for v in views if v is not None])
        assert kv.prefetch(["batch/1", "batch/missing"], "cpu") == 1
        assert kv.lookup(["batch/1"])[0].tier == "cpu"
        listed = kv.list(fingerprint="fp-batch")
        assert sorted(o.key for o in listed) == [b"batch/0", b"batch/1", b"batch/2"]
        assert [o.key for o in kv.list(fingerprint="fp-batch", tier="cpu")] == [b"batch/1"]
        assert kv.delete(["batch/0", "batch/1", "batch/2", "batch/missing"]) == 3
        assert kv.list(fingerprint="fp-batch") == []
        with pytest.raises(UnknownKey):
            kv.show("batch/0")


def test_async_client_has_the_same_api(daemon):
    async def main() -> None:
        async with AsyncKVStoreClient(socket=daemon.socket) as kv:
            assert await kv.health()
            data = _payload(3 << 20, seed=6)
            assert (await kv.put(b"async/a", data, tier="cpu")).status == "stored"
            assert (await kv.put(b"async/a", data, tier="cpu")).status == "exists"
            await kv.put_tensors(b"async/t", {"x": torch.ones(8)}, fingerprint="f", token_count=1)
            views = await kv.get_many([b"async/a", b"async/none"])
            assert views[1] is None and views[0].memoryview.tobytes() == data
            await kv.release_many([views[0]])
            tv = await kv.get_tensors(b"async/t")
            assert torch.equal(tv.tensors["x"], torch.ones(8))
            tv.release()
            assert (await kv.lookup([b"async/a"]))[0].hit
            assert (await kv.stats())["tiers"][0]["name"] == "cpu"
            assert await kv.delete([b"async/a", b"async/t"]) == 2
            with pytest.raises(UnknownKey):
                await kv.get(b"async/a")

    asyncio.run(main())


def test_no_daemon_running_names_the_socket_and_the_start_command(tmp_path):
    sock = tmp_path / "none.sock"
    with pytest.raises(DaemonNotRunning) as exc:
        KVStoreClient(socket=sock)
    assert str(sock) in str(exc.value) and f"kvstore serve --socket {sock}" in str(exc.value)
    sock.touch()  # a stale socket file nobody listens on
    with pytest.raises(DaemonNotRunning, match="kvstore serve"):
        KVStoreClient(socket=sock)

    async def amain() -> None:
        with pytest.raises(DaemonNotRunning):
            await AsyncKVStoreClient(socket=tmp_path / "nope.sock").connect()

    asyncio.run(amain())
