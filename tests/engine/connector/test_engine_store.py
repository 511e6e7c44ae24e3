"""Engines (tiny presets, CPU) doing PIC through a REAL kvstore daemon: a later request
hits what an earlier one computed and generates exactly what in-process PIC generates;
two engines needing the same cold segment compute it once (the other waits through the
daemon); a killed daemon costs only recomputation and a restarted one is found again
with its NVMe tier; a frozen (slow) daemon is bypassed within the timeouts; a put that
fails on capacity does not fail its request; the connector shows in /metrics."""
from __future__ import annotations

import os
import signal
import threading
import time

import engine.pic.planner as pic_planner  # the alone passes of every PIC planner run through it
from connector_testlib import GREEDY, prompt, run_one, wait_until
from engine.server.app import METRICS_KEY, build_app


def reference(memory_engine, prompts):
    """Token ids in-process PIC generates for `prompts`, run in order on one engine."""
    engine, planner = memory_engine()
    return [run_one(engine, planner, p, f"ref-{i}")[0].token_ids for i, p in enumerate(prompts)]


def test_a_later_request_hits_segments_an_earlier_one_computed_and_matches_in_process_pic(
        start_daemon, store_engine, memory_engine):
    d = start_daemon()
    prompts = [prompt((0, 1, 2)), prompt((2, 0, 1))]
    want = reference(memory_engine, prompts)
    engine, planner = store_engine(d)
    out1, rep1, st1 = run_one(engine, planner, prompts[0], "r1")
    assert rep1.miss_segments == 3 and st1.computed == 3 and st1.claimed == 3
    assert planner.store.flush()
    out2, rep2, st2 = run_one(engine, planner, prompts[1], "r2")
    assert [out1.token_ids, out2.token_ids] == want
    assert rep2.hit_segments == 3 and rep2.miss_segments == 0 and rep2.reused_tokens > 0
    assert st2.hits_by_tier["cpu"] == 3 and st2.computed == 0 and not st2.fallback
    assert st2.load_ms > 0 and st2.as_dict()["store_load_overlap"] is not None
    snap = planner.store.metrics.snapshot()
    assert snap["puts_stored"] == 3 and snap["lookup_rpcs"] >= 2 and snap["store_available"] == 1
    with d.client() as kv:
        assert kv.stats()["leases"] == 0  # every lease released once prefill was done
    text = build_app(engine)[METRICS_KEY].render().decode()
    assert "kvengine_store_available 1.0" in text
    assert 'kvengine_store_segment_loads_total{tier="cpu"} 3.0' in text


def test_two_engines_needing_the_same_cold_segment_compute_it_once(start_daemon, store_engine, monkeypatch):
    d = start_daemon()
    (ea, pa), (eb, pb) = store_engine(d), store_engine(d)
    computing, go = threading.Event(), threading.Event()
    real = pic_planner.AlonePass

    def slow_compute(*args, **kwargs):  # holds engine A inside its alone pass until B waits
        computing.set()
        assert go.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(pic_planner, "AlonePass", slow_compute)
    results = {}
    ta = threading.Thread(target=lambda: results.setdefault("a", run_one(ea, pa, prompt((1,)), "a")))
    ta.start()
    assert computing.wait(60)
    tb = threading.Thread(target=lambda: results.setdefault("b", run_one(eb, pb, prompt((1,)), "b")))
    tb.start()
    wait_until(lambda: pb.store.metrics.get("inflight_waits") == 1, what="engine B waiting")
    go.set()
    ta.join(60)
    tb.join(60)
    (out_a, _, st_a), (out_b, rep_b, st_b) = results["a"], results["b"]
    assert pa.store.metrics.get("computes") + pb.store.metrics.get("computes") == 1
    assert st_a.claimed == 1 and st_b.waited == 1 and st_b.computed == 0
    assert rep_b.hit_segments == 1 and rep_b.reused_tokens > 0
    assert out_a.token_ids == out_b.token_ids


def test_a_killed_daemon_costs_recomputation_and_a_restarted_one_is_found_with_its_nvme_tier(
        start_daemon, store_engine, memory_engine):
    d = start_daemon()
    prompts = [prompt((0, 1)), prompt((1, 0)), prompt((0, 1))]
    want = reference(memory_engine, prompts)
    engine, planner = store_engine(d, put_tier="nvme")
    connects = []
    planner.store.link.on_connect(lambda: connects.append(planner.store.link.generation))
    out1, _, _ = run_one(engine, planner, prompts[0], "r1")
    assert planner.store.flush()
    d.kill()
    out2, rep2, st2 = run_one(engine, planner, prompts[1], "r2")  # served by recomputation
    assert st2.fallback and rep2.miss_segments == 2
    snap = planner.store.metrics.snapshot()
    assert snap["store_available"] == 0 and snap["fallback_requests"] >= 1 and snap["disconnects"] == 1
    d.start()
    wait_until(lambda: planner.store.available, what="reconnect to the restarted daemon")
    out3, rep3, st3 = run_one(engine, planner, prompts[2], "r3")
    assert [out1.token_ids, out2.token_ids, out3.token_ids] == want
    assert rep3.hit_segments == 2 and st3.hits_by_tier["nvme"] == 2
    snap = planner.store.metrics.snapshot()
    assert snap["reconnects"] >= 1 and snap["daemon_restarts"] == 1 and snap["store_available"] == 1
    assert connects and connects[-1] == planner.store.link.generation  # told of the reconnection


def test_the_connector_maps_the_daemons_cpu_arena_ahead_of_the_first_load(start_daemon, store_engine):
    """On CUDA the connector maps and pins the CPU arena in the background on connecting
    (StoreSignatureCache.map_arenas_soon); the mapping is the process's, shared with
    every other client (kvstore.client.regions.mapped_arenas)."""
    from kvstore.client.regions import mapped_arenas

    d = start_daemon()
    _, planner = store_engine(d)
    with d.client() as kv:
        (path,) = [t["path"] for t in kv.stats()["tiers"] if t["name"] == "cpu"]
    assert path not in mapped_arenas()  # nothing has read the arena yet
    planner.store.cache.map_arenas_soon()
    wait_until(lambda: path in mapped_arenas(), what="the arena mapped by the background thread")
    arena = mapped_arenas()[path]
    assert arena.nbytes > 0 and not arena.pinned  # no CUDA here: mapped, not pinned
    with d.client() as kv:  # another client of this process reads through the same mapping
        kv.put(b"arena/shared", b"y" * 4096, tier="cpu")
        with kv.get(b"arena/shared") as view:
            assert bytes(view.tensor().numpy()[:2]) == b"yy"
            now = mapped_arenas()[path]
            assert now.mapping_id == arena.mapping_id and now.users >= 2


def test_a_frozen_daemon_is_bypassed_within_the_timeouts_then_used_again(start_daemon, store_engine):
    d = start_daemon()
    engine, planner = store_engine(d, rpc_timeout_s=0.5, load_timeout_s=2.0)
    run_one(engine, planner, prompt((2,)), "warm")
    assert planner.store.flush()
    os.kill(d.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        _, rep, st = run_one(engine, planner, prompt((2, 0)), "frozen")
        assert time.monotonic() - t0 < 10.0
        assert rep.hit_segments == 0 and not planner.store.available
    finally:
        os.kill(d.pid, signal.SIGCONT)
    wait_until(lambda: planner.store.available, what="the daemon answering again")
    _, rep, _ = run_one(engine, planner, prompt((2,)), "thawed")
    assert rep.hit_segments == 1


def test_a_put_failing_on_capacity_does_not_fail_the_request(start_daemon, store_engine, memory_engine):
    d = start_daemon(cpu_capacity="1MiB", nvme_capacity="0")
    want = reference(memory_engine, [prompt((0, 1, 2))])
    engine, planner = store_engine(d, put_tier="cpu")
    with d.client() as kv:
        kv.put(b"ballast", bytes((1 << 20) - 128 * 1024), tier="cpu")
        with kv.get(b"ballast"):  # leased: nothing can be evicted to make room
            out, rep, _ = run_one(engine, planner, prompt((0, 1, 2)), "r1")
            assert planner.store.flush()
    assert out.finish_reason == "length" and out.error is None and [out.token_ids] == want
    assert planner.store.metrics.snapshot()["puts_failed"]["capacity"] >= 1


def test_requests_admitted_together_share_loads_and_match_in_process_pic(start_daemon, store_engine, memory_engine):
    d = start_daemon()
    prompts = [prompt((0, 1)), prompt((1, 0, 2)), prompt((2, 1), "Q: value of k1aa?\nA: ")]
    ref_engine, ref_planner = memory_engine()
    want = [run_one(ref_engine, ref_planner, prompts[0], "ref")[0].token_ids]
    want += [o.token_ids for o in ref_engine.generate(prompts[1:], GREEDY)]
    engine, planner = store_engine(d)
    first, _, _ = run_one(engine, planner, prompts[0], "first")
    assert planner.store.flush()
    outs = engine.generate(prompts[1:], GREEDY)  # admitted in one step: loads overlap the other's prefill
    assert [first.token_ids] + [o.token_ids for o in outs] == want
    reports = [planner.take_store_report(o.request_id) for o in outs]
    # doc 2 is computed once: by the second request; the third, admitted with it, gets it
    # from the daemon (waiting on the claim, or finding it stored already)
    assert [sum(r.hits_by_tier.values()) for r in reports] == [2, 2]
    assert planner.store.metrics.get("computes") == 3
    assert planner.store.metrics.snapshot()["overlap"] is not None
    with d.client() as kv:
        assert kv.stats()["leases"] == 0


def test_cold_fallback_serves_by_full_recompute_then_idle_help_stores_the_segments(
        start_daemon, store_engine, memory_engine):
    from engine.pic.config import PicConfig

    d = start_daemon()
    p = prompt((0, 1, 2))
    full_engine, full_planner = memory_engine(pic=PicConfig(method="full"))
    want = run_one(full_engine, full_planner, p, "full")[0].token_ids
    engine, planner = store_engine(d, pic=PicConfig(cold_full_fraction=0.5, miss_path="alone"))
    out1, rep1, st1 = run_one(engine, planner, p, "r1")
    assert out1.token_ids == want  # served by full recompute: the same tokens
    assert rep1.cold_full and rep1.deferred_segments == 3 and rep1.reused_tokens == 0 and st1.computed == 0
    keys = list(planner.deferred)
    with d.client() as kv:
        assert not any(e.hit for e in kv.lookup(keys))
    # an idle pass gives way to a request: kept half-way (resumed later), claims released
    asked = []
    assert engine.help_idle(should_stop=lambda: asked.append(1) or True) == 0 and asked
    assert planner.idle_pass is not None and not planner.deferred and planner.idle_stopped == 1
    assert [c.job.key for c in planner.idle_pass[0]] == keys
    assert planner.store.metrics.snapshot()["idle_stopped"] == 1
    with d.client() as kv:  # nothing stored, and no claim left behind: another client may claim each key
        assert not any(e.hit for e in kv.lookup(keys))
    assert engine.idle_poll_s is not None and engine.help_idle() == 3 and planner.idle_pass is None
    assert planner.store.flush()
    with d.client() as kv:
        assert all(e.hit for e in kv.lookup(keys))
    assert planner.store.metrics.snapshot()["deferred_computed"] == 3
    out2, rep2, st2 = run_one(engine, planner, prompt((2, 0, 1)), "r2")
    assert not rep2.cold_full and rep2.hit_segments == 3 and st2.hits_by_tier["cpu"] == 3


def test_the_device_cache_serves_repeated_segments_without_the_daemon_and_matches(
        start_daemon, store_engine, memory_engine):
    d = start_daemon()
    prompts = [prompt((0, 1, 2)), prompt((2, 0, 1))]
    want = reference(memory_engine, prompts)
    engine, planner = store_engine(d, device_cache_bytes=64 << 20)
    out1, rep1, st1 = run_one(engine, planner, prompts[0], "r1")
    assert st1.computed == 3 and st1.near_hits == 0
    assert planner.store.flush()
    rpcs = planner.store.metrics.snapshot()["lookup_rpcs"]
    out2, rep2, st2 = run_one(engine, planner, prompts[1], "r2")
    assert [out1.token_ids, out2.token_ids] == want
    assert rep2.hit_segments == 3 and rep2.reused_tokens > 0 and st2.near_hits == 3
    assert sum(st2.hits_by_tier.values()) == 0 and st2.batch is None  # nothing asked of the daemon
    snap = planner.store.metrics.snapshot()
    assert snap["near_hits"] == 3 and snap["lookup_rpcs"] == rpcs
    with d.client() as kv:  # the daemon still got every segment (other engines share them)
        assert len(kv.list(fingerprint=engine.loaded_model.fingerprint, limit=100)) == 3


def test_the_device_cache_is_off_on_the_cpu_by_default_and_its_size_is_checked(start_daemon, store_engine):
    import pytest

    from engine.connector.config import StoreConnectorConfig
    from engine.connector.errors import ConnectorConfigError

    d = start_daemon()
    _, planner = store_engine(d)
    assert planner.store.near.capacity_bytes == 0 and planner.store.near_get(b"x") is None
    with pytest.raises(ConnectorConfigError, match="device_cache_bytes"):
        StoreConnectorConfig(device_cache_bytes=-1)


def test_misses_in_context_are_served_now_and_stored_by_idle_help(start_daemon, store_engine, memory_engine):
    """miss_path="context": uncached segments are computed inside the request's pass (an
    all-cold request generates what full recompute does), nothing is claimed or put on the
    request's path; idle help computes them alone and stores them; the next request hits."""
    from engine.pic.config import PicConfig

    d = start_daemon()
    p = prompt((0, 1, 2))
    full_engine, full_planner = memory_engine(pic=PicConfig(method="full"))
    want = run_one(full_engine, full_planner, p, "full")[0].token_ids
    engine, planner = store_engine(d, pic=PicConfig(miss_path="context"))
    out1, rep1, st1 = run_one(engine, planner, p, "r1")
    assert out1.token_ids == want
    assert rep1.miss_segments == 3 and rep1.deferred_segments == 3 and rep1.reused_tokens == 0
    assert not rep1.cold_full and st1.computed == 0 and st1.claimed == 0
    keys = list(planner.deferred)
    with d.client() as kv:
        assert len(keys) == 3 and not any(e.hit for e in kv.lookup(keys))
    assert engine.idle_poll_s is not None and engine.help_idle() == 3
    assert planner.store.flush()
    with d.client() as kv:
        assert all(e.hit for e in kv.lookup(keys))
    out2, rep2, st2 = run_one(engine, planner, prompt((2, 0, 1)), "r2")
    assert rep2.hit_segments == 3 and rep2.miss_segments == 0 and st2.hits_by_tier["cpu"] == 3
    assert out2.token_ids == reference(memory_engine, [p, prompt((2, 0, 1))])[1]


def test_context_signatures_are_stored_through_the_daemon_and_hit_by_another_engine(
        start_daemon, store_engine, memory_engine):
    """miss_signatures="context": the misses' signatures come from the request's own pass
    and are put through the daemon once its first token is out (the engine's next idle
    call or plan; no idle alone pass); a second
    engine on the same daemon hits every segment, and generates what in-process PIC with
    the same option generates."""
    from engine.pic.config import PicConfig

    # no exact prefixes: the idle work here is keeping the captured signatures
    ctx = PicConfig(miss_path="context", miss_signatures="context", exact_prefix=False)
    d = start_daemon()
    prompts = [prompt((0, 1, 2)), prompt((2, 0, 1))]
    ref_engine, ref_planner = memory_engine(pic=ctx)
    want = [run_one(ref_engine, ref_planner, p, f"ref-{i}")[0].token_ids for i, p in enumerate(prompts)]
    a, pa = store_engine(d, pic=ctx)
    out1, rep1, st1 = run_one(a, pa, prompts[0], "a1")
    assert rep1.miss_segments == 3 and rep1.captured_segments == 3 and rep1.deferred_segments == 0
    assert st1.computed == 0 and not pa.deferred
    assert a.idle_poll_s is not None and a.help_idle() == 3 and a.help_idle() == 0  # kept once idle; no alone pass
    assert pa.store.flush() and pa.store.metrics.snapshot()["captured"] == 3
    b, pb = store_engine(d, pic=ctx)
    out2, rep2, st2 = run_one(b, pb, prompts[1], "b1")
    assert rep2.hit_segments == 3 and rep2.miss_segments == 0 and st2.hits_by_tier["cpu"] == 3
    assert [out1.token_ids, out2.token_ids] == want
    with d.client() as kv:
        assert kv.stats()["leases"] == 0


def test_a_bounded_device_cache_leaves_the_rest_of_the_working_set_to_the_daemon(start_daemon, store_engine):
    """StoreConnectorConfig.device_cache_bytes / device_cache_fraction: the engine's private
    cache holds what fits its bound; every other hit is served by the daemon's tiers."""
    import pytest
    import torch

    from engine.connector.config import StoreConnectorConfig, device_cache_capacity, free_memory_bytes
    from engine.connector.errors import ConnectorConfigError
    from engine.pic.config import PicConfig

    no_prefix = PicConfig(exact_prefix=False, miss_path="alone")
    roomy_engine, roomy = store_engine(start_daemon("roomy"), pic=no_prefix, device_cache_bytes=64 << 20)
    run_one(roomy_engine, roomy, prompt((0, 1, 2)), "r1")
    sizes = sorted(sig.nbytes() for sig, _ in roomy.store.near._entries.values())
    assert len(sizes) == 3
    _, _, st = run_one(roomy_engine, roomy, prompt((2, 0, 1)), "r2")
    assert (st.near_hits, sum(st.hits_by_tier.values())) == (3, 0)  # everything fits: all private
    # room for one signature (each computed here, kept privately as far as the bound allows):
    # the daemon serves the other two hits
    engine, planner = store_engine(start_daemon("bounded"), pic=no_prefix,
                                   device_cache_bytes=sizes[-1] + sizes[0] // 2)
    _, _, st1 = run_one(engine, planner, prompt((0, 1, 2)), "b1")
    assert st1.computed == 3 and len(planner.store.near._entries) == 1
    assert planner.store.flush()
    _, _, st2 = run_one(engine, planner, prompt((2, 0, 1)), "b2")
    assert st2.near_hits == 1 and st2.hits_by_tier["cpu"] == 2
    snap = planner.store.metrics.snapshot()
    assert snap["near_hits"] == 1 and snap["loads"]["cpu"] == 2
    # a fraction of the free memory (the default on CUDA; given here on the CPU)
    f = 1e-4
    cap = device_cache_capacity(StoreConnectorConfig(device_cache_fraction=f), torch.device("cpu"))
    assert 0 < cap and abs(cap - f * free_memory_bytes(torch.device("cpu"))) < 0.2 * cap
    assert device_cache_capacity(StoreConnectorConfig(), torch.device("cpu")) == 0
    with pytest.raises(ConnectorConfigError, match="device_cache_fraction"):
        StoreConnectorConfig(device_cache_fraction=1.5)
