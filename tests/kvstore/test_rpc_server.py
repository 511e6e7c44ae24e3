"""The daemon's gRPC surface (kvstore/server/), driven over its real unix socket: malformed
requests, limits, health, version checks, socket permissions, metrics, TCP, shutdown."""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
import pytest

from kvstore.client import KVStoreClient
from kvstore.errors import InvalidRequest, VersionMismatch
from kvstore.rpc import kvstore_pb2 as pb
from kvstore.rpc.service import ERROR_CODE_METADATA_KEY, KVStoreStub, PROTOCOL_METADATA_KEY
from kvstore.testing import DaemonProcess, free_port


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory):
    """This module's daemon: small message limit, metrics and TCP on, and a socket in a
    directory that does not exist yet (the daemon creates it)."""
    metrics_port, tcp_port = free_port(), free_port()
    d = DaemonProcess(tmp_path_factory.mktemp("rpc"), cpu_capacity="32MiB", nvme_capacity="128MiB",
                      extra_args=["--max-message-size", "64KiB", "--metrics-port", str(metrics_port),
                                  "--tcp", f"127.0.0.1:{tcp_port}"])
    d.socket = d.socket.parent / "private" / "kv.sock"
    d.args[d.args.index("--socket") + 1] = str(d.socket)
    d.metrics_port, d.tcp_port = metrics_port, tcp_port
    d.start()
    yield d
    d.cleanup()


def _raw(daemon: DaemonProcess) -> tuple[grpc.Channel, KVStoreStub]:
    ch = grpc.insecure_channel(f"unix:{daemon.socket}")
    return ch, KVStoreStub(ch)


def _code_of(exc: grpc.RpcError) -> str:
    return dict(exc.trailing_metadata() or ()).get(ERROR_CODE_METADATA_KEY, "")


MALFORMED = [
    ("Lookup", pb.LookupRequest(keys=[b"ok", b""]), "empty key"),
    ("Lookup", pb.LookupRequest(keys=[b"k" * 2000]), "over the limit of 1024"),
    ("Delete", pb.DeleteRequest(keys=[b"%d" % i for i in range(5000)]), "batch of 5000 keys"),
    ("Reserve", pb.ReserveRequest(key=b"x", size=0, tier="cpu"), "size must be > 0"),
    ("Reserve", pb.ReserveRequest(key=b"x", size=2**63, tier="cpu"), "exceeds the 'cpu' tier's capacity"),
    ("Reserve", pb.ReserveRequest(key=b"x", size=10, tier="tape"), "unknown tier 'tape'"),
    ("Reserve", pb.ReserveRequest(key=b"x", size=10, tier="gpu"), "not enabled"),
    ("Reserve", pb.ReserveRequest(key=b"x", size=10, meta=pb.ObjectMeta(extra_json="{nope")), "not valid JSON"),
    ("Reserve", pb.ReserveRequest(key=b"x", size=10, meta=pb.ObjectMeta(cost=float("nan"))), "meta.cost"),
    ("Commit", pb.CommitRequest(reservation_id=0), "reservation_id is required"),
    ("Get", pb.GetRequest(keys=[b"x"]), "client_id is required"),
    ("Prefetch", pb.PrefetchRequest(keys=[b"x"], tier="floppy"), "unknown tier 'floppy'"),
    ("Evict", pb.EvictRequest(tier=""), "tier is required"),
    ("WaitFor", pb.WaitForRequest(key=b"x", timeout_s=-1), "timeout_s"),
    ("List", pb.ListRequest(tier="disk"), "unknown tier 'disk'"),
]


@pytest.mark.parametrize("rpc, request_msg, fragment", MALFORMED, ids=[f"{m[0]}-{m[2][:20]}" for m in MALFORMED])
def test_malformed_request_gets_invalid_argument_naming_the_problem(daemon, rpc, request_msg, fragment):
    ch, stub = _raw(daemon)
    with ch, pytest.raises(grpc.RpcError) as exc:
        getattr(stub, rpc)(request_msg, timeout=10)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert fragment in exc.value.details()
    assert _code_of(exc.value) == "INVALID_REQUEST"


def test_garbage_bytes_and_unknown_fields_are_rejected_clearly_and_the_daemon_keeps_serving(daemon):
    ch = grpc.insecure_channel(f"unix:{daemon.socket}")
    raw = ch.unary_unary("/kvstore.v1.KVStore/Lookup")  # no serializers: bytes on the wire
    with ch:
        with pytest.raises(grpc.RpcError) as exc:
            raw(b"\xff\xff\xff\xff", timeout=10)
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not a valid kvstore.v1.LookupRequest" in exc.value.details()
        with pytest.raises(grpc.RpcError) as exc:
            raw(pb.LookupRequest(keys=[b"a"]).SerializeToString() + b"\xb8\x01\x07", timeout=10)  # field 23
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "unknown field number(s) [23]" in exc.value.details()
    with daemon.client() as kv:
        kv.put(b"after-garbage", b"still serving")
        with kv.get(b"after-garbage") as v:
            assert bytes(v.memoryview) == b"still serving"
        assert kv.health()


def test_client_maps_invalid_argument_to_invalid_request(daemon):
    with daemon.client() as kv:
        with pytest.raises(InvalidRequest, match="unknown tier 'tape'"):
            kv.put(b"k", b"v", tier="tape")
        with pytest.raises(InvalidRequest, match="empty key"):
            kv.lookup([b""])


def test_message_over_the_size_limit_is_refused_and_the_daemon_keeps_serving(daemon):
    with daemon.client() as kv:
        with pytest.raises(InvalidRequest):
            kv.lookup([b"%04d" % i + b"x" * 1000 for i in range(100)])  # ~100 KB request
        assert kv.lookup([b"small"])[0].hit is False


def test_protocol_version_mismatch_is_a_version_mismatch_error(daemon):
    ch, stub = _raw(daemon)
    with ch, pytest.raises(grpc.RpcError) as exc:
        stub.Lookup(pb.LookupRequest(keys=[b"a"]), metadata=((PROTOCOL_METADATA_KEY, "999"),), timeout=10)
    assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert _code_of(exc.value) == "VERSION_MISMATCH"
    assert "protocol 999" in exc.value.details()


def test_standard_grpc_health_check_reports_serving(daemon):
    try:
        from grpc_health.v1 import health_pb2, health_pb2_grpc
    except Exception as exc:  # missing, or built for another protobuf runtime
        pytest.skip(f"grpcio-health-checking is not usable here ({exc}); the raw Check is tested below")
    with grpc.insecure_channel(f"unix:{daemon.socket}") as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_health_check_on_the_wire_answers_serving(daemon):
    from kvstore.rpc.service import HEALTH_CHECK_METHOD, decode_health_status, encode_health_request

    with grpc.insecure_channel(f"unix:{daemon.socket}") as ch:
        raw = ch.unary_unary(HEALTH_CHECK_METHOD)(encode_health_request(), timeout=10)
    assert decode_health_status(raw) == 1  # SERVING


def test_socket_is_mode_0600_in_a_0700_directory_it_created(daemon):
    assert stat.S_IMODE(os.stat(daemon.socket).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(daemon.socket.parent).st_mode) == 0o700


def test_second_daemon_on_the_same_socket_fails_fast_and_the_first_keeps_serving(daemon):
    cmd = [sys.executable, "-m", "kvstore.cli", "serve", *daemon.args]
    done = subprocess.run(cmd, capture_output=True, env=daemon.env, timeout=60)
    assert done.returncode != 0
    err = done.stderr.decode()
    assert "already" in err and str(daemon.socket) in err
    assert "Traceback" not in err
    with daemon.client() as kv:
        assert kv.health()


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not in /metrics")


def test_metrics_endpoint_serves_store_gauges_and_request_latency(daemon):
    url = f"http://127.0.0.1:{daemon.metrics_port}/metrics"
    before = urllib.request.urlopen(url, timeout=10).read().decode()
    with daemon.client() as kv:
        kv.put(b"metrics-key", b"metrics")
        kv.get(b"metrics-key").release()
        assert kv.lookup([b"nope"])[0].hit is False
        objects = sum(t["objects"] for t in kv.stats()["tiers"] if t["name"] == "cpu")
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    assert _metric(text, "kvstore_hits_total") == _metric(before, "kvstore_hits_total") + 1
    # lookups are counted per key too (an engine gets only what its lookup found)
    assert _metric(text, "kvstore_lookup_misses_total") == _metric(before, "kvstore_lookup_misses_total") + 1
    assert _metric(text, 'kvstore_tier_objects{tier="cpu"}') == objects
    assert _metric(text, 'kvstore_tier_used_bytes{tier="cpu"}') > 0
    assert 'kvstore_request_seconds_bucket{le="5e-05",rpc="Lookup"}' in text
    assert "kvstore_leases" in text and "kvstore_evictions_total" in text and "kvstore_writebacks_total" in text


def test_tcp_listener_serves_the_control_plane(daemon):
    with daemon.client() as kv:
        kv.put(b"over-unix", b"x")
    with KVStoreClient(tcp=f"127.0.0.1:{daemon.tcp_port}") as kv:
        assert kv.lookup([b"over-unix"])[0].hit
        assert [t["name"] for t in kv.stats()["tiers"]] == ["cpu", "nvme"]


def test_sigterm_aborts_open_reservations_and_cleans_up(start_daemon):
    d = start_daemon()
    ch, stub = _raw(d)
    with ch:
        res = stub.Reserve(pb.ReserveRequest(key=b"half", size=8192, tier="nvme", client_id="c"), timeout=10)
        assert res.status == "reserved"
        part = Path(res.region.path)
        assert part.exists()
    arena = Path("/dev/shm") / f"{d.shm_name}.arena"
    assert arena.exists()
    assert d.stop(signal.SIGTERM) == 0
    assert not part.exists(), "the aborted reservation's partial file must be removed"
    assert not d.socket.exists() and not arena.exists()
    assert "kvstore daemon stopped" in d.log_path.read_text()
    d.start()
    with d.client() as kv:
        assert kv.lookup([b"half"])[0].hit is False


def test_second_daemon_on_the_same_cache_dir_is_refused(daemon, tmp_path):
    other = DaemonProcess(tmp_path / "other")
    other.args[other.args.index("--dir") + 1] = str(daemon.dir)
    try:
        with pytest.raises(RuntimeError, match="in use by another daemon"):
            other.start(timeout=30)
    finally:
        other.cleanup()


def test_commit_of_an_unknown_reservation_is_unknown_key(daemon):
    ch, stub = _raw(daemon)
    with ch, pytest.raises(grpc.RpcError) as exc:
        stub.Commit(pb.CommitRequest(reservation_id=987654, checksum=1), timeout=10)
    assert exc.value.code() == grpc.StatusCode.NOT_FOUND
    assert _code_of(exc.value) == "UNKNOWN_KEY"


def test_version_mismatch_from_an_old_daemon_reaches_the_client_as_its_class(daemon, monkeypatch):
    import kvstore.client.common as common

    monkeypatch.setattr(common, "METADATA", ((PROTOCOL_METADATA_KEY, "0"),))
    import kvstore.client.sync as sync

    monkeypatch.setattr(sync, "METADATA", ((PROTOCOL_METADATA_KEY, "0"),))
    with pytest.raises(VersionMismatch, match="protocol 0"):
        KVStoreClient(socket=daemon.socket)
