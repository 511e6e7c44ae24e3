"""The QPS search's trials (issue 23: QPS at the SLO measured honestly): a trial must last
long enough for an overloaded queue to show, and a trial sure to fail ends early.

A simulated single-server queue (deterministic service time, Poisson arrivals) shows the
flaw of fixed short trials (a burst of a few requests passes any rate once they fit in the
SLO back to back) and that trials of `trial_s` seconds of arrivals find the queue's
capacity; `over_slo_certain` is checked against numpy's percentile; on a real tiny engine
over a real daemon, a trial cut short aborts its requests and leaves the engine serving."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from tools.servebench import qps_search
from tools.servebench.harness import over_slo_certain, trial_size
from tools.servebench.requests import BenchRequest


class QueueHarness:
    """One server, `service_s` per request, first come first served: each trial's TTFTs are
    the queue's own (arrival to end of service), with run_poisson's early end on the SLO."""

    def __init__(self, service_s: float) -> None:
        self.service_s = service_s
        self.sizes: list[int] = []

    def planner(self, method, fresh=False):
        pass

    def run_alone(self, req):
        pass

    def run_poisson(self, reqs, rate, seed, info=None, slo_ms=None):
        rng = random.Random(seed)
        t, free, ttfts = 0.0, 0.0, []
        for _ in reqs:
            start = max(t, free)
            free = start + self.service_s
            ttfts.append((free - t) * 1e3)
            t += rng.expovariate(rate)
        self.sizes.append(len(reqs))
        over = sum(x > slo_ms for x in ttfts) if slo_ms is not None else 0
        if info is not None:
            info.update(hit_segments=0, miss_segments=0)
            if slo_ms is not None:
                info.update(aborted=over_slo_certain(over, len(reqs)), over_slo=over, sent=len(reqs))
        return ttfts


def _reqs(n: int) -> list[BenchRequest]:
    return [BenchRequest(f"r{i}", "rag", ({"text": f"doc {i}", "cache": True},)) for i in range(n)]


def test_short_fixed_trials_pass_any_rate_but_timed_trials_find_the_capacity():
    h = QueueHarness(service_s=0.1)  # capacity 10 requests/s
    slo = 500.0
    short = qps_search.qps_search(h, "pic", iter(_reqs(10_000)), per_trial=4, slo_ms=slo, start_rate=5.0, max_trials=6)
    assert short["sustainable_qps"] >= 80.0 and not short["converged"]  # 4 back to back fit in 500 ms at any rate
    for seed in range(6):  # Poisson arrivals: below capacity a queue's p99 can still pass 5 service times
        timed = qps_search.qps_search(h, "pic", iter(_reqs(10_000)), per_trial=4, slo_ms=slo, start_rate=5.0,
                                  max_trials=8, seed=7 * seed, trial_s=10 * slo / 1e3, max_per_trial=400)
        assert timed["converged"] and timed["trial_s"] == 5.0
        assert 5.0 <= timed["sustainable_qps"] <= 11.5  # at most a queue 15% over capacity (10 / s) passes
        assert all(t["requests"] == max(4, min(400, int(np.ceil(t["rate"] * 5.0)))) for t in timed["trials"])
        assert any(t["aborted"] for t in timed["trials"]) and not any(t["ok"] and t["aborted"] for t in timed["trials"])


def test_trial_size_and_the_pool_a_search_needs():
    assert trial_size(37.0, 6, None, None) == 6
    assert trial_size(37.0, 6, 2.0, 300) == 74
    assert trial_size(1.0, 6, 2.0, 300) == 6 and trial_size(500.0, 6, 2.0, 300) == 300
    assert qps_search.pool_needed(3, 2, 6, 5, 300) == 3 * (2 + 6 + 5 * 300)
    with pytest.raises(ValueError, match="max_per_trial"):
        qps_search.qps_repeats(QueueHarness(0.1), _reqs(100), per_trial=4, slo_ms=500.0, start_rate=1.0, repeats=1,
                           trial_s=1.0, max_per_trial=2)
    with pytest.raises(ValueError, match="trial_s"):
        qps_search.qps_repeats(QueueHarness(0.1), _reqs(100), per_trial=4, slo_ms=500.0, start_rate=1.0, repeats=1,
                           trial_s=0.0, max_per_trial=8)


def test_qps_repeats_with_timed_trials_read_whole_trials_from_the_pool():
    h = QueueHarness(service_s=0.05)
    need = qps_search.pool_needed(2, 1, 4, 5, 60)
    out = qps_search.qps_repeats(h, _reqs(need), per_trial=4, slo_ms=300.0, start_rate=4.0, repeats=2, max_trials=5,
                             warmup=1, trial_s=3.0, max_per_trial=60)
    assert len(out["repeats"]) == 2
    for r in out["repeats"]:
        for m in ("prefix", "pic"):
            assert r[m]["trial_s"] == 3.0 and r[m]["sustainable_qps"] <= 20.0 * 1.2
    with pytest.raises(ValueError, match="pool holds"):
        qps_search.qps_repeats(h, _reqs(need - 1), per_trial=4, slo_ms=300.0, start_rate=4.0, repeats=2, max_trials=5,
                           warmup=1, trial_s=3.0, max_per_trial=60)


@pytest.mark.parametrize("seed", range(5))
def test_over_slo_certain_is_exactly_when_numpys_p99_is_above_the_slo_whatever_the_rest(seed):
    """The rest at 0 and the overs just above the SLO is the case most favourable to the
    SLO: certain <=> even then numpy's p99 is above it."""
    rng = random.Random(seed)
    slo = 100.0
    for n in [1, 2, 99, 100, 101, 201] + [rng.randint(1, 1000) for _ in range(300)]:
        for over in {0, 1, 2, n // 100, n // 100 + 1, n // 100 + 2, rng.randint(0, n), n}:
            if over > n:
                continue
            p99 = float(np.percentile([slo + 1e-3] * over + [0.0] * (n - over), 99))
            assert over_slo_certain(over, n) == (p99 > slo), (n, over, p99)


@pytest.fixture
def harness(tmp_path, one_torch_thread):
    """The qps phase's harness (tools.servebench.tiered_phases.make_harness) on
    qwen3next-tiny over a real daemon."""
    import argparse

    from engine.builder import EngineConfig, build_engine
    from kvstore.testing import DaemonProcess
    from tools.bench_serving import engine_options
    from tools.servebench.tiered_phases import make_harness

    engine = build_engine("qwen3next-tiny", EngineConfig(**engine_options(None, torch.device("cpu"))))
    with DaemonProcess(tmp_path / "d", cpu_capacity="256MiB", nvme_capacity="256MiB", entry="kvstore.server") as d:
        h, _ = make_harness(argparse.Namespace(device_cache_fraction=None, pic_kernel="auto"), engine, str(d.socket),
                            sweep=False)
        try:
            yield h
        finally:
            h.close()


def test_a_trial_sure_to_fail_is_cut_short_and_the_engine_keeps_serving(harness):
    from tools.servebench import requests

    reqs = requests.load("rag", 14, 3, "tiny", 450, "2-3")
    harness.planner("pic")
    info: dict = {}
    ttfts = harness.run_poisson(reqs[:12], 1000.0, 0, info=info, slo_ms=0.001)  # no request can meet 1 us
    assert info["aborted"] and info["over_slo"] >= 2 and info["sent"] <= 12
    assert len(ttfts) < info["sent"] or info["sent"] < 12  # aborted requests gave no TTFT, or some were never sent
    assert not harness.engine.has_unfinished()
    info2: dict = {}
    ok = harness.run_poisson(reqs[12:], 1.0, 1, info=info2, slo_ms=60_000.0)  # the engine serves what comes next
    assert len(ok) == 2 and not info2["aborted"] and info2["over_slo"] == 0 and info2["sent"] == 2
    assert info2["idle_declined"] == 0  # idle_alone_passes="all": every miss is queued
    c = info2["connector"]  # the store connector's counters over the run: its segments were looked for
    assert sum(c[k] for k in ("hits", "misses", "near_hits")) > 0 and c["put_bytes"] >= 0


def test_a_trial_records_where_its_time_went():
    info = {"prompt_tokens": [100, 300], "computed_tokens": [10, 90], "queue_ms": [1.0, 3.0, 5.0],
            "prefill_host_ms": [20.0, 40.0], "idle_ms": 7.5, "idle_calls": 2, "idle_declined": 4,
            "connector": {"put_bytes": 5}}
    got = qps_search._where_time_went(info)
    assert got == {"computed_share": 0.25, "queue_ms_p50": 3.0, "prefill_host_ms_p50": 30.0, "idle_ms": 7.5,
                   "idle_calls": 2, "idle_declined": 4, "connector": {"put_bytes": 5}}
    assert qps_search._where_time_went({}) == {}


def test_bench_serving_search_with_timed_trials_finds_the_queue_capacity_where_fixed_trials_do_not():
    from tools.servebench import measure

    h = QueueHarness(service_s=0.1)  # capacity 10 / s
    fixed = measure.qps_at_slo(h, "pic", _reqs(4 + 6 * 8), warmup=4, per_trial=8, trials=6, slo_ms=900.0,
                               start_rate=5.0, seed=3)
    assert fixed["sustainable_qps"] >= 80.0  # 8 back to back take 800 ms: every rate passes
    timed = measure.qps_at_slo(h, "pic", _reqs(4 + 6 * 400), warmup=4, per_trial=8, trials=6, slo_ms=900.0,
                               start_rate=5.0, seed=3, trial_s=9.0, max_per_trial=400)
    assert 5.0 <= timed["sustainable_qps"] <= 11.5 and timed["trial_s"] == 9.0
    assert [t["requests"] for t in timed["trials"]] == [max(8, min(400, int(np.ceil(t["rate"] * 9.0))))
                                                        for t in timed["trials"]]
