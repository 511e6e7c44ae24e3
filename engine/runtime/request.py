"""Request bookkeeping: what the engine knows about one generation request.

A `Request` carries the prompt as a list of `PromptSegment`s (text, cache flag and the
token range each one covers) from `LLMEngine.add_request` through the scheduler to the
prefill planner, so position-independent caching can look segments up and splice
them. It also carries the request's progress (prefill cursor, output tokens), its
cache handle while it holds one, and a `RequestTimeline` from which TTFT and
throughput are measured.

The scheduler owns `status`; the engine owns the output fields; the planner owns
`plan` and the prefill cursor (`PrefillProgress`).
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Optional


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, holds no cache
    PREFILLING = "prefilling"  # admitted, holds a cache, prompt not fully computed
    DECODING = "decoding"  # prompt computed, generating one token per step
    FINISHED = "finished"  # done (stop, length or abort); cache freed

    @property
    def holds_cache(self) -> bool:
        return self in (RequestStatus.PREFILLING, RequestStatus.DECODING)


class FinishReason(str, enum.Enum):
    STOP = "stop"  # a stop token or stop string
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"  # cancelled by the caller


@dataclass(frozen=True)
class PromptSegment:
    """One piece of a prompt. `cache` marks it as reusable across requests (position-
    independent caching); `token_start:token_end` is the range of the request's
    prompt token ids it became."""

    text: str
    cache: bool
    token_start: int
    token_end: int

    @property
    def num_tokens(self) -> int:
        return self.token_end - self.token_start


@dataclass
class RequestTimeline:
    """Wall-clock instants (time.perf_counter seconds) of a request's life.

    `scheduled` is the first admission (a preempted request keeps its first one);
    `first_token` is when the first output token was sampled; `token_times` holds the
    instant of every output token."""

    arrival: float
    scheduled: Optional[float] = None
    first_token: Optional[float] = None
    finished: Optional[float] = None
    token_times: list[float] = field(default_factory=list)
    # seconds spent per prefill-plan step label ("compute", or a planner's own labels)
    prefill_split: dict[str, float] = field(default_factory=dict)

    @property
    def ttft(self) -> Optional[float]:
        """Seconds from arrival to the first output token."""
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def queue_time(self) -> Optional[float]:
        return None if self.scheduled is None else self.scheduled - self.arrival

    @property
    def e2e(self) -> Optional[float]:
        return None if self.finished is None else self.finished - self.arrival

    @property
    def decode_tokens_per_s(self) -> Optional[float]:
        """Output tokens after the first, per second of decoding (None with < 2)."""
        if len(self.token_times) < 2:
            return None
        span = self.token_times[-1] - self.token_times[0]
        return (len(self.token_times) - 1) / span if span > 0 else None

    def as_dict(self) -> dict[str, Optional[float]]:
        return {
            "arrival": self.arrival,
            "scheduled": self.scheduled,
            "first_token": self.first_token,
            "finished": self.finished,
            "ttft_s": self.ttft,
            "queue_s": self.queue_time,
            "e2e_s": self.e2e,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "prefill_split_s": dict(self.prefill_split),
        }


@dataclass
class Request:
    """One generation request and its progress. Created by the engine."""

    request_id: str
    prompt_token_ids: list[int]
    segments: list[PromptSegment]
    sampling: Any  # engine.runtime.sampling.SamplingParams
    timeline: RequestTimeline = field(default_factory=lambda: RequestTimeline(time.perf_counter()))
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    finish_reason: Optional[FinishReason] = None
    # Cache handle (engine.runtime.sequence.Sequence) while admitted, else None.
    seq: Any = None
    # The prefill plan and how far it has run; set at admission by the planner.
    plan: Any = None  # engine.runtime.planner.PrefillPlan
    progress: Any = None  # engine.runtime.planner.PrefillProgress
    num_preemptions: int = 0
    # Prompt positions the last completed plan filled without computing them.
    num_reused_tokens: int = 0
    # Why the engine gave up on the request (finish_reason ABORT), if it did.
    error: Optional[str] = None
    # Planner-private data (PIC: hit/miss accounting, signature handles ...).
    planner_state: dict[str, Any] = field(default_factory=dict)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def prefill_token_ids(self) -> list[int]:
        """The tokens a (re)admission must put into the cache before decoding resumes:
        the prompt, plus every output token already sampled (after a preemption the
        cache is rebuilt by recomputation; the last sampled token's logits then give
        the next token)."""
        return self.prompt_token_ids + self.output_token_ids

    def prefill_segments(self) -> list[PromptSegment]:
        """Segments covering `prefill_token_ids()`: the prompt's own segments, and the
        generated tokens (if any) as one uncached trailing segment with empty text."""
        if not self.output_token_ids:
            return list(self.segments)
        n = self.num_prompt_tokens
        return list(self.segments) + [
            PromptSegment(text="", cache=False, token_start=n, token_end=n + self.num_output_tokens)
        ]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
