"""bench_tiered's exact-repeat comparison (issue 23: PIC's exact-prefix hit must cost
what prefix caching's does): the two methods' timed exact repeats do the same work on
the request thread, start on a quiesced engine, alternate, and record what else used
the host. A real kvstore daemon and a tiny engine (CPU, fp32)."""
from __future__ import annotations

import gc
import threading
import time
from collections import Counter

import pytest
import torch

from tools.servebench import tiered
from tools.servebench.host_usage import HostUsage, mean_host
from tools.servebench.requests import BenchRequest, twin


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_torch_thread):
    """Every test of this module on one torch thread (tests/conftest.py)."""


def _repeat() -> BenchRequest:
    from tools.servebench import requests

    return requests.load("repeat", 1, 7, "tiny", 450, "2-3")[0]


def _timed_repeat(h, method: str, req: BenchRequest) -> dict:
    """`method`'s exact repeat of `req` after its twin, as ttft_after_twin times it: the
    aten ops the request thread dispatched, the fused passes it ran (their arguments),
    the puts it queued and the Run."""
    import engine.pic.fused as fused
    from tools.count_prefill_ops import Counting

    h.forget(req)
    h.planner(method, fresh=True)
    h.run_alone(twin(req))
    calls = []
    real = fused.fused_prefill

    def spy(model, cache, seq, ids, items, **kw):
        calls.append({"items": [(it.start, it.end) for it in items], "checkpoints": len(kw.get("checkpoints") or []),
                      "stages": kw.get("stages"), "kernel": kw.get("kernel"), "chain": kw.get("chain"),
                      "captures": kw.get("captures"), "before_layer": kw.get("before_layer")})
        return real(model, cache, seq, ids, items, **kw)

    metrics = h.store.metrics
    queued0 = metrics.snapshot()["puts_queued"]
    counting = Counting()
    fused.fused_prefill = spy
    # the idle work run_alone drains before and after the request is not the request's
    # (PIC puts a reused exact prefix there): counted as one call, its ops not
    idle_puts = [0]
    drain = counting.wrap("drain_idle", h.drain_idle)

    def drain_idle():
        before = metrics.snapshot()["puts_queued"]
        try:
            return drain()
        finally:
            idle_puts[0] += metrics.snapshot()["puts_queued"] - before

    h.drain_idle = drain_idle
    try:
        with counting.mode:
            run = h.run_alone(req)
    finally:
        fused.fused_prefill = real
        del h.drain_idle
    return {"ops": Counter(counting.ops), "fused": calls, "run": run,
            "puts_queued": metrics.snapshot()["puts_queued"] - queued0 - idle_puts[0], "idle_puts": idle_puts[0]}


def test_an_exact_repeat_does_the_same_work_for_prefix_caching_and_pic(harness):
    req = _repeat()
    got = {m: _timed_repeat(harness, m, req) for m in ("prefix", "pic")}
    prefix, pic = got["prefix"], got["pic"]
    for g in (prefix, pic):  # both restore this engine's exact prefix and compute the rest
        assert g["run"].store.get("store_prefix_source") == "engine"
        assert g["run"].reused_tokens > 0.8 * g["run"].prompt_tokens
    assert prefix["run"].reused_tokens == pic["run"].reused_tokens
    # the same aten ops on the request thread: restore and forward op for op
    assert sum(pic["ops"].values()) > 100 and pic["ops"] == prefix["ops"]
    # one fused pass each, with the same items and the engine's prefill stages (its graphs on CUDA)
    assert len(prefix["fused"]) == len(pic["fused"]) == 1
    runner = harness.engine.runner
    for call in (prefix["fused"][0], pic["fused"][0]):
        assert call["stages"] is getattr(runner, "prefill_stages", None)
        assert call["checkpoints"] == 0 and call["captures"] is None and call["before_layer"] is None
    assert pic["fused"][0]["items"] == prefix["fused"][0]["items"]
    assert (pic["fused"][0]["kernel"], pic["fused"][0]["chain"]) == (prefix["fused"][0]["kernel"],
                                                                     prefix["fused"][0]["chain"])
    # nothing for the daemon on PIC's request path: no RPC, no put; its exact prefix, now
    # reused, is put once the engine is idle again (exact_prefix_store="reused")
    assert pic["run"].rpcs == {} and pic["puts_queued"] == 0 and pic["idle_puts"] == 1


def test_run_alone_drains_queued_idle_work_before_the_request_arrives(harness):
    h = harness
    req = _repeat()
    planner = h.planner("pic")
    ids, segs = h.engine._tokenize(twin(req).as_prompt(), None)
    from engine.pic.prefix import prefix_bounds

    h.forget(req)
    assert planner.exact.queue(ids, prefix_bounds(segs))  # an idle exact-prefix pass left queued
    seen = []
    real = h.engine.add_request

    def add_request(*a, **kw):
        seen.append(planner.exact.pending)
        return real(*a, **kw)

    h.engine.add_request = add_request
    try:
        run = h.run_alone(req)
    finally:
        del h.engine.add_request
    assert seen == [False]  # computed before the request arrived, not overlapping it
    assert run.store.get("store_prefix_source") == "engine"  # and the request restored it
    assert run.host["wall_ms"] >= run.ttft_ms * 0.5 and "kvstore-daemon" in run.host["processes_cpu_ms"]


class _OrderHarness:
    """Records the calls ttft_after_twin makes (no engine)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.method = None

    def planner(self, method, fresh=False):
        self.method = method

    def forget(self, req):
        self.calls.append(("forget", req.id))

    def run_alone(self, req):
        from tools.servebench.harness import Run

        self.calls.append((self.method, req.id))
        return Run(req.id, 1.0, 10, 5, 1, 0)


def test_the_caching_methods_alternate_request_by_request_each_after_its_own_twin():
    reqs = [BenchRequest(f"r{i}", "rag", ({"text": "a", "cache": True}, {"text": "q", "cache": False}))
            for i in range(3)]
    h = _OrderHarness()
    out = tiered.ttft_after_twin(h, reqs)
    runs = [c for c in h.calls if c[0] in ("prefix", "pic")]
    warm = runs[len(reqs) * 2:]  # after the cold runs: (twin, timed) per method and request
    assert [m for m, rid in warm if not rid.endswith("-twin")] == ["prefix", "pic", "pic", "prefix", "prefix", "pic"]
    for i in range(0, len(warm), 2):
        assert warm[i][0] == warm[i + 1][0] and warm[i][1] == warm[i + 1][1] + "-twin"
    assert [m for m, _ in runs[:len(reqs) * 2]] == ["prefix", "pic", "pic", "prefix", "prefix", "pic"]
    assert out["prefix"]["warm"]["n"] == out["pic"]["warm"]["n"] == 3


def test_host_usage_names_a_thread_that_was_busy_during_the_request_and_counts_collections():
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            sum(range(1000))

    t = threading.Thread(target=spin, name="busy-helper")
    usage = HostUsage().start()
    t.start()
    time.sleep(0.3)
    gc.collect()
    got = usage.stop()  # the helper still runs: its thread is seen
    stop.set()
    t.join()
    assert got["other_threads_cpu_ms"].get("busy-helper", 0.0) > 50.0
    assert got["gc_collections"] >= 1 and got["gc_ms"] > 0.0
    assert 0.0 <= got["main_cpu_ms"] <= got["wall_ms"] + 1.0
    m = mean_host([got, {**got, "other_threads_cpu_ms": {}}])
    assert m["other_threads_cpu_ms"]["busy-helper"] == pytest.approx(got["other_threads_cpu_ms"]["busy-helper"] / 2,
                                                                     abs=1e-3)
