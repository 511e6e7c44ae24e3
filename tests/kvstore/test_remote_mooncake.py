"""The remote tier on a REAL Mooncake Store: a `mooncake_master` on loopback (embedded
HTTP metadata server, TCP transport) and REAL daemon processes (`kvstore serve --remote
URL`, separate sockets, directories and arenas: two "hosts"). An object put through
daemon 1 is got through daemon 2 with equal bytes; `kvstore inspect --json` and
/metrics show the remote tier; a master hung (SIGSTOP) and then killed and restarted
mid-stream fails no request and the counters say what happened; a damaged or half-written remote object is never
served. Skipped, with the reason, only where Mooncake cannot be imported or started."""
from __future__ import annotations

import json
import time
import urllib.request

import numpy as np
import pytest

from kvstore.remote.envelope import remote_name
from kvstore.remote.testing import MooncakeMaster, mooncake_unavailable
from kvstore.testing import DaemonProcess, free_port

_WHY = mooncake_unavailable()
pytestmark = pytest.mark.skipif(_WHY is not None, reason=_WHY or "")


def blob(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def _start_master(root):
    m = MooncakeMaster(root)
    try:
        m.start()
    except RuntimeError as exc:
        pytest.skip(f"mooncake_master cannot start here: {exc}")
    return m


def _daemon(root, master, *extra) -> DaemonProcess:
    # read_chunk=1MiB: objects over 1 MiB are read in pieces (chunked reads), smaller ones in one get
    url = master.url.replace("&protocol=tcp", "&protocol=tcp&segment=64MiB&read_chunk=1MiB")
    return DaemonProcess(root, cpu_capacity="32MiB", nvme_capacity="64MiB",
                         extra_args=["--remote", url, "--remote-timeout", "1.0", *extra])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One master and two daemons on it ("host1", "host2", the second with /metrics),
    shared by the tests that leave the master running."""
    root = tmp_path_factory.mktemp("cluster")
    m = _start_master(root / "master")
    made = []
    try:
        made.append(_daemon(root / "host1", m).start())
        made.append(_daemon(root / "host2", m, "--metrics-port", str(free_port())).start())
        made[1].metrics_port = int(made[1].args[made[1].args.index("--metrics-port") + 1])
        yield m, made[0], made[1]
    finally:
        for d in made:
            d.cleanup()
        m.stop()


def remote_stats(d) -> dict:
    with d.client() as kv:
        return kv.stats()["remote"]


def drain(d, timeout=20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        r = remote_stats(d)
        if r["pending_writes"] == 0 or time.monotonic() > deadline:
            return r
        time.sleep(0.05)


def test_an_object_put_through_one_daemon_is_got_through_another_with_equal_bytes(cluster):
    _, d1, d2 = cluster
    metrics_port = d2.metrics_port
    objs = {f"seg/{i}".encode(): blob(n, i) for i, n in enumerate((100, 64 << 10, 3 << 20))}
    with d1.client() as kv:
        for k, v in objs.items():
            kv.put(k, v)
    r1 = drain(d1)
    assert r1["objects_written"] == 3 and r1["bytes_written"] == sum(map(len, objs.values()))
    with d2.client() as kv:
        hits = kv.lookup(list(objs) + [b"absent"])
        assert [e.hit for e in hits] == [True, True, True, False]
        assert all(e.tier == "cpu" for e in hits[:3])
        for k, v in objs.items():
            with kv.get(k) as view:
                assert view.memoryview.tobytes() == v
    res = d2.cli("inspect", "--json")
    assert res.returncode == 0, res.stderr
    r2 = json.loads(res.stdout)["remote"]
    assert r2["url"].startswith("mooncake://127.0.0.1:") and r2["reachable"] is True
    assert r2["hits"] == 3 and r2["misses"] == 1 and r2["errors"] == 0 and r2["corrupt_dropped"] == 0
    assert r2["bytes_read"] == sum(map(len, objs.values())) and r2["get_latency"]["count"] >= 1
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    assert "kvstore_remote_hits_total 3.0" in text and "kvstore_remote_reachable 1.0" in text
    assert "kvstore_remote_misses_total 1.0" in text
    res = d2.cli("inspect")  # the table form names the remote tier too
    assert res.returncode == 0 and b"remote" in res.stdout and b"reachable" in res.stdout


def test_master_hung_then_killed_and_restarted_mid_stream_fails_no_request(tmp_path):
    master = _start_master(tmp_path / "master")
    d1, d2 = _daemon(tmp_path / "host1", master), _daemon(tmp_path / "host2", master)
    try:
        d1.start()
        d2.start()
        _stream_through_a_master_restart(master, d1, d2)
    finally:
        d1.cleanup()
        d2.cleanup()
        master.stop()


def _stream_through_a_master_restart(master, d1, d2):
    served_remote, failures, waits = 0, [], []
    with d1.client() as kv1, d2.client() as kv2:
        for i in range(30):
            if i == 4:
                master.pause()  # a hung master: waits time out, then the tier fails fast
            if i == 9:
                master.resume()
            if i == 14:
                master.kill()
            if i == 20:
                master.restart()
            key, body = f"stream/{i}".encode(), blob(32 << 10, 100 + i)
            try:
                kv1.put(key, body)
                with kv1.get(key) as view:  # the writing host always serves its own
                    assert view.memoryview.tobytes() == body
                if i >= 20 or 9 <= i < 14:
                    time.sleep(0.3)  # the restarted master: give the write a moment
                prev = f"stream/{i - 1}".encode()
                t0 = time.monotonic()
                hit = kv2.lookup([prev])[0].hit
                waits.append(time.monotonic() - t0)
                if hit:
                    with kv2.get(prev) as view:
                        assert view.memoryview.tobytes() == blob(32 << 10, 100 + i - 1)
                        served_remote += 1
            except Exception as exc:  # noqa: BLE001 - every request must succeed
                failures.append(f"{i}: {type(exc).__name__}: {exc}")
            time.sleep(0.1)
        assert failures == []
        assert max(waits) < 2 * 1.0 + 1.0  # a look-up waits at most its stat and get bounds (1 s each)
        print(f"lookup waits: max {max(waits):.2f} s, median {sorted(waits)[len(waits) // 2]:.3f} s")
        # after the restart (the master lost its objects) writes reach the other host again
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            kv1.put(b"after-restart", b"x" * 5000) if not kv1.lookup([b"after-restart"])[0].hit else None
            drain(d1)
            if kv2.lookup([b"after-restart"])[0].hit:
                break
            kv1.delete([b"after-restart"])
            time.sleep(0.5)
        with kv2.get(b"after-restart") as view:
            assert view.memoryview.tobytes() == b"x" * 5000
    r1, r2 = remote_stats(d1), remote_stats(d2)
    assert served_remote >= 3
    assert r1["reachable"] and r2["reachable"]
    assert r1["reconnects"] >= 1 and r2["reconnects"] >= 1  # both saw the master go and come back
    assert r1["errors"] + r1["put_skipped_unreachable"] >= 1  # writes while it was away: counted
    assert r2["errors"] + r2["lookups_skipped_unreachable"] >= 1  # look-ups while it was away: counted
    assert r1["timeouts"] + r2["timeouts"] >= 1  # the hung master: bounded waits that ran out
    assert r2["corrupt_dropped"] == 0


def _raw_client(master):
    from mooncake.store import MooncakeDistributedStore

    c = MooncakeDistributedStore()
    assert c.setup("127.0.0.1", master.metadata, 16 << 20, 16 << 20, "tcp", "", f"127.0.0.1:{master.rpc_port}") == 0
    return c


def test_a_corrupted_or_half_written_remote_object_is_dropped_and_counted_never_served(cluster):
    master, d1, d2 = cluster
    before = remote_stats(d2)
    with d2.client() as kv:
        before_objects = kv.stats()["tiers"][0]["objects"]
    # 256 KiB: read in one get; 3 MiB: read in 1 MiB pieces, hashed as they land (a byte
    # flipped in a piece hashed while landing, one in the part `finish` hashes, a torn one)
    objs = {b"damaged": blob(256 << 10, 1), b"half": blob(256 << 10, 2), b"big-mid": blob(3 << 20, 3),
            b"big-end": blob(3 << 20, 4), b"big-half": blob(3 << 20, 5)}
    flip = {b"damaged": 1000, b"big-mid": (1 << 20) + 5, b"big-end": (3 << 20) - 10}
    with d1.client() as kv:
        for k, v in objs.items():
            kv.put(k, v)
    assert drain(d1)["objects_written"] >= len(objs)
    raw = _raw_client(master)
    try:
        name = remote_name("kvstore", b"damaged")
        for k, v in objs.items():
            n = remote_name("kvstore", k)
            obj = bytearray(raw.get(n))
            assert len(obj) > len(v) and bytes(obj[: len(v)]) == v  # the payload, then the trailer
            if k in flip:
                obj[flip[k]] ^= 0xFF  # one payload byte flipped in the remote store
            else:
                obj = obj[: len(v) // 2]  # half of it: a torn object
            assert raw.remove(n, True) == 0 and raw.put(n, bytes(obj)) == 0
        with d2.client() as kv:
            assert [e.hit for e in kv.lookup(list(objs))] == [False] * len(objs)
            assert kv.get_many(list(objs)) == [None] * len(objs)
        r2 = remote_stats(d2)
        assert r2["corrupt_dropped"] - before["corrupt_dropped"] == len(objs) and r2["hits"] == before["hits"]
        deadline = time.monotonic() + 10  # dropped from the remote store too
        while raw.is_exist(name) == 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert raw.is_exist(name) == 0
    finally:
        raw.close()
    with d2.client() as kv:  # nothing of any of them landed in the daemon's tiers
        assert not any(e.hit for e in kv.lookup(list(objs)))
        assert kv.stats()["tiers"][0]["objects"] == before_objects


_INLINE_CLIENT = """
import sys, time
from kvstore.remote.mooncake import MooncakeAdapter, MooncakeTarget
a = MooncakeAdapter(MooncakeTarget.from_url(sys.argv[1]), probe_interval_s=0.1)
print(a.inline_bound_s, a.call("stat", ["kvstore/x"], 3.0).codes[0], flush=True)
sys.stdin.readline()  # the test hangs the master
t0 = time.monotonic()
res = a.call("stat", ["kvstore/x"], 3.0)
print(round(time.monotonic() - t0, 2), res.codes[0], res.timed_out, res.pending, a.reachable(), flush=True)
sys.stdin.readline()  # the test resumes it
deadline = time.monotonic() + 20
while not a.reachable() and time.monotonic() < deadline:
    time.sleep(0.05)
print(a.reachable(), a.call("stat", ["kvstore/x"], 3.0).codes[0], flush=True)
a.close()
"""


def test_an_inline_call_against_a_hung_master_ends_by_the_client_rpc_timeout(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    from kvstore.remote.base import NOT_FOUND, TIMED_OUT

    master = _start_master(tmp_path / "master")
    env = {k: v for k, v in os.environ.items() if k != "MC_RPC_TIMEOUT_MS"}  # the URL's rpc_timeout rules
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    p = subprocess.Popen([sys.executable, "-c", _INLINE_CLIENT, master.url + "&segment=0&rpc_timeout=0.5"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        bound, code = p.stdout.readline().split()
        assert float(bound) == 1.0 and int(code) == NOT_FOUND  # 2 x rpc_timeout <= 3 s: inline
        master.pause()
        p.stdin.write("\n")
        p.stdin.flush()
        secs, code, timed_out, pending, reachable = p.stdout.readline().split()
        # ended by Mooncake's own RPC timeout (0.5 s), not the caller's 3 s, nor Mooncake's default 30 s
        assert float(secs) < 2.0 and int(code) == TIMED_OUT
        assert (timed_out, pending, reachable) == ("True", "False", "False")
        master.resume()
        p.stdin.write("\n")
        p.stdin.flush()
        assert p.stdout.readline().split() == ["True", str(NOT_FOUND)]  # the probe reconnected
        assert p.wait(30) == 0
    finally:
        master.resume()
        if p.poll() is None:
            p.kill()
        master.stop()


def test_a_chunked_get_reads_every_piece_in_order_from_one_replica_lookup(tmp_path):
    import torch

    from kvstore.remote.base import NOT_FOUND, GetItem, PutItem
    from kvstore.remote.mooncake import MooncakeAdapter, MooncakeTarget

    master = _start_master(tmp_path / "master")
    a = None
    try:
        a = MooncakeAdapter(MooncakeTarget.from_url(master.url + "&segment=32MiB&read_chunk=64KiB"))
        n = (1 << 20) + 100  # 16 whole pieces and a short one
        src = torch.from_numpy(np.frombuffer(bytearray(blob(n, 9)), dtype=np.uint8))
        assert a.call("put", [PutItem("t/obj", ((src.data_ptr(), n),))], 5.0).codes == (n,)
        dst = torch.zeros(n, dtype=torch.uint8)
        ends: list[int] = []
        res = a.call("get", [GetItem("t/obj", ((dst.data_ptr(), n),), ends.append)], 5.0)
        assert res.codes == (n,) and torch.equal(src, dst)
        assert ends == [min(n, k << 16) for k in range(1, 18)]
        ends.clear()  # an absent object: the replica lookup says so, no piece is read
        assert a.call("get", [GetItem("t/none", ((dst.data_ptr(), n),), ends.append)], 5.0).codes == (NOT_FOUND,)
        assert ends == []
        big = torch.zeros(n + (1 << 16), dtype=torch.uint8)  # asks more than the object holds: an error
        res = a.call("get", [GetItem("t/obj", ((big.data_ptr(), big.numel()),), ends.append)], 5.0)
        assert res.codes[0] < 0 and res.codes[0] != NOT_FOUND  # the 17th piece runs past its end
        assert ends == [k << 16 for k in range(1, 17)]  # the pieces before it landed, and were reported
        ends.clear()  # an object within read_chunk: one get_into, no progress calls (the caller hashes it all)
        assert a.call("put", [PutItem("t/small", ((src.data_ptr(), 100),))], 5.0).codes == (100,)
        assert a.call("get", [GetItem("t/small", ((dst.data_ptr(), 100),), ends.append)], 5.0).codes == (100,)
        assert ends == []
    finally:
        if a is not None:
            a.close()
        master.stop()


def test_one_object_calls_on_a_real_master_run_inline_and_answer_codes(tmp_path):
    import threading

    import torch

    from kvstore.remote.base import NOT_FOUND
    from kvstore.remote.mooncake import MooncakeAdapter, MooncakeTarget, piece_bytes

    master = _start_master(tmp_path / "master")
    a = None
    try:
        a = MooncakeAdapter(MooncakeTarget.from_url(master.url + "&segment=32MiB&read_chunk=64KiB"))
        seen = []
        get_one_now = a.get_one_now
        a.get_one_now = lambda *args: seen.append(threading.current_thread().name) or get_one_now(*args)
        n = (1 << 18) + 10
        src = torch.from_numpy(np.frombuffer(bytearray(blob(n, 4)), dtype=np.uint8))
        assert a.put_one("t/one", src.data_ptr(), n, 5.0) == n
        dst = torch.zeros(n, dtype=torch.uint8)
        ends: list[int] = []
        assert a.get_one("t/one", dst.data_ptr(), n, 5.0, ends.append) == n and torch.equal(src, dst)
        step = piece_bytes(n, 1 << 16)  # five even pieces of at most 64 KiB
        assert ends == [min(n, k * step) for k in range(1, 6)] and step * 4 < n  # each reported as it landed
        assert seen == [threading.current_thread().name]  # inline: the client's RPC timeout bounds it
        assert a.get_one("t/none", dst.data_ptr(), n, 5.0) == NOT_FOUND
        assert a.put_one("t/small", src.data_ptr(), 100, 5.0) == 100
        dst.zero_()
        ends.clear()  # within read_chunk: one get_into, no progress calls
        assert a.get_one("t/small", dst.data_ptr(), 100, 5.0, ends.append) == 100 and ends == []
        assert torch.equal(dst[:100], src[:100])
    finally:
        if a is not None:
            a.close()
        master.stop()


def test_a_4mib_object_is_read_in_two_pieces_by_default_and_a_damaged_piece_is_refused(tmp_path):
    """The default URL (read_split 3MiB): a 4 MiB object with its trailer is read in two
    pieces from one replica lookup, each hashed as it lands; a byte flipped in the first
    piece (hashed while the second one transfers) or in the second is refused by the
    verifier, never passed; a 1 MiB object is one get."""
    import torch

    from kvstore.errors import BadObject
    from kvstore.records import ObjectMeta
    from kvstore.remote.envelope import PayloadVerifier, encode_trailer
    from kvstore.remote.mooncake import MooncakeAdapter, MooncakeTarget, piece_bytes

    master = _start_master(tmp_path / "master")
    a = None
    try:
        a = MooncakeAdapter(MooncakeTarget.from_url(master.url + "&segment=48MiB"))
        t = a.target
        meta = ObjectMeta("fp", 1, 0.5, {})

        def envelope(n: int, seed: int) -> bytearray:
            payload = blob(n, seed)
            import xxhash

            x = xxhash.xxh3_64_intdigest(payload)
            return bytearray(payload + encode_trailer(b"k", meta, n, x, x))

        def put(name: str, obj: bytearray) -> None:
            a.call("remove", [name], 5.0)
            src = torch.from_numpy(np.frombuffer(obj, dtype=np.uint8))
            assert a.put_one(name, src.data_ptr(), len(obj), 5.0) == len(obj)

        def get(name: str, size: int) -> tuple[PayloadVerifier, list[int], torch.Tensor]:
            dst = torch.zeros(size, dtype=torch.uint8)
            v = PayloadVerifier(memoryview(dst.numpy()), b"k")
            ends: list[int] = []
            assert a.get_one(name, dst.data_ptr(), size, 5.0, lambda e: (ends.append(e), v.landed(e))) == size
            return v, ends, dst

        good = envelope(4 << 20, 11)
        size = len(good)
        step = piece_bytes(size, t.read_chunk_bytes, t.read_split_bytes)
        assert t.read_split_bytes < size <= t.read_chunk_bytes and step < size
        put("t/four", good)
        v, ends, dst = get("t/four", size)
        assert ends == [step, size]  # two pieces, each reported (and hashed) as it landed
        assert v.finish().payload_bytes == 4 << 20 and bytes(dst.numpy()) == bytes(good)
        for at in (1000, step + 1000):  # a byte in the first piece, then one in the second
            bad = bytearray(good)
            bad[at] ^= 0x40
            put("t/four", bad)
            v, ends, _ = get("t/four", size)
            assert ends == [step, size]
            with pytest.raises(BadObject, match="payload hashes"):
                v.finish()
        small = envelope(1 << 20, 12)  # within read_split: one get_into, no progress calls
        put("t/one", small)
        v, ends, _ = get("t/one", len(small))
        assert ends == [] and v.finish().payload_bytes == 1 << 20
    finally:
        if a is not None:
            a.close()
        master.stop()
