"""The measurements of the tiered serving benchmark (tools/bench_tiered.py), each on one
engine (a `Harness`) over the kvstore daemon (the QPS search: tools.servebench.qps_search):

- `working_set_sweep`: a document corpus whose signatures occupy `x` times the GPU tier
  (the daemon's GPU tier; on a machine without one, its CPU tier stands in: `stand_in`),
  grown point by point (0.5x, 2x, ...) by cold PIC requests of up to `build_docs` new
  documents (fewer near the target, so each point lands close to its multiple; the
  point records the multiple reached, `working_set_x_gpu_tier`); at each point requests drawn uniformly over the
  corpus (`docs_per_request` distinct documents in random order and a new question) run
  by full recompute and by PIC with every segment in the daemon's tiers. The engine's own
  device cache is off (StoreConnectorConfig.device_cache_bytes=0) and so are exact
  prefixes (PicConfig.exact_prefix=False): every hit comes from a daemon tier, counted per
  tier (`hits_by_tier`), with the bytes each tier moved (`load_bytes_by_tier`), what each
  tier holds (`stored_bytes_by_tier`) and the engine's device memory (`gpu_memory`); the
  hits the connector's cost admission computed instead of loading them, by tier
  (`skipped_slow_hits_by_tier`, not in `hits_by_tier`), and its read-rate estimates
  (`tier_read_rates`: engine.connector.tier_admission).
- `warm_up`: the TTFT procedure untimed on throwaway requests of each workload, so no
  timed request pays kernel compilation; `hits_by_source`: a set of runs' hits by where
  they came from (the engine's device cache, a daemon tier, exact prefixes).
- `cpu_tier_loads`: requests served with every hit loaded from the daemon's CPU tier
  (device cache off, puts into the CPU tier): the serving path's CPU -> GPU copies.
- `pinned_h2d_gbps`: pinned host -> device copy bandwidth on this machine (None without
  CUDA), the reference of `cpu_to_gpu_fraction_of_pcie_serving`.
- `serving_cpu_to_gpu`: bytes the PIC planners copied from the daemon's CPU tier into the
  engine's device and the device time of those copies (connector metrics
  `h2d_copy_bytes` / `h2d_copy_ms_total`), as GB/s (`gb_per_s`); `load_gb_per_s` divides
  the CPU-tier load bytes by the whole load time (RPCs and decode included).
- `break_even`: per preset, the disk bandwidth below which reading a hit costs more than
  recomputing it: signature bytes per token (the daemon's objects) / full-recompute
  milliseconds per token (the TTFT phase's full runs).
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Sequence

from tools.servebench.requests import BenchRequest, twin

if TYPE_CHECKING:  # the harness imports the engine (torch): not needed to summarize a run
    from tools.servebench.harness import Harness


def percentile(values: Sequence[float], q: float) -> Optional[float]:
    from tools.servebench.harness import percentile as pct

    return pct(values, q)

TIER_NAMES = ("gpu", "cpu", "nvme")

#: asked between units of work: why to stop now (tools.servebench.phase_clock), or None
Stop = Callable[[], Optional[str]]


def never() -> Optional[str]:
    return None


# ---------------------------------------------------------------------- TTFT
def method_order(i: int) -> tuple[str, str]:
    """The caching methods' order for the i-th request of `ttft_after_twin`: alternated,
    so neither method's runs all come first (or all overlap whatever the host does in
    one stretch of the run)."""
    return ("prefix", "pic") if i % 2 == 0 else ("pic", "prefix")


def ttft_after_twin(h: "Harness", reqs: Sequence[BenchRequest], mark=lambda method, state: None) -> dict:
    """TTFT per method (full, prefix, pic) in the layout of measure.ttft_by_method, each
    cache state set up the same way for prefix caching and PIC: *cold*, the request's
    segments and checkpoints deleted (daemon, device cache, trees) first; *warm*, the
    same, then only its twin run (tools.servebench.requests: the documents in another
    order; the request itself for `repeat`, the previous turn for `chat`), so neither
    method finds an exact repeat of the request unless the workload is one. The two
    caching methods run each request one after the other, first one then the other
    alternately (`method_order`), each timed run alone on a quiesced engine
    (Harness.run_alone). Each warm state records its requests' `breakdown`
    (tools.servebench.breakdown). `mark(method, state)` is called before each timed run
    (state "cold" / "warm"; "twin" before an untimed twin), e.g. to label what a
    kernel-launch recorder sees."""
    from tools.servebench.breakdown import ttft_breakdown
    from tools.servebench.measure import mean_store, summarize

    h.planner("full")
    mark("full", "cold")
    full = summarize([h.run_alone(r) for r in reqs])
    out: dict = {"full": {"cold": full, "warm": full}}
    cold: dict[str, list] = {"prefix": [], "pic": []}
    warm: dict[str, list] = {"prefix": [], "pic": []}
    for i, r in enumerate(reqs):
        for method in method_order(i):
            h.forget(r)
            h.planner(method, fresh=True)
            mark(method, "cold")
            cold[method].append(h.run_alone(r))
    for i, r in enumerate(reqs):
        t = twin(r)
        for method in method_order(i):
            h.forget(r)
            h.forget(t)
            h.planner(method, fresh=True)
            mark(method, "twin")
            h.run_alone(t)
            mark(method, "warm")
            warm[method].append(h.run_alone(r))
    for method in ("prefix", "pic"):
        out[method] = {"cold": summarize(cold[method]), "warm": summarize(warm[method])}
        out[method]["warm"]["store"] = mean_store(warm[method])
        out[method]["warm"]["breakdown"] = [ttft_breakdown(r) for r in warm[method]]
        out[method]["cold"]["hits_by_source"] = hits_by_source(cold[method])
        out[method]["warm"]["hits_by_source"] = hits_by_source(warm[method])
    out["prefix_reuse"] = out["prefix"]["warm"]["reuse_fraction"]
    return out


#: where a hit came from (`hits_by_source`): the engine's own device cache, a daemon tier
HIT_SOURCES = ("engine_device_cache",) + TIER_NAMES


def hits_by_source(runs: Sequence) -> dict:
    """Segment hits of `runs` (harness Runs) by where they were served from: the engine's
    own device cache (StoreReport.near_hits, no daemon round trip) or the daemon tier that
    held them at lookup (`gpu`, `cpu`, `nvme`); and exact prefixes restored, by source
    (`engine` tree, or the daemon tier of a stored checkpoint)."""
    out = dict.fromkeys(HIT_SOURCES, 0)
    prefixes: dict[str, int] = {}
    for r in runs:
        s = r.store or {}
        out["engine_device_cache"] += int(s.get("store_near_hits") or 0)
        for t, n in (s.get("store_hits_by_tier") or {}).items():
            out[t] = out.get(t, 0) + int(n)
        src = s.get("store_prefix_source")
        if src:
            name = src if src != "store" else f"store_{s.get('store_prefix_tier')}"
            prefixes[name] = prefixes.get(name, 0) + 1
    out["exact_prefixes"] = prefixes
    return out


def format_hits(hits: Optional[dict]) -> str:
    """`hits_by_source` in one log field: dev/gpu/cpu/nvme (+ exact prefixes)."""
    if not hits:
        return "-"
    text = "/".join(str(hits.get(k, 0)) for k in HIT_SOURCES)
    pre = hits.get("exact_prefixes") or {}
    return text + (" +prefix " + ",".join(f"{k}:{v}" for k, v in sorted(pre.items())) if pre else "")


def warm_up(h: "Harness", load, tasks: Sequence[str], n: int = 1, stop: Stop = never, mark=None) -> dict:
    """Untimed: `ttft_after_twin` on `n` throwaway requests of each of `tasks` (`load(task,
    n)` -> requests from a seed no measurement uses, the same size class as the timed
    ones), so every kernel shape the timed full, prefix and PIC requests use (cold, after
    a twin, exact prefixes, seams) is compiled before them; their segments and
    checkpoints are deleted afterwards. Returns the seconds it took and per task its
    requests' TTFTs (the compile cost a timed request would otherwise have paid); when
    `stop()` answers before a task, the tasks done and `stopped` (the reason). `mark`:
    ttft_after_twin's, with the task first (`mark(task, method, state)`)."""
    import time

    t0 = time.perf_counter()
    per: dict = {}
    stopped = None
    for task in tasks:
        stopped = stop()
        if stopped:
            break
        reqs = load(task, n)
        w = ttft_after_twin(h, reqs, (lambda m, s, _t=task: mark(_t, m, s)) if mark else (lambda m, s: None))
        per[task] = {m: {"cold_ms": w[m]["cold"]["ttft_ms"], "warm_ms": w[m]["warm"]["ttft_ms"]}
                     for m in ("full", "prefix", "pic")}
        for r in reqs:
            h.forget(r)
            h.forget(twin(r))
    return {"s": round(time.perf_counter() - t0, 3), "requests_per_workload": n, "workloads": list(per),
            "ttft_ms": per, "stopped": stopped}


# ---------------------------------------------------------------------- working-set sweep
@dataclass
class Corpus:
    """Documents (cacheable segments) and questions drawn from rag requests."""

    docs: list[dict]
    questions: list[dict]


def make_corpus(load, n_docs: int, seed: int) -> Corpus:
    """At least `n_docs` distinct documents from rag requests (`load(n, seed)` ->
    BenchRequests; their first cacheable segment, the shared system prompt, left out)."""
    docs: dict[str, dict] = {}
    questions: list[dict] = []
    batch = max(4, n_docs // 2)
    s = seed
    while len(docs) < n_docs:
        for r in load(batch, s):
            cached = [seg for seg in r.segments if seg["cache"]]
            for seg in cached[1:]:
                docs.setdefault(seg["text"], dict(seg))
            questions += [dict(seg) for seg in r.segments if not seg["cache"]]
        s += 1
    return Corpus(list(docs.values()), questions)


def corpus_request(corpus: Corpus, idx: Sequence[int], question: int, rid: str) -> BenchRequest:
    segs = tuple(corpus.docs[i] for i in idx) + (corpus.questions[question % len(corpus.questions)],)
    return BenchRequest(rid, "corpus", segs)


def stored_by_tier(h: "Harness", kind: str = "pic-signature") -> dict:
    """Bytes, objects and tokens of this model's `kind` objects per daemon tier."""
    fp = h.engine.loaded_model.fingerprint
    store = h.store
    store.flush()
    objs = store.link.call("list", lambda kv: kv.list(fingerprint=fp))
    out = {t: {"objects": 0, "bytes": 0, "tokens": 0} for t in TIER_NAMES}
    for o in objs:
        if (o.meta.extra or {}).get("kind") != kind:
            continue
        t = out.setdefault(o.tier, {"objects": 0, "bytes": 0, "tokens": 0})
        t["objects"] += 1
        t["bytes"] += o.size
        t["tokens"] += o.meta.token_count
    return out


def _total(by_tier: dict, field: str = "bytes") -> int:
    return sum(v[field] for v in by_tier.values())


def _gpu_memory(device) -> Optional[dict]:
    import torch

    if getattr(device, "type", "cpu") != "cuda":
        return None
    return {"allocated_bytes": torch.cuda.memory_allocated(device),
            "peak_allocated_bytes": torch.cuda.max_memory_allocated(device),
            "reserved_bytes": torch.cuda.memory_reserved(device)}


def working_set_sweep(h: "Harness", corpus_docs, tier_bytes: int, points: Sequence[float], requests_per_point: int,
                      docs_per_request: int, seed: int, stand_in: Optional[str] = None, build_docs: int = 4,
                      log=lambda msg: None, save=lambda points: None, stop: Stop = never) -> list[dict]:
    """The sweep (module docstring). `corpus_docs(n)` -> a Corpus of at least n documents
    (grown on demand); `h` runs PIC through the daemon with no engine-side caches. After
    each point `save(points so far)`. `stop()` is asked before each build request and
    each measured request: a point with at least one measured request is kept (its
    `requests` the number measured, `stopped` the reason), and no later point starts."""
    import torch

    rng = random.Random(seed)
    corpus = corpus_docs(64)
    built = 0  # documents of the corpus stored so far (computed by cold PIC requests)
    out: list[dict] = []
    for x in sorted(points):
        target = x * tier_bytes
        if stop():
            break
        while not stop():
            held = stored_by_tier(h)
            have = _total(held)
            if have >= target:
                break
            # up to build_docs documents per cold request, fewer when the gap is smaller
            # (by the mean signature size so far), so a point lands near its multiple
            per_doc = have / built if built else None
            k = 1 if not per_doc else max(1, min(build_docs, math.ceil((target - have) / per_doc)))
            if built + k > len(corpus.docs):
                corpus = corpus_docs(2 * len(corpus.docs) + k)
            h.planner("pic")
            h.run_alone(corpus_request(corpus, range(built, built + k), built, f"build-{built}"))
            built += k
        if stop():
            break
        n_docs = built
        snap0 = h.store.metrics.snapshot()
        if getattr(h.engine.device, "type", "cpu") == "cuda":
            torch.cuda.reset_peak_memory_stats(h.engine.device)
        hits = {t: 0 for t in TIER_NAMES}
        skipped = {t: 0 for t in TIER_NAMES}  # hits the cost admission did not load (computed in context)
        misses = 0
        full_ms, pic_ms = [], []
        pic_runs: list[dict] = []  # per PIC request: where its TTFT went
        for i in range(requests_per_point):
            if stop() and full_ms:
                break
            idx = rng.sample(range(n_docs), min(docs_per_request, n_docs))
            req = corpus_request(corpus, idx, rng.randrange(len(corpus.questions)), f"ws{x}-{i}")
            h.planner("full")
            full_ms.append(h.run_alone(req).ttft_ms)
            h.planner("pic")
            run = h.run_alone(req)
            pic_ms.append(run.ttft_ms)
            pic_runs.append({"ttft_ms": round(run.ttft_ms, 3), "full_ms": round(full_ms[-1], 3),
                             "hits_by_tier": run.store.get("store_hits_by_tier"),
                             "skipped_slow_hits_by_tier": run.store.get("store_skipped_slow_hits"),
                             "split_ms": {k: round(v, 3) for k, v in run.split.items()}, "timeline": run.timeline,
                             "rpcs": run.rpcs})
            for t, n in (run.store.get("store_hits_by_tier") or {}).items():
                hits[t] = hits.get(t, 0) + n
            for t, n in (run.store.get("store_skipped_slow_hits") or {}).items():
                skipped[t] = skipped.get(t, 0) + n
            misses += run.miss_segments
        snap1 = h.store.metrics.snapshot()
        moved = {t: snap1["load_bytes"].get(t, 0) - snap0["load_bytes"].get(t, 0) for t in TIER_NAMES}
        load_ms = {t: round(snap1["load_ms"].get(t, 0.0) - snap0["load_ms"].get(t, 0.0), 3) for t in TIER_NAMES}
        held = stored_by_tier(h)
        f_mean, p_mean = sum(full_ms) / len(full_ms), sum(pic_ms) / len(pic_ms)
        point = {"working_set_x_gpu_tier": round(_total(held) / tier_bytes, 3), "target_x": x,
                 "gpu_tier_bytes": tier_bytes, "gpu_tier_stand_in": stand_in, "corpus_docs": n_docs,
                 "corpus_bytes": _total(held), "requests": len(full_ms),
                 "stopped": stop() if len(full_ms) < requests_per_point else None, "docs_per_request": docs_per_request,
                 "ttft_ms_full_mean": f_mean, "ttft_ms_pic_mean": p_mean,
                 "ttft_ms_full_p50": percentile(full_ms, 50), "ttft_ms_pic_p50": percentile(pic_ms, 50),
                 "ttft_ms_pic_p99": percentile(pic_ms, 99), "ttft_vs_full": f_mean / p_mean if p_mean else None,
                 "hits_by_tier": hits, "skipped_slow_hits_by_tier": skipped, "miss_segments": misses,
                 "tier_read_rates": _read_rates(h), "load_bytes_by_tier": moved,
                 "load_ms_by_tier": load_ms, "stored_bytes_by_tier": {t: v["bytes"] for t, v in held.items()},
                 "gpu_memory": _gpu_memory(h.engine.device), "pic_requests": pic_runs}
        out.append(point)
        log(f"sweep {x}x: corpus {n_docs} docs ({_total(held) / 2**20:.1f} MiB), full {f_mean:.1f} ms, "
            f"pic {p_mean:.1f} ms, hits {hits}, skipped (slow) {skipped}, misses {misses}")
        save(out)
        if point["stopped"]:
            break
    return out


def _read_rates(h: "Harness") -> Optional[dict]:
    """The connector's measured read rate per tier (engine.connector.tier_admission)."""
    loader = getattr(getattr(h.store, "cache", None), "loader", None)
    return None if loader is None else loader.rates.snapshot()


# ---------------------------------------------------------------------- PCIe and break-even
def pinned_h2d_gbps(nbytes: int = 256 << 20, repeats: int = 5) -> Optional[float]:
    """Best of `repeats` timed copies of a pinned host buffer to the current CUDA device
    (GB/s); None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    best = 0.0
    for _ in range(repeats + 1):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src, non_blocking=True)
        b.record()
        b.synchronize()
        best = max(best, nbytes / (a.elapsed_time(b) * 1e-3) / 1e9)
    return best


def serving_cpu_to_gpu(snapshots: Sequence[dict]) -> dict:
    """CPU-tier loads summed over connector metric snapshots (the PIC planners' loads):
    bytes, milliseconds (each segment's RPC share, decode and device copy) and GB/s; the
    device copies' bytes, time and GB/s, and the host time issuing them (`issue_ms`,
    `copy_groups`: near `copy_ms`, the host bounds the copies)."""
    nbytes = sum((s.get("load_bytes") or {}).get("cpu", 0) for s in snapshots)
    ms = sum((s.get("load_ms") or {}).get("cpu", 0.0) for s in snapshots)
    loads = sum((s.get("loads") or {}).get("cpu", 0) for s in snapshots)
    copy_bytes = sum(s.get("h2d_copy_bytes", 0) for s in snapshots)
    copy_ms = sum(s.get("h2d_copy_ms_total", 0.0) for s in snapshots)
    issue_ms = sum(s.get("h2d_issue_ms_total", 0.0) for s in snapshots)
    return {"loads": loads, "bytes": nbytes, "ms": round(ms, 3),
            "load_gb_per_s": nbytes / (ms * 1e-3) / 1e9 if ms > 0 else None,
            "copy_bytes": copy_bytes, "copy_ms": round(copy_ms, 3), "issue_ms": round(issue_ms, 3),
            "copy_groups": sum(s.get("h2d_copy_groups", 0) for s in snapshots),
            "gb_per_s": copy_bytes / (copy_ms * 1e-3) / 1e9 if copy_ms > 0 else None}


def signature_parts(h: "Harness", limit: int = 16) -> dict:
    """What the bytes of this model's stored signatures are: per part kind (`k`, `v`,
    `state`, `tail_transition`, `conv_tail`, ...) and dtype, bytes summed over up to
    `limit` signatures read back from the daemon (their blob headers)."""
    from kvstore import format as fmt

    fp = h.engine.loaded_model.fingerprint
    store = h.store
    store.flush()
    objs = [o for o in store.link.call("list", lambda kv: kv.list(fingerprint=fp))
            if (o.meta.extra or {}).get("kind") == "pic-signature"][:limit]
    out: dict = {}
    if not objs:
        return out
    views = store.link.call("get", lambda kv: kv.get_many([o.key for o in objs], promote=False))
    for v in views:
        if v is None:
            continue
        try:
            header = fmt.read_header(v.tensor())
            for p in header.parts:
                key = f"{p.name.split('.', 1)[1]}:{p.dtype}"
                out[key] = out.get(key, 0) + p.length
        finally:
            v.release()
    return out


def break_even(stored: dict, workloads: dict) -> dict:
    """Break-even disk bandwidth of one preset (module docstring): `stored` is
    `stored_by_tier` of its signatures, `workloads` the TTFT phase's results."""
    nbytes, tokens = _total(stored), _total(stored, "tokens")
    ms = [w["full"]["warm"]["ttft_ms_mean"] / w["full"]["warm"]["prompt_tokens_mean"]
          for w in workloads.values() if w["full"]["warm"].get("prompt_tokens_mean")]
    per_token_ms = sum(ms) / len(ms) if ms else None
    per_token_bytes = nbytes / tokens if tokens else None
    gbps = (per_token_bytes / (per_token_ms * 1e-3) / 1e9) if per_token_bytes and per_token_ms else None
    return {"signature_bytes_per_token": per_token_bytes, "full_recompute_ms_per_token": per_token_ms,
            "break_even_read_gb_per_s": gbps, "signatures": _total(stored, "objects"),
            "rule": "a hit read below this bandwidth costs more than recomputing its tokens in a full pass"}


def cpu_tier_loads(h: "Harness", reqs: Sequence[BenchRequest]) -> dict:
    """The serving path's CPU tier -> device loads, measured on purpose: in the serve
    phase the engine's device cache and the daemon's GPU tier hold every warm hit, so
    this step runs `reqs` through a PIC planner of its own over the same daemon with no
    device cache (device_cache_bytes=0), no exact prefixes and puts into the CPU tier:
    each request cold (its segments deleted first, then computed and stored in the CPU
    tier), once warm untimed (compiles this path's kernels), once warm measured (every
    hit loads from the CPU tier, layer by layer where the connector does). Returns the
    measured pass's connector-metric deltas (`h2d_copy_bytes`, `h2d_copy_ms_total`, loads
    and bytes per tier), its hits by source and TTFTs; the planner's segments are deleted
    afterwards."""
    from dataclasses import replace

    from engine.connector.attach import attach_store

    for r in reqs:
        h.forget(r)
    planner = attach_store(h.engine, replace(h.pic_config, exact_prefix=False),
                           replace(h.connector, put_tier="cpu", device_cache_bytes=0, device_cache_fraction=None))
    try:
        for r in reqs:
            h.run_alone(r)  # cold: computed, stored in the CPU tier
        for r in reqs:
            h.run_alone(r)  # untimed warm pass
        m0 = planner.store.metrics.snapshot()
        runs = [h.run_alone(r) for r in reqs]
        m1 = planner.store.metrics.snapshot()
    finally:
        planner.store.close()
        h.planner("pic")
    for r in reqs:
        h.forget(r)
    delta = {k: m1.get(k, 0) - m0.get(k, 0)
             for k in ("h2d_copy_bytes", "h2d_copy_ms_total", "h2d_issue_ms_total", "h2d_copy_groups", "hits", "misses")}
    for k in ("loads", "load_bytes", "load_ms"):
        delta[k] = {t: m1[k].get(t, 0) - m0[k].get(t, 0) for t in TIER_NAMES}
    return {"requests": len(reqs), "connector": delta, "hits_by_source": hits_by_source(runs),
            "ttft_ms": [round(r.ttft_ms, 3) for r in runs],
            "gb_per_s": (delta["h2d_copy_bytes"] / (delta["h2d_copy_ms_total"] * 1e-3) / 1e9
                         if delta["h2d_copy_ms_total"] > 0 else None)}
