"""The queue of segments the PIC planner computes alone while idle (cold fallback and
miss_path="context": engine.pic.planner): `DeferredQueue`, oldest first, bounded.

A segment queued twice keeps one entry, moved to the back; past `MAX_DEFERRED` entries
the oldest go. `next_batch` takes the next idle batch off the front (at most
`IDLE_BATCH_TOKENS` tokens, at least one segment); a batch that gave way to a request
goes back to the front (`requeue`). Used from the engine loop's thread only.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterator, Sequence

from engine.pic.segment_store import SegmentJob

#: most segments queued for idle-time alone passes (cold fallback); the oldest go first
MAX_DEFERRED = 512
#: tokens of alone passes one `help_idle` call computes at most (one packed pass): a request
#: arriving meanwhile waits for the pass, so it is kept short (~30-60 ms for a 2B model)
IDLE_BATCH_TOKENS = 4096


class DeferredQueue:
    """Segments to compute alone when idle, by key (module docstring)."""

    def __init__(self, max_entries: int = MAX_DEFERRED, batch_tokens: int = IDLE_BATCH_TOKENS) -> None:
        self.max_entries = max_entries
        self.batch_tokens = batch_tokens
        self._jobs: OrderedDict[bytes, SegmentJob] = OrderedDict()

    def __len__(self) -> int:
        return len(self._jobs)

    def __iter__(self) -> Iterator[bytes]:
        """The queued keys, oldest first."""
        return iter(list(self._jobs))

    def __contains__(self, key: bytes) -> bool:
        return key in self._jobs

    def add(self, jobs: Sequence[SegmentJob]) -> None:
        """Queue `jobs` at the back (a queued key moves there), then trim to `max_entries`."""
        for job in jobs:
            self._jobs[job.key] = job
            self._jobs.move_to_end(job.key)
        while len(self._jobs) > self.max_entries:
            self._jobs.popitem(last=False)

    def next_batch(self) -> list[SegmentJob]:
        """The next idle batch (oldest first, within `batch_tokens`; at least one), taken off."""
        out: list[SegmentJob] = []
        tokens = 0
        while self._jobs:
            job = next(iter(self._jobs.values()))
            if out and tokens + job.num_tokens > self.batch_tokens:
                break
            del self._jobs[job.key]
            out.append(job)
            tokens += job.num_tokens
        return out

    def requeue(self, jobs: Sequence[SegmentJob]) -> None:
        """Put a batch that gave way back at the front, in its order."""
        for job in reversed(jobs):
            self._jobs[job.key] = job
            self._jobs.move_to_end(job.key, last=False)
