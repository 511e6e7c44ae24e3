"""The measurements of the serving benchmark, each on one engine (a `Harness`):

- `ttft_by_method`: TTFT of each request alone, per method and cache state. *cold*: none
  of the request's segments is cached (a new prefix tree per request; for PIC the
  request's segments deleted from the daemon first). *warm*: every segment of the
  request is cached, in another order: prefix caching runs the request's twin first
  (tools.servebench.requests); PIC needs nothing more after its cold pass stored every
  segment (a position-independent signature does not depend on the order it was
  computed in); on CUDA its warm hits come from the engine's own device cache
  (StoreConnectorConfig.device_cache_bytes), as a serving engine's repeated segments
  would, and `hit_breakdown` measures the daemon's tiers without it. Cold PIC deletes
  the request's segments from the daemon and from that cache first. Full recompute has
  one state (its cold and warm are the same runs).
- `qps_at_slo`: the highest Poisson arrival rate whose p99 TTFT stays under the SLO,
  per method, by a geometric search (x2 from a start rate both methods share) then
  bisection; every trial sends fresh
  requests from the same pool (so nothing repeats exactly), after a warm-up stream whose
  last requests arrive as an untimed burst at the start rate. Two cache states: *stream*
  (the cache holds what the warm-up and earlier trials left: a cold start on a pool of
  512 documents, most segments new) and *warm* (`warm_twins`: before each trial its
  requests' twins run alone, untimed, so every segment is cached in another order, the
  TTFT phase's warm state, as in PIC's usual setting of a precomputed corpus; prefix
  caching keeps what the twins' prefixes give it).
  Per workload, `prefix_reuse` is the share of the warm prompts prefix caching reused
  (0 where a twin shares no prefix beyond the first document; about 1 on exact repeats).
  PIC's warm run of a request repeats its cold run exactly: with exact prefixes
  (PicConfig.exact_prefix) it restores the exact prefix the idle time after the cold run
  computed, as prefix caching restores its twin's.
- `hit_breakdown`: where the TTFT of a PIC hit goes, per tier the segments are loaded
  from (NVMe, CPU, GPU where the daemon has a GPU tier), with device-synchronised
  timing marks: lookup, load (latency and the part the engine waited for), compose
  (splice: re-rotation, scatter, state composition), seam, suffix. Its planners keep no
  exact prefixes (PicConfig.exact_prefix off): the repeated request loads its segments.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional, Sequence

from engine.connector.attach import attach_store
from tools.servebench.harness import Harness, Run, start_profile, write_profile, percentile
from tools.servebench.requests import BenchRequest, twin


def summarize(runs: Sequence[Run]) -> dict:
    ttfts = [r.ttft_ms for r in runs]
    prompt = sum(r.prompt_tokens for r in runs)
    out = {"n": len(runs), "ttft_ms_p50": percentile(ttfts, 50), "ttft_ms_p99": percentile(ttfts, 99),
           "ttft_ms_mean": sum(ttfts) / len(ttfts) if ttfts else None,
           "prompt_tokens_mean": prompt / len(runs) if runs else 0,
           "reuse_fraction": sum(r.reused_tokens for r in runs) / prompt if prompt else 0.0,
           "hit_segments": sum(r.hit_segments for r in runs), "miss_segments": sum(r.miss_segments for r in runs),
           "ttft_ms": [round(t, 3) for t in ttfts]}
    for k in ("queue_ms", "prefill_host_ms", "after_ms"):  # Run.timeline: where the TTFT went
        vals = [r.timeline[k] for r in runs if k in r.timeline]
        if vals:
            out[f"{k}_mean"] = sum(vals) / len(vals)
    return out


def ttft_by_method(h: Harness, reqs: Sequence[BenchRequest], name: str = "") -> dict:
    """`name`: with `h.trace_dir`, each method and state runs its last request once more,
    profiled (traces `<name>-<method>-<state>`; the profiled run is not in the figures)."""
    out: dict[str, dict] = {}
    trace = bool(name and h.trace_dir and reqs)

    def traced(label: str, before=None) -> None:
        if trace:
            if before is not None:
                before()
            h.run_alone(reqs[-1], trace=f"{name}-{label}")

    h.planner("full")
    full = summarize([h.run_alone(r) for r in reqs])
    traced("full")
    out["full"] = {"cold": full, "warm": full}
    cold = []
    for r in reqs:
        if h.prefix_store:  # its checkpoints in the daemon too: a cold start deletes them there
            h.forget(r)
        h.planner("prefix", fresh=True)
        cold.append(h.run_alone(r))
    traced("prefix-cold", lambda: h.planner("prefix", fresh=True))
    h.planner("prefix", fresh=True)
    warm = []
    for r in reqs:
        h.run_alone(twin(r))
        warm.append(h.run_alone(r))
    traced("prefix-warm", lambda: h.run_alone(twin(reqs[-1])))
    out["prefix"] = {"cold": summarize(cold), "warm": summarize(warm)}
    out["prefix_reuse"] = out["prefix"]["warm"]["reuse_fraction"]  # what its twins' prefixes gave it
    h.planner("pic")
    cold = []
    for r in reqs:
        h.forget(r)
        cold.append(h.run_alone(r))
    traced("pic-cold", lambda: h.forget(reqs[-1]))
    warm = [h.run_alone(r) for r in reqs]
    traced("pic-warm")
    out["pic"] = {"cold": summarize(cold), "warm": summarize(warm)}
    out["pic"]["warm"]["store"] = mean_store(warm)
    return out


def mean_store(runs: Sequence[Run]) -> dict:
    keys = ("store_load_ms", "store_load_wait_ms")
    got = [r.store for r in runs if r.store]
    if not got:
        return {}
    mean = {k: sum(s.get(k, 0.0) for s in got) / len(got) for k in keys}
    overlaps = [s["store_load_overlap"] for s in got if s.get("store_load_overlap") is not None]
    mean["store_load_overlap"] = sum(overlaps) / len(overlaps) if overlaps else None
    return mean


def qps_at_slo(h: Harness, method: str, stream: Sequence[BenchRequest], warmup: int, per_trial: int,
               trials: int, slo_ms: float, start_rate: float, seed: int, factor: float = 2.0,
               warm_twins: bool = False, trace_trial: Optional[int] = None, trial_s: Optional[float] = None,
               max_per_trial: Optional[int] = None) -> dict:
    """Highest tried rate with p99 TTFT <= slo_ms (module docstring). `stream` holds
    warmup + trials * per_trial requests. The warm-up runs its requests alone, its last
    `per_trial` as an untimed Poisson burst at `start_rate` (`warmup_burst`): the first
    requests an engine runs concurrently pay one-time costs (seconds of queueing on an
    H200), which would otherwise fail whichever method's first trial meets
    them, and the other method would not. `trace_trial` (with `h.trace_dir`): profile
    that trial (0-based; host and device, every thread: the idle work and the puts
    between arrivals too) as `qps-<method>-trial<N>`; it is marked `traced` (the
    profiler slows it, so its pass or fail is not a clean figure: for diagnosis only).
    `trial_s` / `max_per_trial`: each trial sends `trial_s` seconds of arrivals at its
    rate (tools.servebench.harness.trial_size: at least `per_trial`, at most
    `max_per_trial` requests; `stream` then holds warmup + trials * max_per_trial) and is
    cut short once its p99 is sure to miss the SLO; without them a trial is `per_trial`
    requests, which any rate passes once they fit in the SLO back to back (a fast
    method's figure is then the search's top, not a sustainable rate)."""
    from tools.servebench.harness import trial_size

    h.planner(method, fresh=(method == "prefix"))
    burst = stream[max(0, warmup - per_trial):warmup]
    for r in stream[:max(0, warmup - per_trial)]:
        h.run_alone(r)
    burst_info: dict = {}
    burst_ttfts = h.run_poisson(burst, start_rate, seed - 1, info=burst_info) if burst else []
    rest = list(stream[warmup:])
    tried: list[dict] = []
    best: Optional[float] = None
    worst_fail: Optional[float] = None
    rate = start_rate
    taken = 0
    for i in range(trials):
        n = trial_size(rate, per_trial, trial_s, max_per_trial)
        chunk = rest[taken:taken + n]
        taken += n
        if len(chunk) < n:
            break
        if warm_twins:  # every segment of the trial cached, in another order (the TTFT phase's warm state)
            for r in chunk:
                h.run_alone(twin(r))
            while h.engine.help_idle():  # PIC's queued alone passes (cold fallback, miss_path="context")
                pass
        info: dict = {}
        prof = start_profile() if (trace_trial == i and h.trace_dir) else None
        ttfts = h.run_poisson(chunk, rate, seed + i, info=info, slo_ms=slo_ms if trial_s is not None else None)
        if prof is not None:
            write_profile(prof, h.trace_dir, f"qps-{method}{'-warm' if warm_twins else ''}-trial{i}")
            info["traced"] = True
        p99 = None if info.get("aborted") else percentile(ttfts, 99)
        ok = p99 is not None and p99 <= slo_ms
        tried.append({"rate": rate, "requests": n, "ttft_ms_p99": p99, "ttft_ms_p50": percentile(ttfts, 50), "ok": ok,
                      "ttft_ms": [round(t, 3) for t in ttfts], **info})
        if ok:
            best = rate if best is None else max(best, rate)
        else:
            worst_fail = rate if worst_fail is None else min(worst_fail, rate)
        if best is not None and worst_fail is not None:
            rate = (best + worst_fail) / 2  # bisect between the best pass and the lowest failure
        else:
            rate = rate * factor if ok else rate / factor
    return {"method": method, "slo_ms": slo_ms, "sustainable_qps": best or 0.0, "trials": tried,
            "cache": "warm" if warm_twins else "stream", "trial_s": trial_s,
            "warmup_burst": {"rate": start_rate, "ttft_ms": [round(t, 3) for t in burst_ttfts], **burst_info}}


def hit_breakdown(h: Harness, req: BenchRequest, tiers: Sequence[str]) -> dict:
    """TTFT split of a warm PIC request per tier its segments load from."""
    out: dict[str, dict] = {}
    keys = h.keys_of(req)
    if "nvme" in tiers:  # store the request's segments in the NVMe tier: recompute them with puts there
        h.forget(req)
        to_nvme = attach_store(h.engine, replace(h.pic_config, exact_prefix=False),
                              replace(h.connector, put_tier="nvme", device_cache_bytes=0))
        h.run_alone(req)
        to_nvme.store.close()
        h.timed_pic_planner()
        out["nvme"] = _split(h.run_alone(req))  # a Get promotes each segment to the CPU arena
    h.timed_pic_planner()
    h.store.link.call("prefetch", lambda kv: kv.prefetch(keys, tier="cpu"))
    out["cpu"] = _split(h.run_alone(req))
    if "gpu" in tiers:
        moved = h.store.link.call("prefetch", lambda kv: kv.prefetch(keys, tier="gpu"))
        if moved == len(keys):
            out["gpu"] = _split(h.run_alone(req))
    h.planner("pic")
    return out


def _split(run: Run) -> dict:
    s = run.store
    waited_in_splice = (s.get("store_take_wait_ms") or 0.0) + (s.get("store_device_wait_ms") or 0.0)
    return {"ttft_ms": run.ttft_ms, "lookup_ms": run.split["lookup_ms"], "load_ms": s.get("store_load_ms"),
            "load_wait_ms": s.get("store_load_wait_ms"), "load_device_wait_ms": s.get("store_device_wait_ms"),
            "compose_ms": max(0.0, run.split["load_compose_ms"] - waited_in_splice),
            "seam_ms": run.split["seam_ms"], "suffix_ms": run.split["suffix_ms"],
            "fused_ms": max(0.0, run.split.get("fused_ms", 0.0) - waited_in_splice),
            "hits_by_tier": s.get("store_hits_by_tier"), "copies_pending_at_use": s.get("store_copies_pending_at_use")}


def warm_kernels(h, scale: str = "tiny", max_tokens=None, docs=None, seed: int = 10_000) -> None:
    """First calls compile Triton kernels (and autotune them per shape specialisation):
    run each method on a small prompt, then PIC cold and warm on one request of every
    workload from a seed no measurement uses (segment counts and lengths like the
    measured ones, so the packed alone passes and the seam chains meet most of their
    kernel variants here, not in a timed request); its segments are deleted afterwards.
    First the decode step of every batch-size bucket up to the scheduler's max_num_seqs
    (ModelRunner.capture_decode_graphs): requests run alone decode one sequence at a
    time, the QPS phase's batches meet the paged decode kernel at other split counts."""
    from tools.servebench import requests

    h.engine.runner.capture_decode_graphs(h.engine.scheduler.config.max_num_seqs)

    req = BenchRequest("warmup", "warmup", ({"text": "warm-up one " * 20, "cache": True},
                                             {"text": "warm-up two " * 20, "cache": True},
                                             {"text": "Q: ?\nA: ", "cache": False}))
    for method in ("full", "prefix", "pic", "pic"):
        h.planner(method)
        h.run_alone(req)
    h.planner("pic")
    for task in requests.TASKS:
        for r in requests.load(task, 1, seed, scale, max_tokens, docs):
            h.forget(r)
            h.run_alone(r)  # cold: packed alone passes + one-pass prefill
            h.run_alone(r)  # warm
            h.forget(r)
