"""Background write-back: NVMe copies of CPU-tier objects made ahead of need.

Making room in a full memory tier demotes victims one tier down (kvstore.placement), and
demoting an object from the CPU arena to NVMe writes and fsyncs its bytes (outside the
store's lock, kvstore.placement.Placement.demote; other RPCs do not wait for it), so a
put or a promoting get into a full CPU tier pays for the demotions it causes (a 12k-token
rag request's NVMe-tier hit took 2-4 s on an H200 machine, ~0.2 GB/s end to end).

`WriteBack` keeps the CPU tier's *unbacked* bytes (objects with no NVMe copy) at or below
`watermark` x its capacity: a daemon thread gives the coldest unbacked objects (the
eviction policy's order) a backing copy in the NVMe tier, the same copy a promoted NVMe
hit keeps, written outside the lock while the object is pinned (`busy`), sealed (fsync,
rename) and recorded in the index. Demoting a backed object then costs no I/O (its NVMe
copy becomes the primary), making room prefers backed victims (Placement.allocate), and
backed objects survive a daemon restart. A failed copy is logged, counted
(`writeback_failures`) and freed; the object stays as it was.

The round itself is the Store's public `write_back_round` (planned and settled under its
lock by kvstore.placement, copied outside it); this module owns only the thread and its
schedule, and knows the Store through the one-method `WriteBackTarget` protocol.
`run_once()` does one round (the thread's loop body; tests call it directly). The thread
wakes when `kick()`ed (a CPU-tier commit: the way new unbacked bytes arrive) and every
`interval_s` (for copies dropped under NVMe pressure); a round copies at most
`round_bytes`, and rounds repeat while they back something.

Failures are not retried forever: an object whose copy failed MAX_ATTEMPTS times (a
medium error, an index write that failed) is left out of later rounds; it stays in the
CPU tier and is demoted the ordinary way (written when room is needed). Every
failed copy counts in `writeback_failures`, objects given up on in `writeback_given_up`.
"""
from __future__ import annotations

import logging
import threading
from typing import Protocol

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 3  # failed write-backs of one object before the thread stops trying it


class WriteBackTarget(Protocol):
    """What the write-back thread calls: the Store's public `write_back_round`."""

    def write_back_round(self, watermark: float, round_bytes: int, max_attempts: int) -> int: ...


class WriteBack:
    """The write-back thread of one Store (module docstring)."""

    def __init__(self, store: WriteBackTarget, watermark: float, interval_s: float = 0.5,
                 round_bytes: int = 256 << 20) -> None:
        self.store = store
        self.watermark = watermark
        self.interval_s = interval_s
        self.round_bytes = round_bytes
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="kvstore-writeback", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread after its current round (call without the store's lock)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def kick(self) -> None:
        self._wake.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.interval_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                while self.run_once() and not self._stop.is_set():
                    pass  # behind the watermark: keep going
            except Exception:  # never take the daemon down
                log.exception("write-back round failed")

    def run_once(self) -> int:
        """One round: back the coldest unbacked memory-tier objects until the unbacked
        bytes are at the watermark (at most `round_bytes`). Returns how many objects were
        backed."""
        return self.store.write_back_round(self.watermark, self.round_bytes, MAX_ATTEMPTS)
