"""WaitFor never occupies a server worker: with more waiters on one key than the daemon
has workers, every other request (and a get of an unrelated key) still answers at once,
and the waiters all wake when the key is committed (or its writer gives up)."""

from __future__ import annotations

import threading
import time

import grpc

from kvstore.client import KVStoreClient
from kvstore.rpc import codec
from kvstore.rpc import kvstore_pb2 as pb
from kvstore.rpc.service import PROTOCOL_METADATA_KEY, KVStoreStub
from kvstore.checksums import host_checksum
from kvstore.server.wiredata import write_region
from kvstore.testing import record_figures

WAITERS = 20
WORKERS = 4  # far fewer than the waiters: each waiter on a worker would block everything
PROMPT_S = 2.0
MD = ((PROTOCOL_METADATA_KEY, "1"),)


def _start_waiters(d, key: bytes, results: list, timeout: float = 60.0) -> list[threading.Thread]:
    def wait(i: int) -> None:
        with KVStoreClient(socket=d.socket, client_id=f"waiter-{i}") as kv:
            t0 = time.monotonic()
            results[i] = (kv.wait_for(key, timeout), time.monotonic() - t0)

    threads = [threading.Thread(target=wait, args=(i,), daemon=True) for i in range(WAITERS)]
    for t in threads:
        t.start()
    return threads


def _until_waiting(kv: KVStoreClient, n: int) -> None:
    deadline = time.monotonic() + 30
    while kv.stats()["waiting"] < n:
        assert time.monotonic() < deadline, f"only {kv.stats()['waiting']} of {n} waiters arrived"
        time.sleep(0.05)


def _timed(fn):
    t0 = time.monotonic()
    out = fn()
    return out, time.monotonic() - t0


def test_many_waiters_on_one_key_leave_every_other_request_prompt(start_daemon):
    d = start_daemon(extra_args=["--workers", str(WORKERS)])
    key = b"contended"
    ch = grpc.insecure_channel(f"unix:{d.socket}")
    stub = KVStoreStub(ch)
    with ch, d.client() as kv:
        kv.put(b"unrelated", b"u" * 5000)
        res = stub.Reserve(pb.ReserveRequest(key=key, size=4096, tier="cpu", client_id="writer"), timeout=10,
                           metadata=MD)
        assert res.status == "reserved"
        results: list = [None] * WAITERS
        threads = _start_waiters(d, key, results)
        _until_waiting(kv, WAITERS)
        timings = {}
        _, timings["stats"] = _timed(kv.stats)
        (view, timings["get"]) = _timed(lambda: kv.get(b"unrelated"))
        verified = int(view.tobytes() == b"u" * 5000)
        view.release()
        assert verified == 1
        _, timings["put"] = _timed(lambda: kv.put(b"other", b"o" * 100))  # Reserve + Commit
        _, timings["delete"] = _timed(lambda: kv.delete([b"other"]))
        _, timings["lookup"] = _timed(lambda: kv.lookup([key]))
        _, timings["list"] = _timed(lambda: kv.list(limit=10))
        assert max(timings.values()) < PROMPT_S, timings
        assert kv.stats()["waiting"] == WAITERS  # they are all still waiting
        data = bytes(range(256)) * 16
        write_region(codec.region_from_pb(res.region), data)
        t_commit = time.monotonic()
        stub.Commit(pb.CommitRequest(reservation_id=res.reservation_id, checksum=host_checksum(data), client_id="writer"), timeout=10,
                    metadata=MD)
        for t in threads:
            t.join(30)
        woke = time.monotonic() - t_commit
        assert all(r is not None and r[0] is True for r in results), results
        assert woke < 10.0, woke
        assert kv.stats()["waiting"] == 0
        with kv.get(key) as v:
            verified += v.tobytes() == data
        woken = sum(1 for r in results if r is not None and r[0] is True)
        record_figures("test_waitfor", waiters=WAITERS, workers=WORKERS, operations=woken + len(timings),
                       objects_verified=verified, losses=2 - verified,
                       slowest_other_request_ms=round(max(timings.values()) * 1e3, 1),
                       waiters_woken_ms=round(woke * 1e3, 1))
        assert verified == 2


def test_waiters_return_false_when_the_writer_aborts_and_time_out_on_their_own(start_daemon):
    d = start_daemon(extra_args=["--workers", str(WORKERS)])
    key = b"abandoned"
    ch = grpc.insecure_channel(f"unix:{d.socket}")
    stub = KVStoreStub(ch)
    with ch, d.client() as kv:
        res = stub.Reserve(pb.ReserveRequest(key=key, size=100, tier="cpu", client_id="writer"), timeout=10,
                           metadata=MD)
        results: list = [None] * WAITERS
        threads = _start_waiters(d, key, results)
        _until_waiting(kv, WAITERS)
        stub.Abort(pb.AbortRequest(reservation_id=res.reservation_id, client_id="writer"), timeout=10, metadata=MD)
        for t in threads:
            t.join(30)
        assert all(r is not None and r[0] is False and r[1] < 30 for r in results), results
        # a short timeout ends a wait by itself; a key nobody writes answers at once
        res = stub.Reserve(pb.ReserveRequest(key=key, size=100, tier="cpu", client_id="writer"), timeout=10,
                           metadata=MD)
        (present, took) = _timed(lambda: kv.wait_for(key, 0.5))
        assert present is False and 0.4 < took < PROMPT_S + 0.5
        (present, took) = _timed(lambda: kv.wait_for(b"nobody-writes-this", 20))
        assert present is False and took < PROMPT_S
        assert kv.stats()["waiting"] == 0
