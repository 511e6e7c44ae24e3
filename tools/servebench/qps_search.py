"""The QPS search of the tiered serving benchmark (tools/bench_tiered.py), on one engine
(a `Harness`) over the kvstore daemon:

- `qps_search`: the highest Poisson rate whose p99 TTFT stays within the SLO, found by
  bracketing (x2 / /2 from a start rate) and then bisection until the bracket
  [highest pass, lowest failure] is within `tolerance` (relative to the failure);
  `qps_repeats` runs it `repeats` times per method (fresh requests each time, the same
  stream for both methods of a repeat) and reports each repeat, the median, min and max.
  Each method may start from its own rate (`start_rates`: over an indexed corpus
  bench_tiered starts each at half of what it serves back to back when idle), so a fast
  method does not spend its trials doubling up from a slow method's start. A trial lasts `trial_s` seconds of arrivals
  (`harness.trial_size`: rate x trial_s requests, bounded): only a trial long enough for a queue
  to build can fail a rate above what the engine sustains; one sure to fail is cut short.
"""
from __future__ import annotations

import math
import statistics
import time
from typing import TYPE_CHECKING, Callable, Iterator, Optional, Sequence

from tools.servebench.requests import BenchRequest
from tools.servebench.tiered import Stop, never, percentile

if TYPE_CHECKING:
    from tools.servebench.harness import Harness


def qps_search(h: "Harness", method: str, stream: Iterator[BenchRequest], per_trial: int, slo_ms: float,
               start_rate: float, tolerance: float = 0.1, max_trials: int = 12, seed: int = 0,
               stop: Stop = never, trial_s: Optional[float] = None, max_per_trial: Optional[int] = None,
               on_trial: Optional[Callable[[], dict]] = None) -> dict:
    """Sustainable rate of `method` at p99 TTFT <= slo_ms (module docstring). Each trial
    takes the next `trial_size(rate, ...)` requests of `stream` (`per_trial` without
    `trial_s`); a trial whose p99 is sure to exceed the SLO before its end is cut short
    (Harness.run_poisson's `slo_ms`; `aborted` in the trial). `stop()` is asked before
    each trial: a reason ends the search where it is (`stopped`; `converged` says whether
    the bracket was narrow enough by then). `on_trial()` (optional): fields added to each
    trial's record, asked once before the first trial (its answer dropped: what came
    before the search) and after each trial (e.g. kernels compiled during it)."""
    from tools.servebench.harness import trial_size

    if on_trial is not None:
        on_trial()
    h.planner(method)
    best: Optional[float] = None
    fail: Optional[float] = None
    rate = start_rate
    tried = []
    stopped = None
    for i in range(max_trials):
        stopped = stop()
        if stopped:
            break
        n = trial_size(rate, per_trial, trial_s, max_per_trial)
        chunk = [next(stream) for _ in range(n)]
        info: dict = {}
        t0 = time.perf_counter()
        ttfts = h.run_poisson(chunk, rate, seed + i, info=info, slo_ms=slo_ms)
        aborted = bool(info.get("aborted"))
        p99 = None if aborted else percentile(ttfts, 99)
        ok = p99 is not None and p99 <= slo_ms
        tried.append({"rate": rate, "requests": n, "ttft_ms_p99": p99, "ttft_ms_p50": percentile(ttfts, 50),
                      "ok": ok, "aborted": aborted, "over_slo": info.get("over_slo"), "sent": info.get("sent", n),
                      "s": round(time.perf_counter() - t0, 3),
                      "hit_segments": info.get("hit_segments"), "miss_segments": info.get("miss_segments"),
                      **_where_time_went(info), **(on_trial() if on_trial is not None else {})})
        if ok:
            best = rate if best is None else max(best, rate)
        else:
            fail = rate if fail is None else min(fail, rate)
        if best is not None and fail is not None:
            if fail <= best or (fail - best) / fail <= tolerance:
                break
            rate = (best + fail) / 2
        elif best is None:
            rate = rate / 2
        else:
            rate = rate * 2
    converged = best is not None and fail is not None and (fail - best) / fail <= tolerance
    return {"method": method, "sustainable_qps": best or 0.0, "lowest_failed_qps": fail, "converged": converged,
            "tolerance": tolerance, "trial_s": trial_s, "trials": tried, "stopped": stopped}


def qps_repeats(h: "Harness", pool: Sequence[BenchRequest], per_trial: int, slo_ms: float, start_rate: float,
                repeats: int = 3, tolerance: float = 0.1, max_trials: int = 12, warmup: int = 0,
                methods: Sequence[str] = ("prefix", "pic"), seed: int = 0, on_repeat=None,
                stop: Stop = never, start_rates: Optional[dict[str, float]] = None,
                trial_s: Optional[float] = None, max_per_trial: Optional[int] = None,
                before_method: Optional[Callable[[str], None]] = None,
                on_trial: Optional[Callable[[], dict]] = None,
                before_search: Optional[Callable[[str, int], Optional[dict]]] = None) -> dict:
    """`qps_search` per method, `repeats` times; repeat j reads the pool from its own
    offset (the same requests for every method of that repeat). Before each search
    `warmup` requests of its stream run alone, then `per_trial` more as a Poisson burst at
    `start_rate` (untimed: the caches' steady state, and the one-time costs an engine's
    first concurrent requests pay, which would otherwise fail whichever method meets them
    first). `on_repeat(result so far)` after each repeat (a run stopped later keeps them).
    `stop()` is asked before each search and each trial: once it answers, the repeat under
    way is kept only when every method's search has a result (`stopped` names the reason;
    `repeats` holds the repeats done). `start_rates`: a method's own start rate (its burst
    and first trial), else `start_rate`. `trial_s` / `max_per_trial`: each trial's size
    (`trial_size`); the pool must then hold `repeats` x (warmup + per_trial + max_trials x
    max_per_trial) requests (`pool_needed`).

    `before_method(method)` (optional) makes the order method by method: it is called
    before a method's first search (e.g. emptying the daemon of what the method before
    stored, so each method has the tiers' bytes to itself) and may return the method's
    start rate (found then, e.g. over a corpus it has just indexed); that method then runs
    every repeat, then the next method. Without it, repeat by repeat (each repeat's
    methods one after the other). `on_trial`: qps_search's. `before_search(method, j)`
    (optional): called before each search, ahead of its warm-up (e.g. `Harness.empty`,
    so that every repeat starts from the same empty caches instead of what the repeats
    before cached); what it returns is kept in the search's record as `before`."""
    starts = {m: float((start_rates or {}).get(m) or start_rate) for m in methods}
    bad = {m: r for m, r in starts.items() if not (math.isfinite(r) and r > 0)}
    if bad:
        raise ValueError(f"qps_repeats: start rates must be finite and > 0, got {bad}")
    if trial_s is not None and not (math.isfinite(trial_s) and trial_s > 0):
        raise ValueError(f"qps_repeats: trial_s must be finite and > 0, got {trial_s}")
    if trial_s is not None and not (max_per_trial and max_per_trial >= per_trial):
        raise ValueError(f"qps_repeats: a trial_s needs max_per_trial >= per_trial ({per_trial}), got {max_per_trial}")
    need = pool_needed(1, warmup, per_trial, max_trials, max_per_trial if trial_s is not None else None)
    if len(pool) < need * repeats:
        raise ValueError(f"qps_repeats: the pool holds {len(pool)} requests, {need * repeats} are needed")

    def search(j: int, method: str) -> dict:
        stream = iter(pool[j * need:(j + 1) * need])
        before = before_search(method, j) if before_search is not None else None
        h.planner(method)
        for _ in range(warmup):
            h.run_alone(next(stream))
        h.run_poisson([next(stream) for _ in range(per_trial)], starts[method], seed + 100 * j - 1)
        out = qps_search(h, method, stream, per_trial, slo_ms, starts[method], tolerance, max_trials,
                         seed + 100 * j, stop, trial_s, max_per_trial, on_trial)
        if before is not None:
            out["before"] = before
        return out

    if before_method is not None:
        return _method_by_method(search, repeats, methods, stop, before_method, on_repeat, slo_ms, start_rate, starts)
    runs = []
    stopped = None
    for j in range(repeats):
        one: dict = {}
        for method in methods:
            stopped = stop()
            if stopped:
                break
            one[method] = search(j, method)
        done = _complete([one], methods)
        if not done:
            stopped = stopped or stop()
            break
        runs += done
        stopped = stop()
        if stopped:
            break
        if on_repeat is not None and j + 1 < repeats:
            on_repeat(_qps_stats(runs, methods, slo_ms, start_rate, starts))
    out = _qps_stats(runs, methods, slo_ms, start_rate, starts)
    out["stopped"] = stopped
    return out


def _method_by_method(search, repeats: int, methods: Sequence[str], stop: Stop, before_method, on_repeat,
                      slo_ms: float, start_rate: float, starts: dict[str, float]) -> dict:
    """`qps_repeats` method by method (its docstring): the repeats every method finished
    are kept, in order."""
    one: list[dict] = [{} for _ in range(repeats)]
    stopped = None
    for method in methods:
        stopped = stop()
        if stopped:
            break
        rate = before_method(method)
        if rate:  # the method's start rate, found by `before_method` (the searches read `starts`)
            starts[method] = float(rate)
        for j in range(repeats):
            stopped = stop()
            if stopped:
                break
            one[j][method] = search(j, method)
            if on_repeat is not None and method == methods[-1] and j + 1 < repeats:
                on_repeat(_qps_stats(_complete(one, methods), methods, slo_ms, start_rate, starts))
        if stopped:
            break
    out = _qps_stats(_complete(one, methods), methods, slo_ms, start_rate, starts)
    out["order"] = "method"
    out["stopped"] = stopped
    return out


def _complete(one: list[dict], methods: Sequence[str]) -> list[dict]:
    """The leading repeats every method has a search of, each with its gain."""
    runs = []
    for r in one:
        if any(m not in r or not r[m]["trials"] for m in methods):
            break
        p, c = r.get("prefix", {}).get("sustainable_qps"), r.get("pic", {}).get("sustainable_qps")
        r["gain_vs_prefix"] = (c / p) if p and c is not None else None
        runs.append(r)
    return runs


def _where_time_went(info: dict) -> dict:
    """A Poisson trial's `info` (Harness.run_poisson) in a few fields: the share of the
    prompt tokens computed in context, the median queue wait and host prefill time, the
    idle work run between arrivals and the connector counters' change (puts, loads)."""
    out: dict = {}
    prompt, computed = sum(info.get("prompt_tokens") or ()), sum(info.get("computed_tokens") or ())
    if prompt:
        out["computed_share"] = round(computed / prompt, 4)
    for k in ("queue_ms", "prefill_host_ms"):
        if info.get(k):
            out[f"{k}_p50"] = round(percentile(info[k], 50), 3)
    if "idle_ms" in info:
        out["idle_ms"], out["idle_calls"] = info["idle_ms"], info.get("idle_calls")
        out["idle_declined"] = info.get("idle_declined", 0)
    if info.get("connector"):
        out["connector"] = info["connector"]
    return out


def pool_needed(repeats: int, warmup: int, per_trial: int, max_trials: int, max_per_trial: Optional[int]) -> int:
    """Requests `qps_repeats` reads from its pool: per repeat the warm-up, the burst and
    `max_trials` trials of at most `max_per_trial` (or `per_trial`) requests."""
    return repeats * (warmup + per_trial + max_trials * (max_per_trial or per_trial))


def _qps_stats(runs: list, methods: Sequence[str], slo_ms: float, start_rate: float,
               starts: dict[str, float]) -> dict:
    """Median, min and max over the repeats so far."""
    out: dict = {"slo_ms": slo_ms, "start_rate": start_rate, "start_rates": dict(starts), "repeats": list(runs)}
    for method in methods:
        vals = [r[method]["sustainable_qps"] for r in runs]
        out[method] = ({"median": statistics.median(vals), "min": min(vals), "max": max(vals), "values": vals}
                       if vals else {"median": None, "min": None, "max": None, "values": []})
    gains = [r["gain_vs_prefix"] for r in runs if r["gain_vs_prefix"] is not None]
    out["gain_vs_prefix"] = ({"median": statistics.median(gains), "min": min(gains), "max": max(gains),
                              "values": gains} if gains else None)
    return out
