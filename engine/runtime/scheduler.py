"""Continuous batching: which requests run, and how many tokens each, in every step.

Requests move waiting -> prefilling -> decoding -> finished. Each `schedule()` call
builds one step under a token budget (`max_num_batched_tokens`):

1. Decoding requests, oldest admission first, one token each. A decode that needs
   cache the pool cannot give preempts the most recently admitted running request
   (its caches are freed; it goes back to the front of the waiting queue and is
   recomputed on readmission), repeating until the decode fits or the request itself
   was the one preempted.
2. Requests part-way through prefill, oldest first, get up to `prefill_chunk_size`
   tokens each (chunked prefill) while budget remains.
3. Waiting requests are admitted strictly first-come first-served while budget, batch
   slots (`max_num_seqs`) and cache remain: the head of the queue blocks the rest, so
   no request overtakes an earlier one. Admission allocates cache for the whole
   prefill and asks the `PrefillPlanner` how to fill it (see engine.runtime.planner).

A request that could never fit (prompt plus max_new_tokens above what the pool holds for
one sequence alone) is refused at `add_request` with `CapacityError`, so a request
that runs alone always completes and preemption always makes progress.

The scheduler owns request status, the queues and every cache allocation; the engine
runs the step (engine.engine) and reports back through `mark_prefilled` and `finish`.
Not thread-safe: one engine loop calls it.
"""
from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field
from typing import Optional, Protocol

from engine.errors import CapacityError, InvalidRequestError, PlanError
from engine.runtime.planner import FullRecomputePlanner, PrefillPlanner, PrefillProgress
from engine.runtime.request import FinishReason, Request, RequestStatus

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerConfig:
    """Knobs of continuous batching.

    max_num_seqs: requests holding caches at once (the decode batch limit).
    max_num_batched_tokens: tokens computed per step, prefill chunks plus decodes.
    prefill_chunk_size: prompt tokens one request may compute in one step.
    """

    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    prefill_chunk_size: int = 512

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "prefill_chunk_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise InvalidRequestError(name, f"must be a positive integer, got {value!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:  # else some decodes would wait on others
            raise InvalidRequestError(
                "max_num_batched_tokens",
                f"{self.max_num_batched_tokens} is below max_num_seqs={self.max_num_seqs}: every running "
                "request must be able to decode in each step",
            )


class CachePool(Protocol):
    """What the scheduler needs from the engine's caches (engine.runtime.cache_pool
    adapts the model's CacheManager). Token counts are positions held per sequence."""

    def max_tokens_per_sequence(self) -> Optional[int]:
        """Most positions one sequence can ever hold alone (None: unbounded)."""
        ...

    def can_allocate(self, num_tokens: int) -> bool:
        """Whether a new sequence of `num_tokens` positions fits now."""
        ...

    def allocate(self, request_id: str, num_tokens: int) -> object:
        """Create and return a sequence handle with room for `num_tokens` positions."""
        ...

    def can_extend(self, seq: object, num_tokens: int) -> bool:
        """Whether `seq` can grow to hold `num_tokens` positions now."""
        ...

    def extend(self, seq: object, num_tokens: int) -> None:
        """Grow `seq` to hold `num_tokens` positions (after `can_extend` said yes)."""
        ...

    def free(self, seq: object) -> None:
        """Release every cache resource `seq` holds."""
        ...

    def usage(self) -> float:
        """Fraction of the limiting cache resource in use, 0.0 to 1.0."""
        ...


@dataclass
class PrefillChunk:
    """`num_tokens` compute tokens granted to one request's prefill this step."""

    request: Request
    num_tokens: int


@dataclass
class SchedulerOutput:
    """One step's work, in the order the engine runs it."""

    decodes: list[Request] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)
    refused: list[Request] = field(default_factory=list)  # finished with an error

    @property
    def num_scheduled_tokens(self) -> int:
        return len(self.decodes) + sum(c.num_tokens for c in self.prefills)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills


class Scheduler:
    """FCFS continuous-batching scheduler with chunked prefill and recompute
    preemption (see the module docstring for the policy)."""

    def __init__(
        self,
        config: SchedulerConfig,
        pool: CachePool,
        planner: Optional[PrefillPlanner] = None,
    ) -> None:
        self.config = config
        self.pool = pool
        self.planner: PrefillPlanner = planner or FullRecomputePlanner()
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []  # admission order
        self.num_preemptions = 0

    # ---- queue management -------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue `request`; refuse it with `CapacityError` if it can never fit."""
        limit = self.pool.max_tokens_per_sequence()
        needed = request.num_prompt_tokens + request.sampling.max_new_tokens
        if limit is not None and needed > limit:
            raise CapacityError(
                f"request {request.request_id!r} needs {needed} cache positions "
                f"({request.num_prompt_tokens} prompt + {request.sampling.max_new_tokens} max_new_tokens) "
                f"but the engine's cache holds at most {limit} for one sequence"
            )
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def finish(self, request: Request, reason: FinishReason) -> None:
        """Finish `request` (stop, length or abort) and free its caches."""
        if request.is_finished:
            return
        if request.status.holds_cache:
            self.running.remove(request)
            self._free(request)
        else:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason

    def mark_prefilled(self, request: Request) -> None:
        """The engine ran the last step of `request`'s plan; it decodes from now on."""
        assert request.status is RequestStatus.PREFILLING, request.status
        request.status = RequestStatus.DECODING

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- the policy ---------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Build the next step (see the module docstring)."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens

        # 1. decodes, oldest first; grow each by one position, preempting from the tail.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.status is not RequestStatus.DECODING:
                i += 1
                continue
            need = len(req.prefill_token_ids())  # the cache also takes the last sampled token
            preempted_self = False
            while not self.pool.can_extend(req.seq, need):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is req:
                    preempted_self = True
                    break
            if preempted_self:
                break  # everything after it was preempted already
            self.pool.extend(req.seq, need)
            out.decodes.append(req)
            budget -= 1
            i += 1

        # 2. continue partial prefills, oldest first.
        for req in self.running:
            if budget <= 0:
                break
            if req.status is RequestStatus.PREFILLING:
                grant = min(self.config.prefill_chunk_size, budget, req.progress.remaining_compute_tokens)
                out.prefills.append(PrefillChunk(req, grant))
                budget -= grant

        # 3. admit waiting requests strictly FCFS (never right after a preemption: the
        #    cache is short, and readmitting the victim would only thrash).
        while self.waiting and budget > 0 and not out.preempted:
            if len(self.running) >= self.config.max_num_seqs:
                break
            req = self.waiting[0]
            num_tokens = len(req.prefill_token_ids())
            if not self.pool.can_allocate(num_tokens):
                if not self.running:
                    self._refuse_unplaceable(req, num_tokens)
                    out.refused.append(req)
                    continue
                break
            self.waiting.popleft()
            try:
                self._admit(req, num_tokens)
            except Exception as exc:  # a planner failure fails this request, not the engine
                log.exception("planning request %s failed", req.request_id)
                self._refuse(req, f"prefill planning failed: {exc}")
                out.refused.append(req)
                continue
            out.admitted.append(req)
            grant = min(self.config.prefill_chunk_size, budget, req.progress.remaining_compute_tokens)
            out.prefills.append(PrefillChunk(req, grant))
            budget -= grant
        return out

    # ---- internals ------------------------------------------------------------------

    def _admit(self, req: Request, num_tokens: int) -> None:
        req.seq = self.pool.allocate(req.request_id, num_tokens)
        try:
            plan = self.planner.plan(req)
            plan.validate()
            if plan.num_tokens != num_tokens:
                raise PlanError(
                    f"planner returned a plan for {plan.num_tokens} tokens, request has {num_tokens}"
                )
        except BaseException:
            self.pool.free(req.seq)
            req.seq = None
            raise
        req.plan = plan
        req.progress = PrefillProgress(plan)
        req.status = RequestStatus.PREFILLING
        if req.timeline.scheduled is None:
            req.timeline.scheduled = time.perf_counter()
        self.running.append(req)

    def requeue(self, req: Request) -> None:
        """Free a running request's caches and put it back at the head of the queue: it is
        planned and recomputed from its tokens (prompt + output so far) when admitted
        again (the engine's failover when offloaded KV is lost)."""
        self.running.remove(req)
        self._free(req)
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self._free(req)
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req)
        log.info("preempted request %s (%d tokens) for lack of cache", req.request_id, len(req.prefill_token_ids()))

    def _free(self, req: Request) -> None:
        if req.seq is not None:
            self.pool.free(req.seq)
            req.seq = None
        req.plan = None
        req.progress = None
        self.planner.on_request_freed(req)

    def _refuse_unplaceable(self, req: Request, num_tokens: int) -> None:
        """The head of the queue does not fit in an idle engine: it never will."""
        self.waiting.popleft()
        self._refuse(req, f"request needs {num_tokens} cache positions, more than the idle engine can allocate")

    def _refuse(self, req: Request, error: str) -> None:
        req.status = RequestStatus.FINISHED
        req.finish_reason = FinishReason.ABORT
        req.error = error
        log.error("refused request %s: %s", req.request_id, error)
