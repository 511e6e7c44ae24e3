"""Crashes and restarts of real processes: the NVMe tier survives a restart, a daemon
killed with SIGKILL mid-put never serves a partial object, a client killed while holding
a lease loses it when the lease times out, and a corrupt object file is never served."""

from __future__ import annotations

import hashlib
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import grpc
import pytest

from kvstore.errors import UnknownKey
from kvstore.rpc import kvstore_pb2 as pb
from kvstore.rpc.service import KVStoreStub
from kvstore.testing import REPO_ROOT


def _content(key: bytes, size: int) -> bytes:
    """Bytes derivable from the key alone, so a reader can tell a torn object."""
    block = hashlib.sha256(key).digest()
    return (block * (size // len(block) + 1))[:size]


def _wait_for(predicate, timeout: float = 15.0, step: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return predicate()


@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
def test_restart_recovers_every_object_the_nvme_tier_held(start_daemon, how):
    d = start_daemon(cpu_capacity="4MiB", nvme_capacity="64MiB")
    keys = [f"durable/{i}".encode() for i in range(6)]
    with d.client() as kv:
        for i, k in enumerate(keys):
            kv.put(k, _content(k, 100_000 + i), tier="nvme", fingerprint="fp-d", token_count=i)
        kv.put(b"memory-only", b"gone after restart", tier="cpu")
    d.stop(signal.SIGTERM if how == "sigterm" else signal.SIGKILL)
    d.start()
    with d.client() as kv:
        assert kv.lookup([b"memory-only"])[0].hit is False
        assert sorted(o.key for o in kv.list()) == sorted(keys)
        for i, k in enumerate(keys):
            with kv.get(k) as view:
                assert view.memoryview.tobytes() == _content(k, 100_000 + i)
                assert view.meta.fingerprint == "fp-d" and view.meta.token_count == i
        assert kv.stats()["recovered_objects"] == len(keys)


def test_kill9_mid_put_leaves_no_partial_object_and_a_consistent_index(start_daemon):
    d = start_daemon(cpu_capacity="4MiB", nvme_capacity="64MiB")
    with d.client() as kv:
        kv.put(b"before", _content(b"before", 50_000), tier="nvme")
    with grpc.insecure_channel(f"unix:{d.socket}") as ch:
        stub = KVStoreStub(ch)
        res = stub.Reserve(pb.ReserveRequest(key=b"torn", size=1 << 20, tier="nvme", client_id="writer"), timeout=10)
        part = Path(res.region.path)
        with open(part, "r+b") as fh:  # half of the bytes written, never committed
            fh.write(_content(b"torn", 1 << 19))
    d.kill()
    assert part.exists()
    d.start()
    with d.client() as kv:
        assert kv.lookup([b"torn"])[0].hit is False
        with pytest.raises(UnknownKey):
            kv.get(b"torn")
        assert not part.exists(), "the half-written file must be discarded at start"
        assert kv.stats()["partial_writes_removed"] >= 1
        assert [o.key for o in kv.list()] == [b"before"]
        with kv.get(b"before") as v:
            assert v.memoryview.tobytes() == _content(b"before", 50_000)
        kv.put(b"torn", _content(b"torn", 1 << 20), tier="nvme")  # the key is usable again
        assert kv.lookup([b"torn"])[0].hit


def test_kill9_during_a_stream_of_puts_never_exposes_a_torn_object(start_daemon):
    d = start_daemon(cpu_capacity="4MiB", nvme_capacity="256MiB")
    writer = textwrap.dedent(f"""
        import hashlib, sys
        from kvstore.client import KVStoreClient
        def content(key, size):
            block = hashlib.sha256(key).digest()
            return (block * (size // len(block) + 1))[:size]
        kv = KVStoreClient(socket={str(d.socket)!r})
        i = 0
        while True:
            key = b"stream/%d" % i
            kv.put(key, content(key, 2 << 20), tier="nvme")
            print(i, flush=True)
            i += 1
    """)
    proc = subprocess.Popen([sys.executable, "-c", writer], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            env=d.env, cwd=REPO_ROOT)
    try:
        for _ in range(5):  # a few puts have landed; more are in flight
            assert proc.stdout.readline(), "the writer process died early"
        d.kill()
    finally:
        proc.kill()
        proc.wait(30)
    d.start()
    with d.client() as kv:
        listed = kv.list()
        assert len(listed) >= 5
        for info in listed:
            assert info.key.startswith(b"stream/")
            with kv.get(info.key, promote=False) as view:
                assert view.size == 2 << 20
                assert view.memoryview.tobytes() == _content(info.key, 2 << 20), f"torn object {info.key!r}"
        stats = kv.stats()
        assert stats["corrupt_dropped"] == 0
        objects_dir = d.dir / "objects"
        assert not list(objects_dir.rglob("*.part")), "leftover partial files after restart"
        on_disk = sorted(p.name for p in objects_dir.rglob("*.obj"))
        assert len(on_disk) == len(listed), "index and object files disagree"


def test_kill9_of_a_client_holding_a_lease_lets_it_expire_and_the_object_become_evictable(start_daemon):
    d = start_daemon(cpu_capacity="4MiB", nvme_capacity="16MiB", lease_ttl=1.0)
    holder = textwrap.dedent(f"""
        import time
        from kvstore.client import KVStoreClient
        kv = KVStoreClient(socket={str(d.socket)!r})
        view = kv.get(b"leased")
        print("READY", flush=True)
        time.sleep(600)
    """)
    with d.client() as kv:
        kv.put(b"leased", b"L" * 10_000, tier="cpu")
        proc = subprocess.Popen([sys.executable, "-c", holder], stdout=subprocess.PIPE, env=d.env, cwd=REPO_ROOT)
        try:
            assert proc.stdout.readline().strip() == b"READY"
            time.sleep(1.5)  # > ttl: the live client's keepalive holds the lease
            assert kv.stats()["leases"] == 1
            assert kv.evict("cpu") == 0, "a leased object must not be evicted"
            assert kv.lookup([b"leased"])[0].tier == "cpu"
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert _wait_for(lambda: kv.stats()["leases"] == 0), "the dead client's lease never expired"
        assert kv.stats()["expired_leases"] >= 1
        assert kv.evict("cpu") == 1
        assert kv.lookup([b"leased"])[0].tier == "nvme"


def test_corrupt_object_file_is_dropped_and_never_served(start_daemon):
    d = start_daemon(cpu_capacity="4MiB", nvme_capacity="16MiB")
    with d.client() as kv:
        kv.put(b"rot", _content(b"rot", 64_000), tier="nvme")
        kv.put(b"fine", _content(b"fine", 64_000), tier="nvme")
        with kv.get(b"rot", promote=False) as v:
            path = Path(v.lease.region.path)
    d.stop()
    with open(path, "r+b") as fh:  # bit rot while the daemon was down
        fh.seek(1000)
        byte = fh.read(1)
        fh.seek(1000)
        fh.write(bytes([byte[0] ^ 0xFF]))
    d.start()
    with d.client() as kv:
        with pytest.raises(UnknownKey):
            kv.get(b"rot")
        assert kv.lookup([b"rot"])[0].hit is False
        assert kv.stats()["corrupt_dropped"] == 1
        with kv.get(b"fine") as v:
            assert v.memoryview.tobytes() == _content(b"fine", 64_000)
