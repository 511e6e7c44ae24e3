"""The daemon's TCP listener, driven by real daemons and real TCP connections: it never
starts without a token, refuses (and counts) requests without the right one, binds the
loopback address unless a host is named, speaks TLS when given a certificate pair, and
moves bytes over the wire (a TCP client never gets a shared-memory region nor commits
bytes it did not send)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.client import KVStoreClient
from kvstore.config import parse_hostport
from kvstore.errors import DaemonNotRunning, InvalidRequest, KVStoreError, Unauthenticated
from kvstore.rpc import kvstore_pb2 as pb
from kvstore.rpc.auth import bearer_metadata
from kvstore.rpc.service import ERROR_CODE_METADATA_KEY, PROTOCOL_METADATA_KEY, KVStoreStub
from kvstore.testing import REPO_ROOT, DaemonProcess, free_port, record_figures

TOKEN = "tcp-test-token-5f0e9c1a7b3d"


def _token_file(root: Path, text: str = TOKEN, mode: int = 0o600) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    path = root / "token"
    path.write_text(text + "\n")
    path.chmod(mode)
    return path


@pytest.fixture(scope="module")
def tcp_daemon(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("tcp")
    port, metrics_port = free_port(), free_port()
    d = DaemonProcess(root, cpu_capacity="16MiB", nvme_capacity="64MiB",
                      extra_args=["--tcp", f":{port}", "--metrics-port", str(metrics_port),
                                  "--max-message-size", "256KiB"])
    d.env["KVSTORE_TCP_TOKEN_FILE"] = str(_token_file(root))  # the env form of --tcp-token-file
    d.tcp = f"127.0.0.1:{port}"
    d.tcp_port, d.metrics_port, d.token_file = port, metrics_port, root / "token"
    d.start()
    yield d
    d.cleanup()


def _serve(args: list[str], root: Path) -> subprocess.CompletedProcess:
    d = DaemonProcess(root, cpu_capacity="8MiB", nvme_capacity="16MiB", extra_args=args)
    try:
        return subprocess.run([sys.executable, "-m", "kvstore.cli", "serve", *d.args], capture_output=True,
                              env=d.env, cwd=str(REPO_ROOT), timeout=60)
    finally:
        d.cleanup()


def _one_line_error(done: subprocess.CompletedProcess) -> str:
    err = done.stderr.decode().strip()
    assert done.returncode != 0
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


def test_serve_with_tcp_and_no_token_refuses_to_start_with_one_line(tmp_path):
    err = _one_line_error(_serve(["--tcp", f"127.0.0.1:{free_port()}"], tmp_path / "a"))
    assert "--tcp-token-file" in err


def test_serve_refuses_a_token_file_open_to_other_users_or_too_short(tmp_path):
    loose = _token_file(tmp_path / "loose", mode=0o644)
    err = _one_line_error(_serve(["--tcp", f"127.0.0.1:{free_port()}", "--tcp-token-file", str(loose)],
                                 tmp_path / "b"))
    assert str(loose) in err and "chmod 600" in err
    short = _token_file(tmp_path / "short", text="abc")
    err = _one_line_error(_serve(["--tcp", f"127.0.0.1:{free_port()}", "--tcp-token-file", str(short)],
                                 tmp_path / "c"))
    assert "3 characters" in err


def test_port_only_address_means_loopback():
    assert parse_hostport(":5000") == ("127.0.0.1", 5000)
    assert parse_hostport("0.0.0.0:5000") == ("0.0.0.0", 5000)  # every interface only when named


def test_port_only_daemon_listens_on_loopback_alone(tcp_daemon):
    port_hex = f"{tcp_daemon.tcp_port:04X}"
    listening = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            if state == "0A" and local.endswith(":" + port_hex):  # LISTEN
                listening.append(local.split(":")[0])
    loopback = {"0100007F", "0000000000000000FFFF00000100007F", "00000000000000000000000001000000"}
    assert listening and set(listening) <= loopback, listening  # 127.0.0.1 (maybe v4-mapped) or ::1 only


def test_client_with_the_token_puts_and_gets_bytes_over_the_wire(tcp_daemon):
    data = bytes(range(256)) * 300
    keys = [b"wire-key"] + [b"wire-%d" % i for i in range(20)]
    blobs = {k: data if k == b"wire-key" else os.urandom(100 + 997 * i) for i, k in enumerate(keys)}
    ops = verified = wrong = 0
    with KVStoreClient(tcp=tcp_daemon.tcp, tcp_token_file=tcp_daemon.token_file) as kv:
        for k, v in blobs.items():
            res = kv.put(k, v, extra={"n": 1}, tier="nvme" if len(v) % 2 else "cpu")
            ops += 1
            assert res.status == "stored" and res.checksum != 0
        assert kv.put(b"wire-key", data).status == "exists"
        for k, v in blobs.items():
            with kv.get(k) as view:
                ops += 1
                verified += view.tobytes() == v
                wrong += view.tobytes() != v
                assert view.lease.region.kind == "wire" and view.meta.extra == {"n": 1}
        assert kv.get_many([b"absent"]) == [None]
        assert kv.lookup([b"wire-key"])[0].hit
        assert kv.map_arenas() == []
    with tcp_daemon.client() as local:  # the same bytes, seen locally
        for k, v in blobs.items():
            with local.get(k) as view:
                ops += 1
                verified += view.tobytes() == v
                wrong += view.tobytes() != v
    record_figures("test_tcp_wire", operations=ops, objects_verified=verified, losses=wrong)
    assert wrong == 0 and verified == 2 * len(blobs)

def test_tensors_round_trip_over_the_wire(tcp_daemon):
    import torch

    t = {"k": torch.arange(64, dtype=torch.float32).reshape(4, 16), "v": torch.ones(3, dtype=torch.bfloat16)}
    with KVStoreClient(tcp=tcp_daemon.tcp, tcp_token_file=tcp_daemon.token_file) as kv:
        kv.put_tensors(b"wire-tensors", t, fingerprint="fp", token_count=4)
        with kv.get_tensors(b"wire-tensors", verify=True) as (header, got):
            assert header.fingerprint == "fp"
            assert torch.equal(got["k"], t["k"]) and torch.equal(got["v"], t["v"])


def _stats_failures(d: DaemonProcess) -> int:
    with d.client() as kv:
        return int(kv.stats()["tcp_auth_failures"])


def test_requests_without_the_right_token_are_refused_and_counted(tcp_daemon, tmp_path):
    wrong = _token_file(tmp_path, text="not-the-token-at-all-123")
    before = _stats_failures(tcp_daemon)
    with pytest.raises(Unauthenticated, match="no valid token"):
        KVStoreClient(tcp=tcp_daemon.tcp, tcp_token_file=wrong)
    refused = 1  # the client's Info
    ch = grpc.insecure_channel(tcp_daemon.tcp)
    stub = KVStoreStub(ch)
    with ch:
        for rpc, req in (("List", pb.ListRequest()), ("Delete", pb.DeleteRequest(keys=[b"wire-key"])),
                         ("Evict", pb.EvictRequest(tier="cpu")), ("Release", pb.ReleaseRequest(lease_ids=[1])),
                         ("Stats", pb.StatsRequest())):
            with pytest.raises(grpc.RpcError) as exc:
                getattr(stub, rpc)(req, timeout=10, metadata=((PROTOCOL_METADATA_KEY, "1"),))
            assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert dict(exc.value.trailing_metadata() or ())[ERROR_CODE_METADATA_KEY] == "UNAUTHENTICATED"
            refused += 1
        with pytest.raises(grpc.RpcError) as exc:  # a bearer that differs in its last byte
            stub.Lookup(pb.LookupRequest(keys=[b"k"]), timeout=10, metadata=(bearer_metadata(TOKEN[:-1] + "x"),))
        assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
        refused += 1
    counted = _stats_failures(tcp_daemon) - before
    text = urllib.request.urlopen(f"http://127.0.0.1:{tcp_daemon.metrics_port}/metrics", timeout=10).read().decode()
    with tcp_daemon.client() as kv:  # nothing the refused calls asked for happened
        still_there = kv.lookup([b"wire-key"])[0].hit
    record_figures("test_tcp_refused", operations=refused, refused_counted=counted, losses=int(not still_there))
    assert counted == refused == 7
    assert f"kvstore_tcp_auth_failures_total {float(before + refused)}" in text
    assert still_there


def test_no_region_and_no_commit_over_tcp_even_with_the_token(tcp_daemon):
    md = (bearer_metadata(TOKEN), (PROTOCOL_METADATA_KEY, "1"))
    ch = grpc.insecure_channel(tcp_daemon.tcp)
    stub = KVStoreStub(ch)
    with ch:
        res = stub.Reserve(pb.ReserveRequest(key=b"r", size=10, client_id="c"), timeout=10, metadata=md)
        assert res.status == "reserved" and not res.HasField("region")  # a claim, nothing to write through
        for rpc, req in (("Commit", pb.CommitRequest(reservation_id=res.reservation_id, checksum=1)),
                         ("Get", pb.GetRequest(keys=[b"wire-key"], client_id="c"))):
            with pytest.raises(grpc.RpcError) as exc:
                getattr(stub, rpc)(req, timeout=10, metadata=md)
            assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT, rpc
            assert "not served over TCP" in exc.value.details()
        with tcp_daemon.client() as kv:
            assert kv.lookup([b"r"])[0].hit is False  # in flight, never committed
            assert kv.wait_for(b"r", 0.2) is False
        stub.Abort(pb.AbortRequest(reservation_id=res.reservation_id), timeout=10, metadata=md)
        assert stub.Lookup(pb.LookupRequest(keys=[b"r"]), timeout=10, metadata=md).entries[0].hit is False
    with tcp_daemon.client() as kv:  # the key is free again for a real put
        assert kv.put(b"r", b"y" * 10).status == "stored"


def test_cli_over_tcp_needs_the_right_token(tcp_daemon, tmp_path):
    src = tmp_path / "in.bin"
    src.write_bytes(b"cli bytes over tcp")
    base = [sys.executable, "-m", "kvstore.cli"]
    env = dict(tcp_daemon.env)
    env.pop("KVSTORE_TCP_TOKEN_FILE", None)

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*base, *args], capture_output=True, env=env, cwd=str(REPO_ROOT), timeout=60)

    ok = run("put", "cli-key", str(src), "--tcp", tcp_daemon.tcp, "--tcp-token-file", str(tcp_daemon.token_file))
    assert ok.returncode == 0, ok.stderr.decode()
    out = tmp_path / "out.bin"
    got = run("get", "cli-key", "-o", str(out), "--tcp", tcp_daemon.tcp,
              "--tcp-token-file", str(tcp_daemon.token_file))
    assert got.returncode == 0, got.stderr.decode()
    assert out.read_bytes() == b"cli bytes over tcp"
    wrong = _token_file(tmp_path / "w", text="wrong-token-0000000000")
    for args in (("ls", "--tcp", tcp_daemon.tcp, "--tcp-token-file", str(wrong)),
                 ("rm", "cli-key", "--tcp", tcp_daemon.tcp),  # no token at all
                 ("get", "cli-key", "--tcp", tcp_daemon.tcp, "--tcp-token-file", str(tmp_path / "missing"))):
        err = _one_line_error(run(*args))
        assert err.startswith("kvstore: error:"), err
    with tcp_daemon.client() as kv:
        assert kv.lookup([b"cli-key"])[0].hit  # the refused rm removed nothing


def _make_cert(root: Path) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed (it makes the test certificate)")
    cert, key = root / "cert.pem", root / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    return cert, key


def test_tls_listener_serves_clients_that_trust_its_certificate(tmp_path):
    cert, key = _make_cert(tmp_path)
    token = _token_file(tmp_path / "t")
    port = free_port()
    with DaemonProcess(tmp_path / "d", cpu_capacity="8MiB", nvme_capacity="16MiB",
                       extra_args=["--tcp", f"127.0.0.1:{port}", "--tcp-token-file", str(token),
                                   "--tcp-tls-cert", str(cert), "--tcp-tls-key", str(key)]) as d:
        with KVStoreClient(tcp=f"localhost:{port}", tcp_token_file=token, tcp_tls_ca=cert) as kv:
            kv.put(b"tls-key", b"encrypted on the wire")
            with kv.get(b"tls-key") as v:
                assert v.tobytes() == b"encrypted on the wire"
        with pytest.raises((DaemonNotRunning, KVStoreError)):  # plaintext to a TLS port: no answer
            KVStoreClient(tcp=f"127.0.0.1:{port}", tcp_token_file=token, timeout=3.0)
        assert "tcp=127.0.0.1:%d+tls" % port in d.log_path.read_text()


def test_half_configured_tls_refuses_to_start(tmp_path):
    token = _token_file(tmp_path / "t")
    cert, _ = _make_cert(tmp_path)
    err = _one_line_error(_serve(["--tcp", f"127.0.0.1:{free_port()}", "--tcp-token-file", str(token),
                                  "--tcp-tls-cert", str(cert)], tmp_path / "d"))
    assert "--tcp-tls-key" in err


def test_put_bytes_refuses_bad_input_clearly(tcp_daemon):
    with KVStoreClient(tcp=tcp_daemon.tcp, tcp_token_file=tcp_daemon.token_file) as kv:
        with pytest.raises(InvalidRequest, match="unknown tier"):
            kv.put(b"x", b"y", tier="tape")
        with pytest.raises(InvalidRequest, match="at least 1 byte"):
            kv.put(b"x", b"")


def test_get_bytes_over_the_message_limit_is_refused_naming_the_remedy(tcp_daemon):
    with KVStoreClient(tcp=tcp_daemon.tcp, tcp_token_file=tcp_daemon.token_file) as kv:
        keys = [b"big-%d" % i for i in range(3)]
        for i, k in enumerate(keys):
            kv.put(k, bytes([i]) * (100 << 10))
        with pytest.raises(InvalidRequest, match="ask for fewer keys"):
            kv.get_many(keys)
        views = [kv.get(k) for k in keys]  # one at a time they travel
        assert [v.tobytes()[:1] for v in views] == [b"\x00", b"\x01", b"\x02"]
        with pytest.raises(InvalidRequest):  # over the daemon's message limit on the way in
            kv.put(b"too-big", b"x" * (300 << 10))


@settings(max_examples=60, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=st.one_of(st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=80),
                       st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=20).map(
                           lambda t: "Bearer " + TOKEN[:10] + t),
                       st.just("Bearer " + TOKEN[:-1]), st.just("Bearer " + TOKEN + "x"),
                       st.just("bearer " + TOKEN), st.just(TOKEN)))
def test_fuzzed_authorization_values_are_all_refused(tcp_daemon, value):
    ch = grpc.insecure_channel(tcp_daemon.tcp)
    with ch:
        try:
            KVStoreStub(ch).Stats(pb.StatsRequest(), timeout=10, metadata=(("authorization", value or "x"),))
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAUTHENTICATED
        else:
            raise AssertionError(f"authorization {value!r} was accepted")


def test_asyncio_client_over_tcp_authenticates_and_moves_bytes_over_the_wire(tcp_daemon, tmp_path):
    import asyncio

    from kvstore.client import AsyncKVStoreClient

    data = os.urandom(50_000)

    async def run() -> bytes:
        async with AsyncKVStoreClient(tcp=tcp_daemon.tcp, tcp_token_file=tcp_daemon.token_file) as kv:
            assert (await kv.put(b"aio-wire", data)).status == "stored"
            view = await kv.get(b"aio-wire")
            out = view.tobytes()
            await kv.release_many([view])
            return out

    assert asyncio.run(run()) == data
    wrong = _token_file(tmp_path, text="wrong-token-for-asyncio-1")

    async def refused() -> None:
        async with AsyncKVStoreClient(tcp=tcp_daemon.tcp, tcp_token_file=wrong):
            pass

    with pytest.raises(Unauthenticated):
        asyncio.run(refused())
