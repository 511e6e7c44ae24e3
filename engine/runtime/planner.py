"""Prefill planning: how a newly admitted request's caches get filled.

This is the hook position-independent caching (PIC), prefix caching and the store
connector plug into. At admission the scheduler asks the engine's `PrefillPlanner`
for a `PrefillPlan`: an ordered list of steps that together bring the request's caches
from empty to holding every token of `request.prefill_token_ids()`.

- `ComputeStep(start, end)`: run tokens `[start, end)` through the model with
  `ModelRunner.prefill(seq, tokens[start:end], start_pos=start)`, against whatever the
  caches hold for positions `< start`. The scheduler may split a compute step into
  chunks (its token budget and chunk size); each chunk costs its token count.
- `ApplyStep(start, end, apply)`: fill positions `[start, end)` without running them
  through the model (splice cached K/V, compose linear states, load from the store);
  `apply(runner, request)` does it, costs no token budget, and must leave
  `request.seq.num_computed_tokens == end` (the engine checks). An apply step may also
  cover zero positions (for example: compose a state split at a seam).
- `FusedStep(start, end, run, compute_tokens)`: fill positions `[start, end)` in one
  call that computes `compute_tokens` of them in context and fills the others without
  computing (PIC's and prefix caching's one-pass prefill, engine/pic/fused.py);
  `run(runner, request)` returns the logits of position `end - 1` and must leave
  `request.seq.num_computed_tokens == end`; `run(runner, request, all_logits=True)`
  returns those of every position of its last computed range (offline measurement).
  It runs whole, never chunked, once the scheduler grants the request any compute,
  and costs `compute_tokens`.

Rules every plan obeys (checked by `PrefillPlan.validate`): steps are contiguous from
position 0 to the number of prefill tokens, and the last step is a `ComputeStep`
or a `FusedStep` (the first output token is sampled from the logits of the prompt's
last token, so at least that token is computed).

The order of calls, per request:
1. `plan(request)` once at each admission (after a preemption the request is planned
   again from scratch). A PIC planner does its segment lookups here.
2. The engine runs the steps in order as the scheduler grants compute tokens:
   apply steps run as soon as they are reached, compute steps run chunk by chunk.
3. `on_prefill_done(request)` once the last step has run (a PIC planner queues the
   signatures it computed for storage here, off the critical path). The engine has set
   `request.num_reused_tokens` to the plan's `num_reused_tokens` before the call; a
   planner whose lookups run as plan steps sets it to what they actually found.
4. `on_request_freed(request)` when the request's caches are released (finish, abort
   or preemption), so the planner can drop what it holds for it.

The engine adds the wall time of every step to `request.timeline.prefill_split[label]`
(see `LLMEngine.sync_timings` for exact figures on CUDA), so a planner's labels become
the request's time split (load/compose, seam, suffix).

`FullRecomputePlanner` is the default: one compute step over every token.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Protocol, Union, runtime_checkable

from engine.errors import PlanError

if TYPE_CHECKING:
    from engine.runtime.request import Request


@dataclass(frozen=True)
class ComputeStep:
    """Run prompt positions `[start, end)` through the model. `label` names the step in
    the request's time split (e.g. "seam", "suffix")."""

    start: int
    end: int
    label: str = "compute"

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class ApplyStep:
    """Fill prompt positions `[start, end)` of the caches without computing them.
    `label` names the step in logs and timings (e.g. "load segment 2")."""

    start: int
    end: int
    apply: Callable[[object, "Request"], None]
    label: str = "apply"

    @property
    def num_tokens(self) -> int:
        return 0  # costs no compute budget


@dataclass(frozen=True)
class FusedStep:
    """Fill positions `[start, end)` in one call that computes `compute_tokens` of them
    (module docstring); `run(runner, request)` returns the last position's logits."""

    start: int
    end: int
    run: Callable[[object, "Request"], object]
    compute_tokens: int
    label: str = "fused"

    @property
    def num_tokens(self) -> int:
        return self.compute_tokens


PlanStep = Union[ComputeStep, ApplyStep, FusedStep]
COMPUTING_STEPS = (ComputeStep, FusedStep)


@dataclass(frozen=True)
class PrefillPlan:
    """Ordered steps that fill a request's caches for `num_tokens` positions."""

    steps: tuple[PlanStep, ...]
    num_tokens: int

    @property
    def num_compute_tokens(self) -> int:
        return sum(s.num_tokens for s in self.steps if isinstance(s, COMPUTING_STEPS))

    @property
    def num_reused_tokens(self) -> int:
        return self.num_tokens - self.num_compute_tokens

    def validate(self) -> None:
        """Raise `PlanError` unless the steps tile `[0, num_tokens)` and end in compute."""
        if not self.steps:
            raise PlanError(f"empty plan for {self.num_tokens} tokens")
        pos = 0
        for i, step in enumerate(self.steps):
            if step.start != pos or step.end < step.start:
                raise PlanError(
                    f"step {i} covers [{step.start}, {step.end}) but the plan is at position {pos}"
                )
            if isinstance(step, ComputeStep) and step.end == step.start:
                raise PlanError(f"step {i} computes no tokens at position {pos}")
            if isinstance(step, FusedStep) and not 1 <= step.compute_tokens <= step.end - step.start:
                raise PlanError(f"fused step {i} computes {step.compute_tokens} of {step.end - step.start} tokens")
            pos = step.end
        if pos != self.num_tokens:
            raise PlanError(f"plan ends at position {pos}, the request has {self.num_tokens} tokens")
        if not isinstance(self.steps[-1], COMPUTING_STEPS):
            raise PlanError("the last step must be a ComputeStep or FusedStep (the last token's logits are needed)")


class PrefillProgress:
    """Cursor over a plan: which step runs next and how far into it compute has got.
    Owned by the engine; the scheduler reads `remaining_compute_tokens`."""

    def __init__(self, plan: PrefillPlan) -> None:
        self.plan = plan
        self.step_index = 0
        self.offset = 0  # tokens of the current compute step already computed
        self.remaining_compute_tokens = plan.num_compute_tokens

    @property
    def done(self) -> bool:
        return self.step_index >= len(self.plan.steps)

    @property
    def current(self) -> Optional[PlanStep]:
        return None if self.done else self.plan.steps[self.step_index]

    def advance(self, num_computed: int) -> None:
        """Record that the current compute step computed `num_computed` more tokens."""
        step = self.current
        assert isinstance(step, ComputeStep)
        self.offset += num_computed
        self.remaining_compute_tokens -= num_computed
        if step.start + self.offset >= step.end:
            self.step_index += 1
            self.offset = 0

    def finish_fused(self) -> None:
        """The current fused step ran (whole)."""
        step = self.current
        assert isinstance(step, FusedStep)
        self.remaining_compute_tokens -= step.compute_tokens
        self.step_index += 1
        self.offset = 0

    def skip_apply(self) -> None:
        assert isinstance(self.current, ApplyStep)
        self.step_index += 1
        self.offset = 0


@runtime_checkable
class PrefillPlanner(Protocol):
    """Decides, per admitted request, which prompt tokens are computed and which are
    filled from elsewhere. Called from the engine loop's thread only."""

    def plan(self, request: "Request") -> PrefillPlan:
        """The plan for `request.prefill_token_ids()` (see the module docstring)."""
        ...

    def on_prefill_done(self, request: "Request") -> None:
        """The request's plan has fully run; its caches hold every prefill token."""
        ...

    def on_request_freed(self, request: "Request") -> None:
        """The request's caches were released (finish, abort or preemption)."""
        ...


class FullRecomputePlanner:
    """Compute every prompt token (no reuse): one `ComputeStep` over the whole prompt."""

    name = "full"

    def plan(self, request: "Request") -> PrefillPlan:
        n = len(request.prefill_token_ids())
        return PrefillPlan(steps=(ComputeStep(0, n),), num_tokens=n)

    def on_prefill_done(self, request: "Request") -> None:
        return None

    def on_request_freed(self, request: "Request") -> None:
        return None
