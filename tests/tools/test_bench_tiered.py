"""tools/bench_tiered.py: the QPS bisection on a fake engine (and its stop between
trials), phase limits, hits by source and the sources of the CPU -> GPU fraction on fixed
inputs, the per-request TTFT breakdown, the kernel-launch recorder, and --quick end to end
on the CPU in the split form a GPU run uses (serve and pcie, with the untimed warm-up
checked to cover every kernel specialisation a timed request launches; then qps, which
measures its own SLO base, and the sweep in a daemon of its own, kept in the same file by
--merge; a phase stopped by its limit; runs joined by --merge RUN...), with the summary
keys issue 23 names."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools.servebench import qps_search, tiered
from tools.servebench.requests import BenchRequest

REPO = Path(__file__).resolve().parents[2]


class FakeHarness:
    """run_poisson answers a p99 TTFT that grows with the rate: the SLO holds below `limit`."""

    def __init__(self, limit: float) -> None:
        self.limit = limit
        self.rates: list[float] = []
        self.planners: list[str] = []
        self.alone = 0

    def planner(self, method, fresh=False):
        self.planners.append(method)

    def run_alone(self, req):
        self.alone += 1

    def run_poisson(self, reqs, rate, seed, info=None, slo_ms=None):
        self.rates.append(rate)
        ttft = 100.0 if rate <= self.limit else 1000.0
        if info is not None:
            info.update(hit_segments=len(reqs), miss_segments=0)
        return [ttft] * len(reqs)


def _reqs(n: int) -> list[BenchRequest]:
    return [BenchRequest(f"r{i}", "rag", ({"text": f"doc {i}", "cache": True},)) for i in range(n)]


@pytest.mark.parametrize("limit", [0.3, 3.7, 41.0])
def test_qps_search_brackets_then_bisects_to_within_the_tolerance(limit):
    h = FakeHarness(limit)
    got = qps_search.qps_search(h, "pic", iter(_reqs(200)), per_trial=2, slo_ms=500.0, start_rate=2.0,
                            tolerance=0.1, max_trials=30)
    assert got["converged"] and got["sustainable_qps"] <= limit < got["lowest_failed_qps"]
    assert (got["lowest_failed_qps"] - got["sustainable_qps"]) / got["lowest_failed_qps"] <= 0.1
    assert [t["rate"] for t in got["trials"]] == h.rates
    # bisection, not a ladder: after the bracket every rate lies strictly inside it
    ok = [t["rate"] for t in got["trials"] if t["ok"]]
    bad = [t["rate"] for t in got["trials"] if not t["ok"]]
    assert ok and bad and max(ok) == got["sustainable_qps"] and min(bad) == got["lowest_failed_qps"]


def test_qps_search_reports_an_unconverged_search_and_zero_when_nothing_passes():
    got = qps_search.qps_search(FakeHarness(0.0), "prefix", iter(_reqs(20)), per_trial=2, slo_ms=500.0,
                            start_rate=1.0, max_trials=4)
    assert got["sustainable_qps"] == 0.0 and not got["converged"] and len(got["trials"]) == 4


def test_qps_repeats_give_median_min_max_and_the_same_stream_to_both_methods():
    h = FakeHarness(5.0)
    out = qps_search.qps_repeats(h, _reqs(3 * (1 + 2 + 2 * 12)), per_trial=2, slo_ms=500.0, start_rate=1.0, repeats=3,
                             max_trials=12, warmup=1)
    assert len(out["repeats"]) == 3 and out["gain_vs_prefix"]["median"] == pytest.approx(1.0)
    for m in ("prefix", "pic"):
        assert out[m]["min"] <= out[m]["median"] <= out[m]["max"] <= 5.0
    assert h.alone == 6  # one warm-up request per search, then an untimed burst at the start rate
    assert h.rates.count(1.0) == 12  # per search: the burst and the first trial at the start rate
    with pytest.raises(ValueError, match="pool holds"):
        qps_search.qps_repeats(h, _reqs(5), per_trial=2, slo_ms=1.0, start_rate=1.0)


def test_qps_repeats_call_before_search_ahead_of_each_search_and_keep_its_answer():
    h = FakeHarness(5.0)
    calls = []

    def before(method, j):
        calls.append((method, j, h.alone))
        return {"emptied": f"{method}{j}"}

    out = qps_search.qps_repeats(h, _reqs(2 * (1 + 2 + 2 * 12)), per_trial=2, slo_ms=500.0, start_rate=1.0,
                                 repeats=2, max_trials=12, warmup=1, before_search=before)
    # before every search, ahead of its warm-up request
    assert calls == [("prefix", 0, 0), ("pic", 0, 1), ("prefix", 1, 2), ("pic", 1, 3)]
    assert [r[m]["before"] for r in out["repeats"] for m in ("prefix", "pic")] == [
        {"emptied": "prefix0"}, {"emptied": "pic0"}, {"emptied": "prefix1"}, {"emptied": "pic1"}]


def test_qps_repeats_start_each_method_from_its_own_rate():
    h = FakeHarness(40.0)
    out = qps_search.qps_repeats(h, _reqs(1 + 2 + 2 * 12), per_trial=2, slo_ms=500.0, start_rate=1.0, repeats=1,
                             max_trials=12, warmup=0, start_rates={"pic": 16.0})
    assert out["start_rates"] == {"prefix": 1.0, "pic": 16.0}
    trials = {m: [t["rate"] for t in out["repeats"][0][m]["trials"]] for m in ("prefix", "pic")}
    assert trials["prefix"][0] == 1.0 and trials["pic"][0] == 16.0
    assert out["repeats"][0]["pic"]["converged"] and len(trials["pic"]) < len(trials["prefix"])
    with pytest.raises(ValueError, match="start rates"):
        qps_search.qps_repeats(h, _reqs(27), per_trial=2, slo_ms=500.0, start_rate=1.0, repeats=1,
                           start_rates={"pic": float("nan")})


def test_qps_repeats_method_by_method_prepare_each_method_once_and_start_it_where_told():
    h = FakeHarness(8.0)
    seen = []

    def before(method):
        seen.append((method, len(h.planners)))
        return 4.0 if method == "pic" else None

    out = qps_search.qps_repeats(h, _reqs(2 * (0 + 2 + 2 * 12)), per_trial=2, slo_ms=500.0, start_rate=1.0,
                                 repeats=2, max_trials=12, warmup=0, before_method=before)
    assert out["order"] == "method" and len(out["repeats"]) == 2
    assert seen == [("prefix", 0), ("pic", 4)]  # before each method's first search, never between its repeats
    assert h.planners == ["prefix"] * 4 + ["pic"] * 4  # two per search (qps_repeats, qps_search)
    assert out["start_rates"] == {"prefix": 1.0, "pic": 4.0}
    assert all(r["pic"]["trials"][0]["rate"] == 4.0 and r["prefix"]["trials"][0]["rate"] == 1.0
               for r in out["repeats"])
    assert out["gain_vs_prefix"]["median"] == pytest.approx(1.0, rel=0.15)


def test_break_even_is_bytes_per_token_over_recompute_time_per_token():
    stored = {"gpu": {"objects": 1, "bytes": 4_000_000, "tokens": 1000},
              "cpu": {"objects": 1, "bytes": 4_000_000, "tokens": 1000},
              "nvme": {"objects": 0, "bytes": 0, "tokens": 0}}
    work = {"rag": {"full": {"warm": {"ttft_ms_mean": 200.0, "prompt_tokens_mean": 10_000}}}}
    be = tiered.break_even(stored, work)
    # 4000 B/token read vs 0.02 ms/token recomputed: 0.2 GB/s
    assert be["break_even_read_gb_per_s"] == pytest.approx(0.2) and be["signatures"] == 2


def _snap(copy_bytes: int, copy_ms: float) -> dict:
    return {"h2d_copy_bytes": copy_bytes, "h2d_copy_ms_total": copy_ms, "loads": {"cpu": 1},
            "load_bytes": {"cpu": copy_bytes}, "load_ms": {"cpu": copy_ms}, "h2d_issue_ms_total": copy_ms / 5,
            "h2d_copy_groups": 4 if copy_bytes else 0}


def test_cpu_to_gpu_fraction_names_the_phases_its_copies_came_from():
    from tools import bench_tiered

    pre = {"workloads": {}, "connector_pic": _snap(0, 0.0), "connector_sweep": _snap(1_000_000_000, 50.0),
           "cpu_tier_step": {"connector": _snap(2_000_000_000, 50.0)}}
    s = bench_tiered.summarize({"m": pre}, {"pinned_h2d_gbps": 50.0})
    # 3 GB in 100 ms of copies: 30 GB/s over 50 GB/s pinned
    assert s["cpu_to_gpu_fraction_of_pcie_serving"] == pytest.approx(0.6)
    c = s["cpu_to_gpu_serving"]
    assert c["source"] == ["m:sweep", "m:cpu_tier_step"]  # the serve phase copied nothing
    assert c["by_phase"]["m:cpu_tier_step"]["gb_per_s"] == pytest.approx(40.0)
    assert c["by_phase"]["m:serve"]["gb_per_s"] is None
    # the host time issuing the copies, next to their device time
    assert c["issue_ms"] == pytest.approx(20.0) and c["copy_groups"] == 8
    assert c["by_phase"]["m:sweep"]["issue_ms"] == pytest.approx(10.0)
    assert bench_tiered.summarize({"m": {"workloads": {}}}, {"pinned_h2d_gbps": 50.0})[
        "cpu_to_gpu_fraction_of_pcie_serving"] is None


def test_hits_by_source_separates_the_engine_device_cache_from_the_daemon_tiers():
    from tools.servebench.harness import Run

    runs = [Run("a", 1.0, 10, 5, 3, 0, store={"store_near_hits": 2, "store_hits_by_tier": {"gpu": 0, "cpu": 1,
                                                                                           "nvme": 0}}),
            Run("b", 1.0, 10, 5, 2, 0, store={"store_near_hits": 0, "store_hits_by_tier": {"gpu": 1, "cpu": 0,
                                                                                           "nvme": 1},
                                              "store_prefix_source": "store", "store_prefix_tier": "cpu"}),
            Run("c", 1.0, 10, 5, 0, 0, store={"store_prefix_source": "engine"})]
    h = tiered.hits_by_source(runs)
    assert h == {"engine_device_cache": 2, "gpu": 1, "cpu": 1, "nvme": 1,
                 "exact_prefixes": {"store_cpu": 1, "engine": 1}}
    assert tiered.format_hits(h) == "2/1/1/1 +prefix engine:1,store_cpu:1"


def test_warmup_covers_every_timed_workload_and_what_mix_is_made_of():
    from tools import bench_tiered
    from tools.servebench.requests import ALL_TASKS

    assert bench_tiered.warmup_tasks(["rag", "repeat"]) == ["rag", "repeat"]
    assert bench_tiered.warmup_tasks(["chat", "mix"]) == ["chat"] + [t for t in ALL_TASKS if t not in ("chat", "mix")]


def _run(args: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "tools/bench_tiered.py", *args], capture_output=True, text=True,
                          cwd=str(REPO), env=env, timeout=600)


def test_quick_split_run_merged_in_place_and_joined_writes_the_issue_summary(tmp_path):
    merged, stopped, joined = tmp_path / "serving-tiered.json", tmp_path / "stopped.json", tmp_path / "joined.json"
    # serve and pcie; PIC's kernels through Triton (the interpreter) so the warm-up check sees their launches
    p = _run(["--quick", "--phases", "serve,pcie", "--workloads", "rag,repeat,chat", "--n", "1", "--check-warmup",
              "--pic-kernel", "triton", "--json", str(merged)])
    assert p.returncode == 0, p.stderr[-3000:]
    first = json.loads(merged.read_text())["presets"]["qwen3next-tiny"]
    assert set(first["phases"]) == {"serve", "pcie"} and "qps" not in first
    # the CPU-tier step records the copies' issue time and groups beside their bytes (0 on the CPU)
    assert {"h2d_copy_bytes", "h2d_copy_ms_total", "h2d_issue_ms_total", "h2d_copy_groups"} \
        <= set(first["cpu_tier_step"]["connector"])
    # the next command keeps them (--merge alone: the phases of the --json file it does not measure)
    p = _run(["--quick", "--phases", "qps,sweep", "--qps-repeats", "2", "--qps-max-trials", "3", "--sweep", "0.5,4",
              "--json", str(merged), "--merge"])
    assert p.returncode == 0, p.stderr[-3000:]
    assert "tiered serving summary" in p.stdout
    run = json.loads(merged.read_text())
    pre = run["presets"]["qwen3next-tiny"]
    assert pre["warmup"]["workloads"] == ["rag"]  # the qps phase alone warms up on what it serves
    assert set(pre["phases"]) == {"serve", "pcie", "qps", "sweep"}
    assert all(ph["complete"] and ph["stopped"] is None and ph["wall_s"] > 0 for ph in pre["phases"].values())
    assert len(run["config"]) == 2 and "--merge" in run["command"]
    s = run["summary"]
    for key in ("ttft_vs_best_baseline_avg", "ttft_vs_best_baseline_min", "exact_repeat_pic_over_prefix_ttft",
                "qps_gain_vs_prefix_at_slo_median", "qps_repeats", "cpu_to_gpu_fraction_of_pcie_serving",
                "working_set_sweep"):
        assert key in s
    assert s["ttft_vs_best_baseline_avg"] > 0 and s["ttft_vs_best_baseline_min"] <= s["ttft_vs_best_baseline_avg"]
    assert s["exact_repeat_pic_over_prefix_ttft"] > 0
    assert len(s["qps_repeats"]) == 2 and all(r["prefix_qps"] >= 0 and r["pic_qps"] >= 0 for r in s["qps_repeats"])
    assert s["cpu_to_gpu_fraction_of_pcie_serving"] is None  # no PCIe on the CPU: recorded as such
    # prefix caching ran through the daemon: a cold request stored its checkpoint there
    w = pre["workloads"]["repeat"]
    assert w["prefix"]["warm"]["reuse_fraction"] > 0.5 and w["pic"]["warm"]["reuse_fraction"] > 0.5
    # each warm request's TTFT broken down, for both methods; the parts add up to the TTFT
    for task in ("repeat", "chat"):
        for m in ("prefix", "pic"):
            rows = pre["workloads"][task][m]["warm"]["breakdown"]
            assert len(rows) == 1 and rows[0]["synced"] is False
            r = rows[0]
            parts = sum(r[k] for k in ("lookup_ms", "restore_ms", "miss_ms", "forward_ms", "drain_ms", "other_ms"))
            assert parts == pytest.approx(r["ttft_ms"], abs=0.01) and r["forward_ms"] > 0
            assert r["prefix_source"] == "engine" and r["restore_ms"] > 0  # an exact prefix restored
    # the repeat restores its exact prefix from the engine's tree: no daemon call on its path
    assert pre["workloads"]["repeat"]["pic"]["warm"]["breakdown"][0]["store_rpcs"] == {}
    # warm = after the twin only: on rag (documents rotated) prefix caching reuses the system
    # prompt and nothing more, PIC splices every document from the store
    rag = pre["workloads"]["rag"]
    assert rag["prefix_reuse"] < 0.5 < rag["pic"]["warm"]["reuse_fraction"]
    assert rag["pic"]["warm"]["hit_segments"] > 0 and rag["pic"]["warm"]["miss_segments"] == 0
    assert rag["pic"]["cold"]["hit_segments"] == 0 and rag["prefix"]["cold"]["reuse_fraction"] == 0
    assert rag["pic"]["warm"]["breakdown"][0]["store_rpcs"].get("lookup", 0) >= 1
    # the first command's untimed warm-up: the serve procedure on throwaway requests of every
    # timed workload; every kernel specialisation a timed request launched, the warm-up launched first
    warm = first["warmup"]
    assert warm["workloads"] == ["rag", "repeat", "chat"] and warm["total_s"] >= warm["s"] > 0
    assert all(len(warm["ttft_ms"][t][m]["warm_ms"]) == 1 for t in ("rag", "repeat") for m in ("full", "prefix", "pic"))
    assert warm["kernel_specialisations"] >= 1 and warm["cold_launches"] == []
    # hits by source: without a device cache (CPU) rag's warm PIC hits all come from the daemon's CPU tier
    hs = rag["pic"]["warm"]["hits_by_source"]
    assert hs["engine_device_cache"] == 0 and hs["cpu"] == rag["pic"]["warm"]["hit_segments"] > 0
    assert sum(v for k, v in w["pic"]["warm"]["hits_by_source"].items() if k != "exact_prefixes") + sum(
        w["pic"]["warm"]["hits_by_source"]["exact_prefixes"].values()) > 0
    # the pcie phase's CPU-tier step: every hit loaded from the CPU tier, bytes moved; no PCIe copies on the CPU
    step = pre["cpu_tier_step"]
    assert step["hits_by_source"]["cpu"] > 0 and step["hits_by_source"]["engine_device_cache"] == 0
    assert step["hits_by_source"]["gpu"] == step["hits_by_source"]["nvme"] == 0
    assert step["connector"]["load_bytes"]["cpu"] > 0 and step["gb_per_s"] is None
    assert "qwen3next-tiny:cpu_tier_step" in s["cpu_to_gpu_serving"]["by_phase"]
    assert pre["break_even"]["break_even_read_gb_per_s"] > 0
    assert sum(pre["break_even"]["signature_bytes_by_part"].values()) > 0  # what a hit reads, by part and dtype
    # the sweep: the CPU tier stands in for the GPU tier; the corpus outgrows it and the
    # hits come from the daemon's tiers (the engine's own caches are off), NVMe included
    pts = s["working_set_sweep"]
    assert [p["target_x"] for p in pts] == [0.5, 4.0]
    assert all(p["gpu_tier_stand_in"] == "cpu" and p["stopped"] is None for p in pts)
    assert pts[0]["working_set_x_gpu_tier"] >= 0.5 and pts[1]["working_set_x_gpu_tier"] >= 4.0
    for p in pts:
        assert set(p["hits_by_tier"]) == {"gpu", "cpu", "nvme"} and p["ttft_vs_full"] > 0
        assert sum(p["hits_by_tier"].values()) >= p["requests"] * p["docs_per_request"] - p["miss_segments"] > 0
        assert sum(p["load_bytes_by_tier"].values()) > 0
    assert pts[0]["stored_bytes_by_tier"]["nvme"] == 0 < pts[1]["stored_bytes_by_tier"]["nvme"]
    assert pts[1]["hits_by_tier"]["nvme"] > 0

    # a phase past its limit stops, says so, and keeps what it has (here: nothing yet)
    p = _run(["--quick", "--phases", "qps", "--limit-s", "qps=0.001", "--json", str(stopped)])
    assert p.returncode == 0, p.stderr[-3000:]
    q = json.loads(stopped.read_text())["presets"]["qwen3next-tiny"]
    assert q["phases"]["qps"]["stopped"] == "time limit" and q["phases"]["qps"]["complete"]
    assert q["qps"]["stopped"] == "time limit" and q["qps"]["repeats"] == [] and not q["qps"]["complete"]
    # runs joined: each key from the first run that has it, the phases' records one by one
    p = _run(["--merge", str(merged), str(stopped), "--json", str(joined)])
    assert p.returncode == 0, p.stderr[-3000:]
    j = json.loads(joined.read_text())
    assert j["presets"]["qwen3next-tiny"]["phases"]["qps"]["stopped"] is None
    assert len(j["summary"]["qps_repeats"]) == 2 and j["merged_from"] == [str(merged), str(stopped)]


class Countdown:
    """A stop that answers "time limit" from its n-th question on."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __call__(self):
        self.n -= 1
        return "time limit" if self.n < 0 else None


def _untimed(repeat: dict) -> dict:
    """A repeat's record without its trials' wall-clock seconds (`s`), which differ run to run."""
    return {m: ({**r, "trials": [{k: v for k, v in t.items() if k != "s"} for t in r["trials"]]}
                if isinstance(r, dict) and "trials" in r else r) for m, r in repeat.items()}


def test_qps_repeats_stopped_by_the_limit_keep_the_finished_repeats_only():
    h = FakeHarness(5.0)
    pool = _reqs(3 * (1 + 2 + 2 * 4))
    full = qps_search.qps_repeats(h, pool, per_trial=2, slo_ms=500.0, start_rate=1.0, repeats=3, max_trials=4,
                              warmup=1)
    # asked before each search and each of its trials, and after each repeat: 2 * (1 + 4) + 1 per repeat
    out = qps_search.qps_repeats(FakeHarness(5.0), pool, per_trial=2, slo_ms=500.0, start_rate=1.0, repeats=3,
                             max_trials=4, warmup=1, stop=Countdown(11 + 3))
    assert full["stopped"] is None and len(full["repeats"]) == 3
    assert out["stopped"] == "time limit" and len(out["repeats"]) == 1
    assert _untimed(out["repeats"][0]) == _untimed(full["repeats"][0])
    assert out["pic"]["values"] == full["pic"]["values"][:1]
    # stopped inside the first repeat's second search: nothing complete to keep
    none = qps_search.qps_repeats(FakeHarness(5.0), pool, per_trial=2, slo_ms=500.0, start_rate=1.0, repeats=3,
                              max_trials=4, warmup=1, stop=Countdown(6))
    assert none["repeats"] == [] and none["pic"]["median"] is None and none["gain_vs_prefix"] is None


def test_a_search_stopped_between_trials_reports_its_bracket_so_far():
    got = qps_search.qps_search(FakeHarness(3.7), "pic", iter(_reqs(200)), per_trial=2, slo_ms=500.0, start_rate=2.0,
                            max_trials=30, stop=Countdown(2))
    assert got["stopped"] == "time limit" and len(got["trials"]) == 2 and not got["converged"]
    assert got["sustainable_qps"] == 2.0  # the rates passed before the stop


def test_ttft_breakdown_parts_add_up_to_the_ttft():
    from tools.servebench.breakdown import mean_breakdown, ttft_breakdown
    from tools.servebench.harness import Run

    run = Run("a", 30.0, 100, 90, 2, 0, split={"lookup_ms": 1.0, "load_compose_ms": 2.0, "miss_ms": 0.0,
                                               "fused_ms": 20.0, "seam_ms": 0.0, "suffix_ms": 0.0,
                                               "checkpoint_ms": 1.5},
              store={"store_prefix_source": "engine"}, timeline={"queue_ms": 1.0, "prefill_host_ms": 24.5,
                                                                 "after_ms": 4.0}, rpcs={"lookup": 2})
    b = ttft_breakdown(run)
    assert (b["lookup_ms"], b["restore_ms"], b["forward_ms"], b["drain_ms"]) == (1.0, 2.0, 21.5, 4.0)
    assert b["other_ms"] == pytest.approx(1.5) and b["store_rpcs"] == {"lookup": 2} and not b["synced"]
    m = mean_breakdown([b, {**b, "ttft_ms": 40.0, "other_ms": 11.5, "store_rpcs": {}}])
    assert m["ttft_ms"] == 35.0 and m["other_ms"] == 6.5 and m["store_rpcs_per_request"] == {"lookup": 1.0}


def test_kernel_launches_flag_a_specialisation_first_launched_after_the_warm_up():
    import torch

    from kernels import rope_scatter
    from kernels.backend import INTERPRET
    from tools.servebench.kernel_keys import KernelLaunches

    if not INTERPRET and not torch.cuda.is_available():
        pytest.skip("Triton kernels run only on CUDA or under TRITON_INTERPRET")
    dev = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"

    def launch(n: int, heads: int = 2, shift: int = 0) -> None:
        k = torch.randn(n * heads * 8 + shift, device=dev)[shift:].view(n, heads, 8)
        v = torch.randn(n, heads, 8, device=dev)
        kp, vp = torch.zeros(4, 16, heads, 8, device=dev), torch.zeros(4, 16, heads, 8, device=dev)
        rope_scatter(k, v, kp, vp, torch.arange(n, device=dev), 3, force_triton=True)

    rec = KernelLaunches()
    with rec.recording():
        rec.label = "warm-up"
        launch(5)
        rec.seal()
        rec.label = "rag/pic/warm"
        launch(7)  # the token count is the grid, not a specialisation: warm
        assert rec.cold() == [] and rec.count() == 1
        launch(5, heads=3)  # another constexpr block (and strides): compiled here on a GPU
        launch(5, shift=1, heads=3)  # a 16-byte-misaligned key pointer: another specialisation
    cold = rec.cold()
    assert [c["label"] for c in cold] == ["rag/pic/warm"] * 2 and {c["kernel"] for c in cold} == {
        "_rope_scatter_kernel"}
    launch(9, heads=5)  # outside recording(): not seen
    assert rec.count() == 3


def test_quick_real_shape_preset_runs_its_scaled_down_variant_through_the_serving_path(tmp_path):
    out = tmp_path / "real.json"
    p = _run(["--quick", "--preset", "qwen3.5-35b-a3b-real", "--phases", "serve,pcie", "--workloads", "rag,repeat",
              "--n", "1", "--json", str(out)])
    assert p.returncode == 0, p.stderr[-3000:]
    run = json.loads(out.read_text())
    pre = run["presets"]["qwen3.5-35b-a3b-real"]
    assert pre["model"] == "qwen3.5-35b-a3b-real:scaled-down" and pre["daemon"]["gpu"] == "0"
    assert set(pre["workloads"]) == {"rag", "repeat"} and pre["phases"]["serve"]["complete"]
    rag, rep = pre["workloads"]["rag"], pre["workloads"]["repeat"]
    assert rag["pic"]["warm"]["hit_segments"] > 0 and rag["pic"]["warm"]["miss_segments"] == 0
    assert rep["pic"]["warm"]["reuse_fraction"] > 0.5 and rep["prefix"]["warm"]["reuse_fraction"] > 0.5
    assert pre["cpu_tier_step"]["hits_by_source"]["cpu"] > 0
    assert run["summary"]["exact_repeat_pic_over_prefix_ttft"] > 0


def _toy_kernel(x_ptr, n):  # a kernel body is never run here: only its compiled-kernel cache is read
    return None


def test_compile_counter_reports_the_kernels_whose_compiled_count_grew():
    from triton.runtime.jit import JITFunction

    from tools.servebench.kernel_keys import CompileCounter, compiled_kernels

    jit = JITFunction(_toy_kernel)  # Triton's own kernel object; its per-device cache filled by hand
    for dev in (0, 1):  # the (kernel cache, key cache, target, backend, binder) of each device
        jit.device_caches[dev] = ({}, {}, None, None, None)
    counter = CompileCounter()
    assert counter.since() == {}
    jit.device_caches[0][0]["spec-a"] = object()  # what JITFunction.run does when it compiles
    jit.device_caches[0][0]["spec-b"] = object()
    assert compiled_kernels()["_toy_kernel"] == 2
    assert counter.since() == {"_toy_kernel": 2} and counter.since() == {}
    jit.device_caches[1][0]["spec-a"] = object()  # another device
    assert counter.since() == {"_toy_kernel": 1}


def test_share_cold_off_leaves_no_daemon_call_in_the_quiesce_before_a_timed_pic_request(tmp_path):
    """--share-cold: with it on (default) an idle PIC engine polls the daemon for offered
    cold segments, so the quiesce before each timed PIC request ends with a List RPC
    (prefix caching, which has no idle work, makes none); off, PIC's quiesce makes none."""
    import time

    import torch

    from engine.builder import EngineConfig, build_engine
    from kvstore.testing import DaemonProcess
    from tools import bench_tiered
    from tools.bench_serving import engine_options
    from tools.servebench.requests import load
    from tools.servebench.tiered_phases import make_harness

    d = DaemonProcess(tmp_path / "d", entry="kvstore.server").start()
    try:
        calls = {}
        for flag in ("on", "off"):
            args = bench_tiered.parse_args(["--quick", "--share-cold", flag])
            engine = build_engine("qwen3next-tiny", EngineConfig(**engine_options(args, torch.device("cpu"))))
            h, _ = make_harness(args, engine, str(d.socket), sweep=False)
            try:
                assert h.connector.share_cold is (flag == "on")
                (req,) = load("repeat", 1, 0, "tiny", args.max_tokens, args.docs)
                for method in ("pic", "prefix"):
                    h.planner(method)
                    h.run_alone(req)
                    time.sleep(0.05)  # past the poll interval (share_poll_s), as between timed requests
                    with h.counting_rpcs() as rpcs:
                        h.quiesce()
                    calls[flag, method] = dict(rpcs)
            finally:
                h.close()
        assert calls["on", "pic"] == {"share": 1}
        assert calls["off", "pic"] == calls["on", "prefix"] == calls["off", "prefix"] == {}
    finally:
        d.cleanup()


def test_quick_qps_over_an_indexed_corpus_hits_every_document_from_the_first_trial(tmp_path):
    out = tmp_path / "indexed.json"
    p = _run(["--quick", "--phases", "qps", "--qps-corpus", "indexed", "--qps-repeats", "1", "--qps-max-trials", "2",
              "--json", str(out)])
    assert p.returncode == 0, p.stderr[-3000:]
    run = json.loads(out.read_text())
    pre = run["presets"]["qwen3next-tiny"]
    assert "qps" not in pre  # the cold stream's key is left to a cold run
    q = pre["qps_indexed"]
    ix = q["index"]
    assert q["corpus"] == "indexed" and ix["segments"] > 0 and ix["computed"] == ix["segments"] and ix["flushed"]
    assert ix["puts"]["puts_stored"] == ix["segments"] and ix["puts"]["puts_dropped"] == 0
    assert len(q["idle_ttft_ms"]["pic"]) == len(q["idle_ttft_ms"]["prefix"]) == 4
    assert q["order"] == "method" and set(q["purged"]) == {"prefix", "pic"}
    trials = q["repeats"][0]["pic"]["trials"]
    assert trials and all(t["miss_segments"] == 0 and t["hit_segments"] > 0 for t in trials)
    assert q["repeats"][0]["prefix"]["trials"][0]["miss_segments"] > 0  # prefix caching indexes nothing ahead
    s = run["summary"]
    assert s["qps_gain_vs_prefix_at_slo_median"] is None
    assert s["qps_gain_vs_prefix_at_slo_median_indexed_corpus"] > 0 and len(s["qps_repeats_indexed_corpus"]) == 1


def test_each_trial_records_what_on_trial_answers_after_it_not_before_the_search():
    answers = iter([{"compiled": {"before": 3}}, {}, {"compiled": {"k": 12}}, {}, {}, {}])
    got = qps_search.qps_search(FakeHarness(2.0), "pic", iter(_reqs(40)), per_trial=2, slo_ms=500.0,
                                start_rate=1.0, max_trials=4, on_trial=lambda: next(answers))
    trials = got["trials"]
    assert "compiled" not in trials[0] and trials[1]["compiled"] == {"k": 12}
    assert all("compiled" not in t for t in trials[2:])


def _serve_run(workloads: list[str], avg, low, rep, n: int) -> dict:
    wl = {w: {"pic": {"warm": {"n": n}}} for w in workloads}
    return {"presets": {"p": {"workloads": wl}}, "pcie": {},
            "summary": {"ttft_vs_best_baseline_avg": avg, "ttft_vs_best_baseline_min": low,
                        "exact_repeat_pic_over_prefix_ttft": rep}}


def test_joined_runs_report_the_serve_headline_as_the_median_over_the_runs_that_measured_it(tmp_path):
    from tools import bench_tiered

    eight = ["fact", "twohop", "aggregate", "fewshot", "rag", "repeat", "chat", "mix"]
    runs = [_serve_run(eight, 4.1, 0.87, 1.15, 2), _serve_run(eight, 4.13, 0.73, 1.37, 2),
            _serve_run(eight, 4.0, 1.06, 0.94, 2), _serve_run(["repeat"], 1.06, 1.06, 0.94, 10),
            _serve_run(["repeat"], 1.02, 1.02, 0.98, 10), {"presets": {"p": {"workloads": {}}}, "summary": {}}]
    paths = [f"r{i}.json" for i in range(len(runs))]
    got = bench_tiered.serve_runs(runs, paths)
    avg = got["ttft_vs_best_baseline_avg"]
    assert avg["values"] == [4.1, 4.13, 4.0] and avg["runs"] == paths[:3]  # runs of `repeat` alone: not averages
    assert (avg["median"], avg["min"], avg["max"]) == (4.1, 4.0, 4.13)
    rep = got["exact_repeat_pic_over_prefix_ttft"]
    assert rep["values"] == [1.15, 1.37, 0.94, 0.94, 0.98] and rep["n"] == [2, 2, 2, 10, 10]
    assert rep["median"] == 0.98 and got["ttft_vs_best_baseline_min"]["median"] == 0.87
    assert bench_tiered.serve_runs(runs[:1] + runs[-1:], paths[:2]) == {}  # one run: nothing to take a median of


def test_a_merge_takes_the_serve_phases_connector_snapshot_from_a_run_that_served_workloads():
    import copy

    from tools.servebench.tiered_summary import merge_docs

    served = json.loads((REPO / "docs/results/serving-tiered-2026-12-03-serve2.json").read_text())
    name = next(iter(served["presets"]))
    qps_only = copy.deepcopy(served)  # an engine that ran no workload: its snapshot is the QPS phase's
    pre = qps_only["presets"][name]
    pre["workloads"], pre["qps"] = {}, {"marker": 1}
    pre["connector_pic"] = dict(pre["connector_pic"], h2d_copy_bytes=7)
    joined = merge_docs([qps_only, served])
    got = joined["presets"][name]
    assert got["qps"] == {"marker": 1}  # every other key: the first run's
    assert got["connector_pic"] == served["presets"][name]["connector_pic"] and got["workloads"]
    assert joined["summary"]["cpu_to_gpu_serving"]["by_phase"][f"{name}:serve"]["copy_bytes"] == \
        served["presets"][name]["connector_pic"]["h2d_copy_bytes"] != 7
    assert merge_docs([qps_only])["presets"][name]["connector_pic"]["h2d_copy_bytes"] == 7  # none served
