"""Cold segments of one request computed in parallel by an idle engine (engine.connector.
coldshare), with a REAL daemon and REAL engine processes: an idle `kvengine serve --store`
process computes part of another engine's cold segments (its /metrics and the
requester's say so), the stored signatures are the bytes the requester would have
computed alone and the output equals in-process PIC; a helper killed while holding a
claim costs the requester only the claim's expiry; `share_cold=False` (`[store]
share_cold = false` in `--pic-config`) and `dedup=False` offer nothing; offers are withdrawn once the request's miss step is done."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

import engine.pic.planner as pic_planner  # the alone passes of every PIC planner run through it
from connector_testlib import prompt, run_one, wait_until
from engine.connector.codec import signature_blob
from engine.connector.coldshare import WANTED_TAG, decode_tokens, encode_tokens, own_share
from engine.pic.compute import compute_signature

REPO = Path(__file__).resolve().parents[3]


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env.update(OMP_NUM_THREADS="1", KVSTORE_CONFIG=os.devnull)
    return env


@pytest.fixture
def helper_server():
    """helper_server(daemon) -> base URL of an idle `kvengine serve --store` process."""
    procs = []

    def start(daemon, *extra: str) -> str:
        cmd = [sys.executable, "-m", "engine.cli", "serve", "--preset", "qwen3next-tiny", "--device", "cpu",
               "--dtype", "float32", "--port", "0", "--log-level", "warning", "--store", str(daemon.socket), *extra]
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env(),
                             cwd=str(REPO))
        procs.append(p)
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            line = p.stdout.readline()
            if not line and p.poll() is not None:
                raise AssertionError(f"kvengine serve exited with {p.returncode}")
            m = re.search(r"on (http://\S+)", line)
            if m:
                return m.group(1)
        raise AssertionError("kvengine serve did not start")

    yield start
    for p in procs:
        p.send_signal(signal.SIGINT)
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def slowed_compute(monkeypatch, per_segment_s: float, gate=None):
    """Make this process's alone passes slow (the helper process's are not), optionally
    holding the first one until `gate()` is true."""
    real = pic_planner.AlonePass
    calls = []

    def slow(model, segments, *args, **kwargs):
        for _ in segments:
            calls.append(1)
            if gate is not None and len(calls) == 1:
                wait_until(gate, timeout=120, what="the helper's claim")
            time.sleep(per_segment_s)
        return real(model, segments, *args, **kwargs)

    monkeypatch.setattr(pic_planner, "AlonePass", slow)


def reference(memory_engine, segments):
    engine, planner = memory_engine()
    return run_one(engine, planner, segments, "ref")[0].token_ids


def test_an_idle_engine_process_computes_part_of_a_requests_cold_segments_with_identical_results(
        start_daemon, store_engine, memory_engine, helper_server, monkeypatch):
    d = start_daemon()
    segments = prompt((0, 1, 2))
    want = reference(memory_engine, segments)
    url = helper_server(d)
    engine, planner = store_engine(d, share_pack_tokens=1)  # one segment per pass: never claims ahead
    slowed_compute(monkeypatch, 0.6)
    out, rep, st = run_one(engine, planner, segments, "r1")
    assert out.token_ids == want
    assert rep.miss_segments + rep.hit_segments == 3
    assert st.offloaded >= 1 and st.computed + st.offloaded == 3  # part of the work done by the idle engine
    snap = planner.store.metrics.snapshot()
    assert snap["cold_offered"] == 1 and snap["cold_offloaded"] == st.offloaded  # it keeps 2 of 3 (share_keep)
    wait_until(lambda: metric(url, "kvengine_store_cold_helped_total") >= st.offloaded, what="helper metrics")
    # the signatures the helper stored are what this engine computes alone (to float
    # rounding: a helper computes what it took in one packed pass, whose batched
    # projections may round differently from a one-segment pass)
    state_keys = [u for u in planner._layout(*_ids_and_segments(engine, segments)) if u[0] == "splice"]
    fp = engine.loaded_model.fingerprint
    with d.client() as kv:
        for _, u in state_keys:
            ids, _ = _ids_and_segments(engine, segments)
            mine = signature_blob(compute_signature(engine.runner.model, ids[u.offset:u.end], planner.anchor_ids,
                                                    u.split, backend=engine.runner.backend), fp)
            view = kv.get_tensors(u.key)
            try:
                assert set(view.tensors) == set(mine.tensors)
                for name, t in mine.tensors.items():
                    got = view.tensors[name]
                    assert got.dtype == t.dtype and got.shape == t.shape, name
                    if t.is_floating_point():
                        torch.testing.assert_close(got, t, rtol=1e-4, atol=1e-5, msg=name)
                    else:
                        assert torch.equal(got, t), name
            finally:
                view.release()
        planner.store.share.settle()
        assert kv.list(prefix=WANTED_TAG) == []  # offers withdrawn or taken


def _ids_and_segments(engine, segments):
    return engine._tokenize(segments, None)


def test_a_helper_killed_while_holding_a_claim_does_not_hang_the_requester(
        start_daemon, store_engine, memory_engine, monkeypatch, tmp_path):
    d = start_daemon(lease_ttl=2.0, expire_interval=0.1)
    segments = prompt((0, 1, 2))
    want = reference(memory_engine, segments)
    engine, planner = store_engine(d, share_pack_tokens=1)
    ready = tmp_path / "claimed"
    helper = subprocess.Popen([sys.executable, str(REPO / "tests/engine/connector/hanging_helper.py"), str(d.socket),
                               engine.loaded_model.fingerprint, str(ready)], env=child_env(), cwd=str(REPO))
    try:
        def claimed_then_killed() -> bool:
            if not ready.exists() or not ready.read_text():
                return False
            if helper.poll() is None:
                helper.kill()  # dies holding the claim
                helper.wait()
            return True

        slowed_compute(monkeypatch, 0.0, gate=claimed_then_killed)
        t0 = time.monotonic()
        out, _, st = run_one(engine, planner, segments, "r1")
        elapsed = time.monotonic() - t0
    finally:
        if helper.poll() is None:
            helper.kill()
            helper.wait()
    assert out.token_ids == want
    assert st.computed == 3 and st.offloaded == 0  # the claimed segment was computed here after all
    snap = planner.store.metrics.snapshot()
    assert snap["inflight_wait_misses"] == 1 and snap["cold_offloaded"] == 0
    assert elapsed < 20.0  # bounded by the claim's expiry (2 s TTL), not by share_wait_s


def test_with_sharing_off_nothing_is_offered(start_daemon, store_engine):
    d = start_daemon()
    for overrides in ({"share_cold": False}, {"dedup": False}):
        engine, planner = store_engine(d, **overrides)
        assert planner.store.share is None and planner.idle_poll_s is None and engine.idle_poll_s is None
        run_one(engine, planner, prompt((0, 1, 2), f"Q: {overrides}?\nA: "), f"r{len(overrides)}")
        assert planner.store.metrics.get("cold_offered") == 0
        with d.client() as kv:
            assert kv.list(prefix=WANTED_TAG) == []
            kv.delete([o.key for o in kv.list()])  # cold again for the next configuration


def test_the_requester_keeps_the_fewest_first_segments_holding_its_share():
    assert own_share([], 0.5) == 0 and own_share([100], 0.5) == 1
    assert own_share([100, 100], 0.5) == 1 and own_share([100, 100, 100], 0.5) == 2
    assert own_share([10, 10, 10, 100], 0.5) == 3  # all but one at most
    assert own_share([500, 10, 10, 10], 0.5) == 1 and own_share([100] * 7, 0.5) == 4
    assert own_share([100] * 4, 1.0) == 3 and own_share([100] * 4, 0.01) == 1


def test_wanted_records_hold_token_ids_as_little_endian_uint32():
    ids = (0, 1, 65535, 2**32 - 1)
    assert encode_tokens(ids) == b"".join(i.to_bytes(4, "little") for i in ids)
    assert decode_tokens(encode_tokens(ids)) == ids
    with pytest.raises(ValueError, match="5 bytes"):
        decode_tokens(b"\x00" * 5)


def test_an_idle_engine_skips_its_own_offers_and_offers_whose_key_it_cannot_derive(start_daemon, store_engine):
    d = start_daemon()
    (ea, pa), (eb, pb) = store_engine(d), store_engine(d)
    ids = list(range(5, 40))
    key = pa.key(ids, 16)
    from engine.connector.coldshare import ColdSegment

    pa.store.share.publish("own", [ColdSegment(key, tuple(ids), 16), ColdSegment(b"\x01" * 32, tuple(ids), 16)])
    pa.store.share.settle()
    time.sleep(0.02)
    assert ea.help_idle() == 0  # its own offers
    done = [eb.help_idle() for _ in range(3) if not time.sleep(0.02)]
    assert sum(done) == 1  # the genuine offer; the forged key is rejected
    assert pb.store.metrics.get("cold_helped") == 1 and pb.store.metrics.get("cold_rejected") == 1
    assert pb.store.flush()
    with d.client() as kv:
        assert kv.lookup([key])[0].hit
        assert kv.list(prefix=WANTED_TAG) == []


def test_the_requester_computes_its_share_in_one_pass_then_what_no_helper_took_in_another(
        start_daemon, store_engine, memory_engine, monkeypatch):
    d = start_daemon()
    segments = prompt((0, 1, 2))
    want = reference(memory_engine, segments)
    engine, planner = store_engine(d, share_pack_tokens=1 << 20)  # no helper: its two, then the offered one
    passes = []
    real = pic_planner.AlonePass

    def counted(model, segs, *args, **kwargs):
        passes.append(len(segs))
        return real(model, segs, *args, **kwargs)

    monkeypatch.setattr(pic_planner, "AlonePass", counted)
    out, rep, st = run_one(engine, planner, segments, "r1")
    assert out.token_ids == want
    assert st.computed == 3 and st.offloaded == 0
    assert passes == [2, 1]
    assert planner.store.metrics.snapshot()["cold_offered"] == 1


def test_a_helper_whose_pass_gives_way_to_a_request_releases_its_claims(start_daemon, store_engine):
    d = start_daemon()
    (ea, pa), (eb, pb) = store_engine(d), store_engine(d)
    ids = list(range(7, 50))
    key = pa.key(ids, 16)
    from engine.connector.coldshare import ColdSegment

    pa.store.share.publish("req", [ColdSegment(key, tuple(ids), 16)])
    pa.store.share.settle()
    for _ in range(20):  # until the helper has seen the offer and started (then stopped) its pass
        time.sleep(0.02)
        if eb.help_idle(should_stop=lambda: True) == 0 and pb.store.metrics.get("idle_stopped"):
            break
    assert pb.store.metrics.get("idle_stopped") == 1 and pb.store.metrics.get("cold_helped") == 0
    with d.client() as kv:
        assert not kv.lookup([key])[0].hit  # nothing stored
    claim = pa.store.claim(key)  # and nothing left claimed: the requester gets it to compute
    assert claim.owned
    pa.store.drop_claim(claim)
