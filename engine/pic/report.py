"""Per-request accounting of a prefill plan: which tokens were reused and which computed,
and where the time went; plus `PlanBuilder`, which assembles a `PrefillPlan` from compute
ranges and apply callables.

Token accounting (`PrefillReport`), per request:
- `reused_tokens`: prompt positions filled from a cache hit (a signature or a prefix
  checkpoint) without running them through the model for this request;
- `recomputed_tokens`: tokens this request ran through the model: in context (seams,
  the question, uncached segments) plus the alone passes of signature misses (a cold
  segment is computed alone once, anchor included, and then spliced like a hit);
- the parts: `seam_tokens`, `suffix_tokens` (in-context compute that is not a seam),
  `miss_tokens` (alone passes). A warm request has reused + recomputed = prompt.

Time split (milliseconds): every plan step carries its kind as its label (`lookup`,
`miss`, `load`, `checkpoint` for apply steps; `seam`, `suffix` for compute steps); the
engine adds each step's wall time to `request.timeline.prefill_split[label]`
(device-synchronised when `LLMEngine.sync_timings` is set), and `PlanBuilder.finish`
copies it into `lookup_ms` (signature lookups), `miss_ms` (alone passes of misses and
their puts), `load_compose_ms` (splicing: re-rotation, scatter, state composition;
prefix restores), `seam_ms`, `suffix_ms`, `checkpoint_ms` (prefix caching's boundary
snapshots) and `fused_ms` (PIC's one-pass prefill, where splicing, seams and suffix
run together; engine.pic.fused). Lookups a planner does inside `plan()` (prefix matching) it adds itself.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional

import torch

from engine.runtime.planner import ApplyStep, ComputeStep, FusedStep, PrefillPlan

if TYPE_CHECKING:  # pragma: no cover - annotations only
    from engine.pic.config import PicConfig
    from engine.runtime.request import Request

#: key of a planner's per-request state in `Request.planner_state`
STATE_KEY = "pic"

COMPUTE_KINDS = ("seam", "suffix")
APPLY_KINDS = ("lookup", "miss", "load", "checkpoint")
_MS_FIELD = {"lookup": "lookup_ms", "miss": "miss_ms", "load": "load_compose_ms", "checkpoint": "checkpoint_ms",
             "seam": "seam_ms", "suffix": "suffix_ms", "fused": "fused_ms"}


@dataclass
class PrefillReport:
    """What one request's prefill reused, computed and spent (module docstring)."""

    request_id: str
    method: str
    prompt_tokens: int
    reused_tokens: int = 0
    recomputed_tokens: int = 0
    seam_tokens: int = 0
    suffix_tokens: int = 0
    miss_tokens: int = 0
    hit_segments: int = 0
    miss_segments: int = 0
    prefix_tokens: int = 0  # of reused_tokens: restored from an exact prefix checkpoint (no seam)
    lookup_ms: float = 0.0
    miss_ms: float = 0.0
    load_compose_ms: float = 0.0
    seam_ms: float = 0.0
    suffix_ms: float = 0.0
    checkpoint_ms: float = 0.0
    fused_ms: float = 0.0  # the one-pass prefill (seams + splices + suffix together)
    deferred_segments: int = 0  # cold fallback: misses queued for idle-time alone passes
    captured_segments: int = 0  # misses whose signatures the request's own pass took (miss_signatures)
    slow_hit_segments: int = 0  # hits not loaded (slower than computing them): computed in context
    cold_full: bool = False  # cold fallback: the prompt was computed by full recompute
    complete: bool = False  # the plan ran to its end (False after a preemption mid-way)

    def add_compute(self, kind: str, n: int) -> None:
        if kind == "seam":
            self.seam_tokens += n
        else:
            self.suffix_tokens += n
        self.recomputed_tokens += n

    def add_miss(self, n: int) -> None:
        self.miss_tokens += n
        self.recomputed_tokens += n
        self.miss_segments += 1

    def add_in_context_miss(self, n: int, captured: bool = False) -> None:
        """A missing segment computed in context in the request (miss_path="context"):
        its `n` positions (all its placements) count as suffix compute; it is queued
        (`deferred_segments`), or its signature is taken from the pass (`captured`)."""
        self.add_compute("suffix", n)
        self.miss_segments += 1
        if captured:
            self.captured_segments += 1
        else:
            self.deferred_segments += 1

    def add_slow_hit(self, n: int) -> None:
        """A hit the store did not load (slower than computing it: SegmentStore.slow_hits)
        computed in context: its `n` positions (all its placements) count as suffix compute."""
        self.add_compute("suffix", n)
        self.slow_hit_segments += 1

    def add_hit(self, reused: int) -> None:
        self.hit_segments += 1
        self.reused_tokens += reused

    def set_cold_full(self, deferred: int, captured: int = 0) -> None:
        """The request is served by full recompute (cold fallback): nothing reused,
        every prompt token computed in context, `deferred` misses queued, `captured`
        misses' signatures taken from the pass."""
        self.cold_full = True
        self.deferred_segments = deferred
        self.captured_segments = captured
        self.reused_tokens = self.hit_segments = self.seam_tokens = 0
        self.suffix_tokens = self.recomputed_tokens = self.prompt_tokens

    def as_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k not in ("request_id", "complete")}
        for name in _MS_FIELD.values():
            d[name] = round(d[name], 3)
        return d


class PlanBuilder:
    """Builds a plan step by step, counting compute tokens into the report."""

    def __init__(self, report: PrefillReport) -> None:
        self.report = report
        self._steps: list = []
        self._pos = 0

    @property
    def position(self) -> int:
        return self._pos

    def apply(self, end: int, fn: Callable[[object, object], None], kind: str) -> None:
        """An apply step over [position, end) that runs `fn(runner, request)`, labelled `kind`."""
        if kind not in APPLY_KINDS:
            raise ValueError(f"apply kind {kind!r} is not one of {APPLY_KINDS}")
        self._steps.append(ApplyStep(self._pos, end, fn, kind))
        self._pos = end

    def compute(self, end: int, kind: str) -> None:
        """Compute [position, end) in context, counted and labelled as `kind` (seam or
        suffix); extends the previous step when it is a compute step of the same kind."""
        if kind not in COMPUTE_KINDS:
            raise ValueError(f"compute kind {kind!r} is not one of {COMPUTE_KINDS}")
        if end <= self._pos:
            return
        self.report.add_compute(kind, end - self._pos)
        last = self._steps[-1] if self._steps else None
        if isinstance(last, ComputeStep) and last.label == kind:
            self._steps[-1] = ComputeStep(last.start, end, kind)
        else:
            self._steps.append(ComputeStep(self._pos, end, kind))
        self._pos = end

    def fused(self, end: int, fn: Callable[[object, object], object], compute_by_kind: dict[str, int]) -> None:
        """One fused step over [position, end) (engine.runtime.planner.FusedStep) that
        computes `compute_by_kind` tokens (seam / suffix counts, for the report)."""
        total = 0
        for kind, n in compute_by_kind.items():
            if kind not in COMPUTE_KINDS:
                raise ValueError(f"compute kind {kind!r} is not one of {COMPUTE_KINDS}")
            if n:
                self.report.add_compute(kind, n)
                total += n
        self._steps.append(FusedStep(self._pos, end, fn, total))
        self._pos = end

    def build(self) -> PrefillPlan:
        plan = PrefillPlan(steps=tuple(self._steps), num_tokens=self._pos)
        plan.validate()
        return plan

    def finish(self, prefill_split: dict[str, float]) -> None:
        """The plan has run: add the per-label step times (seconds) to the report (once)."""
        if self.report.complete:
            return
        for label, seconds in prefill_split.items():
            name = _MS_FIELD.get(label)
            if name is not None:
                setattr(self.report, name, getattr(self.report, name) + seconds * 1e3)
        self.report.complete = True


@dataclass
class ReportBook:
    """Finished reports by request id, for callers that read them after the engine
    returned (`take`); bounded so a long-running server does not grow without end."""

    capacity: int = 4096
    _reports: dict[str, PrefillReport] = field(default_factory=dict)

    def add(self, report: PrefillReport) -> None:
        self._reports.pop(report.request_id, None)
        self._reports[report.request_id] = report
        while len(self._reports) > self.capacity:
            self._reports.pop(next(iter(self._reports)))

    def take(self, request_id: str) -> Optional[PrefillReport]:
        return self._reports.pop(request_id, None)


class ReportingPlanner:
    """Shared by every planner here: per-request reports, kept for `take_report`."""

    name = "base"

    def __init__(self, config: PicConfig, device: torch.device) -> None:
        self.config = config
        self.device = torch.device(device)
        self.reports = ReportBook()

    def _new_builder(self, request: Request) -> PlanBuilder:
        return PlanBuilder(PrefillReport(request.request_id, self.name, len(request.prefill_token_ids())))

    def take_report(self, request_id: str) -> Optional[PrefillReport]:
        """The report of a request whose prefill completed (each report is returned once)."""
        return self.reports.take(request_id)

    def _finish(self, request: Request, builder: PlanBuilder) -> None:
        builder.finish(request.timeline.prefill_split)
        self.reports.add(builder.report)
        # what the lookups found, not the plan's splice positions (which count a miss
        # computed in the request as reused): the figure usage and metrics report
        request.num_reused_tokens = builder.report.reused_tokens

    def on_prefill_done(self, request: Request) -> None:
        state = request.planner_state.get(STATE_KEY)
        if state is not None:
            self._finish(request, state.builder)
            self._release(state)

    def on_request_freed(self, request: Request) -> None:
        state = request.planner_state.pop(STATE_KEY, None)
        if state is not None:
            self._release(state)

    def _release(self, state) -> None:
        return None
