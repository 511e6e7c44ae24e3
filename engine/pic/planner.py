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
its boundary and the layout starts there (no seam, no composition before it). After the
prefill, a prefix that was not exact yet is queued for an idle-time pass (`help_idle`,
after the queued alone passes); the cold fallback's pass takes the checkpoints itself.

`FullPlanner` computes everything (with the same report); the prefix planner lives in
engine.pic.prefix. Planners are called from the engine loop's thread only.
"""
from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from engine.models.config import GDN, SWA, ModelConfig
from engine.pic.capture import CaptureSet, ContextCapture
from engine.pic.compute import AlonePass
from engine.pic.config import PicConfig
from engine.pic.costs import PathCosts
from engine.pic.errors import AlonePassStopped, PicConfigError
from engine.pic.exact_prefix import ExactPrefixes, PrefixMatch, unpin
from engine.pic.fused import FusedItem, fused_prefill
from engine.pic.full import FullPlanner, full_pass
from engine.pic.prefix import PrefixNode, PrefixTree, prefix_bounds, restore_checkpoints
from engine.pic.report import STATE_KEY, PlanBuilder, ReportingPlanner
from engine.pic.signature import SegmentSignature
from engine.pic.signature_cache import InMemorySignatureCache, SignatureCache, segment_key, signature_variant
from engine.pic.splice import SplicePiece, splice
from engine.runtime.planner import PrefillPlan
from engine.runtime.request import PromptSegment, Request

STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_state_dtype(name: str, model_dtype: Optional[torch.dtype]) -> torch.dtype:
    """PicConfig.state_dtype -> a dtype: "auto" is the model's dtype when that is bfloat16
    or float16, else float32."""
    if name == "auto":
        return model_dtype if model_dtype in (torch.bfloat16, torch.float16) else torch.float32
    return STATE_DTYPES[name]
#: most segments queued for idle-time alone passes (cold fallback); the oldest go first
MAX_DEFERRED = 512
#: tokens of alone passes one `help_idle` call computes at most (one packed pass): a request
#: arriving meanwhile waits for the pass, so it is kept short (~30-60 ms for a 2B model)
IDLE_BATCH_TOKENS = 4096
#: how often an idle engine polls `help_idle` while segments are queued (seconds)
IDLE_POLL_S = 0.02


@dataclass(frozen=True)
class SpliceUnit:
    """A cached segment to splice: content tokens at [offset, end) of the prompt."""

    offset: int
    end: int
    split: int
    first: bool
    key: bytes

    @property
    def num_tokens(self) -> int:
        return self.end - self.offset

    @property
    def splice_start(self) -> int:
        """First position its splice writes: 0 (anchor included) when placed first, else
        after its seam (SplicePiece.start, without the signature)."""
        return 0 if self.first else self.offset + self.split


@dataclass
class _RequestState:
    builder: PlanBuilder
    units: list[SpliceUnit]
    token_ids: list[int]
    signatures: dict[bytes, SegmentSignature] = field(default_factory=dict)
    missing: list[SpliceUnit] = field(default_factory=list)
    held: list[bytes] = field(default_factory=list)
    full: bool = False  # cold fallback: the fused step computes the whole prompt
    in_context: set[bytes] = field(default_factory=set)  # misses the fused step computes (miss_path)
    to_capture: list[SpliceUnit] = field(default_factory=list)  # misses whose signatures the pass takes
    captured: Optional[CaptureSet] = None  # filled by the fused step, kept after the first token
    bounds: list[tuple[int, int]] = field(default_factory=list)  # prefix boundaries (exact_prefix)
    prefix: Optional[PrefixMatch] = None  # the exact prefix restored (exact_prefix)
    prefix_done: bool = False  # the request's own pass took its exact checkpoints (cold fallback)
    prefix_pinned: list[PrefixNode] = field(default_factory=list)  # nodes that pass inserted


def _add_compute(items: list[FusedItem], start: int, end: int, sealed: bool = False) -> None:
    """Append in-context positions [start, end) to fused items, merged with a computed
    item right before them (one range instead of two) unless either is `sealed` (a
    captured tail kept its own range)."""
    if end <= start:
        return
    if sealed:
        items.append(FusedItem(start, end, sealed=True))
        return
    if items and items[-1].computes and not items[-1].sealed and items[-1].end == start:
        items[-1] = FusedItem(items[-1].start, end)
    else:
        items.append(FusedItem(start, end))


class PicPlanner(ReportingPlanner):
    """`pic` and `naive` (module docstring)."""

    def __init__(self, config: PicConfig, model_config: ModelConfig, fingerprint: str,
                 anchor_ids: Sequence[int], cache: SignatureCache, device: torch.device,
                 model_dtype: Optional[torch.dtype] = None, prefix_tree: Optional[PrefixTree] = None) -> None:
        super().__init__(config, device)
        if config.method not in ("pic", "naive"):
            raise PicConfigError(f"PicPlanner serves methods pic and naive, not {config.method!r}")
        self.name = config.method
        self.fingerprint = fingerprint
        self.anchor_ids = [int(t) for t in anchor_ids]
        self.cache = cache
        window = model_config.attention.sliding_window if SWA in model_config.layers else None
        self.has_delta = GDN in model_config.layers
        self.seam = config.effective_seam(window)
        self.linear_mode = "add" if config.method == "naive" else "compose"
        self.state_dtype = resolve_state_dtype(config.state_dtype, model_dtype)
        #: cold-fallback segments to compute alone when idle: key -> (content tokens, split)
        self.deferred: OrderedDict[bytes, tuple[tuple[int, ...], int]] = OrderedDict()
        #: captures of finished prefills whose signatures are still to be kept (keep_captured)
        self.captured: deque[CaptureSet] = deque()
        #: measured cost per token of alone passes and of full passes (cold_full_policy="cost")
        self.costs = PathCosts(self.device)
        #: idle alone passes stopped half-way for an arriving request (`help_idle(should_stop=...)`)
        self.idle_stopped = 0
        #: the idle pass that gave way, with its batch, resumed by the next `help_idle`
        self.idle_pass: Optional[tuple[list, AlonePass]] = None
        #: exact-prefix reuse (PicConfig.exact_prefix; `pic` only): its prefix tree and idle jobs
        self.exact: Optional[ExactPrefixes] = None
        if config.exact_prefix and config.method == "pic":
            self.exact = ExactPrefixes(prefix_tree if prefix_tree is not None else PrefixTree(
                config.prefix_cache_bytes), config)

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

    def _layout(self, ids: list[int], segments: list[PromptSegment], start: int = 0) -> list[tuple]:
        """("compute", end, kind) and ("splice", SpliceUnit) items in prompt order, from
        position `start` (the end of a restored exact prefix, a segment boundary: the
        segments before it are left out).

        Positions no segment covers (the BOS the engine puts before the first segment)
        are computed, except the anchor in front of a first placement, which the splice
        covers."""
        a = len(self.anchor_ids)
        anchored = ids[:a] == self.anchor_ids and start == 0
        segments = [s for s in segments if s.num_tokens > 0]
        items: list[tuple] = []
        pos = start  # end of the items so far

        def compute(end: int, kind: str) -> None:
            nonlocal pos
            if end > pos:
                items.append(("compute", end, kind))
                pos = end

        for i, s in enumerate(segments):
            if s.token_end <= start:  # inside the restored prefix
                continue
            # a segment that starts the prompt and holds the anchor itself: content after it
            offset = a if (s.token_start == 0 and anchored) else s.token_start
            n = s.token_end - offset
            if not s.cache or i == len(segments) - 1 or n <= 0:
                compute(s.token_end, "suffix")
                continue
            split = min(n, self.seam)
            key = self.key(ids[offset:s.token_end], split)
            if self.config.keep_end_state and anchored and offset == a and i == 0:
                items.append(("splice", SpliceUnit(offset, s.token_end, split, True, key)))
                pos = s.token_end
                continue
            compute(offset, "suffix")  # positions before the content (BOS, uncovered gaps)
            if split >= n:
                compute(s.token_end, "seam")
                continue
            compute(offset + split, "seam")
            items.append(("splice", SpliceUnit(offset, s.token_end, split, False, key)))
            pos = s.token_end
        compute(len(ids), "suffix")
        return items

    def plan(self, request: Request) -> PrefillPlan:
        self.keep_captured()  # earlier requests' context signatures, before this one looks up
        ids = list(request.prefill_token_ids())
        b = self._new_builder(request)
        bounds = prefix_bounds(request.prefill_segments()) if self.exact is not None else []
        prefix = None
        if bounds:
            t0 = time.perf_counter()
            prefix = self._match_prefix(request, ids, bounds)
            b.report.lookup_ms += (time.perf_counter() - t0) * 1e3
        start = 0 if prefix is None else prefix.end
        items = self._layout(ids, request.prefill_segments(), start)
        units = [it[1] for it in items if it[0] == "splice"]
        state = _RequestState(b, units, ids, bounds=bounds, prefix=prefix)
        if units:  # nothing to look up after an exact prefix that covers every cached segment
            b.apply(0, self._lookup, "lookup")
            b.apply(0, self._compute_misses, "miss")
        if start:  # the exact state at the deepest matched boundary: no seam, no composition
            checkpoints = [n.checkpoint for n in prefix.path]
            b.apply(start, lambda runner, req, _c=checkpoints: restore_checkpoints(runner.cache, req.seq, _c), "load")
            for cp in checkpoints:
                b.report.add_hit(cp.end - cp.start)
            b.report.prefix_tokens = start
            self.exact.restored += 1
        if self.config.fused:
            self._plan_fused(b, items)
            request.planner_state[STATE_KEY] = state
            return b.build()
        run: list[SpliceUnit] = []
        for it in items:
            if it[0] == "splice":
                run.append(it[1])
                continue
            self._flush(b, run)
            b.compute(it[1], it[2])
        self._flush(b, run)
        request.planner_state[STATE_KEY] = state
        return b.build()

    def _plan_fused(self, b: PlanBuilder, items: list[tuple]) -> None:
        """One fused step over the whole layout (engine.pic.fused)."""
        spec: list[tuple] = []
        kinds = {"seam": 0, "suffix": 0}
        pos = start = b.position
        for it in items:
            if it[0] == "splice":
                spec.append(("s", it[1]))
                pos = it[1].end
            else:
                spec.append(("c", pos, it[1]))
                kinds[it[2]] += it[1] - pos
                pos = it[1]
        b.fused(pos, lambda runner, req, _s=tuple(spec), _a=start, **kw: self._run_fused(runner, req, _s, _a, **kw),
                kinds)

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
                    self._prefix_computed(state.token_ids, tip)
                    return logits
                return full_pass(runner, request, state.token_ids, start, self.config, all_logits, captures)
        self._ready(runner, request, [s[1] for s in spec if s[0] == "s" and s[1].key not in state.in_context],
                    layered=True)
        sealed = self._seal_tails(runner, state, spec)
        items: list[FusedItem] = []
        for s in spec:
            if s[0] == "c":
                _add_compute(items, s[1], s[2])
                continue
            u = s[1]
            if u.key in state.in_context:  # a miss computed in context (miss_path="context")
                _add_compute(items, u.splice_start, u.end, sealed=u in sealed)
                continue
            sig = state.signatures[u.key]
            first = u.first and sig.placeable_first
            if u.first and not first:  # a context signature placed first: anchor and seam computed
                _add_compute(items, 0, u.offset + u.split)
            piece = SplicePiece(sig, u.offset, first, self.linear_mode)
            items.append(FusedItem(piece.start, piece.end, piece))
        return fused_prefill(runner.model, runner.cache, request.seq, state.token_ids, items,
                             backend=runner.backend, kernel=self.config.kernel, chain=self.config.seam_chain,
                             all_logits=all_logits, stages=getattr(runner, "prefill_stages", None),
                             captures=captures, batch_long_ranges=self.config.batch_long_ranges,
                             before_layer=self._layer_hook(request))

    def _seal_tails(self, runner, state: _RequestState, spec: tuple) -> set:
        """The captured units whose tails the fused step keeps as ranges of their own, so
        that a delta-rule layer's shared varlen call for long ranges (engine.pic.long_ranges)
        also gives the capture their (T, E) and it runs no call of its own: all captured
        later placements, when each one's seam follows a spliced hit (merging then joins
        nothing but its own seam and the next hit's); none otherwise (a run of misses stays
        one range: one call instead of one per tail), nor off fla, without delta layers or
        without the shared call (PicConfig.batch_long_ranges off)."""
        later = [u for u in state.to_capture if not u.first]
        if not later or runner.backend != "fla" or not self.has_delta or not self.config.batch_long_ranges:
            return set()
        at = {id(s[1]): j for j, s in enumerate(spec) if s[0] == "s"}
        for u in later:
            j = at.get(id(u))
            if j is None or j < 2:
                return set()
            seam, before = spec[j - 1], spec[j - 2]
            if seam[0] != "c" or seam[1] != u.offset or before[0] != "s" or before[1].key in state.in_context:
                return set()
        return set(later)

    def _captures(self, state: _RequestState) -> Optional[CaptureSet]:
        """The fused step's captures (miss_signatures="context"), kept in the request state
        until the prefill is done; None without misses to capture."""
        if not state.to_capture:
            return None
        a = len(self.anchor_ids)
        state.captured = CaptureSet([ContextCapture(u.key, u.offset, u.end, u.split, u.first, a)
                                     for u in state.to_capture], self.state_dtype)
        return state.captured

    def on_prefill_done(self, request: Request) -> None:
        state = request.planner_state.get(STATE_KEY)
        if state is not None and state.captured is not None:  # kept after its first token is out
            self.captured.append(state.captured)
            state.captured = None
        if state is not None and self.exact is not None and state.bounds and not state.prefix_done:
            self.exact.queue(state.token_ids, state.bounds)  # its exact checkpoints, computed while idle
        super().on_prefill_done(request)

    # ------------------------------------------------------------ exact prefixes
    def _match_prefix(self, request: Request, ids: list[int], bounds: list[tuple[int, int]]) -> Optional[PrefixMatch]:
        """The exact prefix this request restores (engine.pic.exact_prefix), its path
        pinned; None when none is usable. The store-backed planner also asks the daemon."""
        m = self.exact.match(ids, bounds)
        return m if m.path else None

    def _prefix_computed(self, ids: Sequence[int], tip: Optional[PrefixNode]) -> None:
        """Hook: exact checkpoints of `ids`' prefix down to `tip` are in the tree (the
        store-backed planner keeps the deepest one with states in the daemon)."""
        return None

    def _help_prefix(self, runner, should_stop: Optional[Callable[[], bool]] = None) -> int:
        """One queued exact prefix computed (idle work); 1 when a job ran."""
        if should_stop is not None and should_stop():  # the pass cannot give way half-way: not now
            return 0
        job = self.exact.next_job()
        if job is None:
            return 0
        path = self.exact.compute(runner, job)
        if path:
            self._prefix_computed(job.ids, path[-1])
        return 1

    def keep_captured(self) -> int:
        """Turn the captures of finished prefills into signatures and cache them (the
        store-backed planner stores them through the daemon); how many. Deferred from
        `on_prefill_done`, which the engine calls before it samples the request's first
        token, to the next `plan()` (before any lookup) or idle call, so that a request's
        TTFT does not carry its signatures' bookkeeping."""
        n = 0
        while self.captured:
            caps = self.captured.popleft()
            for cap, sig in zip(caps.captures, caps.signatures({"fingerprint": self.fingerprint})):
                self._keep_captured(cap, sig)
                n += 1
        return n

    def _keep_captured(self, cap: ContextCapture, sig: SegmentSignature) -> None:
        """Cache a context signature (the store-backed planner stores it through the daemon)."""
        self.cache.put(cap.key, sig)

    def _flush(self, b: PlanBuilder, run: list[SpliceUnit]) -> None:
        """One apply step splicing a run of contiguous units (batched kernels)."""
        if not run:
            return
        units = tuple(run)
        run.clear()
        b.apply(units[-1].end, lambda runner, req, _u=units: self._splice(runner, req, _u), "load")

    # --------------------------------------------------------------- apply steps
    def _lookup(self, runner, request: Request) -> None:
        state: _RequestState = request.planner_state[STATE_KEY]
        report = state.builder.report
        seen: set[bytes] = set()
        a = len(self.anchor_ids)
        for u in state.units:
            if u.key not in seen:
                seen.add(u.key)
                sig = self.cache.get(u.key)
                if sig is None:
                    state.missing.append(u)
                    continue
                state.held.append(u.key)
                state.signatures[u.key] = sig.to(runner.cache.device)
            if u.key in state.signatures:
                report.add_hit(u.num_tokens + a if u.first else u.num_tokens - u.split)

    def _compute_misses(self, runner, request: Request) -> None:
        state: _RequestState = request.planner_state[STATE_KEY]
        report = state.builder.report
        if self._fall_back_to_full(state) or self._misses_in_context(state):
            return
        sigs = self._alone(runner, [(state.token_ids[u.offset:u.end], u.split) for u in state.missing])
        for u, sig in zip(state.missing, sigs):
            self.cache.put(u.key, sig)
            state.signatures[u.key] = sig
            report.add_miss(len(self.anchor_ids) + u.num_tokens)

    # ------------------------------------------------------------ cold fallback
    def _fall_back_to_full(self, state: _RequestState) -> bool:
        """Cold fallback (module docstring): True when this request's misses hold at
        least `cold_full_fraction` of its prompt; they are then queued for `help_idle`,
        and the request's fused step computes the whole prompt."""
        f = self.cold_full_threshold()
        if f is None or not state.missing or not self.config.fused:
            return False
        if sum(u.num_tokens for u in state.missing) < f * len(state.token_ids):
            return False
        if self.config.miss_signatures == "context":
            state.to_capture = self._first_placements(state.missing)
            state.builder.report.set_cold_full(0, len(state.to_capture))
        else:
            for u in state.missing:
                self._defer(u.key, tuple(state.token_ids[u.offset:u.end]), u.split)
            self._trim_deferred()
            state.builder.report.set_cold_full(len(state.missing))
        if state.prefix is not None:  # the restored exact prefix stays reused; the rest is computed
            r = state.builder.report
            r.reused_tokens, r.hit_segments = state.prefix.end, len(state.prefix.path)
            r.suffix_tokens = r.recomputed_tokens = r.prompt_tokens - state.prefix.end
        state.missing = []
        state.full = True
        return True

    def _misses_in_context(self, state: _RequestState) -> bool:
        """miss_path="context": the fused step computes this request's misses in context
        (each where its splice would be: tail, or anchor + segment when placed first);
        they are queued for `help_idle`. True when there were misses to take."""
        if self.config.miss_path != "context" or not state.missing or not self.config.fused:
            return False
        capture = self.config.miss_signatures == "context"
        for u in state.missing:
            if not capture:
                self._defer(u.key, tuple(state.token_ids[u.offset:u.end]), u.split)
            state.in_context.add(u.key)
        self._trim_deferred()
        if capture:
            state.to_capture = self._first_placements(state.missing)
        for key in dict.fromkeys(u.key for u in state.missing):  # every placement of each miss
            state.builder.report.add_in_context_miss(
                sum(u.end - u.splice_start for u in state.units if u.key == key), captured=capture)
        state.missing = []
        return True

    @staticmethod
    def _first_placements(missing: Sequence[SpliceUnit]) -> list[SpliceUnit]:
        """One unit per missing key: its first placement in the prompt."""
        seen: dict[bytes, SpliceUnit] = {}
        for u in missing:
            seen.setdefault(u.key, u)
        return sorted(seen.values(), key=lambda u: u.offset)

    def _defer(self, key: bytes, ids: tuple[int, ...], split: int) -> None:
        self.deferred[key] = (ids, split)
        self.deferred.move_to_end(key)

    def _trim_deferred(self) -> None:
        while len(self.deferred) > MAX_DEFERRED:
            self.deferred.popitem(last=False)

    def cold_full_threshold(self) -> Optional[float]:
        """The share of a prompt's tokens in misses from which the cold fallback takes the
        request (PicConfig.cold_full_fraction / cold_full_policy); None: never."""
        f = self.config.cold_full_fraction
        if f is None or self.config.cold_full_policy != "cost":
            return f
        even = self.costs.break_even()
        return f if even is None else min(f, even)

    def _next_deferred(self) -> list[tuple[bytes, tuple[int, ...], int]]:
        """The queued segments of the next idle batch (oldest first, within
        IDLE_BATCH_TOKENS; at least one), taken off the queue."""
        out: list[tuple[bytes, tuple[int, ...], int]] = []
        tokens = 0
        while self.deferred:
            key, (ids, split) = next(iter(self.deferred.items()))
            if out and tokens + len(ids) > IDLE_BATCH_TOKENS:
                break
            del self.deferred[key]
            out.append((key, ids, split))
            tokens += len(ids)
        return out

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

    def _run_idle(self, items: list, alone: AlonePass,
                  should_stop: Optional[Callable[[], bool]]) -> Optional[list[SegmentSignature]]:
        """Run (or resume) the idle batch `items`' alone pass: its signatures, or None when
        it gave way to a request; it is then kept with its items (`idle_pass`) and the next
        `help_idle` resumes it where it stopped. Only a pass run in one go is measured."""
        self.idle_pass = None
        fresh = alone.layer == 0
        with self.costs.measure("alone", alone.tokens if fresh else 0) as sample:
            finished = alone.run(should_stop)
            if not finished:
                sample.discard()
        if not finished:
            if self.config.idle_resume:
                self.idle_pass = (items, alone)
            self.idle_stopped += 1
            return None
        return self._signed(alone)

    def _requeue(self, todo: Sequence[tuple[bytes, tuple[int, ...], int]]) -> None:
        """Put an idle batch that gave way back at the front of the queue (idle_resume=False)."""
        for key, ids, split in reversed(todo):
            self.deferred[key] = (tuple(ids), split)
            self.deferred.move_to_end(key, last=False)

    @property
    def idle_poll_s(self) -> Optional[float]:
        """How often the engine should call `help_idle` while idle (None: never)."""
        queues = self.config.cold_full_fraction is not None or self.config.miss_path == "context"
        if self.config.miss_signatures == "context":  # misses' signatures come from their requests
            queues = bool(self.captured)
        if self.exact is not None and self.exact.pending:
            queues = True
        return IDLE_POLL_S if queues else None

    def help_idle(self, runner, should_stop: Optional[Callable[[], bool]] = None) -> int:
        """Compute queued cold-fallback segments alone and cache them; how many. Called
        by the engine while it has no request. `should_stop` (e.g. "a request arrived"):
        asked between the pass's layers; when it says so the pass gives way: it is kept,
        0 is returned, and the next call resumes it where it stopped. Context signatures
        waiting to be kept go first (`keep_captured`)."""
        kept = self.keep_captured()
        if kept:
            return kept
        if self.idle_pass is None and not self.deferred and self.exact is not None and self.exact.pending:
            return self._help_prefix(runner, should_stop)
        if self.idle_pass is not None:
            todo, alone = self.idle_pass
        else:
            todo = self._next_deferred()
            todo = [t for t, held in zip(todo, self.cache.lookup([t[0] for t in todo])) if not held]
            if not todo:
                return 0
            alone = self._start_alone(runner, [(ids, split) for _, ids, split in todo])
        sigs = self._run_idle(todo, alone, should_stop)
        if sigs is None:
            if self.idle_pass is None:  # not kept (idle_resume=False): queued again
                self._requeue(todo)
            return 0
        for (key, _, _), sig in zip(todo, sigs):
            self.cache.put(key, sig)
        return len(todo)

    def _ready(self, runner, request: Request, units: Sequence[SpliceUnit], layered: bool = False) -> None:
        """Hook: make every unit's signature available in the request state before it is
        spliced (the store-backed planner takes loads here); signatures of the
        in-process cache are there since the lookup step. `layered`: the fused pass
        follows, which waits per layer through `_layer_hook`."""
        return None

    def _layer_hook(self, request: Request):
        """Hook: the fused pass's `before_layer(i)` (None: nothing to wait for per layer;
        the store-backed planner waits there for segments copied layer by layer)."""
        return None

    def _splice(self, runner, request: Request, units: tuple[SpliceUnit, ...]) -> None:
        self._ready(runner, request, units)
        state: _RequestState = request.planner_state[STATE_KEY]
        pieces = [SplicePiece(state.signatures[u.key], u.offset, u.first, self.linear_mode) for u in units]
        splice(runner.cache, runner.model, request.seq, pieces, kernel=self.config.kernel)

    def _release(self, state: _RequestState) -> None:
        for key in state.held:
            self.cache.release(key)
        state.held.clear()
        if state.prefix is not None:
            unpin(state.prefix.path)
            state.prefix = None
        unpin(state.prefix_pinned)
        state.prefix_pinned.clear()


def anchor_for(config: PicConfig, tokenizer) -> list[int]:
    """The anchor tokens every segment is computed behind: [BOS] or nothing."""
    if config.anchor == "bos" and getattr(tokenizer, "bos_id", None) is not None:
        return [int(tokenizer.bos_id)]
    return []


def make_planner(config: PicConfig, model, fingerprint: str, tokenizer,
                 signature_cache: Optional[SignatureCache] = None, prefix_tree=None):
    """The planner of `config.method` for `model` (a HybridDecoder). `signature_cache`
    (pic, naive) defaults to an in-process LRU of `config.signature_cache_bytes`;
    `prefix_tree` (prefix; pic's exact prefixes) to a new `PrefixTree` of
    `config.prefix_cache_bytes`."""
    device = model.device
    if config.method == "full":
        return FullPlanner(config, device)
    if config.method == "prefix":
        from engine.pic.prefix import PrefixPlanner, PrefixTree

        tree = prefix_tree if prefix_tree is not None else PrefixTree(config.prefix_cache_bytes)
        return PrefixPlanner(config, tree, device)
    cache = signature_cache if signature_cache is not None else InMemorySignatureCache(config.signature_cache_bytes)
    return PicPlanner(config, model.config, fingerprint, anchor_for(config, tokenizer), cache, device, model.dtype,
                      prefix_tree=prefix_tree)
