"""The queue of segments the PIC planner computes alone while idle (cold fallback and
miss_path="context": engine.pic.planner): `DeferredQueue`, oldest first, bounded.

A segment queued twice keeps one entry, moved to the back; past `MAX_DEFERRED` entries
the oldest go. `next_batch` takes the next idle batch off the front (at most
`batch_tokens` tokens, at least one segment; PicConfig.idle_batch_tokens); a batch that
gave way to a request goes back to the front (`requeue`). With `repeated_only`
(PicConfig.idle_alone_passes="repeated") `add` queues a segment only on its second
sighting: the first is recorded (a bounded record of the last `MAX_SEEN` keys) and
counted in `declined`, so a document a stream names once costs no alone pass. Used from
the engine loop's thread only.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterator, Sequence

from engine.pic.config import IDLE_BATCH_TOKENS
from engine.pic.seen import SeenKeys
from engine.pic.segment_store import SegmentJob

#: most segments queued for idle-time alone passes (cold fallback); the oldest go first
MAX_DEFERRED = 512
#: keys a `repeated_only` queue remembers having seen once (the oldest are forgotten)
MAX_SEEN = 16384


class DeferredQueue:
    """Segments to compute alone when idle, by key (module docstring)."""

    def __init__(self, max_entries: int = MAX_DEFERRED, batch_tokens: int = IDLE_BATCH_TOKENS,
                 repeated_only: bool = False) -> None:
        self.max_entries = max_entries
        self.batch_tokens = batch_tokens
        self.repeated_only = repeated_only
        self._jobs: OrderedDict[bytes, SegmentJob] = OrderedDict()
        #: keys seen (repeated_only): a key's next sighting queues it
        self._seen = SeenKeys(MAX_SEEN)
        #: segments `add` did not queue because they were seen for the first time
        self.declined = 0

    def __len__(self) -> int:
        return len(self._jobs)

    def __iter__(self) -> Iterator[bytes]:
        """The queued keys, oldest first."""
        return iter(list(self._jobs))

    def __contains__(self, key: bytes) -> bool:
        return key in self._jobs

    def add(self, jobs: Sequence[SegmentJob]) -> int:
        """Queue `jobs` at the back (a queued key moves there), then trim to `max_entries`;
        with `repeated_only` a key seen for the first time is recorded instead. How many
        were queued."""
        queued = 0
        for job in jobs:
            if self.repeated_only and not self._seen_before(job.key):
                continue
            queued += 1
            self._jobs[job.key] = job
            self._jobs.move_to_end(job.key)
        while len(self._jobs) > self.max_entries:
            self._jobs.popitem(last=False)
        return queued

    def _seen_before(self, key: bytes) -> bool:
        """Whether `key` was offered before (and is still remembered); records it."""
        if self._seen.saw(key) or key in self._jobs:
            return True
        self.declined += 1
        return False

    def clear(self) -> int:
        """Forget queued segments and keys seen (benchmarks: a cold start); how many were queued."""
        n = len(self._jobs)
        self._jobs.clear()
        self._seen.clear()
        return n

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
