"""The fast Lookup socket (`<socket>.fast`, length-prefixed msgpack) of a real daemon
process: the same answers and errors as gRPC Lookup, the client's fallback to gRPC, bad
frames, clients that die mid-frame, permissions, metrics and shutdown."""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import stat
import subprocess
import sys
import textwrap
import time
import urllib.request

import msgpack
import pytest

from kvstore.client import KVStoreClient
from kvstore.client.aio import AsyncKVStoreClient
from kvstore.errors import InvalidRequest
from kvstore.rpc import fastwire
from kvstore.rpc.service import PROTOCOL_VERSION
from kvstore.testing import REPO_ROOT, DaemonProcess, free_port


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory):
    """This module's daemon: small frame limit (64KiB) and metrics on."""
    port = free_port()
    d = DaemonProcess(tmp_path_factory.mktemp("fast"), cpu_capacity="32MiB", nvme_capacity="128MiB",
                      extra_args=["--max-message-size", "64KiB", "--metrics-port", str(port)])
    d.metrics_port = port
    d.start()
    yield d
    d.cleanup()


def _connect(daemon: DaemonProcess) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10.0)
    s.connect(str(fastwire.fast_socket_path(daemon.socket)))
    return s


def _recv_exactly(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        more = s.recv(n - len(buf))
        assert more, "the daemon closed the connection instead of answering"
        buf += more
    return buf


def _recv_frame(s: socket.socket) -> dict:
    (n,) = fastwire.HEADER.unpack(_recv_exactly(s, fastwire.HEADER_SIZE))
    return fastwire.decode(_recv_exactly(s, n))


def _ask(s: socket.socket, msg: object) -> dict:
    s.sendall(fastwire.frame(msgpack.packb(msg, use_bin_type=True)))
    return _recv_frame(s)


def _lookup_msg(keys: list) -> dict:
    return {"v": PROTOCOL_VERSION, "op": "lookup", "keys": keys}


def _fill(kv: KVStoreClient, prefix: str) -> list[bytes]:
    """Keys on the CPU tier, on the NVMe tier, and absent (in a mixed order)."""
    keys = [f"{prefix}/{i}".encode() for i in range(12)]
    for i, k in enumerate(keys):
        if i % 3 == 0:
            kv.put(k, bytes([i]) * (100 + i), tier="cpu")
        elif i % 3 == 1:
            kv.put(k, bytes([i]) * (300 + i), tier="nvme")
    return keys


def test_fast_lookup_answers_exactly_what_grpc_lookup_answers_across_tiers(daemon):
    with daemon.client() as kv:
        keys = _fill(kv, "fast/same")
        fast = kv.lookup(keys + ["fast/same/0", memoryview(b"fast/same/1")])
        assert kv._fast.connected, "the client did not use the fast socket"
        grpc_ = kv.lookup_grpc(keys + ["fast/same/0", memoryview(b"fast/same/1")])
        assert fast == grpc_
        assert [(e.hit, e.tier) for e in fast[:3]] == [(True, "cpu"), (True, "nvme"), (False, None)]
        assert fast[1].size == 301 and fast[2].size == 0
        assert kv.lookup([]) == kv.lookup_grpc([]) == []
        kv.delete(keys)
        assert not any(e.hit for e in kv.lookup(keys))


def test_async_client_fast_lookup_matches_grpc_lookup(daemon):
    with daemon.client() as kv:
        keys = _fill(kv, "fast/aio")

    async def main() -> tuple:
        async with AsyncKVStoreClient(daemon.socket) as akv:
            fast = await akv.lookup(keys)
            used = akv._fast.connected
            return fast, await akv.lookup_grpc(keys), used

    fast, grpc_, used = asyncio.run(main())
    assert used and fast == grpc_
    assert sum(e.hit for e in fast) == 8


def test_bad_keys_raise_the_same_error_on_the_fast_path_as_over_grpc(daemon):
    with daemon.client() as kv:
        for bad in ([b"ok", b""], [b"k" * 2000]):
            with pytest.raises(InvalidRequest) as fast_err:
                kv.lookup(bad)
            with pytest.raises(InvalidRequest) as grpc_err:
                kv.lookup_grpc(bad)
            assert str(fast_err.value) == str(grpc_err.value)
        assert kv._fast.connected, "an error frame must not drop the connection"


def test_client_falls_back_to_grpc_when_the_daemon_runs_without_the_fast_socket(start_daemon):
    d = start_daemon(extra_args=["--no-fast-lookup"])
    assert not fastwire.fast_socket_path(d.socket).exists()
    with d.client() as kv:
        keys = _fill(kv, "fast/off")
        got = kv.lookup(keys)
        assert not kv._fast.connected
        assert got == kv.lookup_grpc(keys) and sum(e.hit for e in got) == 8

    async def main() -> tuple:
        async with AsyncKVStoreClient(d.socket) as akv:
            return await akv.lookup(keys), akv._fast.connected

    agot, used = asyncio.run(main())
    assert agot == got and not used


def test_config_shows_fast_lookup_on_by_default_and_its_env_override(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "KVSTORE_CONFIG": os.devnull}
    env.pop("KVSTORE_FAST_LOOKUP", None)
    run = lambda e: json.loads(subprocess.run([sys.executable, "-m", "kvstore.cli", "config", "--json"],  # noqa: E731
                                              capture_output=True, env=e, check=True, timeout=60).stdout)
    out = run(env)
    assert out["config"]["fast_lookup"] is True and out["sources"]["fast_lookup"] == "default"
    out = run({**env, "KVSTORE_FAST_LOOKUP": "false"})
    assert out["config"]["fast_lookup"] is False and out["sources"]["fast_lookup"] == "env:KVSTORE_FAST_LOOKUP"


def test_client_reconnects_to_the_fast_socket_after_a_daemon_restart(start_daemon):
    d = start_daemon()
    with d.client() as kv:
        kv.put(b"fast/restart", b"x" * 10, tier="nvme")
        assert kv.lookup([b"fast/restart"])[0].hit and kv._fast.connected
        d.restart()
        assert kv.lookup([b"fast/restart"])[0].hit  # the dead connection fails over to gRPC
        assert kv.lookup([b"fast/restart"])[0].hit and kv._fast.connected


@pytest.mark.parametrize("msg, code, words", [
    ([1, 2, 3], "INVALID_REQUEST", "must be a msgpack map"),
    ({"v": PROTOCOL_VERSION, "op": "get", "keys": []}, "INVALID_REQUEST", "unknown op 'get'"),
    ({"v": PROTOCOL_VERSION, "op": "lookup", "keys": "abc"}, "INVALID_REQUEST", "keys must be an array"),
    ({"v": PROTOCOL_VERSION, "op": "lookup", "keys": [b"a", "b"]}, "INVALID_REQUEST", "keys[1] is str"),
    ({"v": PROTOCOL_VERSION + 1, "op": "lookup", "keys": []}, "VERSION_MISMATCH", "protocol"),
    ({"v": PROTOCOL_VERSION, "op": "lookup", "keys": [b"k"] * 5000}, "INVALID_REQUEST", "batch of 5000 keys"),
])
def test_malformed_requests_get_an_error_frame_and_the_connection_stays_usable(daemon, msg, code, words):
    with _connect(daemon) as s:
        reply = _ask(s, msg)
        assert reply["error"]["code"] == code and words in reply["error"]["message"], reply
        assert _ask(s, _lookup_msg([b"fast/none"]))["found"] == (None,)


def test_a_frame_that_is_not_msgpack_gets_an_error_naming_it(daemon):
    with _connect(daemon) as s:
        s.sendall(fastwire.frame(b"\xc1\xc1 not msgpack"))
        reply = _recv_frame(s)
        assert reply["error"]["code"] == "INVALID_REQUEST" and "not one msgpack value" in reply["error"]["message"]
        assert _ask(s, _lookup_msg([]))["found"] == ()


def test_an_oversized_frame_gets_an_error_and_a_clean_close_and_the_daemon_keeps_serving(daemon):
    with _connect(daemon) as s:
        s.sendall(fastwire.HEADER.pack(1 << 30))
        reply = _recv_frame(s)
        assert "frame of 1073741824 bytes is over the limit of 65536" in reply["error"]["message"]
        assert s.recv(10) == b"", "the connection should be closed after an oversized frame"
    with daemon.client() as kv:
        kv.put(b"fast/after-bad", b"v", tier="cpu")
        assert kv.lookup([b"fast/after-bad"])[0].hit and kv._fast.connected


def test_a_client_killed_mid_frame_or_stalled_mid_frame_does_not_disturb_others(daemon):
    path = fastwire.fast_socket_path(daemon.socket)
    script = textwrap.dedent(f"""
        import socket, struct, sys
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect({str(path)!r})
        s.sendall(struct.pack(">I", 1000) + b"\\x83" + b"x" * 9)
        print("sent", flush=True)
        sys.stdin.read()
    """)
    child = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    stalled = _connect(daemon)  # this one stays open with half a frame
    try:
        assert child.stdout.readline().strip() == b"sent"
        stalled.sendall(fastwire.HEADER.pack(500) + b"\x83")
        with daemon.client() as kv:
            kv.put(b"fast/others", b"v", tier="cpu")
            for _ in range(20):
                assert kv.lookup([b"fast/others"])[0].hit
            child.kill()
            child.wait(10)
            time.sleep(0.1)
            for _ in range(20):
                assert kv.lookup([b"fast/others", b"fast/none"])[1].hit is False
            assert kv._fast.connected
    finally:
        stalled.close()
        if child.poll() is None:
            child.kill()
            child.wait(10)


def test_fast_lookups_are_counted_in_the_lookup_latency_metric(daemon):
    url = f"http://127.0.0.1:{daemon.metrics_port}/metrics"

    def count() -> float:
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        m = re.search(r'kvstore_request_seconds_count\{rpc="Lookup"\} ([0-9.e+]+)', text)
        return float(m.group(1)) if m else 0.0

    before = count()
    with daemon.client() as kv:
        for _ in range(7):
            kv.lookup([b"fast/metric"])
        assert kv._fast.connected
    assert count() - before == 7


def test_the_fast_socket_is_private_and_removed_on_graceful_shutdown(start_daemon):
    d = start_daemon()
    path = fastwire.fast_socket_path(d.socket)
    st = os.stat(path)
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    with _connect(d) as s:  # an open connection does not hold up the shutdown
        assert _ask(s, _lookup_msg([b"x"]))["found"] == (None,)
        assert d.stop() == 0
    assert not path.exists() and not d.socket.exists()


def test_a_lookup_that_finds_the_store_lock_busy_is_answered_in_order_once_it_frees(tmp_path):
    """In-process daemon (real Store, real socket) so the test can hold the Store's lock:
    the loop hands the lookup to a worker thread instead of stalling, a second request
    pipelined behind it waits its turn, and both are answered in order."""
    from kvstore.config import load_config
    from kvstore.server.daemon import Daemon

    sock_dir = tmp_path / "s"
    cfg = load_config(cli={"socket": str(sock_dir / "kv.sock"), "dir": str(tmp_path / "cache"),
                           "cpu_capacity": "8MiB", "nvme_capacity": "16MiB", "gpu_capacity": "0",
                           "shm_name": f"kvstore-test-{os.getpid()}-busy"}, env={"KVSTORE_CONFIG": os.devnull})
    d = Daemon(cfg)
    d.start()
    try:
        with KVStoreClient(cfg.socket) as kv:
            kv.put(b"busy/k", b"v" * 7, tier="cpu")
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(10.0)
        s.connect(str(fastwire.fast_socket_path(cfg.socket)))
        with s, d.store._lock:
            s.sendall(fastwire.frame(msgpack.packb(_lookup_msg([b"busy/k"]), use_bin_type=True))
                      + fastwire.frame(msgpack.packb(_lookup_msg([b"busy/none", b"busy/k"]), use_bin_type=True)))
            s.settimeout(0.3)
            with pytest.raises(socket.timeout):
                s.recv(1)
            s.settimeout(10.0)
            d.store._lock.release()  # let the worker thread through ...
            try:
                first, second = _recv_frame(s), _recv_frame(s)
            finally:
                d.store._lock.acquire()  # ... and give the `with` its lock back
        assert first["found"] == (("cpu", 7),) and second["found"] == (None, ("cpu", 7))
    finally:
        d.stop()
    assert not fastwire.fast_socket_path(cfg.socket).exists()
