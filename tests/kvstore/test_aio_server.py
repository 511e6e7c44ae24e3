"""The daemon's asyncio (grpc.aio) server, over its real unix socket: many clients at once,
RPCs that block (WaitFor) next to ones served on the event loop, graceful shutdown with
an RPC in flight, and the leases of a client that was killed expiring."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import time

from kvstore.client import KVStoreClient
from kvstore.rpc import kvstore_pb2 as pb
from kvstore.rpc.service import PROTOCOL_METADATA_KEY, KVStoreStub
from kvstore.testing import REPO_ROOT


def test_concurrent_clients_each_see_their_own_puts_gets_and_lookups(daemon):
    errors: list[BaseException] = []

    def worker(n: int) -> None:
        try:
            with daemon.client() as kv:
                keys = [f"aio/c{n}/{i}".encode() for i in range(8)]
                for i, k in enumerate(keys):
                    kv.put(k, bytes([n, i]) * 300, tier="cpu" if i % 2 else "nvme")
                for _ in range(20):
                    assert all(e.hit for e in kv.lookup(keys))
                views = kv.get_many(keys)
                assert [bytes(v.memoryview[:2]) for v in views] == [bytes([n, i]) for i in range(8)]
                kv.release_many(views)
                assert kv.delete(keys) == 8
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    with daemon.client() as kv:
        assert kv.stats()["leases"] == 0


def test_lookups_are_answered_while_another_rpc_blocks_in_wait_for(daemon):
    with daemon.client() as writer, daemon.client() as reader:
        ch_stub = writer._stub
        res = ch_stub.Reserve(pb.ReserveRequest(key=b"aio/pending", size=4096, tier="cpu", client_id="w"),
                              metadata=((PROTOCOL_METADATA_KEY, "1"),), timeout=10)
        assert res.status == "reserved"
        waited: list[bool] = []
        t = threading.Thread(target=lambda: waited.append(reader.wait_for(b"aio/pending", timeout=1.5)))
        t.start()
        time.sleep(0.2)
        t0 = time.monotonic()
        for _ in range(20):
            assert reader.lookup([b"aio/pending"])[0].hit is False
        assert time.monotonic() - t0 < 1.0, "lookups must not queue behind a blocked WaitFor"
        t.join(10)
        assert waited == [False]  # nothing was committed: the wait timed out
        ch_stub.Abort(pb.AbortRequest(reservation_id=res.reservation_id, client_id="w"),
                      metadata=((PROTOCOL_METADATA_KEY, "1"),), timeout=10)


def test_sigterm_lets_an_in_flight_rpc_finish_then_exits_cleanly(start_daemon):
    d = start_daemon()
    with d.client() as kv:
        stub: KVStoreStub = kv._stub
        res = stub.Reserve(pb.ReserveRequest(key=b"aio/open", size=4096, tier="cpu", client_id="w"),
                           metadata=((PROTOCOL_METADATA_KEY, "1"),), timeout=10)
        assert res.status == "reserved"
        got: list[object] = []

        def wait() -> None:
            try:
                got.append(kv.wait_for(b"aio/open", timeout=1.0))
            except Exception as exc:  # noqa: BLE001 - the assertion below names it
                got.append(exc)

        t = threading.Thread(target=wait)
        t.start()
        time.sleep(0.3)  # the WaitFor is in flight on the daemon
        t0 = time.monotonic()
        assert d.stop(signal.SIGTERM) == 0
        t.join(10)
    assert got == [False], f"the in-flight WaitFor should have completed normally, got {got!r}"
    assert time.monotonic() - t0 < 5.0
    assert not d.socket.exists()
    assert "kvstore daemon stopped" in d.log_path.read_text()


def test_a_killed_clients_lease_expires_and_its_object_can_then_be_deleted(start_daemon):
    d = start_daemon(lease_ttl=1.0, expire_interval=0.1)
    with d.client() as kv:
        kv.put(b"aio/leased", b"z" * 5000, tier="cpu")
        script = textwrap.dedent(f"""
            import sys, time
            from kvstore.client import KVStoreClient
            kv = KVStoreClient(socket={str(d.socket)!r})
            view = kv.get(b"aio/leased")
            print("leased", flush=True)
            time.sleep(60)
        """)
        child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, cwd=str(REPO_ROOT),
                                 env=d.env)
        try:
            assert child.stdout is not None and child.stdout.readline().strip() == b"leased"
            assert kv.stats()["leases"] == 1
            assert kv.delete([b"aio/leased"]) == 0, "a leased object must stay"
            child.send_signal(signal.SIGKILL)
            child.wait(10)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait(10)
        deadline = time.monotonic() + 10
        while kv.stats()["leases"] and time.monotonic() < deadline:
            time.sleep(0.1)
        stats = kv.stats()
        assert stats["leases"] == 0 and stats["expired_leases"] >= 1
        assert kv.delete([b"aio/leased"]) == 1


def test_a_fresh_client_per_call_and_a_long_lived_one_agree(daemon):
    with daemon.client() as kv:
        kv.put(b"aio/agree", b"a" * 100, tier="cpu")
        long_lived = [kv.lookup([b"aio/agree", b"aio/absent"]) for _ in range(5)]
    for _ in range(3):
        with KVStoreClient(socket=daemon.socket) as fresh:
            assert fresh.lookup([b"aio/agree", b"aio/absent"]) == long_lived[0]
    assert all(x == long_lived[0] for x in long_lived)
    assert [e.hit for e in long_lived[0]] == [True, False]
