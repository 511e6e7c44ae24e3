"""StoreSignatureCache against a REAL kvstore daemon (subprocess, temp socket and arena):
signatures round-trip bit-identically and load zero-copy from the shared arena, leases
end when the engine releases, in-flight claims make a second engine wait and then hit,
a claim of a dead engine expires, a missing daemon costs nothing but misses (and the
cache connects once it appears), and a put that fails on capacity is counted, not raised."""
from __future__ import annotations

import threading

import pytest
import torch

from connector_testlib import wait_until
from engine.connector.config import StoreConnectorConfig
from engine.connector.store_cache import COMPUTE, INFLIGHT, OWNED, PRESENT, WAITED, StoreSignatureCache
from engine.models.config import FULL, GDN, GLA, LIGHTNING, MAMBA2, SWA, AttentionConfig, LinearConfig, ModelConfig
from engine.models.weights import build_model
from engine.pic.compute import compute_signature
from engine.pic.signature_cache import segment_key, signature_variant
from kvstore import format as fmt
from kvstore.testing import DaemonProcess

BOS = 256
SPLIT = 4
FP = "test-fingerprint"
ALL_KINDS = (GDN, FULL, SWA, LIGHTNING, GLA, MAMBA2)


@pytest.fixture(scope="module")
def model():
    cfg = ModelConfig(
        name="connector-test", family="test", scale="custom", vocab_size=260, hidden_size=32, intermediate_size=64,
        layers=ALL_KINDS, max_position_embeddings=4096,
        attention=AttentionConfig(num_heads=4, num_kv_heads=2, head_dim=8, rotary_dim=4, sliding_window=6),
        linear=LinearConfig(num_heads=2, num_v_heads=4, key_dim=8, value_dim=8, conv_size=3, chunk_size=8,
                            conv_kinds=(GDN, MAMBA2)))
    return build_model(cfg, "cpu", torch.float32, seed=0)


def signature(model, ids):
    return compute_signature(model, ids, [BOS], SPLIT), segment_key(FP, ids, signature_variant([BOS], SPLIT))


def connector(daemon: DaemonProcess, **kw) -> StoreConnectorConfig:
    return StoreConnectorConfig(socket=str(daemon.socket), reconnect_min_s=0.05, reconnect_max_s=0.2, **kw)


def test_round_trip_of_a_real_signature_is_bit_identical_and_zero_copy(start_daemon, model):
    d = start_daemon()
    sig, key = signature(model, list(range(40, 80)))
    with StoreSignatureCache(FP, "cpu", connector(d)) as cache, d.client() as kv:
        assert cache.lookup([key]) == [False]
        assert cache.put(key, sig) and cache.flush()
        assert cache.lookup([key, b"\x01" * 32]) == [True, False]
        seg = cache.acquire(key)
        want, want_meta, _ = sig.to_tensors()
        got, got_meta, _ = seg.signature.to_tensors()
        assert got_meta == want_meta and got.keys() == want.keys()
        for name in want:
            assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name
        # zero copy: every part is a view into the leased bytes of the daemon's arena
        base, size = seg.view.array.ctypes.data, seg.view.size
        assert seg.served_tier == "cpu"
        assert all(base <= t.data_ptr() < base + size for t in got.values())
        assert kv.stats()["leases"] == 1
        cache.release(key)
        assert kv.stats()["leases"] == 0
        info = kv.show(key)
        assert info.info.meta.fingerprint == FP and info.info.meta.token_count == 40
        assert info.header["meta"]["format"] == "pic-signature-v1"
        snap = cache.metrics.snapshot()
        assert snap["puts_stored"] == 1 and snap["loads"]["cpu"] == 1 and snap["hits"] == 1


def test_a_second_engine_waits_for_a_claimed_segment_then_hits(start_daemon, model):
    d = start_daemon()
    sig, key = signature(model, list(range(10, 50)))
    with StoreSignatureCache(FP, "cpu", connector(d)) as a, \
            StoreSignatureCache(FP, "cpu", connector(d, inflight_wait_s=30.0)) as b:
        mine = a.claim(key)
        assert mine.status == OWNED
        theirs = b.claim(key)
        assert theirs.status == INFLIGHT
        result = {}
        waiter = threading.Thread(target=lambda: result.setdefault("claim", b.wait_inflight(theirs)))
        waiter.start()
        wait_until(lambda: b.metrics.get("inflight_waits") == 1, what="b waiting")
        assert a.store(key, sig, claim=mine)
        waiter.join(30)
        got = result["claim"]
        assert got.status == WAITED and got.segment is not None
        assert torch.equal(got.segment.signature.layers[1].k, sig.layers[1].k)
        b.release(key)
        # once stored, a late claimer finds it present instead of computing it
        late = b.claim(key)
        assert late.status == PRESENT and late.segment is not None
        b.release(key)
        assert b.metrics.get("inflight_wait_hits") == 1 and a.metrics.get("claims") == 1


def test_a_claim_held_by_a_dead_engine_expires(start_daemon, model):
    d = start_daemon(lease_ttl=0.5, expire_interval=0.05)
    _, key = signature(model, list(range(5, 25)))
    with StoreSignatureCache(FP, "cpu", connector(d, inflight_wait_s=20.0)) as b:
        dead = StoreSignatureCache(FP, "cpu", connector(d))
        assert dead.claim(key).status == OWNED
        dead.putter.close()
        dead.link.close()  # gone without aborting: no keepalive renews its claim any more
        theirs = b.claim(key)
        assert theirs.status == INFLIGHT
        got = b.wait_inflight(theirs)
        assert got.status == COMPUTE and got.wait_ms < 15_000
        assert b.metrics.get("inflight_wait_misses") == 1


def test_a_missing_daemon_costs_only_misses_and_the_cache_connects_when_it_starts(tmp_path, model):
    d = DaemonProcess(tmp_path / "late", entry="kvstore.server")
    sig, key = signature(model, list(range(60, 90)))
    cache = StoreSignatureCache(FP, "cpu", connector(d))
    try:
        assert not cache.available and cache.metrics.snapshot()["store_available"] == 0
        assert cache.lookup([key]) == [False]
        assert cache.get(key) is None
        assert cache.claim(key).status == COMPUTE
        assert cache.put(key, sig) is False
        assert cache.metrics.snapshot()["puts_failed"]["unavailable"] == 1
        d.start()
        wait_until(lambda: cache.available, what="reconnect")
        assert cache.put(key, sig) and cache.flush()
        assert cache.get(key) is not None
        cache.release(key)
    finally:
        cache.close()
        d.cleanup()


def test_a_put_failing_on_capacity_is_counted_not_raised(start_daemon, model):
    d = start_daemon(cpu_capacity="1MiB", nvme_capacity="0")
    sig, key = signature(model, list(range(100, 200)))
    tensors, meta, layers = sig.to_tensors()
    size = fmt.plan_blob(tensors, fingerprint=FP, token_count=100, meta=meta, layers=layers).total_size
    with d.client() as kv, StoreSignatureCache(FP, "cpu", connector(d, put_tier="cpu")) as cache:
        ballast = (1 << 20) - size + 64 * 1024  # leaves room for claims, not for the signature
        kv.put(b"ballast", bytes(ballast), tier="cpu")
        with kv.get(b"ballast"):  # leased: eviction cannot free it
            assert cache.put(key, sig)
            assert cache.flush()
        snap = cache.metrics.snapshot()
        assert snap["puts_failed"]["capacity"] == 1 and snap["puts_stored"] == 0
        assert cache.lookup([key]) == [False]


@pytest.mark.parametrize("bad, needle", [
    (dict(rpc_timeout_s=0), "rpc_timeout_s"), (dict(load_timeout_s=float("nan")), "load_timeout_s"),
    (dict(reconnect_min_s=1.0, reconnect_max_s=0.5), "reconnect_max_s"), (dict(put_queue_depth=-1), "put_queue_depth"),
    (dict(put_tier="disk"), "put_tier"), (dict(socket=""), "socket"),
    (dict(share_keep=0), "share_keep"), (dict(share_keep=1.5), "share_keep"),
])
def test_bad_connector_options_are_refused_naming_the_option(bad, needle):
    from engine.connector.errors import ConnectorConfigError

    with pytest.raises(ConnectorConfigError, match=needle):
        StoreConnectorConfig(**bad)
