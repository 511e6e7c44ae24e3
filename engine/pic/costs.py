"""What a token costs on each of the two ways a cold segment can reach a prefill: computed
alone (engine.pic.compute, packed alone passes) or recomputed in context (a full pass);
measured on this engine, for the cost-based cold fallback (`PicConfig.cold_full_policy`).

`PathCosts.measure(kind, tokens)` brackets a pass. On CUDA it records two timing events
on the current stream and reads them later, once the end event has completed (never
waiting for it): the device time between them is the pass's wall time whether the pass
was bound by the GPU (a full pass) or by the host launching it (alone passes are), as
long as the GPU was idle when it started, which is the case between requests. Elsewhere
it takes the wall clock. Each kind keeps an exponential moving average of milliseconds
per token. "full" passes are the cold fallback's and the fused passes that splice nothing
(every position computed in context); the planner also prices a hit with it (what a hit
saves, for the store's cost admission: engine.connector.tier_admission).

`break_even()` is full / alone: the share of a prompt's tokens that alone passes can
compute in the time a full pass computes the whole prompt. A request whose misses hold
more than that is served faster by full recompute (and its misses computed later, when
idle). On an H200 alone passes cost 1.6-3x a full pass per token (docs/BENCHMARKS.md): a
break-even of 0.33-0.6.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator, Optional

import torch

KINDS = ("alone", "full")


class Sample:
    """One bracketed pass (`PathCosts.measure`); `discard()` keeps it out of the averages."""

    def __init__(self) -> None:
        self.discarded = False

    def discard(self) -> None:
        self.discarded = True


class PathCosts:
    """Measured ms per token of alone passes and full passes (module docstring)."""

    def __init__(self, device: torch.device, smoothing: float = 0.3, min_tokens: int = 256) -> None:
        if not 0.0 < smoothing <= 1.0:
            raise ValueError(f"smoothing={smoothing!r} must be in (0, 1]")
        self.device = torch.device(device)
        self.smoothing = smoothing
        #: passes of fewer tokens are not counted (their fixed costs would dominate)
        self.min_tokens = min_tokens
        self._ms_per_token: dict[str, Optional[float]] = {k: None for k in KINDS}
        self._samples = {k: 0 for k in KINDS}
        self._pending: list[tuple[str, int, object, object]] = []

    @contextmanager
    def measure(self, kind: str, tokens: int) -> Iterator["Sample"]:
        """Bracket a pass of `tokens` tokens; `sample.discard()` inside drops it (a pass
        that gave way half-way measures nothing useful)."""
        if kind not in KINDS:
            raise ValueError(f"kind={kind!r} must be one of {KINDS}")
        sample = Sample()
        if tokens < self.min_tokens:
            yield sample
            return
        if self.device.type == "cuda":  # pragma: no cover - GPU only
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            yield sample
            if sample.discarded:
                return
            end.record()
            self._pending.append((kind, tokens, start, end))
            if len(self._pending) > 64:  # never waited for; keep the list short
                self._poll()
                del self._pending[:-64]
            return
        t0 = time.perf_counter()
        yield sample
        if not sample.discarded:
            self._add(kind, tokens, (time.perf_counter() - t0) * 1e3)

    def _add(self, kind: str, tokens: int, ms: float) -> None:
        per = ms / tokens
        old = self._ms_per_token[kind]
        self._ms_per_token[kind] = per if old is None else old + self.smoothing * (per - old)
        self._samples[kind] += 1

    def _poll(self) -> None:  # pragma: no cover - GPU only
        left = []
        for kind, tokens, start, end in self._pending:
            if end.query():
                self._add(kind, tokens, start.elapsed_time(end))
            else:
                left.append((kind, tokens, start, end))
        self._pending = left

    def ms_per_token(self, kind: str) -> Optional[float]:
        """The moving average for `kind` (None before its first measured pass)."""
        if self._pending:
            self._poll()
        return self._ms_per_token[kind]

    def break_even(self) -> Optional[float]:
        """full / alone ms per token (None until both are measured)."""
        alone, full = self.ms_per_token("alone"), self.ms_per_token("full")
        if not alone or full is None:
            return None
        return full / alone

    def snapshot(self) -> dict:
        return {"alone_ms_per_token": self.ms_per_token("alone"), "full_ms_per_token": self.ms_per_token("full"),
                "break_even": self.break_even(), "alone_passes": self._samples["alone"],
                "full_passes": self._samples["full"]}
