"""Wall-clock limits of a benchmark's phases: `PhaseClock` is one phase's limit, asked
between units of work (a workload, a QPS trial, a sweep request) whether the phase must
stop; `parse_limits` reads the `--limit-s` flag.

A phase stops cooperatively: the unit running when the limit passes finishes, nothing
after it starts, and the phase records `"stopped": "time limit"` with what it has. So a
phase overruns its limit by at most one unit of work; the JSON is rewritten after every
unit, so a command killed from outside keeps the finished units too.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

#: the reason a phase records when its limit passed
TIME_LIMIT = "time limit"


@dataclass
class PhaseClock:
    """One phase's limit (`limit_s` None: no limit). Calling it answers why the phase
    must stop (TIME_LIMIT) or None; once stopped it stays stopped."""

    name: str
    limit_s: Optional[float] = None
    started: float = field(default_factory=time.perf_counter)
    stopped: Optional[str] = None

    def __call__(self) -> Optional[str]:
        if self.stopped is None and self.limit_s is not None and self.elapsed_s() >= self.limit_s:
            self.stopped = TIME_LIMIT
        return self.stopped

    def elapsed_s(self) -> float:
        return time.perf_counter() - self.started

    def record(self, complete: bool) -> dict:
        """What the JSON keeps of the phase: its limit, wall time, why it stopped early
        (None: it ran to its end) and whether it ended (False: still running, or killed)."""
        return {"limit_s": self.limit_s, "wall_s": round(self.elapsed_s(), 3), "stopped": self.stopped,
                "complete": complete}


def parse_limits(text: Optional[str], phases: tuple[str, ...]) -> dict[str, float]:
    """`--limit-s` -> seconds per phase: "300" (every phase) or "serve=240,qps=200";
    ValueError naming the bad part."""
    if not text:
        return {}
    out: dict[str, float] = {}
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        name, sep, value = part.rpartition("=")
        names = [name] if sep else list(phases)
        if sep and name not in phases:
            raise ValueError(f"{part!r}: unknown phase {name!r}; choose from {', '.join(phases)}")
        try:
            secs = float(value)
        except ValueError:
            raise ValueError(f"{part!r}: {value!r} is not a number of seconds") from None
        if secs <= 0:
            raise ValueError(f"{part!r}: the limit must be > 0 seconds")
        for n in names:
            out[n] = secs
    return out
