"""Two engine processes on one host and one kvstore daemon (tools.servebench.worker).

`run_pair`: sharing one daemon vs each with a private in-process signature cache. The
same request trace (drawn from one pool per workload) is dealt alternately to two
workers, which run at the same time (TTFT per workload: `tasks`); then, optionally, a
ladder of Poisson trials over both engines (`trials`; `qps_at_slo` reads the highest
rate within an SLO off it). With a shared daemon, a segment one engine computed is a hit for the
other (and a segment both need at once is computed once: the other waits through the
daemon); with private caches each engine only reuses what it computed itself.
Reported: segment hit rate (hits / (hits + misses)), TTFT p50/p99 over both engines'
requests, segments computed and waited for, and the loads by the path they took
(`paths`: per daemon tier the segments came from, loads, bytes, loader ms and GB/s;
`peer`: GPU-tier loads whose bytes sat on another GPU than the engine's, copied device
to device over CUDA IPC).

`run_cold_parallel`: the cold TTFT of requests with several cold segments on one engine
alone vs the same requests when a second, idle engine helps (engine.connector.coldshare):
worker `w0` runs each request cold twice, without and with cold sharing (its segments
deleted from the daemon before each run); worker `w1` only helps. Reported: mean and
p50 TTFT of both, `speedup` = mean alone / mean helped, and the segments the helper
computed.

GPUs (`gpus`, a list of device indices): worker i runs its engine on
`cuda:<gpus[i % len(gpus)]>`. Every device stays visible to every worker (no
CUDA_VISIBLE_DEVICES): the daemon's GPU tier is opened through CUDA IPC handles that
name the daemon's device index, which a worker that cannot see that device cannot open.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

from kvstore.tiers.registry import TIERS as TIER_REGISTRY
from tools.servebench.harness import percentile
from tools.servebench.requests import BenchRequest

REPO = Path(__file__).resolve().parents[2]
TIERS = TIER_REGISTRY.names


def _device(gpus: Optional[Sequence[int]], i: int) -> Optional[str]:
    return f"cuda:{gpus[i % len(gpus)]}" if gpus else None


def _requests(reqs: Sequence[BenchRequest]) -> list[dict]:
    return [{"id": r.id, "task": r.task, "segments": list(r.segments)} for r in reqs]


def run_workers(preset: str, engine_options: dict, specs: Sequence[dict], socket: Optional[str],
                threads: Optional[int] = None, gpus: Optional[Sequence[int]] = None, timeout: float = 900.0,
                stop_after: Optional[Sequence[str]] = None, warm: Optional[dict] = None,
                put_tier: Optional[str] = None) -> tuple[list[dict], float]:
    """Start one worker per spec (`name`, `role`, `requests`, ...), release them together,
    wait for them; with `stop_after`, `<barrier>/stop` is written once the named workers
    finished (the helpers then finish). `warm` (scale, max_tokens, docs): each worker runs
    `measure.warm_kernels` before it is ready (its own seed), so no first-time kernel
    compilation lands in a timed request. Returns (their outputs, wall seconds after go)."""
    work = Path(tempfile.mkdtemp(prefix="servebench-"))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    procs, outs, names = [], [], []
    for i, s in enumerate(specs):
        name = s["name"]
        spec = {"preset": preset, "engine": engine_options, "socket": socket, "barrier": str(work),
                "threads": threads, "device": _device(gpus, i), "warm": warm, "index": i, "put_tier": put_tier, **s}
        (work / f"{name}.json").write_text(json.dumps(spec))
        out = work / f"{name}.out.json"
        outs.append(out)
        names.append(name)
        log = open(work / f"{name}.log", "wb")
        procs.append(subprocess.Popen([sys.executable, "-m", "tools.servebench.worker", "--spec",
                                       str(work / f"{name}.json"), "--out", str(out)],
                                      stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(REPO)))
    deadline = time.monotonic() + timeout
    try:
        while not all((work / f"{n}.ready").exists() for n in names):
            for n, p in zip(names, procs):
                if p.poll() is not None:
                    raise RuntimeError(f"worker {n} exited with {p.returncode}:\n{_tail(work / f'{n}.log')}")
            if time.monotonic() > deadline:
                raise RuntimeError("workers not ready in time")
            time.sleep(0.05)
        t0 = time.perf_counter()
        (work / "go").write_text("go")
        order = list(zip(names, procs))
        if stop_after:
            first = [(n, p) for n, p in order if n in stop_after]
            order = first + [(n, p) for n, p in order if n not in stop_after]
        for j, (n, p) in enumerate(order):
            if stop_after and j == len(stop_after):
                (work / "stop").write_text("stop")
            if p.wait(max(1.0, deadline - time.monotonic())) != 0:
                raise RuntimeError(f"worker {n} failed:\n{_tail(work / f'{n}.log')}")
        wall = time.perf_counter() - t0
    finally:
        (work / "stop").write_text("stop")
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [json.loads(o.read_text()) for o in outs], wall


def run_pair(preset: str, engine_options: dict, requests: Sequence[BenchRequest], socket: Optional[str],
             threads: Optional[int] = None, gpus: Optional[Sequence[int]] = None, timeout: float = 900.0,
             warm: Optional[dict] = None, put_tier: Optional[str] = None,
             trials: Sequence[tuple[float, Sequence[BenchRequest]]] = (), seed: int = 0,
             pic: Optional[dict] = None) -> dict:
    """Run `requests` on two worker processes (module docstring); socket None: private caches.
    `put_tier`: the daemon tier the workers put signatures in (None: the daemon's default).
    `pic`: PicConfig fields of the workers' PIC planner (e.g. miss_path, miss_signatures; default PicConfig()).
    `trials` (total rate, requests): afterwards, Poisson arrivals of each trial's requests
    dealt alternately to the two engines at half the rate each, both starting together;
    reported per trial with the TTFTs of both (`trials`), for a QPS search at an SLO."""
    names = ["w0", "w1"]
    specs = [{"name": n, "role": "requests", "requests": _requests(requests[i::2]), "peers": names, "pic": pic or {},
              "trials": [{"rate": rate / 2, "seed": seed + 100 * j + i, "requests": _requests(reqs[i::2])}
                         for j, (rate, reqs) in enumerate(trials)]}
             for i, n in enumerate(names)]
    results, wall = run_workers(preset, engine_options, specs, socket, threads, gpus, timeout, warm=warm,
                                put_tier=put_tier)
    runs = [r for res in results for r in res["runs"]]
    tasks: dict[str, list[float]] = {}
    for r in runs:
        tasks.setdefault(r.get("task", "rag"), []).append(r["ttft_ms"])
    merged = []
    for j, (rate, _) in enumerate(trials):
        parts = [res["trials"][j] for res in results]
        ttft = [t for p in parts for t in p["ttft_ms"]]
        merged.append({"rate": rate, "ttft_ms": ttft, "ttft_ms_p99": percentile(ttft, 99),
                       "ttft_ms_p50": percentile(ttft, 50), "queue_ms": [q for p in parts for q in p["queue_ms"]],
                       "hit_segments": sum(p["hit_segments"] for p in parts),
                       "miss_segments": sum(p["miss_segments"] for p in parts)})
    hits = sum(r["hit_segments"] for r in runs)
    misses = sum(r["miss_segments"] for r in runs)
    ttfts = [r["ttft_ms"] for r in runs]
    return {"shared": socket is not None, "requests": len(runs), "hit_rate": hits / (hits + misses) if hits + misses else 0.0,
            "segments_computed": misses, "segments_waited": sum(r.get("waited", 0) for r in runs),
            "ttft_ms_p50": percentile(ttfts, 50), "ttft_ms_p99": percentile(ttfts, 99),
            "ttft_ms_mean": sum(ttfts) / len(ttfts) if ttfts else None, "wall_s": wall,
            "devices": [res["device"] for res in results], "paths": load_paths([res["store"] for res in results]),
            "startup": [res.get("startup") for res in results],
            "tasks": {k: {"requests": len(v), "ttft_ms_p50": percentile(v, 50), "ttft_ms_p99": percentile(v, 99),
                          "ttft_ms_mean": sum(v) / len(v)} for k, v in tasks.items()},
            "trials": merged}


def qps_at_slo(trials: Sequence[dict], slo_ms: float) -> dict:
    """The highest rate of the ladder (ascending, every rung run) below which no rung
    failed: each rung's p99 TTFT (both engines' requests) within `slo_ms` (0.0 when the
    first fails). A pass above a failure is noise, not a sustainable rate."""
    passed = [t["ttft_ms_p99"] is not None and t["ttft_ms_p99"] <= slo_ms for t in trials]
    best = 0.0
    for t, ok in sorted(zip(trials, passed), key=lambda tp: tp[0]["rate"]):
        if not ok:
            break
        best = t["rate"]
    return {"slo_ms": slo_ms, "sustainable_qps": best, "passed": passed}


def load_paths(snapshots: Sequence[Optional[dict]]) -> dict:
    """Loads summed over workers' connector metrics, by the daemon tier they came from,
    and the cross-GPU (peer) share of the GPU-tier loads."""
    snaps = [s for s in snapshots if s]
    out: dict = {}
    for t in TIERS:
        n = sum(s["loads"][t] for s in snaps)
        nbytes = sum(s["load_bytes"][t] for s in snaps)
        ms = sum(s["load_ms"][t] for s in snaps)
        out[t] = {"loads": n, "bytes": nbytes, "ms": round(ms, 3),
                  "gb_per_s": round(nbytes / ms / 1e6, 3) if ms > 0 else None}
    out["peer"] = {"loads": sum(s.get("peer_loads", 0) for s in snaps),
                   "bytes": sum(s.get("peer_load_bytes", 0) for s in snaps)}
    return out


def run_cold_parallel(preset: str, engine_options: dict, requests: Sequence[BenchRequest], socket: str,
                      threads: Optional[int] = None, gpus: Optional[Sequence[int]] = None,
                      timeout: float = 900.0, warm: Optional[dict] = None, put_tier: Optional[str] = None) -> dict:
    """Cold TTFT alone vs helped by an idle engine (module docstring; `put_tier` as run_pair's)."""
    specs = [{"name": "w0", "role": "cold", "requests": _requests(requests), "pic": {"miss_path": "alone"}},
             {"name": "w1", "role": "helper", "requests": []}]
    results, wall = run_workers(preset, engine_options, specs, socket, threads, gpus, timeout, stop_after=["w0"],
                                warm=warm, put_tier=put_tier)
    runs = results[0]["runs"]
    out: dict = {"requests": len(requests), "wall_s": wall, "devices": [res["device"] for res in results],
                 "startup": [res.get("startup") for res in results]}
    for mode in ("alone", "helped"):
        rs = [r for r in runs if r["mode"] == mode]
        ttfts = [r["ttft_ms"] for r in rs]
        out[mode] = {"ttft_ms_mean": sum(ttfts) / len(ttfts) if ttfts else None,
                     "ttft_ms_p50": percentile(ttfts, 50), "ttft_ms_p99": percentile(ttfts, 99),
                     "cold_segments_mean": sum(r["segments"] for r in rs) / len(rs) if rs else None,
                     "computed": sum(r["computed"] for r in rs), "offloaded": sum(r["offloaded"] for r in rs)}
    a, h = out["alone"]["ttft_ms_mean"], out["helped"]["ttft_ms_mean"]
    out["speedup"] = a / h if a and h else None
    helper = results[1]["store"] or {}
    out["helper"] = {k: helper.get(k, 0) for k in ("cold_helped", "cold_help_ms_total", "cold_rejected", "claims",
                                                   "puts_stored", "puts_dropped", "store_errors", "puts_failed")}
    requester = results[0]["store"] or {}
    out["requester"] = {k: requester.get(k, 0) for k in (
        "cold_offered", "cold_offloaded", "cold_wait_ms_total", "claims", "inflight_waits", "inflight_wait_hits",
        "inflight_wait_misses", "computes")}
    out["runs"] = runs
    return out


def _tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"
