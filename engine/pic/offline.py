"""Running one request's prefill plan directly on a `ModelRunner`, outside the engine loop,
keeping the caches and every logit of the final compute step: what the drift tool and a
quality harness need (per-layer states, next-token distributions on the question).

`build_request` tokenizes segments exactly as `LLMEngine.add_request` does (BOS, then
each segment alone without BOS), `prefill_with_plan` runs the planner's steps as
`LLMEngine._run_prefill` does (apply steps as reached, compute steps through
`runner.prefill`, here in chunks of `chunk_size`; each step's time added to
`request.timeline.prefill_split[label]`), then calls `on_prefill_done`.
`release` frees the request's caches and tells the planner.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from engine.errors import InvalidRequestError
from engine.runtime.planner import ApplyStep, FusedStep
from engine.runtime.request import PromptSegment, Request
from engine.runtime.sampling import SamplingParams
from engine.runtime.sequence import Sequence as CacheSequence

_ids = itertools.count()


@dataclass
class PrefillResult:
    request: Request
    seq: CacheSequence
    logits: torch.Tensor  # [n, vocab]: every token of the final compute step
    logits_start: int  # prompt position of logits[0]
    report: object  # engine.pic.report.PrefillReport (None for a planner without reports)


def build_request(tokenizer, segments: Sequence[dict], request_id: Optional[str] = None) -> Request:
    """A `Request` from `[{"text": str, "cache": bool}, ...]`, tokenized like the engine."""
    bos = getattr(tokenizer, "bos_id", None)
    ids: list[int] = [] if bos is None else [bos]
    segs: list[PromptSegment] = []
    for i, seg in enumerate(segments):
        text, cache = seg.get("text"), seg.get("cache", False)
        if not isinstance(text, str) or not isinstance(cache, bool):
            raise InvalidRequestError(f"segments[{i}]", "needs a string text and a boolean cache flag")
        toks = tokenizer.encode(text, add_bos=False)
        segs.append(PromptSegment(text, cache, len(ids), len(ids) + len(toks)))
        ids.extend(toks)
    if not any(s.num_tokens for s in segs):
        raise InvalidRequestError("segments", "the prompt has no tokens")
    return Request(request_id or f"offline-{next(_ids)}", ids, segs, SamplingParams())


def prefill_with_plan(planner, runner, request: Request, chunk_size: Optional[int] = None,
                      sync_timings: bool = False) -> PrefillResult:
    """Plan `request` and run the plan on `runner` (module docstring)."""
    plan = request.plan = planner.plan(request)
    request.seq = runner.cache.allocate(CacheSequence(request.request_id))
    try:
        runner.cache.ensure_capacity(request.seq, plan.num_tokens)
        ids = request.prefill_token_ids()
        logits, logits_start = None, 0
        split = request.timeline.prefill_split
        for step in plan.steps:
            t0 = time.perf_counter()
            if isinstance(step, FusedStep):
                logits = step.run(runner, request, all_logits=True)  # the last computed range's
                logits_start = step.end - logits.shape[0]
            elif isinstance(step, ApplyStep):
                step.apply(runner, request)
            else:
                parts, pos = [], step.start
                while pos < step.end:
                    end = step.end if chunk_size is None else min(step.end, pos + chunk_size)
                    parts.append(runner.prefill(request.seq, ids[pos:end], start_pos=pos, all_logits=True))
                    pos = end
                logits, logits_start = torch.cat(parts), step.start
            if sync_timings and runner.device.type == "cuda":
                torch.cuda.synchronize(runner.device)
            split[step.label] = split.get(step.label, 0.0) + time.perf_counter() - t0
    except BaseException:
        release(planner, runner, request)
        raise
    planner.on_prefill_done(request)
    take = getattr(planner, "take_report", None)
    return PrefillResult(request, request.seq, logits, logits_start, take(request.request_id) if take else None)


def release(planner, runner, request: Request) -> None:
    """Free the request's caches and tell the planner."""
    if request.seq is not None and request.seq.is_allocated:
        runner.cache.free(request.seq)
    request.seq = None
    planner.on_request_freed(request)
