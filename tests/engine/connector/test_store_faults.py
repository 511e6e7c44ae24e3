"""A daemon that dies, freezes (SIGSTOP) or restarts in the middle of a request (after
the request's Lookup found its segments, before its Get) costs recomputation, never a
failed or wrong request: the output equals in-process PIC, the frozen daemon's calls time
out within the connector's bounds, and the daemon is used again once it is back."""
from __future__ import annotations

import os
import signal
import sys
import time

from connector_testlib import prompt, run_one, wait_until
from kvstore.testing import record_figures

RPC_TIMEOUT_S, LOAD_TIMEOUT_S = 0.5, 2.0
# the frozen request: one timed-out call, the load wait, and the tiny model's recompute
FROZEN_BOUND_S = RPC_TIMEOUT_S + LOAD_TIMEOUT_S + 12.0
FIGURES = {"requests": 0, "matched": 0, "mismatched": 0}


def _fault_before_get(planner, fault):
    """Run `fault()` once, when the request's loader is about to Get what Lookup found."""
    link = planner.store.link
    real = link.call
    fired = []

    def call(name, fn, *args, **kwargs):
        # the loader's Get only: an exact-prefix checkpoint Get (engine.connector.prefix_store)
        # can come after the loader's, and a fault there would miss the request's loads
        if name == "get" and not fired and sys._getframe(1).f_code.co_filename.endswith("loader.py"):
            fired.append(time.monotonic())
            fault()
        return real(name, fn, *args, **kwargs)

    link.call = call
    return fired


def _check(out, want) -> None:
    FIGURES["requests"] += 1
    FIGURES["matched" if out.token_ids == want else "mismatched"] += 1
    record_figures("test_store_faults", operations=FIGURES["requests"], objects_verified=FIGURES["matched"],
                   losses=FIGURES["mismatched"])
    assert out.error is None and out.finish_reason == "length"
    assert out.token_ids == want


def _warm(memory_engine, store_engine, d, **overrides):
    prompts = [prompt((0, 1)), prompt((1, 0)), prompt((0, 1))]
    ref_engine, ref_planner = memory_engine()
    want = [run_one(ref_engine, ref_planner, p, f"ref-{i}")[0].token_ids for i, p in enumerate(prompts)]
    engine, planner = store_engine(d, put_tier="nvme", **overrides)
    out, _, _ = run_one(engine, planner, prompts[0], "warm")
    _check(out, want[0])
    assert planner.store.flush()
    return engine, planner, prompts, want


def test_frozen_daemon_costs_recompute_within_the_store_timeout(start_daemon, store_engine, memory_engine):
    d = start_daemon()
    engine, planner, prompts, want = _warm(memory_engine, store_engine, d, rpc_timeout_s=RPC_TIMEOUT_S,
                                           load_timeout_s=LOAD_TIMEOUT_S)
    fired = _fault_before_get(planner, lambda: os.kill(d.pid, signal.SIGSTOP))
    try:
        t0 = time.monotonic()
        out, rep, st = run_one(engine, planner, prompts[1], "frozen")
        took = time.monotonic() - t0
        assert fired, "the fault must hit mid-request"
        _check(out, want[1])
        assert took < FROZEN_BOUND_S, took
        assert rep.hit_segments == 0 and st.fallback  # looked up as hits, served by recompute
        assert planner.store.metrics.snapshot()["fallback_requests"] >= 1
    finally:
        os.kill(d.pid, signal.SIGCONT)
    wait_until(lambda: planner.store.available, timeout=30, what="the thawed daemon answering")
    out, rep, _ = run_one(engine, planner, prompts[2], "thawed")
    _check(out, want[2])
    assert rep.hit_segments == 2


def test_daemon_killed_mid_request_costs_recompute_then_hits_after_restart(start_daemon, store_engine,
                                                                           memory_engine):
    d = start_daemon()
    engine, planner, prompts, want = _warm(memory_engine, store_engine, d)
    fired = _fault_before_get(planner, d.kill)
    out, rep, st = run_one(engine, planner, prompts[1], "killed")
    assert fired
    _check(out, want[1])
    assert rep.hit_segments == 0 and st.fallback
    d.start()
    wait_until(lambda: planner.store.available, timeout=30, what="reconnect to the restarted daemon")
    out, rep, st = run_one(engine, planner, prompts[2], "after")
    _check(out, want[2])
    assert rep.hit_segments == 2 and st.hits_by_tier["nvme"] == 2  # the NVMe tier survived the kill


def test_daemon_restarted_mid_request_never_fails_or_corrupts_it(start_daemon, store_engine, memory_engine):
    d = start_daemon()
    engine, planner, prompts, want = _warm(memory_engine, store_engine, d)
    fired = _fault_before_get(planner, d.restart)  # SIGTERM, then a new daemon on the same directory
    out, _, _ = run_one(engine, planner, prompts[1], "restarted")
    assert fired
    _check(out, want[1])  # from the restarted daemon's NVMe tier or recomputed: the same tokens
    wait_until(lambda: planner.store.available, timeout=30, what="reconnect to the restarted daemon")
    out, rep, _ = run_one(engine, planner, prompts[2], "after")
    _check(out, want[2])
    assert rep.hit_segments == 2
