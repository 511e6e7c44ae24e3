"""One engine, switched between prefill methods, measured one request at a time or under
Poisson arrivals.

`Harness(engine, connector)` owns the planners of one engine: `full` and `prefix`
(engine.pic), and `pic` through the kvstore daemon (engine.connector, one store
connection reused by every run; with `connector=None`, PIC over the engine's private
in-process cache). With `prefix_store=True` prefix caching keeps its checkpoints in the
daemon too (engine.connector.prefix_planner, `--method prefix --store`: the tiers and
the byte budget PIC has), over the PIC planner's store connection. `planner(method,
fresh=True)` gives a planner with an empty cache where that makes sense (a new prefix
tree; for `pic`, `forget(request)` deletes the request's segments from the daemon
instead; `forget` deletes its exact-prefix checkpoints, prefix caching's too).

`run_alone` measures one request on an otherwise idle engine (`quiesce` first: idle
work drained, puts stored, the device finished): TTFT from the request's own timeline
(arrival -> first token sampled, the GPU synchronised by sampling), with the planner's
token and time split, the connector's store report and what else used the host while
it ran (`Run.host`: tools.servebench.host_usage). `run_poisson`
sends requests at exponential gaps (seeded) and returns each one's TTFT, queueing
included. Puts of signatures computed in a run are flushed after it, outside the
measurement.
"""
from __future__ import annotations

import contextlib
import math
import random
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from engine.connector.attach import attach_store
from engine.connector.config import StoreConnectorConfig
from engine.pic.config import PicConfig
from engine.pic.planner import make_planner
from engine.pic.prefix import prefix_bounds
from engine.runtime.sampling import SamplingParams
from tools.servebench.host_usage import HostUsage
from tools.servebench.requests import BenchRequest

METHODS = ("full", "prefix", "pic")


@dataclass
class Run:
    """One request measured alone."""

    id: str
    ttft_ms: float
    prompt_tokens: int
    reused_tokens: int
    hit_segments: int
    miss_segments: int
    split: dict[str, float] = field(default_factory=dict)  # lookup/miss/load_compose/seam/suffix/fused/checkpoint ms
    store: dict[str, Any] = field(default_factory=dict)
    #: where the TTFT went on the host's clock: queue_ms (arrival -> admission: planning
    #: included), prefill_host_ms (the plan's steps as the host ran them; the device may
    #: still be working), after_ms (the rest: device drain, first token sampled)
    timeline: dict[str, float] = field(default_factory=dict)
    #: daemon calls made while the request was in flight, by name (`Harness.counting_rpcs`)
    rpcs: dict[str, int] = field(default_factory=dict)
    #: the step times were device-synchronised (LLMEngine.sync_timings on CUDA)
    synced: bool = False
    #: what else used the host while the request was in flight (tools.servebench.host_usage)
    host: dict[str, Any] = field(default_factory=dict)


class Harness:
    """See the module docstring."""

    def __init__(self, engine, connector: Optional[StoreConnectorConfig], pic: PicConfig = PicConfig(),
                 trace_dir: Optional[str] = None, prefix_store: bool = False) -> None:
        self.engine = engine
        #: prefix caching with its checkpoints in the daemon too (module docstring)
        self.prefix_store = prefix_store and connector is not None
        #: where `run_alone(..., trace=NAME)` writes torch.profiler traces (None: never)
        self.trace_dir = trace_dir
        #: `run_poisson` runs the engine's idle work (queued alone passes and their puts)
        #: between arrivals; False: it only waits (a diagnostic: requests without background work)
        self.idle_between_arrivals = True
        self.connector = connector
        self.pic_config = pic
        self._planners: dict[str, Any] = {}
        self._store_planner = None
        self._timed_planner = None
        self._ids = 0
        #: processes whose CPU time `run_alone` accounts per request, by name (e.g. the
        #: kvstore daemon: tools.servebench.host_usage)
        self.pids: dict[str, int] = {}

    # ------------------------------------------------------------------ planners
    def planner(self, method: str, fresh: bool = False):
        """Install and return the planner of `method` (see the module docstring)."""
        if method == "pic" and self.connector is not None:
            if self._store_planner is None:
                self._store_planner = attach_store(self.engine, self.pic_config, self.connector)
            planner = self._store_planner
        elif method == "prefix" and self.prefix_store:
            planner = self._planners.get(method)
            if planner is None or fresh:
                planner = self._store_prefix_planner()
                self._planners[method] = planner
        else:
            planner = self._planners.get(method)
            if planner is None or fresh:
                m = self.engine.runner.model
                # the baselines run PIC's kernel setting too (PicConfig.kernel): the same kernels for every method
                cfg = self.pic_config if method == "pic" else PicConfig(method=method, kernel=self.pic_config.kernel)
                planner = make_planner(cfg, m, self.engine.loaded_model.fingerprint, self.engine.tokenizer)
                self._planners[method] = planner
        self.engine.scheduler.planner = planner
        return planner

    def pic_planner(self):
        """The `pic` planner (created on first use), leaving the engine's installed
        planner as it is: what `store`, `keys_of` and `forget` use, so that reading the
        store or making a request cold never switches the method a run is timed with."""
        current = self.engine.scheduler.planner
        try:
            return self.planner("pic")
        finally:
            self.engine.scheduler.planner = current

    def _store_prefix_planner(self):
        """A `prefix` planner with a new (empty) tree whose checkpoints go to the daemon,
        over the PIC planner's store connection, its tree bounded as PIC's exact prefixes
        are (PicConfig.prefix_cache_bytes)."""
        from engine.connector.prefix_planner import StorePrefixPlanner
        from engine.pic.prefix import PrefixTree

        pic = self.pic_planner()
        cfg = PicConfig(method="prefix", prefix_cache_bytes=self.pic_config.prefix_cache_bytes,
                        kernel=self.pic_config.kernel)
        return StorePrefixPlanner(cfg, PrefixTree(cfg.prefix_cache_bytes), self.engine.device, pic.store.cache,
                                  pic.store.checkpoints)

    def timed_pic_planner(self):
        """A PIC planner through the daemon that synchronises the device at every timing
        mark (an exact TTFT split, at a small cost): for the breakdown of a hit."""
        if self._timed_planner is None:
            from dataclasses import replace

            # no engine-side device cache, no exact prefixes: the breakdown measures segment loads
            # from the daemon's tiers
            self._timed_planner = attach_store(self.engine, replace(self.pic_config, sync_timing=True,
                                                                    exact_prefix=False),
                                               replace(self.connector, device_cache_bytes=0))
        self.engine.scheduler.planner = self._timed_planner
        return self._timed_planner

    @property
    def store(self):
        return self.pic_planner().store

    def keys_of(self, req: BenchRequest) -> list[bytes]:
        """The segment keys PIC uses for `req` (same tokenisation as the engine)."""
        planner = self.pic_planner()
        ids, segs = self.engine._tokenize(req.as_prompt(), None)
        return planner.segment_keys(ids, segs)

    def forget(self, req: BenchRequest) -> None:
        """Delete `req`'s segments and exact-prefix checkpoints from the daemon and from
        every PIC planner's device cache and prefix tree in this harness (a cold start
        for PIC); without a daemon, from the engine's in-process caches."""
        keys = self.keys_of(req)
        ids, segs = self.engine._tokenize(req.as_prompt(), None)
        bounds = prefix_bounds(segs)
        for p in (self._planners.get("pic"), self._store_planner, self._timed_planner):
            if p is not None and p.exact is not None and bounds:  # its exact prefixes too
                p.exact.forget(ids, bounds)
        if self.connector is None:  # PIC over the engine's in-process cache
            self.pic_planner().cache.discard(keys)
            return
        for p in (self._store_planner, self._timed_planner):
            if p is not None:
                p.store.near.discard(keys)
        if bounds:  # engine.connector.prefix_store's keys of its prefixes
            keys += [self.pic_planner().store.checkpoints.key(ids[:hi]) for _, hi in bounds]
        if keys:
            self.store.flush()
            self.store.link.call("delete", lambda kv: kv.delete(keys))

    def purge(self) -> int:
        """Delete every object of this engine's model from the daemon (frees the tiers
        between presets); returns how many were deleted."""
        fp = self.engine.loaded_model.fingerprint
        store = self.store
        store.flush()
        deleted = 0
        while True:
            objs = store.link.call("list", lambda kv: kv.list(fingerprint=fp, limit=1000))
            if not objs:
                return deleted
            deleted += store.link.call("delete", lambda kv: kv.delete([o.key for o in objs]))

    def empty(self, method: str) -> dict:
        """Start `method` over from empty caches (a cold-stream repeat that does not
        inherit what the repeat before cached): its queued idle work is run out and its
        puts stored first, then every object of the model goes from the daemon (`purge`),
        and the method's in-process caches are emptied: for `pic` the device signature
        cache and the exact-prefix tree of every PIC planner of this harness, for `prefix`
        a fresh planner (a new, empty tree). What went, by place."""
        self.planner(method)
        out = {"idle_drained": self.drain_idle()}
        out["daemon_objects"] = self.purge()
        if method == "pic":
            near = exact = 0
            for p in (self._planners.get("pic"), self._store_planner, self._timed_planner):
                if p is None:
                    continue
                if getattr(p, "store", None) is not None and hasattr(p.store, "near"):
                    near += p.store.near.clear()
                elif hasattr(p, "cache") and hasattr(p.cache, "clear"):  # PIC over the in-process cache
                    near += p.cache.clear()
                if p.exact is not None:
                    exact += p.exact.clear()
                p.deferred.clear()  # drained above; forgets the keys seen once (idle_alone_passes)
            out["device_signatures"], out["exact_prefix_nodes"] = near, exact
        elif method == "prefix":
            out["prefix_nodes"] = self.engine.scheduler.planner.tree.num_nodes
            self.planner("prefix", fresh=True)
        return out

    def drain_idle(self) -> int:
        """Run the planner's idle work (cold-fallback segments queued by earlier requests,
        PicConfig.cold_full_fraction) until there is none; how many segments it computed."""
        done = 0
        while True:
            n = self.engine.help_idle()
            if not n:
                return done
            done += n

    def close(self) -> None:
        for p in (self._store_planner, self._timed_planner):
            if p is not None:
                p.store.close()

    @contextlib.contextmanager
    def counting_rpcs(self):
        """Count the daemon calls (StoreLink.call, any thread) of this harness's store
        connections while the block runs; yields the counts by call name."""
        counts: dict[str, int] = {}
        links = {id(p.store.link): p.store.link for p in (self._store_planner, self._timed_planner)
                 if p is not None and getattr(getattr(p, "store", None), "link", None) is not None}
        for link in links.values():
            def call(what, fn, _real=link.call):
                counts[what] = counts.get(what, 0) + 1
                return _real(what, fn)
            link.call = call  # an instance attribute over the method, removed below
        try:
            yield counts
        finally:
            for link in links.values():
                del link.call

    # ------------------------------------------------------------------ runs
    def _rid(self, base: str) -> str:
        self._ids += 1
        return f"{base}#{self._ids}"

    def run_alone(self, req: BenchRequest, max_new_tokens: int = 1, trace: Optional[str] = None) -> Run:
        """`trace`: with a `trace_dir`, profile this run (torch.profiler, host and device)
        and write `<trace>.json` (Chrome trace) and `<trace>.txt` (op tables) there; the
        idle work the run queued (cold-fallback segments) is profiled apart as
        `<trace>-idle`."""
        engine, planner = self.engine, self.engine.scheduler.planner
        rid = self._rid(req.id)
        self.quiesce()
        prof = start_profile() if (trace and self.trace_dir) else None
        usage = HostUsage(self.pids).start()
        with self.counting_rpcs() as rpcs:
            engine.add_request(req.as_prompt(), SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True),
                               request_id=rid)
            final = None
            while final is None:
                for out in engine.step():
                    if out.request_id == rid and out.finished:
                        final = out
        used = usage.stop()
        if final.error is not None or final.timeline.ttft is None:  # the engine failed it: say why, not a TypeError
            raise RuntimeError(f"request {rid} failed in the engine: {final.error or 'no first token'}")
        if prof is not None:
            write_profile(prof, self.trace_dir, trace)
        rep = planner.take_report(rid)
        take = getattr(planner, "take_store_report", None)
        sr = take(rid) if take else None
        if prof is not None and getattr(planner, "deferred", None):  # the idle work it queued, profiled apart
            idle = start_profile()
            self.drain_idle()
            write_profile(idle, self.trace_dir, f"{trace}-idle")
        self.drain_idle()  # requests alone: the engine is idle before the next one arrives
        if hasattr(planner, "store"):
            planner.store.flush()
        d = rep.as_dict() if rep is not None else {}
        split = {k: d.get(k, 0.0) for k in ("lookup_ms", "miss_ms", "load_compose_ms", "seam_ms", "suffix_ms",
                                            "fused_ms", "checkpoint_ms")}
        tl = final.timeline
        timeline = {}
        if tl.scheduled is not None and tl.first_token is not None:
            host = sum(tl.prefill_split.values())
            timeline = {"queue_ms": (tl.scheduled - tl.arrival) * 1e3, "prefill_host_ms": host * 1e3,
                        "after_ms": (tl.first_token - tl.scheduled - host) * 1e3}
        return Run(req.id, tl.ttft * 1e3, final.num_prompt_tokens, d.get("reused_tokens", 0),
                   d.get("hit_segments", 0), d.get("miss_segments", 0), split, sr.as_dict() if sr else {}, timeline,
                   dict(rpcs), bool(engine.sync_timings and engine.device.type == "cuda"), used)

    def quiesce(self) -> None:
        """Before a request alone: nothing of earlier runs left to overlap it. The
        engine's idle work is drained and queued puts are stored (as after every
        `run_alone`; again here, for whatever ran in between), and on CUDA the device
        has finished every stream's work (idle passes, put copies on side streams)."""
        self.drain_idle()
        planner = self.engine.scheduler.planner
        if hasattr(planner, "store"):
            planner.store.flush()
        if getattr(self.engine.device, "type", "cpu") == "cuda":
            import torch

            torch.cuda.synchronize(self.engine.device)

    def run_poisson(self, reqs: Sequence[BenchRequest], rate: float, seed: int,
                    max_new_tokens: int = 4, info: Optional[dict] = None,
                    slo_ms: Optional[float] = None) -> list[float]:
        """TTFTs (ms) of `reqs` arriving as a Poisson process of `rate` per second. `info`
        (optional) gets where the time went: `queue_ms` per request (arrival to
        scheduling), `idle_calls` / `idle_ms` (idle work run between arrivals; it gives
        way, between layers, to a request that is due), `idle_stopped` (idle passes
        dropped for one), `idle_declined` (misses not queued for an idle alone pass because
        they were seen for the first time, PicConfig.idle_alone_passes), `hit_segments` /
        `miss_segments` (summed over the requests' reports), and per request
        `prompt_tokens`, `computed_tokens` (run through the model in context for it) and
        `prefill_host_ms` (host wall time of its prefill steps).

        `slo_ms` (optional) ends the run early once its p99 TTFT is sure to exceed the SLO
        (`over_slo_certain`: more than 1% of the requests, plus one, have a TTFT above it or
        are still waiting for their first token past it): the requests not yet arrived are
        not sent, those in the engine are aborted, and `info` gets `aborted: True` with
        `over_slo` (that count) and `sent` (requests added to the engine). The TTFTs
        returned are then those of the requests that got a first token; a caller must read
        the run as failed, not take their p99."""
        engine, planner = self.engine, self.engine.scheduler.planner
        rng = random.Random(seed)
        t = time.perf_counter() + 0.01
        arrivals = deque()
        for r in reqs:
            arrivals.append((t, r))
            t += rng.expovariate(rate)
        params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
        ttfts: dict[str, float] = {}
        queued: dict[str, float] = {}
        host_ms: dict[str, float] = {}
        ids: list[str] = []
        arrived: dict[str, float] = {}  # request id -> arrival, while it has no first token
        over = 0  # requests whose first token came after the SLO
        aborted = False
        idle_calls, idle_s = 0, 0.0
        stopped0 = getattr(planner, "idle_stopped", 0)
        declined0 = _declined(planner)
        m0 = _connector_counts(planner)
        while arrivals or engine.has_unfinished():
            now = time.perf_counter()
            while arrivals and arrivals[0][0] <= now:
                at, r = arrivals.popleft()
                rid = self._rid(r.id)
                ids.append(rid)
                engine.add_request(r.as_prompt(), params, request_id=rid, arrival_time=at)
                if slo_ms is not None:
                    arrived[rid] = at
            if slo_ms is not None and not aborted and arrived:
                for rid in list(arrived):
                    tl = engine.get_request(rid).timeline  # still in the engine: finished ones left below
                    if tl.first_token is not None:
                        over += tl.ttft * 1e3 > slo_ms
                        del arrived[rid]
                late = sum(1 for at in arrived.values() if (now - at) * 1e3 > slo_ms)
                if over_slo_certain(over + late, len(reqs)):
                    aborted, over = True, over + late
                    arrivals.clear()
                    for rid in list(arrived):
                        engine.abort(rid)
                    arrived.clear()
            if not engine.has_unfinished():
                t_idle = time.perf_counter()
                # idle work (cold-fallback segments) between arrivals; it gives way when the
                # next request is due, as the server's loop lets it give way to a new request
                did = self.idle_between_arrivals and engine.help_idle(
                    should_stop=lambda: bool(arrivals) and arrivals[0][0] <= time.perf_counter())
                idle_s += time.perf_counter() - t_idle
                if did:
                    idle_calls += 1
                elif arrivals:
                    time.sleep(max(0.0, min(arrivals[0][0] - time.perf_counter(), 0.05)))
                continue
            for out in engine.step():
                if out.finished and out.request_id in arrived:  # finished before the check saw its first token
                    del arrived[out.request_id]
                    over += out.timeline.ttft is not None and out.timeline.ttft * 1e3 > slo_ms
                if out.finished and out.timeline.ttft is not None:
                    ttfts[out.request_id] = out.timeline.ttft * 1e3
                    tl = out.timeline
                    if tl.scheduled is not None:
                        queued[out.request_id] = (tl.scheduled - tl.arrival) * 1e3
                    host_ms[out.request_id] = sum(tl.prefill_split.values()) * 1e3
        hits = misses = 0
        prompt, computed = [], []
        for rid in ids:
            rep = planner.take_report(rid)
            if rep is not None:
                hits, misses = hits + rep.hit_segments, misses + rep.miss_segments
                prompt.append(rep.prompt_tokens)
                computed.append(rep.recomputed_tokens - rep.miss_tokens)
            take = getattr(planner, "take_store_report", None)
            if take:
                take(rid)
        if hasattr(planner, "store"):
            planner.store.flush()
        if info is not None:
            if slo_ms is not None:
                info.update(aborted=aborted, over_slo=over, sent=len(ids))
            m1 = _connector_counts(planner)
            if m0 is not None and m1 is not None:
                info["connector"] = {k: m1[k] - m0[k] for k in m1}
            info.update(queue_ms=[round(queued[i], 3) for i in ids if i in queued], idle_calls=idle_calls,
                        idle_ms=round(idle_s * 1e3, 3), idle_stopped=getattr(planner, "idle_stopped", 0) - stopped0,
                        idle_declined=_declined(planner) - declined0,
                        hit_segments=hits, miss_segments=misses, prompt_tokens=prompt, computed_tokens=computed,
                        prefill_host_ms=[round(host_ms[i], 3) for i in ids if i in host_ms])
        return [ttfts[i] for i in ids if i in ttfts]


#: connector counters a Poisson run reports the change of (`info["connector"]`)
_CONNECTOR_COUNTS = ("put_bytes", "puts_stored", "puts_dropped", "puts_failed", "prefix_puts", "hits", "misses",
                     "near_hits", "deferred_computed", "deferred_ms_total", "put_ms_total", "load_ms_total",
                     "load_wait_ms_total", "promotions")


def _declined(planner) -> int:
    """Misses the planner's deferred queue did not queue, seen once (idle_alone_passes)."""
    return getattr(getattr(planner, "deferred", None), "declined", 0)


def _connector_counts(planner) -> Optional[dict]:
    """The planner's store connector counters (`_CONNECTOR_COUNTS`, and loads / load
    bytes per tier), None without a store connector."""
    metrics = getattr(getattr(planner, "store", None), "metrics", None)
    if metrics is None or not hasattr(metrics, "snapshot"):
        return None
    snap = metrics.snapshot()
    out = {k: snap[k] for k in _CONNECTOR_COUNTS if isinstance(snap.get(k), (int, float))}
    for k in ("loads", "load_bytes"):
        for t, v in (snap.get(k) or {}).items():
            out[f"{k}_{t}"] = v
    return out


def trial_size(rate: float, per_trial: int, trial_s: Optional[float], max_per_trial: Optional[int]) -> int:
    """Requests of a trial at `rate`: `per_trial`, or with `trial_s` enough for `trial_s`
    seconds of arrivals (at least `per_trial`, at most `max_per_trial`). A trial must last
    long enough for an overloaded queue to show: a burst of a few requests passes any
    rate once they fit in the SLO back to back."""
    if trial_s is None:
        return per_trial
    n = max(per_trial, math.ceil(rate * trial_s))
    return min(n, max_per_trial) if max_per_trial else n


def over_slo_certain(over: int, n: int) -> bool:
    """Whether `over` of `n` TTFTs above the SLO already put the p99 (numpy's linear
    interpolation) above it whatever the others are: the p99 lies at 0.99 (n - 1) in the
    sorted values, so with `over` above the SLO it sits among them (or between two of
    them) once over >= 0.01 (n - 1) + 1."""
    return n > 0 and 100 * (over - 1) >= n - 1  # over >= 0.01 (n - 1) + 1, in integers


def percentile(values: Sequence[float], q: float) -> Optional[float]:
    if not values:
        return None
    import numpy as np

    return float(np.percentile(list(values), q))


def start_profile():
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    prof = profile(activities=acts)
    prof.__enter__()
    return prof


def write_profile(prof, directory: str, name: str) -> None:
    from pathlib import Path

    prof.__exit__(None, None, None)
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(d / f"{name}.json"))
    from tools.profile_engine import torch_tables

    (d / f"{name}.txt").write_text(torch_tables(prof, 40))
