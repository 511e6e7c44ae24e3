"""`DaemonSegmentStore`: engine.pic's `SegmentStore` over the kvstore daemon (through a
`StoreSignatureCache`, engine.connector.store_cache), so that loads overlap compute and
cold segments are computed once across engines; `store_pic_planner` builds a
`PicPlanner` over one; `StoreReport` is its side of a request.

What each call of the SegmentStore contract (engine.pic.segment_store) does here:

1. `admit` (plan time): the engine's own device cache answers first (no daemon round
   trip); the rest of the request's keys go to the loader as one batch (one Lookup, then
   one Get per tier group on the loader thread), with the planner's per-key compute
   estimate for the cost admission (engine.connector.tier_admission: hits slower to load
   than to compute are skipped, `slow_hits`). `hint` (queued requests, `prefetch_queued` of them while
   the daemon answers): lookup + NVMe -> CPU promotion, no lease. Requests admitted
   together load in admission order while earlier ones prefill.
2. `lookup`: waits only for the batch's Lookup answer (bounded by `load_timeout_s`):
   device-cache hits come with their signature, daemon hits as None (taken at their
   splice), so the `miss` step runs while the hits load.
3. `claim`: claims every miss through the daemon (StoreSignatureCache.claim), computes
   the ones this engine won in one packed pass (queuing each put as soon as the pass is
   done: other engines may be waiting for it), then waits (bounded) for the ones another
   engine is computing, and computes those that did not arrive. With cold sharing
   (engine.connector.coldshare, `share_cold`) and several misses: it first offers all but
   the first ones (`share_keep` of the cold tokens) to idle engines, claims and computes
   in prompt order in packs of `share_pack_tokens` (a segment a helper claimed answers
   INFLIGHT and is waited for after the others, bounded by `share_wait_s`), and withdraws
   its offers.
4. `take`: takes each pending hit from the loader (blocking only until that segment is
   placed: `take_wait_ms`) and makes the compute stream wait on the device copies of
   exactly the segments about to be spliced. A hit that could not be loaded after all
   (evicted between Lookup and Get) answers None: the planner computes and publishes it.
5. `finish`: leases released, the loader batch finished, the request's `StoreReport`
   kept for `take_report` when its prefill completed.

Idle work: `claim_jobs` looks the planner's queued segments up and claims those no
engine holds or computes; `offered` takes segments other engines offered (one pack,
claimed); `publish_jobs` stores what the pass computed under those claims,
`release_jobs` drops the claims of a pass that gave way (waiters compute or claim
again). Exact-prefix checkpoints go through engine.connector.prefix_store.

Failure: nothing raises into a request; a daemon that is away makes lookups miss,
claims compute and puts fail (counted in `metrics`). Called from the engine loop's
thread only; the cache's loader and put threads guard their own state.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from engine.connector.claims import INFLIGHT, OWNED, PRESENT, WAITED, Claim
from engine.connector.coldshare import ColdSegment, ColdShare, own_share
from engine.connector.loader import LoadBatch, LoadedSegment
from engine.connector.metrics import overlap_fraction
from engine.connector.prefix_store import PrefixCheckpointStore
from engine.connector.store_cache import StoreSignatureCache
from engine.pic.config import PicConfig
from engine.pic.planner import PicPlanner, anchor_for
from engine.pic.prefix import merge_path, path_to, usable_path
from engine.pic.segment_store import ClaimedJob, ComputeFn, Filled, SegmentJob, SegmentStore
from engine.pic.signature import SegmentSignature

log = logging.getLogger("engine.connector")

TIERS = ("gpu", "cpu", "nvme")
#: finished requests' reports kept for `take_report` (the oldest go)
MAX_REPORTS = 4096


@dataclass
class StoreReport:
    """The store side of one request's prefill (module docstring)."""

    request_id: str
    segments: int = 0  # distinct cached segments in the prompt
    hits_by_tier: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    #: hits not loaded (their load expected slower than computing them; tier_admission
    #: "cost"): key -> the tier that held it (SegmentStore.slow_hits)
    skipped: dict[bytes, str] = field(default_factory=dict, repr=False)
    computed: int = 0  # computed alone here
    claimed: int = 0  # computed here under a claim other engines could see
    waited: int = 0  # computed by another engine while this one waited
    offloaded: int = 0  # of those, segments this request offered to idle engines (cold sharing)
    wait_inflight_ms: float = 0.0
    load_wait_ms: float = 0.0  # engine loop blocked on this request's loads
    copies_pending_at_use: int = 0  # device copies not finished when their splice began
    device_wait_ms: float = 0.0  # splice waiting for device copies (measured only with PicConfig.sync_timing)
    take_wait_ms: float = 0.0  # splice steps waiting for the loader to place their segments
    fallback: bool = False  # the daemon was unavailable: served by recomputation
    batch: Optional[LoadBatch] = None
    loaded: dict[bytes, LoadedSegment] = field(default_factory=dict, repr=False)  # key -> segment spliced
    pending: set[bytes] = field(default_factory=set, repr=False)  # hits at lookup, not taken yet
    held: list[bytes] = field(default_factory=list, repr=False)  # keys whose leases the request holds
    late_misses: int = 0  # hits at lookup that could not be loaded (evicted, corrupt): computed at splice
    near: dict[bytes, SegmentSignature] = field(default_factory=dict, repr=False)  # from the device cache
    #: segments copied layer by layer whose waits the fused pass makes per layer (layer_hook)
    layered: list[LoadedSegment] = field(default_factory=list, repr=False)
    near_hits: int = 0  # segments spliced from the engine's device cache (no daemon round trip)
    prefix_source: Optional[str] = None  # exact prefix restored from: "engine" (its tree), "store" (the daemon)
    prefix_tier: Optional[str] = None  # the daemon tier that held it (source "store")
    prefix_tokens: int = 0  # positions restored from it

    @property
    def load_ms(self) -> float:
        """Latency of the request's batch load (admission -> last copy complete)."""
        return 0.0 if self.batch is None else self.batch.load_ms

    @property
    def skipped_by_tier(self) -> dict[str, int]:
        """`skipped` counted by tier."""
        out = dict.fromkeys(TIERS, 0)
        for tier in self.skipped.values():
            out[tier if tier in out else "cpu"] += 1
        return out

    def as_dict(self) -> dict:
        load = self.load_ms
        return {
            "store_segments": self.segments, "store_hits": sum(self.hits_by_tier.values()),
            "store_hits_by_tier": dict(self.hits_by_tier), "store_skipped_slow_hits": self.skipped_by_tier,
            "store_computed": self.computed,
            "store_claimed": self.claimed, "store_waited": self.waited, "store_offloaded": self.offloaded,
            "store_wait_inflight_ms": round(self.wait_inflight_ms, 3), "store_load_ms": round(load, 3),
            "store_load_wait_ms": round(self.load_wait_ms, 3),
            "store_load_overlap": overlap_fraction(load, self.load_wait_ms + self.device_wait_ms),
            "store_take_wait_ms": round(self.take_wait_ms, 3), "store_device_wait_ms": round(self.device_wait_ms, 3),
            "store_copies_pending_at_use": self.copies_pending_at_use,
            "store_late_misses": self.late_misses, "store_fallback": self.fallback,
            "store_near_hits": self.near_hits, "store_prefix_source": self.prefix_source,
            "store_prefix_tier": self.prefix_tier, "store_prefix_tokens": self.prefix_tokens,
        }


class DaemonSegmentStore(SegmentStore):
    """Segment signatures in the kvstore daemon (module docstring)."""

    def __init__(self, cache: StoreSignatureCache, anchor_tokens: int = 0, prefetch_queued: int = 4,
                 checkpoints: Optional[PrefixCheckpointStore] = None, sync_timing: bool = False) -> None:
        self.cache = cache
        self.anchor_tokens = anchor_tokens
        self.prefetch_queued = prefetch_queued
        #: exact-prefix checkpoints in the daemon (engine.connector.prefix_store); None: kept nowhere
        self.checkpoints = checkpoints
        self.sync_timing = sync_timing
        self._requests: dict[str, StoreReport] = {}
        self._reports: OrderedDict[str, StoreReport] = OrderedDict()

    # ------------------------------------------------------------ the cache's public surface
    @property
    def metrics(self):
        return self.cache.metrics

    @property
    def available(self) -> bool:
        return self.cache.available

    @property
    def link(self):
        return self.cache.link

    @property
    def share(self) -> Optional[ColdShare]:
        return self.cache.share

    @property
    def near(self):
        return self.cache.near

    def near_get(self, key: bytes) -> Optional[SegmentSignature]:
        return self.cache.near_get(key)

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued put finished (True) or `timeout` passed."""
        return self.cache.flush(timeout)

    def close(self, timeout: float = 30.0) -> None:
        self.cache.close(timeout=timeout)

    def register_metrics(self, registry) -> None:
        from engine.connector.metrics import PrometheusCollector

        registry.register(PrometheusCollector(self.cache.metrics))

    def take_report(self, request_id: str) -> Optional[StoreReport]:
        return self._reports.pop(request_id, None)

    # ------------------------------------------------------------ plan time
    def admit(self, request_id: str, keys: Sequence[bytes], prefix=None,
              compute_ms: Optional[dict[bytes, float]] = None) -> None:
        sr = StoreReport(request_id, segments=len(keys))
        if prefix is not None:
            sr.prefix_source, sr.prefix_tokens, sr.prefix_tier = prefix.source, prefix.end, prefix.tier
        if keys:  # none after an exact prefix that covers every cached segment
            for k in keys:  # the engine's own device cache first: no daemon round trip for those
                sig = self.cache.near_get(k)
                if sig is not None:
                    sr.near[k] = sig
            rest = [k for k in keys if k not in sr.near]
            if rest:
                sr.batch = self.cache.prefetch(request_id, rest, compute_ms)
        self._requests[request_id] = sr

    def hint_depth(self) -> int:
        return self.prefetch_queued if self.cache.available else 0

    def hint(self, keys: Sequence[bytes]) -> None:
        self.cache.hint(keys)

    # ------------------------------------------------------------ request steps
    def _report(self, request_id: str, keys: Sequence[bytes] = ()) -> StoreReport:
        if request_id not in self._requests:
            self.admit(request_id, keys)
        return self._requests[request_id]

    def lookup(self, request_id: str, keys: Sequence[bytes]) -> dict[bytes, Optional[SegmentSignature]]:
        sr = self._report(request_id, keys)
        batch = sr.batch
        hits: set[bytes] = set()
        if batch is not None:
            if batch.wait_lookup(self.cache.config.load_timeout_s):
                hits = batch.hits
                sr.skipped.update(batch.skipped)
            else:
                self.metrics.inc("load_timeouts")
                log.warning("lookup for request %s not answered after %.1f s; recomputing its segments",
                            request_id, self.cache.config.load_timeout_s)
            sr.fallback = batch.unavailable
        extra = [k for k in keys if k not in sr.near and (batch is None or k not in batch.keys)]
        if extra:  # keys the admission did not load (a lookup without admit): one Lookup now
            hits = set(hits) | {k for k, present in zip(extra, self.cache.lookup(extra)) if present}
        out: dict[bytes, Optional[SegmentSignature]] = {}
        for key in keys:
            if key in sr.near:
                out[key] = sr.near[key]
                sr.near_hits += 1
            elif key in hits:
                out[key] = None
                sr.pending.add(key)
            elif key not in sr.skipped:
                self.metrics.inc("misses")
        return out

    def slow_hits(self, request_id: str) -> frozenset[bytes]:
        sr = self._requests.get(request_id)
        return frozenset() if sr is None else frozenset(sr.skipped)

    def _use(self, sr: StoreReport, key: bytes, seg: LoadedSegment) -> SegmentSignature:
        sr.held.append(key)
        sr.hits_by_tier[seg.tier if seg.tier in sr.hits_by_tier else "cpu"] += 1
        sr.loaded[key] = seg
        if seg.device_buffer is not None:  # a copy this engine owns (not a view of store memory)
            self.cache.remember(key, seg.signature)
        return seg.signature

    def claim(self, request_id: str, jobs: Sequence[SegmentJob], compute: ComputeFn) -> list[Filled]:
        sr = self._report(request_id)
        filled: dict[bytes, Filled] = {}
        share = self.cache.share
        cfg = self.cache.config
        shared = share is not None and len(jobs) >= max(2, cfg.share_min_segments) and self.cache.available
        kept = own_share([j.num_tokens for j in jobs], cfg.share_keep) if shared else len(jobs)
        offered = {j.key for j in jobs[kept:]}
        records = share.publish(request_id, [ColdSegment(j.key, j.token_ids, j.split) for j in jobs[kept:]]) \
            if shared else []
        try:
            later: list[tuple[SegmentJob, Claim]] = []
            batch: list[tuple[SegmentJob, Claim]] = []
            tokens = 0
            for i, job in enumerate(jobs):
                # with sharing, compute what is claimed before claiming on: at the pack limit,
                # and after the kept share (helpers take offered segments meanwhile)
                if shared and batch and (tokens + job.num_tokens > cfg.share_pack_tokens or i == kept):
                    self._compute(sr, batch, compute, filled)
                    batch, tokens = [], 0
                claim = self.cache.claim(job.key)
                if claim.status == PRESENT:  # landed since the lookup (an offered one: a helper stored it)
                    if job.key in offered:
                        sr.offloaded += 1
                        self.metrics.inc("cold_offloaded")
                    filled[job.key] = Filled(job.key, self._use(sr, job.key, claim.segment), False)
                elif claim.status == INFLIGHT:
                    later.append((job, claim))
                else:
                    batch.append((job, claim))
                    tokens += job.num_tokens
            self._compute(sr, batch, compute, filled)  # one packed pass for all of them
            for job, claim in later:
                mine = job.key in offered
                got = self.cache.wait_inflight(claim, cfg.share_wait_s if mine else None)
                sr.wait_inflight_ms += got.wait_ms
                if mine:
                    self.metrics.inc("cold_wait_ms_total", got.wait_ms)
                if got.status == WAITED:
                    sr.waited += 1
                    if mine:
                        sr.offloaded += 1
                        self.metrics.inc("cold_offloaded")
                    filled[job.key] = Filled(job.key, self._use(sr, job.key, got.segment), False)
                else:
                    self._compute(sr, [(job, got)], compute, filled)
        finally:
            if records:
                share.withdraw(records)
        return [filled[j.key] for j in jobs]

    def _compute(self, sr: StoreReport, units: list[tuple[SegmentJob, Claim]], compute: ComputeFn,
                 filled: dict[bytes, Filled]) -> None:
        """Compute the units' signatures (one packed pass) and store each under its claim."""
        if not units:
            return
        try:
            sigs = compute([job for job, _ in units])
        except BaseException:
            for _, claim in units:
                self.cache.drop_claim(claim)
            raise
        for (job, claim), sig in zip(units, sigs):
            sr.claimed += int(claim.status == OWNED)
            self._stored(sr, job.key, sig, job.cost, claim)
            filled[job.key] = Filled(job.key, sig, True)

    def _stored(self, sr: StoreReport, key: bytes, sig: SegmentSignature, cost: float,
                claim: Optional[Claim]) -> None:
        self.cache.remember(key, sig)
        sr.computed += 1
        self.metrics.inc("computes")
        # cost: tokens of the alone pass (the recompute work a hit saves; the daemon's
        # eviction weighs it per byte)
        self.cache.store(key, sig, claim=claim if claim is not None and claim.status == OWNED else None, cost=cost)

    def take(self, request_id: str, keys: Sequence[bytes],
             layered: bool = False) -> dict[bytes, Optional[SegmentSignature]]:
        """The loader's segments for `keys`, their device copies waited on (by the compute
        stream); with `layered` (the fused pass follows) a segment copied layer by layer
        is waited on per layer instead, by `layer_hook`, unless timing is synchronised."""
        sr = self._requests.get(request_id)
        if sr is None:
            return {}
        out: dict[bytes, Optional[SegmentSignature]] = {}
        for key in keys:
            if key not in sr.pending:
                continue
            sr.pending.discard(key)
            t0 = time.perf_counter()
            seg = self.cache.acquire(key, request_id, wait_device=False)
            sr.take_wait_ms += (time.perf_counter() - t0) * 1e3
            if seg is None:
                sr.late_misses += 1
                out[key] = None
            else:
                out[key] = self._use(sr, key, seg)
        for key in keys:
            seg = sr.loaded.get(key)
            if seg is None or seg.ready is None:
                continue
            if layered and seg.layers is not None and not self.sync_timing:  # pragma: no cover - GPU only
                if seg.pending:
                    sr.copies_pending_at_use += 1
                if all(s is not seg for s in sr.layered):
                    sr.layered.append(seg)
                continue
            if seg.pending:  # pragma: no cover - GPU only
                sr.copies_pending_at_use += 1
                if self.sync_timing:
                    t0 = time.perf_counter()
                    seg.ready.synchronize()
                    sr.device_wait_ms += (time.perf_counter() - t0) * 1e3
            seg.wait_device()
        return out

    def layer_hook(self, request_id: str) -> Optional[Callable[[int], None]]:
        """The fused pass's `before_layer`: the compute stream waits for layer i of every
        segment a `layered` take left to it, just before layer i (None when there is none)."""
        sr = self._requests.get(request_id)
        segs = list(sr.layered) if sr is not None else []
        if not segs:
            return None

        def before_layer(i: int) -> None:  # pragma: no cover - GPU only
            for seg in segs:
                seg.wait_layer(i)

        return before_layer

    def publish(self, key: bytes, signature: SegmentSignature, cost: float, request_id: Optional[str] = None) -> None:
        sr = self._requests.get(request_id) if request_id is not None else None
        if sr is not None:  # a late miss the request computed
            self._stored(sr, key, signature, cost, None)
            return
        # a context signature: kept in the device cache and stored through the daemon
        # (the put thread; never on the request's path)
        self.cache.remember(key, signature)
        self.cache.store(key, signature, cost=cost)
        self.metrics.inc("captured")

    def finish(self, request_id: str, done: bool) -> None:
        sr = self._requests.pop(request_id, None)
        if sr is None:
            return
        for key in sr.held:
            self.cache.release(key)
        sr.held.clear()
        # only admit's prefetch starts a batch for the request (StoreSignatureCache.prefetch)
        batch = self.cache.finish_request(request_id) if sr.batch is not None else None
        if batch is not None:
            sr.load_wait_ms = batch.wait_ms
            sr.fallback = sr.fallback or batch.unavailable
        sr.loaded.clear()
        sr.layered.clear()
        if done:
            self._reports[request_id] = sr
            while len(self._reports) > MAX_REPORTS:
                self._reports.popitem(last=False)

    # ------------------------------------------------------------ idle work
    @property
    def idle_poll_s(self) -> Optional[float]:
        return None if self.cache.share is None else self.cache.config.share_poll_s

    def claim_jobs(self, jobs: Sequence[SegmentJob], strict: bool = False) -> list[ClaimedJob]:
        try:
            held = self.cache.lookup([j.key for j in jobs], strict=strict)
        except Exception:  # the daemon is away: nothing to store into; drop the batch
            if strict:
                raise
            log.debug("lookup of deferred segments failed", exc_info=True)
            return []
        mine: list[ClaimedJob] = []
        for job, present in zip(jobs, held):
            if present:
                continue
            claim = self.cache.claim(job.key)
            if claim.status == PRESENT:  # stored by another engine since the lookup
                self.cache.release(job.key)
            elif claim.status != INFLIGHT:  # INFLIGHT: another engine computes it
                mine.append(ClaimedJob(job, "deferred", claim))
        return mine

    def offered(self) -> list[ClaimedJob]:
        share = self.cache.share
        if share is None:
            return []
        return [ClaimedJob(SegmentJob(w.key, tuple(w.token_ids), w.split, float(self.anchor_tokens + len(w.token_ids))),
                           "offered", claim) for w, claim in share.take_many(self.cache.config.share_pack_tokens)]

    def publish_jobs(self, claimed: Sequence[ClaimedJob], signatures: Sequence[SegmentSignature],
                     alone_ms: float = 0.0) -> None:
        t1 = time.perf_counter()
        for c, sig in zip(claimed, signatures):
            if c.origin == "deferred":
                self.cache.remember(c.job.key, sig)
            claim = c.claim if isinstance(c.claim, Claim) and c.claim.status == OWNED else None
            self.cache.store(c.job.key, sig, claim=claim, cost=c.job.cost)
        store_ms = (time.perf_counter() - t1) * 1e3
        m = self.metrics
        deferred = [c for c in claimed if c.origin == "deferred"]
        if deferred:
            m.inc("deferred_computed", len(deferred))
            m.inc("deferred_batches")
            m.inc("deferred_tokens", sum(c.job.num_tokens for c in deferred))
            m.inc("deferred_ms_total", alone_ms + store_ms)
            m.inc("deferred_alone_ms_total", alone_ms)
            m.inc("deferred_store_ms_total", store_ms)
        helped = len(claimed) - len(deferred)
        if helped:
            m.inc("cold_helped", helped)
            m.inc("cold_help_ms_total", alone_ms + store_ms)

    def release_jobs(self, claimed: Sequence[ClaimedJob], reason: str, alone_ms: float = 0.0) -> None:
        for c in claimed:
            self.cache.drop_claim(c.claim if isinstance(c.claim, Claim) else None)
        m = self.metrics
        if reason == "rejected":
            m.inc("cold_rejected", len(claimed))
        elif reason == "stopped" and claimed:
            m.inc("idle_stopped")
            if any(c.origin == "deferred" for c in claimed):  # the layers run before it gave way
                m.inc("deferred_ms_total", alone_ms)
                m.inc("deferred_alone_ms_total", alone_ms)

    # ------------------------------------------------------------ exact prefixes
    @property
    def keeps_prefixes(self) -> bool:
        return self.checkpoints is not None

    def find_prefix(self, ids: Sequence[int], ends: Sequence[int]):
        return None if self.checkpoints is None else self.checkpoints.find(ids, ends)

    def put_prefix(self, ids: Sequence[int], tip) -> None:
        """Keep the deepest exact checkpoint with states down to `tip` in the daemon too
        (one merged object: engine.connector.prefix_store)."""
        path = usable_path(path_to(tip))
        if path and self.checkpoints is not None:
            end = path[-1].checkpoint.end
            self.checkpoints.put(list(ids[:end]), merge_path([n.checkpoint for n in path]))

    def has_prefix(self, ids: Sequence[int]) -> bool:
        if self.checkpoints is None:
            return False
        try:
            return self.checkpoints.has(ids)
        except Exception:  # the daemon is away: compute it for this engine anyway
            return False


def prefix_variant(model_dtype: Optional[torch.dtype]) -> str:
    """The variant of prefix checkpoint keys: the dtype the model's caches hold."""
    return "" if model_dtype is None else f"dtype={str(model_dtype).removeprefix('torch.')}"


def store_pic_planner(config: PicConfig, model, fingerprint: str, tokenizer, cache: StoreSignatureCache,
                      prefetch_queued: int = 4, prefix_tree=None):
    """A `PicPlanner` (engine.pic.planner) over a `DaemonSegmentStore` of `cache`, for
    `model` (a HybridDecoder)."""
    anchor = anchor_for(config, tokenizer)
    store = DaemonSegmentStore(cache, len(anchor), prefetch_queued,
                               PrefixCheckpointStore(cache, fingerprint, prefix_variant(model.dtype)),
                               sync_timing=config.sync_timing)
    return PicPlanner(config, model.config, fingerprint, anchor, store, cache.device, model.dtype,
                      prefix_tree=prefix_tree)
