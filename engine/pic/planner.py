"""The prefill planners of `kvengine run --method full|prefix|naive|pic`, plugged into the
scheduler's prefill-planner hook (engine.runtime.planner), and `make_planner`.

`PicPlanner` (methods `pic` and `naive`) plans a request from its segments:

- the first segment, when cached and right behind the anchor (BOS), is spliced whole
  from its signature: the alone pass is the real computation of those positions;
- every later cached segment gets a seam: its first `split = min(n, seam)` tokens
  are computed in context (through every layer, against the spliced K/V and the
  composed states), then its tail [split, n) is spliced (`engine.pic.splice`);
  with `naive` the seam is 0 and states are added without T;
- uncached segments, and the last segment of the prompt (its last token's logits
  are the first output), are computed in context.

With `PicConfig.fused` (the default) all of that after the lookup and miss steps is ONE
`FusedStep`: seams, splices and the suffix go through the layers in a single pass
(engine.pic.fused; same numbers, one pass of per-call overhead instead of one per
computed range). Without it, the plan alternates compute steps and splice steps.

Every plan with segments to splice starts with two zero-width apply steps: `lookup`
(one `get` per distinct segment) and `miss` (each missing segment is computed alone, put into the signature
cache, then spliced exactly as a hit would be: a cold and a warm request take the same
path; all of a request's alone passes run packed in one pass through the layers,
`engine.pic.compute.compute_signatures`). Signatures are keyed by `segment_key(fingerprint, content tokens,
signature_variant(anchor, split))`, so the same segment reuses one signature at any
offset and in any order. Accounting and timing: engine.pic.report.

Cold fallback (`PicConfig.cold_full_fraction`): when the misses of a request hold at
least that fraction of its prompt, the miss step queues them instead (`deferred`) and the
fused step computes the whole prompt in context (plain full recompute: the request's TTFT
is full recompute's, not alone passes + splicing); `help_idle(runner)`, which the engine
calls while it has no request, computes queued segments alone (packed, a token budget
per call) and caches them, so later requests hit them.

Exact prefixes (`PicConfig.exact_prefix`, `pic` only; engine.pic.exact_prefix): before
the layout, the request's leading cached segments are matched against the planner's
prefix tree of exact checkpoints; the deepest usable one is restored by a `load` step at
its boundary and the layout starts there (no seam, no composition before it). When the
restored prefix leaves nothing to splice (an exact repeat: only the uncached rest is
left), everything after the restore is prefix caching's path: its one pass
(engine.pic.prefix.fill_with_checkpoints), and no lookup, claim, take, layer hook,
capture, look-ahead hint or publishing of earlier captures on the request's path (those
wait for the next request that splices, or for idle time). When the prefix ends at the
last cacheable boundary (`layout.cached_after` is False) the plan is made without a
layout or a hit-cost estimate (`_plan_rest`): such a request costs the host no more than
prefix caching's (tests/engine/connector/test_exact_repeat_host.py counts it). After
the prefill, a prefix that was not exact yet is queued for an idle-time pass
(`help_idle`, after the queued alone passes); the cold fallback's pass takes the
checkpoints itself.

Where signatures come from and go to is the planner's `SegmentStore` (engine.pic.
segment_store: its call order): lookup at the `lookup` step (hits it chose not to load,
`slow_hits`, are computed in context: engine.pic.miss_routing), claim at the `miss` step
(the store decides what this engine computes and what it waits for), take at each
splice, publish, finish, idle work. `make_planner` gives the in-process store; the
kvstore daemon's is engine.connector.daemon_store. The layout is engine.pic.layout.

`FullPlanner` computes everything (with the same report); the prefix planner lives in
engine.pic.prefix. Planners are called from the engine loop's thread only.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from engine.models.config import GDN, SWA, ModelConfig
from engine.pic.capture import CaptureSet, ContextCapture
from engine.pic.compute import AlonePass, resolve_state_dtype
from engine.pic.config import PicConfig
from engine.pic.costs import PathCosts
from engine.pic.deferred import DeferredQueue
from engine.pic.errors import AlonePassStopped, PicConfigError
from engine.pic.exact_prefix import ExactPrefixes, PrefixMatch
from engine.pic.full import FullPlanner, full_pass
from engine.pic.fused import fused_prefill
from engine.pic.idle_work import IdleWork
from engine.pic.layout import (LayoutItem, Splice, SpliceUnit, cached_after, fused_items, fused_spec, layout,
                               seal_tails, splice_units)
from engine.pic.miss_routing import fall_back_to_full, hit_compute_ms, misses_in_context, slow_hits_in_context
from engine.pic.prefix import PrefixNode, PrefixTree, fill_with_checkpoints, prefix_bounds, restore_checkpoints
from engine.pic.report import STATE_KEY, PlanBuilder, ReportingPlanner
from engine.pic.segment_store import ClaimedJob, InProcessSegmentStore, SegmentJob, SegmentStore
from engine.pic.signature import SegmentSignature
from engine.pic.signature_cache import InMemorySignatureCache, SignatureCache, segment_key, signature_variant
from engine.pic.splice import SplicePiece, splice
from engine.runtime.planner import PrefillPlan
from engine.runtime.request import PromptSegment, Request


#: planner_state key marking a queued request whose keys were hinted to the store
HINTED_KEY = "store_hinted"


@dataclass
class _RequestState:
    builder: PlanBuilder
    units: list[SpliceUnit]
    token_ids: list[int]
    signatures: dict[bytes, SegmentSignature] = field(default_factory=dict)
    missing: list[SpliceUnit] = field(default_factory=list)
    slow: list[SpliceUnit] = field(default_factory=list)  # hits the store did not load (SegmentStore.slow_hits)
    full: bool = False  # cold fallback: the fused step computes the whole prompt
    in_context: set[bytes] = field(default_factory=set)  # misses the fused step computes (miss_path)
    to_capture: list[SpliceUnit] = field(default_factory=list)  # misses whose signatures the pass takes
    captured: Optional[CaptureSet] = None  # filled by the fused step, kept after the first token
    bounds: list[tuple[int, int]] = field(default_factory=list)  # prefix boundaries (exact_prefix)
    prefix: Optional[PrefixMatch] = None  # the exact prefix restored (exact_prefix)
    prefix_done: bool = False  # the request's own pass took its exact checkpoints (cold fallback)
    prefix_pinned: list[PrefixNode] = field(default_factory=list)  # nodes that pass inserted
    rest_only: bool = False  # the exact prefix ends at the last cacheable boundary: nothing spliced after it


class PicPlanner(IdleWork, ReportingPlanner):
    """`pic` and `naive` (module docstring)."""

    def __init__(self, config: PicConfig, model_config: ModelConfig, fingerprint: str,
                 anchor_ids: Sequence[int], store: SegmentStore, device: torch.device,
                 model_dtype: Optional[torch.dtype] = None, prefix_tree: Optional[PrefixTree] = None) -> None:
        super().__init__(config, device)
        if config.method not in ("pic", "naive"):
            raise PicConfigError(f"PicPlanner serves methods pic and naive, not {config.method!r}")
        if not isinstance(store, SegmentStore):
            raise PicConfigError(f"store must be a SegmentStore, got {type(store).__name__}")
        self.name = config.method
        #: whether this planner can fill full-attention layers kept outside the paged pool
        #: (HiSparse's ExternalKVCache): splices and fused passes can, exact prefixes'
        #: checkpoints (restored into the paged pool) cannot
        self.supports_external_kv = not config.exact_prefix or config.method != "pic"
        self.fingerprint = fingerprint
        self.anchor_ids = [int(t) for t in anchor_ids]
        self.store = store
        window = model_config.attention.sliding_window if SWA in model_config.layers else None
        self.has_delta = GDN in model_config.layers
        self.seam = config.effective_seam(window)
        self.linear_mode = "add" if config.method == "naive" else "compose"
        self.state_dtype = resolve_state_dtype(config.state_dtype, model_dtype)
        #: cold-fallback segments to compute alone when idle, oldest first
        self.deferred = DeferredQueue(batch_tokens=config.idle_batch_tokens,
                                      repeated_only=config.idle_alone_passes == "repeated")
        #: captures of finished prefills whose signatures are still to be kept (keep_captured)
        self.captured: deque[CaptureSet] = deque()
        #: measured cost per token of alone passes and of full passes (cold_full_policy="cost")
        self.costs = PathCosts(self.device)
        #: idle alone passes stopped half-way for an arriving request (`help_idle(should_stop=...)`)
        self.idle_stopped = 0
        #: the idle pass that gave way, with its claimed jobs, resumed by the next `help_idle`
        self.idle_pass: Optional[tuple[list[ClaimedJob], AlonePass]] = None
        #: exact-prefix reuse (PicConfig.exact_prefix; `pic` only): its prefix tree and idle jobs
        self.exact: Optional[ExactPrefixes] = None
        if config.exact_prefix and config.method == "pic":
            self.exact = ExactPrefixes(prefix_tree if prefix_tree is not None else PrefixTree(
                config.prefix_cache_bytes), config)
        self._waiting: Optional[Sequence[Request]] = None

    @property
    def cache(self) -> Optional[SignatureCache]:
        """The signature cache behind the store (None when it has none)."""
        return self.store.cache

    def attach_queue(self, waiting: Sequence[Request]) -> None:
        """The scheduler's waiting queue, for the store's look-ahead hints (`SegmentStore.hint`)."""
        self._waiting = waiting

    def take_store_report(self, request_id: str):
        """The store's report of a request whose prefill completed (returned once; None
        when the store keeps none)."""
        return self.store.take_report(request_id)

    def register_metrics(self, registry) -> None:
        """Expose the store's metrics in a prometheus_client registry."""
        self.store.register_metrics(registry)

    # ------------------------------------------------------------------ planning
    def key(self, content: Sequence[int], split: int) -> bytes:
        variant = signature_variant(self.anchor_ids, split)
        if not self.config.keep_end_state:
            variant += ";end_state=0"
        if self.state_dtype != torch.float32:
            variant += f";state={str(self.state_dtype).removeprefix('torch.')}"
        if self.config.miss_signatures == "context":
            variant += ";ctx=1"
        return segment_key(self.fingerprint, content, variant)

    def _layout(self, ids: list[int], segments: list[PromptSegment], start: int = 0) -> list[LayoutItem]:
        """The request's layout from position `start` (engine.pic.layout)."""
        return layout(ids, segments, self.anchor_ids, self.seam, self.key, self.config.keep_end_state, start)

    def segment_keys(self, ids: list[int], segments: list[PromptSegment]) -> list[bytes]:
        """The keys of a prompt's spliced segments, in prompt order (placements repeat)."""
        return [u.key for u in splice_units(self._layout(ids, segments))]

    def _job(self, ids: Sequence[int], u: SpliceUnit) -> SegmentJob:
        return SegmentJob(u.key, tuple(ids[u.offset:u.end]), u.split, float(len(self.anchor_ids) + u.num_tokens))

    def _reused(self, u: SpliceUnit) -> int:
        """Positions a hit of `u` reuses: anchor and content when placed first, else its tail."""
        return u.num_tokens + len(self.anchor_ids) if u.first else u.num_tokens - u.split

    def plan(self, request: Request) -> PrefillPlan:
        ids = list(request.prefill_token_ids())
        segments = request.prefill_segments()
        b = self._new_builder(request)
        bounds = prefix_bounds(segments) if self.exact is not None else []
        prefix = None
        if bounds:
            t0 = time.perf_counter()
            prefix = self.exact.find(ids, bounds, self.store)
            b.report.lookup_ms += (time.perf_counter() - t0) * 1e3
        start = 0 if prefix is None else prefix.end
        if start and self.config.fused and not cached_after(segments, start):
            return self._plan_rest(request, b, ids, bounds, prefix, start)
        items = self._layout(ids, segments, start)
        units = splice_units(items)
        state = _RequestState(b, units, ids, bounds=bounds, prefix=prefix)
        # an exact prefix that leaves nothing to splice: prefix caching's path after the
        # restore (module docstring); no store work on this request's path
        prefix_only = bool(start) and not units and self.config.fused
        if not prefix_only:
            self.keep_captured()  # earlier requests' context signatures, before this one looks up
        if units:  # nothing to look up after an exact prefix that covers every cached segment
            b.apply(0, self._lookup, "lookup")
            b.apply(0, self._compute_misses, "miss")
        if start:  # the exact state at the deepest matched boundary: no seam, no composition
            self._restore_step(b, prefix, start)
        if prefix_only:
            _, kinds, end = fused_spec(items, b.position)
            b.fused(end, lambda runner, req, **kw: self._run_prefix_only(runner, req, **kw), kinds)
        elif self.config.fused:
            spec, kinds, end = fused_spec(items, b.position)
            b.fused(end, lambda runner, req, _s=tuple(spec), _a=b.position, **kw: self._run_fused(
                runner, req, _s, _a, **kw), kinds)
        else:
            run: list[SpliceUnit] = []
            for it in items:
                if isinstance(it, Splice):
                    run.append(it.unit)
                    continue
                self._flush(b, run)
                b.compute(it.end, it.kind)
            self._flush(b, run)
        request.planner_state[STATE_KEY] = state
        request.planner_state[HINTED_KEY] = True
        self.store.admit(request.request_id, list(dict.fromkeys(u.key for u in units)), prefix,
                         hit_compute_ms(self.config, self.costs.ms_per_token("full"), units, self._reused))
        if not prefix_only:
            self._hint_queued()
        return b.build()

    def _restore_step(self, b: PlanBuilder, prefix: PrefixMatch, start: int) -> None:
        """The `load` step restoring the exact prefix [0, start), counted as its hits."""
        checkpoints = [n.checkpoint for n in prefix.path]
        b.apply(start, lambda runner, req, _c=checkpoints: restore_checkpoints(runner.cache, req.seq, _c), "load")
        for cp in checkpoints:
            b.report.add_hit(cp.end - cp.start)
        b.report.prefix_tokens = start
        self.exact.restored += 1

    def _plan_rest(self, request: Request, b: PlanBuilder, ids: list[int], bounds: list[tuple[int, int]],
                   prefix: PrefixMatch, start: int) -> PrefillPlan:
        """The plan of a request whose restored exact prefix [0, start) ends at its last
        cacheable boundary and leaves no cached segment to splice after it (`cached_after`
        is False: an exact repeat): prefix caching's plan after its restore, the `load`
        step then one fused step computing [start, len(ids)), found without a layout, a
        hit-cost estimate (no device event read) or any store work but the request's
        bookkeeping (`admit` with no keys, `finish`). Same plan, report and pass as the
        general path gives such a request."""
        self._restore_step(b, prefix, start)
        b.fused(len(ids), self._run_prefix_only, {"suffix": len(ids) - start})
        request.planner_state[STATE_KEY] = _RequestState(b, [], ids, bounds=bounds, prefix=prefix, rest_only=True)
        request.planner_state[HINTED_KEY] = True
        self.store.admit(request.request_id, (), prefix)
        return b.build()

    def _hint_queued(self) -> None:
        """The keys of the next queued requests not hinted yet, to the store (look-ahead)."""
        depth = self.store.hint_depth()
        if not self._waiting or not depth:
            return
        keys: list[bytes] = []
        for req in list(self._waiting)[:depth]:
            if req.planner_state.get(HINTED_KEY):
                continue
            req.planner_state[HINTED_KEY] = True
            keys += self.segment_keys(list(req.prefill_token_ids()), req.prefill_segments())
        if keys:
            self.store.hint(keys)

    def _run_fused(self, runner, request: Request, spec: tuple, start: int, all_logits: bool = False):
        state: _RequestState = request.planner_state[STATE_KEY]
        captures = self._captures(state)
        if state.full:  # cold fallback: plain full recompute of the fused step's range
            with self.costs.measure("full", len(state.token_ids) - start):
                if self.exact is not None and captures is None and state.bounds and state.bounds[-1][1] > start:
                    # the exact checkpoints of its prefix come with the pass (engine.pic.exact_prefix)
                    logits, tip = self.exact.fill_request(runner, request.seq, state.token_ids, state.bounds,
                                                          state.prefix or PrefixMatch(), state.prefix_pinned,
                                                          all_logits)
                    state.prefix_done = True
                    self.exact.offer(self.store, state.token_ids, tip)  # the store keeps it too, or once reused
                    return logits
                return full_pass(runner, request, state.token_ids, start, self.config, all_logits, captures)
        spliced = [s.unit for s in spec if isinstance(s, Splice) and s.unit.key not in state.in_context]
        self._ready(runner, request, spliced, layered=True)
        sealed = set()
        if runner.backend == "fla" and self.has_delta and self.config.batch_long_ranges:
            sealed = seal_tails(spec, state.to_capture, state.in_context)
        items = fused_items(spec, state.signatures, state.in_context, sealed, self.linear_mode)
        with self.costs.measure("full", 0 if spliced else len(state.token_ids) - start):  # all in context: a full pass
            return fused_prefill(runner.model, runner.cache, request.seq, state.token_ids, items,
                                 backend=runner.backend, kernel=self.config.kernel, chain=self.config.seam_chain,
                                 all_logits=all_logits, stages=getattr(runner, "prefill_stages", None),
                                 captures=captures, batch_long_ranges=self.config.batch_long_ranges,
                                 before_layer=self._layer_hook(request))

    def _run_prefix_only(self, runner, request: Request, all_logits: bool = False):
        """The rest of a request whose restored exact prefix leaves nothing to splice:
        the pass prefix caching runs after its restore (PrefixPlanner's fused step,
        engine.pic.prefix.fill_with_checkpoints: the same call, the same checkpoints of
        any further boundary, put in the tree), with no store take, layer hook or
        captures. A checkpoint deeper than the restored one goes to the store too."""
        state: _RequestState = request.planner_state[STATE_KEY]
        if state.rest_only:  # no boundary after the restored one: no checkpoint to take
            ids = state.token_ids
            logits = fill_with_checkpoints(runner, request.seq, ids, [], frozenset(), len(ids), self.config,
                                           all_logits)[0]
            state.prefix_done = True
            return logits
        m = state.prefix
        restored_tip = m.tree_tip
        logits, tip = self.exact.fill_request(runner, request.seq, state.token_ids, state.bounds, m,
                                              state.prefix_pinned, all_logits)
        state.prefix_done = True
        if tip is not restored_tip:
            self.exact.offer(self.store, state.token_ids, tip)
        return logits

    def _captures(self, state: _RequestState) -> Optional[CaptureSet]:
        """The fused step's captures (miss_signatures="context"), kept in the request state
        until the prefill is done; None without misses to capture."""
        if not state.to_capture:
            return None
        a = len(self.anchor_ids)
        state.captured = CaptureSet([ContextCapture(u.key, u.offset, u.end, u.split, u.first, a)
                                     for u in state.to_capture], self.state_dtype)
        return state.captured

    def _flush(self, b: PlanBuilder, run: list[SpliceUnit]) -> None:
        """One apply step splicing a run of contiguous units (batched kernels)."""
        if not run:
            return
        units = tuple(run)
        run.clear()
        b.apply(units[-1].end, lambda runner, req, _u=units: self._splice(runner, req, _u), "load")

    # --------------------------------------------------------------- apply steps
    def _lookup(self, runner, request: Request) -> None:
        """The store's `lookup`: hits counted per placement, one miss per distinct key."""
        state: _RequestState = request.planner_state[STATE_KEY]
        report = state.builder.report
        hits = self.store.lookup(request.request_id, list(dict.fromkeys(u.key for u in state.units)))
        slow = self.store.slow_hits(request.request_id)
        for key, sig in hits.items():
            if sig is not None:
                state.signatures[key] = sig.to(runner.cache.device)
        seen: set[bytes] = set()
        for u in state.units:
            if u.key in hits:
                report.add_hit(self._reused(u))
            elif u.key not in seen:
                seen.add(u.key)
                (state.slow if u.key in slow else state.missing).append(u)

    def _compute_misses(self, runner, request: Request) -> None:
        """The store's `claim` over the misses, unless the cold fallback or miss_path
        takes them; what it computed here counts as misses, what it found as hits."""
        state: _RequestState = request.planner_state[STATE_KEY]
        report = state.builder.report
        # cold fallback (module docstring), then the slow hits in context (none left after it)
        full = fall_back_to_full(self.config, self.cold_full_threshold(), state, self.deferred, self._job)
        slow_hits_in_context(state)
        if full or self._misses_in_context(state):
            return
        missing, state.missing = state.missing, []
        if not missing:
            return
        filled = self.store.claim(request.request_id, [self._job(state.token_ids, u) for u in missing],
                                  lambda jobs: self._alone(runner, [(j.token_ids, j.split) for j in jobs]))
        for u, f in zip(missing, filled):
            state.signatures[u.key] = f.signature
            if f.computed:
                report.add_miss(len(self.anchor_ids) + u.num_tokens)
            else:
                report.add_hit(self._reused(u))

    def _ready(self, runner, request: Request, units: Sequence[SpliceUnit], layered: bool = False) -> None:
        """Every unit's signature in the request state before the units are spliced: the
        store's `take`; a hit that could not be loaded after all is computed here (its
        accounting corrected) and published. `layered`: the fused pass follows, which
        waits per layer through `_layer_hook` (SegmentStore.take's `layered`)."""
        state: _RequestState = request.planner_state[STATE_KEY]
        report = state.builder.report
        got = self.store.take(request.request_id, list(dict.fromkeys(u.key for u in units)), layered=layered)
        for key, sig in got.items():
            if sig is not None:
                state.signatures[key] = sig
                continue
            counted = [u for u in state.units if u.key == key]
            for u in counted:
                report.hit_segments -= 1
                report.reused_tokens -= self._reused(u)
            job = self._job(state.token_ids, counted[0])
            (sig,) = self._alone(runner, [(job.token_ids, job.split)])
            state.signatures[key] = sig
            report.add_miss(int(job.cost))
            self.store.publish(key, sig, job.cost, request.request_id)

    def _layer_hook(self, request: Request) -> Optional[Callable[[int], None]]:
        """The fused pass's `before_layer(i)`: the store's per-layer waits for segments it
        left to the pass (SegmentStore.layer_hook; None: nothing to wait for per layer)."""
        return self.store.layer_hook(request.request_id)

    def _splice(self, runner, request: Request, units: tuple[SpliceUnit, ...]) -> None:
        self._ready(runner, request, units)
        state: _RequestState = request.planner_state[STATE_KEY]
        pieces = [SplicePiece(state.signatures[u.key], u.offset, u.first, self.linear_mode) for u in units]
        splice(runner.cache, runner.model, request.seq, pieces, kernel=self.config.kernel)

    # ------------------------------------------------------------ where misses go
    def _misses_in_context(self, state: _RequestState) -> bool:
        """miss_path="context" (engine.pic.miss_routing.misses_in_context)."""
        return misses_in_context(self.config, state, self.deferred, self._job)

    def cold_full_threshold(self) -> Optional[float]:
        """The share of a prompt's tokens in misses from which the cold fallback takes the
        request (PicConfig.cold_full_fraction / cold_full_policy); None: never."""
        f = self.config.cold_full_fraction
        if f is None or self.config.cold_full_policy != "cost":
            return f
        even = self.costs.break_even()
        return f if even is None else min(f, even)

    # ------------------------------------------------------------ alone passes
    def _alone(self, runner, segments: Sequence[tuple[Sequence[int], int]],
               should_stop: Optional[Callable[[], bool]] = None) -> list[SegmentSignature]:
        """Signatures of (content tokens, split) segments, each computed alone behind the
        anchor (one packed pass), tagged with this model's fingerprint. `should_stop`
        (idle work): asked between layers; True raises AlonePassStopped."""
        if not segments:
            return []
        alone = self._start_alone(runner, segments)
        with self.costs.measure("alone", alone.tokens):
            if not alone.run(should_stop):
                raise AlonePassStopped(f"alone pass stopped before layer {alone.layer}")
        return self._signed(alone)

    def _start_alone(self, runner, segments: Sequence[tuple[Sequence[int], int]]) -> AlonePass:
        return AlonePass(runner.model, [(list(ids), split) for ids, split in segments], self.anchor_ids,
                         backend=runner.backend, state_dtype=self.state_dtype,
                         keep_end_state=self.config.keep_end_state, tail_states=self.config.tail_states)

    def _signed(self, alone: AlonePass) -> list[SegmentSignature]:
        sigs = alone.signatures()
        for sig in sigs:
            sig.meta["fingerprint"] = self.fingerprint
        return sigs

    # ------------------------------------------------------------------ lifecycle
    def on_prefill_done(self, request: Request) -> None:
        state = request.planner_state.get(STATE_KEY)
        if state is not None and state.captured is not None:  # kept after its first token is out
            self.captured.append(state.captured)
            state.captured = None
        if (state is not None and self.exact is not None and state.bounds and not state.prefix_done
                and self.exact.wants_pass(state.token_ids, state.bounds)):
            self.exact.queue(state.token_ids, state.bounds)  # its exact checkpoints, computed while idle
        super().on_prefill_done(request)
        self.store.finish(request.request_id, done=True)

    def on_request_freed(self, request: Request) -> None:
        state = request.planner_state.get(STATE_KEY)
        super().on_request_freed(request)
        if state is None or not state.builder.report.complete:  # complete: on_prefill_done finished it
            self.store.finish(request.request_id, done=False)

    def _release(self, state: _RequestState) -> None:
        if state.prefix is not None:  # exact_prefix.unpin, inlined: twice per request
            for n in state.prefix.path:
                n.pins -= 1
            state.prefix = None
        for n in state.prefix_pinned:
            n.pins -= 1
        state.prefix_pinned.clear()


def anchor_for(config: PicConfig, tokenizer) -> list[int]:
    """The anchor tokens every segment is computed behind: [BOS] or nothing."""
    if config.anchor == "bos" and getattr(tokenizer, "bos_id", None) is not None:
        return [int(tokenizer.bos_id)]
    return []


def make_planner(config: PicConfig, model, fingerprint: str, tokenizer,
                 signature_cache: Optional[SignatureCache] = None, prefix_tree=None,
                 store: Optional[SegmentStore] = None):
    """The planner of `config.method` for `model` (a HybridDecoder). `store` (pic, naive)
    defaults to an `InProcessSegmentStore` over `signature_cache`, itself by default an
    in-process LRU of `config.signature_cache_bytes`; `prefix_tree` (prefix; pic's exact
    prefixes) to a new `PrefixTree` of `config.prefix_cache_bytes`."""
    device = model.device
    if config.method == "full":
        return FullPlanner(config, device)
    if config.method == "prefix":
        from engine.pic.prefix import PrefixPlanner, PrefixTree

        tree = prefix_tree if prefix_tree is not None else PrefixTree(config.prefix_cache_bytes)
        return PrefixPlanner(config, tree, device)
    if store is None:
        store = InProcessSegmentStore(signature_cache if signature_cache is not None
                                      else InMemorySignatureCache(config.signature_cache_bytes))
    return PicPlanner(config, model.config, fingerprint, anchor_for(config, tokenizer), store, device, model.dtype,
                      prefix_tree=prefix_tree)
