"""Per-request accounting of a prefill plan: which tokens were reused and which computed,
and where the time went; plus `PlanBuilder`, which assembles a `PrefillPlan` from compute
ranges and apply callables while timing every step.

Token accounting (`PrefillReport`), per request:
- `reused_tokens`: prompt positions filled from a cache hit (a signature or a prefix
  checkpoint) without running them through the model for this request;
- `recomputed_tokens`: tokens this request ran through the model: in context (seams,
  the question, uncached segments) plus the alone passes of signature misses (a cold
  segment is computed alone once, anchor included, and then spliced like a hit);
- the parts: `seam_tokens`, `suffix_tokens` (in-context compute that is not a seam),
  `miss_tokens` (alone passes). A warm request has reused + recomputed = prompt.

Time split (milliseconds of wall clock, device-synchronised at each mark when the
planner's `sync_timing` is set): `lookup_ms` (signature or prefix lookups), `miss_ms`
(alone passes of misses and their puts), `load_compose_ms` (splicing: re-rotation,
scatter, state composition; prefix restores), `seam_ms`, `suffix_ms`, `checkpoint_ms`
(prefix caching's boundary snapshots). A compute step's time is measured between the
apply steps around it (each plan starts with one and separates compute steps of
different kinds by a zero-width mark), the last one ending when the planner hears
`on_prefill_done`. With one request in flight (`kvengine run`) the split is exact;
under concurrent load it is wall time, other requests' work included.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from engine.runtime.planner import ApplyStep, ComputeStep, PrefillPlan

COMPUTE_KINDS = ("seam", "suffix")
APPLY_KINDS = ("lookup", "miss", "load", "checkpoint", "mark")
_MS_FIELD = {"lookup": "lookup_ms", "miss": "miss_ms", "load": "load_compose_ms", "checkpoint": "checkpoint_ms",
             "seam": "seam_ms", "suffix": "suffix_ms"}


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
    lookup_ms: float = 0.0
    miss_ms: float = 0.0
    load_compose_ms: float = 0.0
    seam_ms: float = 0.0
    suffix_ms: float = 0.0
    checkpoint_ms: float = 0.0
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

    def add_hit(self, reused: int) -> None:
        self.hit_segments += 1
        self.reused_tokens += reused

    def as_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k not in ("request_id", "complete")}
        for name in _MS_FIELD.values():
            d[name] = round(d[name], 3)
        return d


@dataclass
class _Timed:
    kind: str
    t0: Optional[float] = None
    t1: Optional[float] = None


class PlanBuilder:
    """Builds a timed plan step by step (see the module docstring)."""

    def __init__(self, report: PrefillReport, device: torch.device, sync: bool) -> None:
        self.report = report
        self._sync = sync and device.type == "cuda"
        self._device = device
        self._steps: list = []
        self._timed: list[_Timed] = []  # one per step, same order
        self._pos = 0
        self._done_at: Optional[float] = None

    @property
    def position(self) -> int:
        return self._pos

    def _now(self) -> float:
        if self._sync:
            torch.cuda.synchronize(self._device)
        return time.perf_counter()

    def apply(self, end: int, fn: Callable[[object, object], None], kind: str, label: str) -> None:
        """An apply step over [position, end) that runs `fn(runner, request)`, timed as `kind`."""
        if kind not in APPLY_KINDS:
            raise ValueError(f"apply kind {kind!r} is not one of {APPLY_KINDS}")
        rec = _Timed(kind)

        def timed(runner, request, _fn=fn, _rec=rec):
            _rec.t0 = self._now()
            _fn(runner, request)
            _rec.t1 = self._now()

        self._steps.append(ApplyStep(self._pos, end, timed, label))
        self._timed.append(rec)
        self._pos = end

    def compute(self, end: int, kind: str) -> None:
        """Compute [position, end) in context, counted and timed as `kind` (seam/suffix).
        Extends the previous step when it is a compute step of the same kind; separates
        it from one of another kind by a zero-width timing mark."""
        if kind not in COMPUTE_KINDS:
            raise ValueError(f"compute kind {kind!r} is not one of {COMPUTE_KINDS}")
        if end <= self._pos:
            return
        self.report.add_compute(kind, end - self._pos)
        if self._steps and isinstance(self._steps[-1], ComputeStep):
            if self._timed[-1].kind == kind:
                self._steps[-1] = ComputeStep(self._steps[-1].start, end)
                self._pos = end
                return
            self.apply(self._pos, _noop, "mark", "timing mark")
        self._steps.append(ComputeStep(self._pos, end))
        self._timed.append(_Timed(kind))
        self._pos = end

    def build(self) -> PrefillPlan:
        plan = PrefillPlan(steps=tuple(self._steps), num_tokens=self._pos)
        plan.validate()
        return plan

    def finish(self) -> None:
        """The plan has run: add the step times to the report's time split (once)."""
        if self.report.complete:
            return
        self._done_at = self._now()
        for i, rec in enumerate(self._timed):
            if isinstance(self._steps[i], ApplyStep):
                if rec.kind != "mark" and rec.t0 is not None and rec.t1 is not None:
                    self._add(rec.kind, rec.t1 - rec.t0)
                continue
            prev_end = self._timed[i - 1].t1 if i > 0 else None
            nxt = self._timed[i + 1].t0 if i + 1 < len(self._timed) else self._done_at
            if prev_end is not None and nxt is not None:
                self._add(rec.kind, nxt - prev_end)
        self.report.complete = True

    def _add(self, kind: str, seconds: float) -> None:
        name = _MS_FIELD[kind]
        setattr(self.report, name, getattr(self.report, name) + seconds * 1e3)


def _noop(runner, request) -> None:
    return None


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
