"""The `full` baseline planner (every prompt token computed) and `full_pass`, the one fused
pass over a range of the prompt that it and PIC's cold fallback share."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from engine.pic.capture import CaptureSet
from engine.pic.config import PicConfig
from engine.pic.fused import FusedItem, fused_prefill
from engine.pic.report import STATE_KEY, PlanBuilder, ReportingPlanner
from engine.runtime.planner import PrefillPlan
from engine.runtime.request import Request


@dataclass
class _FullState:
    builder: PlanBuilder


def full_pass(runner, request: Request, ids: list[int], start: int, config: PicConfig, all_logits: bool = False,
              captures: Optional[CaptureSet] = None):
    """Compute prompt positions [start, len(ids)) in context as one fused pass (the `full`
    baseline, and PIC's cold fallback; `captures`: misses whose signatures it takes)."""
    return fused_prefill(runner.model, runner.cache, request.seq, ids, [FusedItem(start, len(ids))],
                         backend=runner.backend, kernel=config.kernel, chain=config.seam_chain, all_logits=all_logits,
                         stages=getattr(runner, "prefill_stages", None), captures=captures,
                         batch_long_ranges=config.batch_long_ranges)


class FullPlanner(ReportingPlanner):
    """`full`: compute every prompt token (with `PicConfig.fused`, the default, as one
    fused step over the whole prompt: the pass PIC's plans run, so the baseline and the
    method differ only in what they compute)."""

    name = "full"

    def plan(self, request: Request) -> PrefillPlan:
        b = self._new_builder(request)
        ids = list(request.prefill_token_ids())
        if self.config.fused:  # the same one pass as PIC's (and its cold fallback's) prefill
            b.fused(len(ids), lambda runner, req, _ids=ids, **kw: self._run_fused(runner, req, _ids, **kw),
                    {"suffix": len(ids)})
        else:  # the scheduler's compute steps (chunked by its budget)
            b.compute(len(ids), "suffix")
        request.planner_state[STATE_KEY] = _FullState(b)
        return b.build()

    def _run_fused(self, runner, request: Request, ids: list[int], all_logits: bool = False):
        return full_pass(runner, request, ids, 0, self.config, all_logits)
