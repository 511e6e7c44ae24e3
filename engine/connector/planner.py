"""`StorePicPlanner`: engine.pic's PIC planner driving the store-backed signature cache,
so that loads overlap compute and cold segments are computed once across engines.

What it adds to `PicPlanner`, in the order of a request's life:

1. `plan(request)` (admission): the request's distinct segment keys go to the loader
   as one batch (one Lookup + one Get on the loader thread), and the segments of the
   next few *queued* requests are looked up and hinted to the daemon (NVMe -> CPU
   promotion), so their loads are cheap by the time they are admitted. Requests
   admitted together load in admission order while earlier ones prefill.
2. `lookup` step: waits only for the batch's Lookup answer (which segments are hits),
   so the `miss` step runs while the hits load.
3. `miss` step: claims every missing segment through the daemon first, computes the
   ones this engine won (queuing each put as soon as its alone pass is done: other
   engines may be waiting for it), then waits (bounded) for the ones another engine is
   computing, and computes those that did not arrive.
4. each `load` (splice) step takes its segments from the loader (blocking only until
   that segment is placed; time blocked is the request's `load_wait_ms`) and makes the
   compute stream wait on the events of exactly those segments, so later segments
   decode and copy while earlier ones are spliced and seams computed. A hit that could
   not be loaded after all (evicted between Lookup and Get) is computed there.
5. prefill done or request freed: leases released, the request's store report kept.

Cold sharing (engine.connector.coldshare, `StoreConnectorConfig.share_cold`): a miss
step with several cold segments first offers all but the first to idle engines, then
claims and computes them one by one in prompt order (a segment a helper claimed answers
INFLIGHT and is waited for after the others, bounded by `share_wait_s`), and withdraws
its offers. `help_idle(runner)`, called by the engine when it has nothing to do (every
`idle_poll_s`), takes one segment another engine offered, computes it and stores it.

`take_store_report(request_id)` returns the connector's side of a request (`StoreReport`):
segments by tier, load latency and the time the engine waited for it (overlap), copies
still in flight when their splice was reached, dedup waits, and whether the daemon was
unavailable (served by recomputation).

Called from the engine loop's thread only, like every planner.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from engine.connector.coldshare import ColdSegment, ColdShare, own_share
from engine.connector.loader import LoadBatch, LoadedSegment
from engine.connector.metrics import overlap_fraction
from engine.connector.prefix_store import PrefixCheckpointStore
from engine.connector.store_cache import COMPUTE, INFLIGHT, OWNED, PRESENT, WAITED, Claim, StoreSignatureCache
from engine.models.config import ModelConfig
from engine.pic.config import PicConfig
from engine.pic.errors import AlonePassStopped
from engine.pic.exact_prefix import PrefixMatch
from engine.pic.planner import PicPlanner, SpliceUnit, _RequestState
from engine.pic.prefix import PrefixNode, PrefixTree, insert_chain, merge_path, path_to, split_checkpoint, usable_path
from engine.runtime.planner import PrefillPlan
from engine.runtime.request import Request

log = logging.getLogger("engine.connector")

_PIC_KEY = "pic"  # engine.pic.planner's planner_state key
_STORE_KEY = "store"
_HINTED_KEY = "store_hinted"
TIERS = ("gpu", "cpu", "nvme")


@dataclass
class StoreReport:
    """The store side of one request's prefill (module docstring)."""

    request_id: str
    segments: int = 0  # distinct cached segments in the prompt
    hits_by_tier: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
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
    pending: dict[bytes, list] = field(default_factory=dict, repr=False)  # hits at lookup, not taken yet
    late_misses: int = 0  # hits at lookup that could not be loaded (evicted, corrupt): computed at splice
    near: dict[bytes, object] = field(default_factory=dict, repr=False)  # key -> signature from the device cache
    #: segments copied layer by layer whose waits the fused pass makes per layer (_layer_hook)
    layered: list[LoadedSegment] = field(default_factory=list, repr=False)
    near_hits: int = 0  # segments spliced from the engine's device cache (no daemon round trip)
    prefix_source: Optional[str] = None  # exact prefix restored from: "engine" (its tree), "store" (the daemon)
    prefix_tier: Optional[str] = None  # the daemon tier that held it (source "store")
    prefix_tokens: int = 0  # positions restored from it

    @property
    def load_ms(self) -> float:
        """Latency of the request's batch load (admission -> last copy complete)."""
        return 0.0 if self.batch is None else self.batch.load_ms

    def as_dict(self) -> dict:
        load = self.load_ms
        return {
            "store_segments": self.segments, "store_hits": sum(self.hits_by_tier.values()),
            "store_hits_by_tier": dict(self.hits_by_tier), "store_computed": self.computed,
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


class StorePicPlanner(PicPlanner):
    """PIC through the kvstore daemon (module docstring)."""

    def __init__(self, config: PicConfig, model_config: ModelConfig, fingerprint: str, anchor_ids: Sequence[int],
                 cache: StoreSignatureCache, device: torch.device, prefetch_queued: int = 4,
                 model_dtype: Optional[torch.dtype] = None, prefix_tree: Optional[PrefixTree] = None) -> None:
        super().__init__(config, model_config, fingerprint, anchor_ids, cache, device, model_dtype, prefix_tree)
        self.store = cache
        #: exact-prefix checkpoints in the daemon (engine.connector.prefix_store)
        self.checkpoints = PrefixCheckpointStore(cache, fingerprint, prefix_variant(model_dtype))
        self.prefetch_queued = prefetch_queued
        self._waiting: Optional[Sequence[Request]] = None
        self._store_reports: OrderedDict[str, StoreReport] = OrderedDict()

    def attach_queue(self, waiting: Sequence[Request]) -> None:
        """The scheduler's waiting queue, for look-ahead hints (engine.scheduler.waiting)."""
        self._waiting = waiting

    def take_store_report(self, request_id: str) -> Optional[StoreReport]:
        """The store report of a request whose prefill completed (returned once)."""
        return self._store_reports.pop(request_id, None)

    def register_metrics(self, registry) -> None:
        """Expose the connector's metrics in a prometheus_client registry."""
        from engine.connector.metrics import PrometheusCollector

        registry.register(PrometheusCollector(self.store.metrics))

    # ------------------------------------------------------------------ planning
    def plan(self, request: Request) -> PrefillPlan:
        plan = super().plan(request)
        state: _RequestState = request.planner_state[_PIC_KEY]
        keys = list(dict.fromkeys(u.key for u in state.units))
        report = StoreReport(request.request_id, segments=len(keys))
        if state.prefix is not None:
            report.prefix_source, report.prefix_tokens = state.prefix.source, state.prefix.end
            report.prefix_tier = state.prefix.tier
        for k in keys:  # the engine's own device cache first: no daemon round trip for those
            sig = self.store.near_get(k)
            if sig is not None:
                report.near[k] = sig
        rest = [k for k in keys if k not in report.near]
        if rest:
            report.batch = self.store.prefetch(request.request_id, rest)
        request.planner_state[_STORE_KEY] = report
        request.planner_state[_HINTED_KEY] = True
        self._hint_queued()
        return plan

    def _hint_queued(self) -> None:
        if not self._waiting or not self.prefetch_queued or not self.store.available:
            return
        keys: list[bytes] = []
        for req in list(self._waiting)[: self.prefetch_queued]:
            if req.planner_state.get(_HINTED_KEY):
                continue
            req.planner_state[_HINTED_KEY] = True
            ids = list(req.prefill_token_ids())
            keys += [it[1].key for it in self._layout(ids, req.prefill_segments()) if it[0] == "splice"]
        if keys:
            self.store.hint(keys)

    # --------------------------------------------------------------- apply steps
    def _lookup(self, runner, request: Request) -> None:
        """Waits only for the Lookup answer: misses go to the `miss` step (computed while
        the hits load); hits are taken at their splice (`_splice`)."""
        state: _RequestState = request.planner_state[_PIC_KEY]
        sr: StoreReport = request.planner_state[_STORE_KEY]
        report = state.builder.report
        batch = sr.batch
        hits: set[bytes] = set()
        if batch is not None:
            if batch.wait_lookup(self.store.config.load_timeout_s):
                hits = batch.hits
            else:
                self.store.metrics.inc("load_timeouts")
                log.warning("lookup for request %s not answered after %.1f s; recomputing its segments",
                            request.request_id, self.store.config.load_timeout_s)
            sr.fallback = batch.unavailable
        seen: set[bytes] = set()
        for u in state.units:
            if u.key not in seen:
                seen.add(u.key)
                if u.key in sr.near:
                    state.signatures[u.key] = sr.near[u.key]
                    sr.near_hits += 1
                elif u.key not in hits:
                    state.missing.append(u)
                    self.store.metrics.inc("misses")
                    continue
                else:
                    sr.pending[u.key] = []
            if u.key in sr.near:
                report.add_hit(self._reused(u))
            elif u.key in sr.pending:
                sr.pending[u.key].append(u)
                report.add_hit(self._reused(u))

    def _reused(self, u: SpliceUnit) -> int:
        return u.num_tokens + len(self.anchor_ids) if u.first else u.num_tokens - u.split

    def _use(self, state: _RequestState, sr: StoreReport, key: bytes, seg: LoadedSegment) -> None:
        state.held.append(key)
        state.signatures[key] = seg.signature
        sr.hits_by_tier[seg.tier if seg.tier in sr.hits_by_tier else "cpu"] += 1
        sr.loaded[key] = seg
        if seg.device_buffer is not None:  # a copy this engine owns (not a view of store memory)
            self.store.remember(key, seg.signature)

    def _compute_misses(self, runner, request: Request) -> None:
        state: _RequestState = request.planner_state[_PIC_KEY]
        sr: StoreReport = request.planner_state[_STORE_KEY]
        report = state.builder.report
        if self._fall_back_to_full(state) or self._misses_in_context(state):  # compute now, alone when idle
            return
        missing, state.missing = list(state.missing), []
        share = self.store.share
        if share is not None and len(missing) >= max(2, self.store.config.share_min_segments) and self.store.available:
            self._compute_misses_shared(runner, request, missing, share)
            return
        later: list[tuple[SpliceUnit, Claim]] = []
        mine: list[tuple[SpliceUnit, Claim]] = []
        for u in missing:
            claim = self.store.claim(u.key)
            if claim.status == PRESENT:
                self._use(state, sr, u.key, claim.segment)
                report.add_hit(self._reused(u))
            elif claim.status == INFLIGHT:
                later.append((u, claim))
            else:
                mine.append((u, claim))
        self._compute_batch(runner, state, sr, mine)  # one packed pass for all of them
        for u, claim in later:
            got = self.store.wait_inflight(claim)
            sr.wait_inflight_ms += got.wait_ms
            if got.status == WAITED:
                sr.waited += 1
                self._use(state, sr, u.key, got.segment)
                report.add_hit(self._reused(u))
            else:
                self._compute(runner, state, sr, u, got)

    def _compute_misses_shared(self, runner, request: Request, missing: list[SpliceUnit], share: ColdShare) -> None:
        """The miss step with cold sharing (module docstring): keep the first misses
        (`share_keep` of the cold tokens), offer the rest, compute the kept ones (packed
        passes of at most `share_pack_tokens`), then claim and compute what no helper
        took, wait for what helpers claimed, withdraw."""
        state: _RequestState = request.planner_state[_PIC_KEY]
        sr: StoreReport = request.planner_state[_STORE_KEY]
        report = state.builder.report
        kept = own_share([u.num_tokens for u in missing], self.store.config.share_keep)
        offered = {u.key for u in missing[kept:]}
        records = share.publish(request.request_id, [
            ColdSegment(u.key, tuple(state.token_ids[u.offset:u.end]), u.split) for u in missing[kept:]])
        try:
            later: list[tuple[SpliceUnit, Claim]] = []
            batch: list[tuple[SpliceUnit, Claim]] = []
            tokens = 0
            pack = self.store.config.share_pack_tokens
            for i, u in enumerate(missing):
                # compute what is claimed before claiming on: at the pack limit, and after the
                # kept share (helpers take offered segments meanwhile)
                if batch and (tokens + u.num_tokens > pack or i == kept):
                    self._compute_batch(runner, state, sr, batch)
                    batch, tokens = [], 0
                claim = self.store.claim(u.key)
                if claim.status == PRESENT:  # an offered segment a helper stored already
                    if u.key in offered:
                        sr.offloaded += 1
                        self.store.metrics.inc("cold_offloaded")
                    self._use(state, sr, u.key, claim.segment)
                    report.add_hit(self._reused(u))
                elif claim.status == INFLIGHT:
                    later.append((u, claim))
                else:
                    batch.append((u, claim))
                    tokens += u.num_tokens
            self._compute_batch(runner, state, sr, batch)
            for u, claim in later:
                mine = u.key in offered
                got = self.store.wait_inflight(claim, self.store.config.share_wait_s if mine else None)
                sr.wait_inflight_ms += got.wait_ms
                if mine:
                    self.store.metrics.inc("cold_wait_ms_total", got.wait_ms)
                if got.status == WAITED:
                    sr.waited += 1
                    if mine:
                        sr.offloaded += 1
                        self.store.metrics.inc("cold_offloaded")
                    self._use(state, sr, u.key, got.segment)
                    report.add_hit(self._reused(u))
                else:
                    self._compute(runner, state, sr, u, got)
        finally:
            share.withdraw(records)

    # ------------------------------------------------------------------ idle help
    @property
    def idle_poll_s(self) -> Optional[float]:
        """How often the engine should call `help_idle` while idle (None: never)."""
        polls = [p for p in (super().idle_poll_s, None if self.store.share is None else self.store.config.share_poll_s)
                 if p is not None]
        return min(polls) if polls else None

    def help_idle(self, runner, should_stop: Optional[Callable[[], bool]] = None) -> int:
        """Idle work, one unit per call: this engine's queued cold-fallback segments
        first (claimed, computed alone packed, stored), else cold segments other engines
        offered (engine.connector.coldshare; up to `share_pack_tokens`, one packed pass),
        each stored under its claim. Returns the
        number of segments computed. Called by the engine when it has no request to run.
        `should_stop` (a request arrived): asked between the pass's layers; when it says
        so, 0 is returned (`idle_stopped`) and the pass's claims released (waiters compute
        or claim again); a pass over this engine's own queue is kept and resumed by the
        next call (`_help_deferred`), one over offered segments is dropped. Context
        signatures waiting to be stored go first (`keep_captured`)."""
        kept = self.keep_captured()
        if kept:
            return kept
        if self.idle_pass is not None or self.deferred:
            return self._help_deferred(runner, should_stop)
        if self.exact is not None and self.exact.pending:
            return self._help_prefix(runner, should_stop)
        share = self.store.share
        if share is None:
            return 0
        taken = []
        for wanted, claim in share.take_many(self.store.config.share_pack_tokens):
            if self.key(wanted.token_ids, wanted.split) != wanted.key:  # other anchor/seam/options, or forged
                self.store.metrics.inc("cold_rejected")
                self.store.drop_claim(claim)
            else:
                taken.append((wanted, claim))
        if not taken:
            return 0
        t0 = time.perf_counter()
        try:  # one packed alone pass for every segment taken
            sigs = self._alone(runner, [(w.token_ids, w.split) for w, _ in taken], should_stop)
        except AlonePassStopped:  # a request arrived: the requesters compute them (or another helper)
            for _, claim in taken:
                self.store.drop_claim(claim)
            self.store.metrics.inc("idle_stopped")
            return 0
        except Exception:  # helping must not stop this engine; the requesters compute them
            log.exception("computing %d offered segments failed", len(taken))
            for _, claim in taken:
                self.store.drop_claim(claim)
            return 0
        for (wanted, claim), sig in zip(taken, sigs):
            self.store.store(wanted.key, sig, claim=claim, cost=float(len(self.anchor_ids) + len(wanted.token_ids)))
        self.store.metrics.inc("cold_helped", len(taken))
        self.store.metrics.inc("cold_help_ms_total", (time.perf_counter() - t0) * 1e3)
        return len(taken)

    def _help_deferred(self, runner, should_stop: Optional[Callable[[], bool]] = None) -> int:
        """One idle batch of this engine's queued segments: claimed, computed alone in one
        packed pass, stored. A pass that gives way to a request releases its claims (the
        requester or another engine may compute them meanwhile) and is resumed by the
        next call, which stores what it computed (a put of a segment stored meanwhile
        counts as `puts_exists`)."""
        if self.idle_pass is not None:
            mine, alone = self.idle_pass
        else:
            mine = self._claim_deferred()
            if not mine:
                return 0
            alone = self._start_alone(runner, [(ids, split) for (_, ids, split), _ in mine])
        t0 = time.perf_counter()
        try:
            sigs = self._run_idle(mine, alone, should_stop)
        except Exception:  # idle work must not stop this engine; a later request computes them
            log.exception("computing %d deferred segments failed", len(mine))
            self.idle_pass = None
            for _, claim in mine:
                self.store.drop_claim(claim)
            return 0
        m = self.store.metrics
        if sigs is None:  # a request arrived: release the claims, resume the pass later
            for _, claim in mine:
                self.store.drop_claim(claim)
            if self.idle_pass is None:  # not kept (idle_resume=False): queued again
                self._requeue([t for t, _ in mine])
            m.inc("idle_stopped")
            spent = (time.perf_counter() - t0) * 1e3  # the layers run before it gave way
            m.inc("deferred_ms_total", spent)
            m.inc("deferred_alone_ms_total", spent)
            return 0
        t1 = time.perf_counter()
        for ((key, ids, _), claim), sig in zip(mine, sigs):
            self.store.remember(key, sig)
            self.store.store(key, sig, claim=claim if claim.status == OWNED else None,
                             cost=float(len(self.anchor_ids) + len(ids)))
        t2 = time.perf_counter()
        m.inc("deferred_computed", len(mine))
        m.inc("deferred_batches")
        m.inc("deferred_tokens", sum(len(ids) for (_, ids, _), _ in mine))
        m.inc("deferred_ms_total", (t2 - t0) * 1e3)
        m.inc("deferred_alone_ms_total", (t1 - t0) * 1e3)
        m.inc("deferred_store_ms_total", (t2 - t1) * 1e3)
        return len(mine)

    def _claim_deferred(self) -> list:
        """The next idle batch of queued segments that no engine holds or computes, each
        with this engine's claim on it."""
        todo = self._next_deferred()
        try:
            held = self.store.lookup([t[0] for t in todo])
        except Exception:  # the daemon is away: nothing to store into; drop the batch
            log.debug("lookup of deferred segments failed", exc_info=True)
            return []
        mine: list[tuple[tuple[bytes, tuple[int, ...], int], Claim]] = []
        for t, present in zip(todo, held):
            if present:
                continue
            claim = self.store.claim(t[0])
            if claim.status == PRESENT:  # stored by another engine since the lookup
                self.store.release(t[0])
            elif claim.status != INFLIGHT:  # another engine computes it: nothing to do
                mine.append((t, claim))
        return mine

    # ------------------------------------------------------------ exact prefixes
    def _match_prefix(self, request: Request, ids: list[int], bounds: list[tuple[int, int]]) -> Optional[PrefixMatch]:
        """The engine's own tree first; when it does not reach the request's deepest
        boundary, the daemon (one Lookup over the deeper boundaries): a deeper checkpoint
        found there is restored (and kept in the tree for the next request)."""
        local = super()._match_prefix(request, ids, bounds)
        have = 0 if local is None else local.end
        deeper = [hi for _, hi in bounds if hi > have]
        found = self.checkpoints.find(ids, deeper) if deeper else None
        if found is None:
            return local
        cp, tier = found
        if local is not None:  # the daemon's is deeper: release the engine's
            for n in local.path:
                n.pins -= 1
        cut = [b for b in bounds if b[1] <= cp.end]
        insert_chain(self.exact.tree, self.exact.tree.root, ids, split_checkpoint(cp, cut))
        node = PrefixNode((), None, cp)  # restored from the merged object itself, whatever fit in the tree
        node.pins += 1
        return PrefixMatch(self.exact.tree.walk([tuple(ids[lo:hi]) for lo, hi in bounds]), [node], "store", tier)

    def _prefix_computed(self, ids, tip: Optional[PrefixNode]) -> None:
        """Keep the deepest exact checkpoint with states the engine just computed in the
        daemon too (one merged object: module engine.connector.prefix_store)."""
        path = usable_path(path_to(tip))
        if path:
            end = path[-1].checkpoint.end
            self.checkpoints.put(list(ids[:end]), merge_path([n.checkpoint for n in path]))

    def _help_prefix(self, runner, should_stop: Optional[Callable[[], bool]] = None) -> int:
        """One queued exact prefix: skipped when the daemon holds it already (another
        engine computed it), else computed and stored."""
        if should_stop is not None and should_stop():  # the pass cannot give way half-way: not now
            return 0
        job = self.exact.next_job()
        if job is None:
            return 0
        try:
            held = self.checkpoints.has(job.ids)
        except Exception:  # the daemon is away: compute it for this engine anyway
            held = False
        if held:
            return 1
        path = self.exact.compute(runner, job)
        if path:
            self._prefix_computed(job.ids, path[-1])
        return 1

    def _compute(self, runner, state: _RequestState, sr: StoreReport, u: SpliceUnit, claim: Claim) -> None:
        self._compute_batch(runner, state, sr, [(u, claim)])

    def _compute_batch(self, runner, state: _RequestState, sr: StoreReport,
                       units: list[tuple[SpliceUnit, Claim]]) -> None:
        """Compute the units' signatures alone (packed in one pass) and store each."""
        if not units:
            return
        try:
            sigs = self._alone(runner, [(state.token_ids[u.offset:u.end], u.split) for u, _ in units])
        except BaseException:
            for _, claim in units:
                self.store.drop_claim(claim)
            raise
        for (u, claim), sig in zip(units, sigs):
            self._stored(state, sr, u, claim, sig)

    def _stored(self, state: _RequestState, sr: StoreReport, u: SpliceUnit, claim: Claim, sig) -> None:
        state.signatures[u.key] = sig
        self.store.remember(u.key, sig)
        alone = len(self.anchor_ids) + u.num_tokens
        state.builder.report.add_miss(alone)
        sr.computed += 1
        sr.claimed += int(claim.status == OWNED)
        self.store.metrics.inc("computes")
        # cost: tokens of the alone pass (the recompute work a hit saves; the daemon's
        # eviction weighs it per byte)
        self.store.store(u.key, sig, claim=claim if claim.status == OWNED else None, cost=float(alone))

    def _keep_captured(self, cap, sig) -> None:
        """A context signature (miss_signatures="context"): kept in the device cache and
        stored through the daemon (the put thread; never on the request's path), with the
        alone pass it saves as its cost."""
        self.store.remember(cap.key, sig)
        self.store.store(cap.key, sig, cost=float(len(self.anchor_ids) + cap.num_tokens))
        self.store.metrics.inc("captured")

    def _ready(self, runner, request: Request, units: Sequence[SpliceUnit], layered: bool = False) -> None:
        """Every unit's signature taken from the loader and its device copies waited on
        (by the compute stream) before the units are spliced; with `layered` (the fused
        pass follows) a segment copied layer by layer is waited on per layer instead, by
        the pass's `before_layer` hook (`_layer_hook`), unless timing is synchronised."""
        state: _RequestState = request.planner_state[_PIC_KEY]
        sr: StoreReport = request.planner_state[_STORE_KEY]
        for u in units:
            if u.key not in state.signatures and u.key in sr.pending:
                self._take(runner, request, state, sr, u.key)
        for u in units:
            seg = sr.loaded.get(u.key)
            if seg is None or seg.ready is None:
                continue
            if layered and seg.layers is not None and not self.config.sync_timing:  # pragma: no cover - GPU only
                if seg.pending:
                    sr.copies_pending_at_use += 1
                if all(s is not seg for s in sr.layered):
                    sr.layered.append(seg)
                continue
            if seg.pending:  # pragma: no cover - GPU only
                sr.copies_pending_at_use += 1
                if self.config.sync_timing:
                    t0 = time.perf_counter()
                    seg.ready.synchronize()
                    sr.device_wait_ms += (time.perf_counter() - t0) * 1e3
            seg.wait_device()

    def _layer_hook(self, request: Request):
        """The fused pass's `before_layer`: the compute stream waits for layer i of every
        segment `_ready` left to it, just before layer i (None when there is none)."""
        sr = request.planner_state.get(_STORE_KEY)
        segs = list(sr.layered) if sr is not None else []
        if not segs:
            return None

        def before_layer(i: int) -> None:  # pragma: no cover - GPU only
            for seg in segs:
                seg.wait_layer(i)

        return before_layer

    def _take(self, runner, request: Request, state: _RequestState, sr: StoreReport, key: bytes) -> None:
        """Take a looked-up hit from the loader (waiting for it if needed); a hit that
        could not be loaded after all is computed here and its accounting corrected."""
        counted = sr.pending.pop(key)
        t0 = time.perf_counter()
        seg = self.store.acquire(key, request.request_id, wait_device=False)
        sr.take_wait_ms += (time.perf_counter() - t0) * 1e3
        if seg is not None:
            self._use(state, sr, key, seg)
            return
        report = state.builder.report
        for u in counted:
            report.hit_segments -= 1
            report.reused_tokens -= self._reused(u)
        sr.late_misses += 1
        self._compute(runner, state, sr, counted[0], Claim(key, COMPUTE))

    # ------------------------------------------------------------------ lifecycle
    def on_prefill_done(self, request: Request) -> None:
        super().on_prefill_done(request)
        self._finish_store(request, keep=True)

    def on_request_freed(self, request: Request) -> None:
        super().on_request_freed(request)
        self._finish_store(request, keep=False)

    def _finish_store(self, request: Request, keep: bool) -> None:
        sr: Optional[StoreReport] = request.planner_state.pop(_STORE_KEY, None)
        if sr is None:
            return
        batch = self.store.finish_request(request.request_id)
        if batch is not None:
            sr.load_wait_ms = batch.wait_ms
            sr.fallback = sr.fallback or batch.unavailable
        sr.loaded.clear()
        if keep:
            self._store_reports[request.request_id] = sr
            while len(self._store_reports) > 4096:
                self._store_reports.popitem(last=False)


def prefix_variant(model_dtype: Optional[torch.dtype]) -> str:
    """The variant of prefix checkpoint keys: the dtype the model's caches hold."""
    return "" if model_dtype is None else f"dtype={str(model_dtype).removeprefix('torch.')}"
