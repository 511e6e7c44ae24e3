"""tools/bench_serving.py --quick end to end on the CPU: it starts its own REAL daemon,
measures every phase on the tiny presets (the two-engine ones, sharing and parallel cold
prefill, on the first preset), writes the JSON run with the summary fields the issues
name, and prints its table last."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_quick_run_writes_the_summary_and_prints_the_table_last(tmp_path):
    out = tmp_path / "serving.json"
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "tools/bench_serving.py", "--quick", "--share-warm-pair", "on", "--json",
                           str(out)],
                          capture_output=True, text=True, cwd=str(REPO), env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = json.loads(out.read_text())
    assert run["complete"] is True and not out.with_name(out.name + ".tmp").exists()
    summary = run["summary"]
    for key in ("ttft_reduction_vs_prefix_avg", "ttft_reduction_vs_full_avg", "qps_gain_vs_prefix_at_slo",
                "cold_parallel_speedup", "cross_gpu_hit_rate"):
        assert key in summary
    assert summary["ttft_reduction_vs_prefix_avg"] > 0 and summary["ttft_reduction_vs_full_avg"] > 0
    assert set(run["presets"]) == {"qwen3next-tiny", "ring-tiny"}
    first = run["presets"]["qwen3next-tiny"]
    assert set(first["workloads"]) == {"fact", "twohop", "aggregate", "fewshot", "rag", "repeat", "chat", "mix"}
    for w in first["workloads"].values():
        assert w["pic"]["warm"]["hit_segments"] > 0 and w["pic"]["warm"]["miss_segments"] == 0
        assert w["pic"]["cold"]["hit_segments"] == 0
    # prefix caching's reuse per workload: nothing past the rotated documents, all of an exact
    # repeat's cacheable prefix, a chat turn's history
    reuse = summary["prefix_reuse_by_workload"]
    assert reuse["qwen3next-tiny/fact"] == first["workloads"]["fact"]["prefix_reuse"] == 0.0
    assert reuse["qwen3next-tiny/repeat"] > 0.5 and reuse["qwen3next-tiny/chat"] > 0.5
    assert 0.0 < reuse["qwen3next-tiny/mix"] < reuse["qwen3next-tiny/repeat"]
    for key in ("ttft_vs_best_baseline_avg", "ttft_vs_best_baseline_min", "exact_repeat_pic_over_prefix_ttft"):
        assert summary[key] is not None and summary[key] > 0
    # PIC on exact repeats and chat turns restores the exact prefix, as prefix caching does
    for task in ("repeat", "chat"):
        assert first["workloads"][task]["pic"]["warm"]["reuse_fraction"] >= reuse[f"qwen3next-tiny/{task}"]
    assert first["sharing"]["shared"]["hit_rate"] > first["sharing"]["private"]["hit_rate"]
    for part in (first["sharing"]["shared"], first["sharing"]["private"], first["cold_parallel"]):
        assert [set(w) for w in part["startup"]] == [{"build_s", "warm_s"}] * 2  # where worker starts went
    for mode in ("shared", "private"):  # every workload on both engines, then the Poisson ladder over both
        pair = first["sharing"][mode]
        assert set(pair["tasks"]) == {"fact", "twohop", "aggregate", "fewshot", "rag"}
        assert sum(t["requests"] for t in pair["tasks"].values()) == pair["requests"] == 20
    assert first["sharing"]["warm_pair_s"] > 0  # the untimed pair ran before the measured ones
    q = first["sharing"]["qps"]
    start = first["qps"]["start_rate"]  # the ladder: twice the single-engine search's start, x 1, 2, 4, 8
    assert q["rates"] == [2 * start * f for f in (1, 2, 4, 8)]
    for mode in ("shared", "private"):
        trials = first["sharing"][mode]["trials"]
        assert [t["rate"] for t in trials] == q["rates"][:1] + q["rates"]  # an untimed burst, then the ladder
        assert all(len(t["ttft_ms"]) == 8 for t in trials)  # 2 x --qps-requests per rung
    assert q["slo_ms"] > 0 and q["slo_rule"].endswith("private pair's idle rag p99")
    assert len(q["shared"]["passed"]) == 4 and summary["sharing_qps_gain_shared_vs_private"] == q["gain"]
    assert {"cpu", "nvme"} <= set(first["breakdown"])
    paths = first["sharing"]["shared"]["paths"]
    assert paths["cpu"]["loads"] > 0 and paths["cpu"]["bytes"] > 0 and paths["peer"]["loads"] == 0
    cold = first["cold_parallel"]
    assert cold["alone"]["cold_segments_mean"] >= 3 and summary["cold_parallel_speedup"] > 0
    for r in cold["runs"]:  # every segment cold in both modes: computed here, or by the idle helper
        assert r["hit_segments"] + r["miss_segments"] == r["segments"]
        assert r["computed"] + r["offloaded"] == r["segments"]
        assert r["offloaded"] == 0 if r["mode"] == "alone" else r["offloaded"] <= r["segments"] - 1
    assert cold["helper"]["cold_helped"] >= cold["helped"]["offloaded"]
    assert first["qps"]["slo_ms"] > 0 and first["qps"]["pic"]["trials"]
    assert first["qps"]["slo_rule"].endswith("full-recompute rag p99 (idle)")
    for trial in first["qps"]["pic"]["trials"]:  # where each trial's time went
        assert len(trial["ttft_ms"]) == len(trial["queue_ms"]) > 0 and trial["idle_ms"] >= 0
        n = len(trial["ttft_ms"])  # per request: its prompt, what it computed, its prefill's host time
        assert len(trial["prompt_tokens"]) == len(trial["computed_tokens"]) == len(trial["prefill_host_ms"]) == n
        assert all(0 < c <= p for c, p in zip(trial["computed_tokens"], trial["prompt_tokens"]))
        assert all(ms > 0 for ms in trial["prefill_host_ms"])
    for method in ("prefix", "pic"):  # each method met concurrency once, untimed, before its trials
        for part in (first["qps"], first["qps"]["warm"]):
            burst = part[method]["warmup_burst"]
            assert burst["rate"] == first["qps"]["start_rate"] and len(burst["ttft_ms"]) == len(burst["queue_ms"]) == 4
        assert first["qps"][method]["cache"] == "stream" and first["qps"]["warm"][method]["cache"] == "warm"
    # warm: every segment of a trial's requests was cached before it, so PIC's trials miss nothing
    assert summary["qps_gain_vs_prefix_at_slo_warm"] is not None
    for trial in first["qps"]["warm"]["pic"]["trials"]:
        assert trial["miss_segments"] == 0 and trial["hit_segments"] > 0
    assert sum(t["miss_segments"] for t in first["qps"]["pic"]["trials"]) > 0  # the stream starts cold
    conn = first["connector"]
    if conn["deferred_batches"]:  # the cold fallback's idle passes, split
        assert conn["deferred_tokens"] > 0 and conn["deferred_alone_ms_total"] > 0
        assert conn["deferred_ms_total"] >= conn["deferred_alone_ms_total"]
    assert run["machine"]["python"] and run["command"].startswith("python tools/bench_serving.py")
    lines = proc.stdout.strip().splitlines()
    assert lines[-1].startswith("summary: ttft_reduction_vs_prefix_avg=")
    assert "TTFT (ms) per workload" in proc.stdout
    # --merge: the run split into one file per preset joins back into the same presets and summary
    parts = []
    for name, pre in run["presets"].items():
        part = dict(run, presets={name: pre})
        parts.append(tmp_path / f"{name}.json")
        parts[-1].write_text(json.dumps(part))
    merged_path = tmp_path / "merged.json"
    proc = subprocess.run([sys.executable, "tools/bench_serving.py", "--merge", *map(str, parts),
                           "--json", str(merged_path)], capture_output=True, text=True, cwd=str(REPO), env=env,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    merged = json.loads(merged_path.read_text())
    assert merged["presets"] == run["presets"] and merged["summary"] == summary
    assert merged["merged_from"] == [str(p) for p in parts]
    assert proc.stdout.strip().splitlines()[-1].startswith("summary: ttft_reduction_vs_prefix_avg=")


def test_a_stream_trial_profiled_and_run_without_idle_work(tmp_path):
    """--qps-trace-trial with --trace writes the op tables of one stream trial per method;
    --qps-idle off runs no idle work between arrivals (the in-context misses stay queued)."""
    out, trace = tmp_path / "serving.json", tmp_path / "trace"
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "tools/bench_serving.py", "--quick", "--presets", "ring-tiny",
                           "--workloads", "rag", "--n", "1", "--skip", "sharing,cold,breakdown", "--qps-cache", "stream",
                           "--qps-trials", "2", "--qps-requests", "3", "--cold-full-fraction", "0", "--qps-idle", "off",
                           "--trace", str(trace), "--qps-trace-trial", "1", "--json", str(out)],
                          capture_output=True, text=True, cwd=str(REPO), env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    q = json.loads(out.read_text())["presets"]["ring-tiny"]["qps"]
    assert q["idle_between_arrivals"] == "off"
    for method in ("prefix", "pic"):
        trials = q[method]["trials"]
        assert [t.get("traced", False) for t in trials] == [False, True]
        assert all(t["idle_calls"] == 0 for t in trials)
        table = (trace / "ring-tiny" / f"qps-{method}-trial1.txt").read_text()
        assert "Self CPU time total" in table and "sync-like calls" in table
    assert sum(t["miss_segments"] for t in q["pic"]["trials"]) > 0  # nothing cached them between arrivals
