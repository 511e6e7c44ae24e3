"""Background write-back: NVMe copies of CPU-tier objects made ahead of need.

Making room in a full memory tier demotes victims one tier down (kvstore.placement), and
demoting an object from the CPU arena to NVMe writes and fsyncs its bytes while the
store's lock is held: every RPC waits behind it (lookups included), and a put or a
promoting get into a full CPU tier pays for the demotions it causes (a 12k-token rag
request's NVMe-tier hit took 2-4 s on an H200 machine, ~0.2 GB/s end to end).

`WriteBack` keeps the CPU tier's *unbacked* bytes (objects with no NVMe copy) at or below
`watermark` x its capacity: a daemon thread gives the coldest unbacked objects (the
eviction policy's order) a backing copy in the NVMe tier, the same copy a promoted NVMe
hit keeps, written outside the lock while the object is pinned (`busy`), sealed (fsync,
rename) and recorded in the index. Demoting a backed object then costs no I/O (its NVMe
copy becomes the primary), making room prefers backed victims (Placement.allocate), and
backed objects survive a daemon restart. A failed copy is logged, counted
(`writeback_failures`) and freed; the object stays as it was.

`run_once()` does one round (the thread's loop body; tests call it directly). The thread
wakes when `kick()`ed (a CPU-tier commit: the way new unbacked bytes arrive) and every
`interval_s` (for copies dropped under NVMe pressure); a round copies at most
`round_bytes`, and rounds repeat while they back something.

Failures are not retried forever: an object whose copy failed MAX_ATTEMPTS times (a
medium error, an index write that failed) is left out of later rounds; it stays in the
CPU tier and is demoted the ordinary way (under the lock) when room is needed. Every
failed copy counts in `writeback_failures`, objects given up on in `writeback_given_up`.
"""
from __future__ import annotations

import logging
import threading
from typing import Any

from kvstore.errors import BadObject, KVStoreError
from kvstore.eviction import Candidate
from kvstore.placement import StoreInternals, object_name



log = logging.getLogger(__name__)

MAX_ATTEMPTS = 3  # failed write-backs of one object before the thread stops trying it


class WriteBack:
    """The write-back thread of one Store (module docstring)."""

    def __init__(self, store: StoreInternals, watermark: float, interval_s: float = 0.5,
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
        """One round: back the coldest unbacked CPU objects until the unbacked bytes are
        at the watermark (at most `round_bytes`). Returns how many objects were backed."""
        s = self.store
        place = s._place
        with s._lock:
            if not s._open or "cpu" not in s.tiers or "nvme" not in s.tiers:
                return 0
            unbacked = [o for o in place.objects.values() if o.tier == "cpu" and o.backing is None]  # one scan
            excess = sum(o.size for o in unbacked) - int(self.watermark * s.tiers["cpu"].capacity)
            if excess <= 0:
                return 0
            cands = [Candidate(o.key, o.size, o.meta.cost, o.last_access, o.hits) for o in unbacked
                     if not o.pinned and o.writeback_failures < MAX_ATTEMPTS]
            jobs: list[tuple[Any, Any]] = []
            for key in place.policy.choose_victims(cands, min(excess, self.round_bytes)):
                o = place.objects[key]
                try:
                    slot = place.allocate("nvme", o.size, o.key, frozenset({o.key}))
                except KVStoreError as exc:  # the NVMe tier is full of pinned objects: later
                    log.debug("no NVMe room to back %r: %s", o.key, exc)
                    break
                o.busy += 1
                jobs.append((o, slot))
            cpu, nvme = s.tiers["cpu"], s.tiers["nvme"]
        done = [(o, *self._copy(place, cpu, nvme, o, slot)) for o, slot in jobs]  # outside the lock: pinned
        backed = 0
        with s._lock:
            for o, slot, error in done:
                o.busy -= 1
                keep = error is None and s._open and not o.removed and o.tier == "cpu" and o.backing is None
                if keep:
                    o.backing = slot
                    try:
                        place.index.put(place.record(o))
                    except KVStoreError as exc:
                        log.warning("write-back of %r: index record failed (%s); copy dropped", o.key, exc)
                        o.backing, keep, error = None, False, exc
                if keep:
                    backed += 1
                    place.counters["writebacks"] += 1
                    place.counters["writeback_bytes"] += o.size
                else:
                    if error is not None:
                        place.counters["writeback_failures"] += 1
                        o.writeback_failures += 1
                        if o.writeback_failures == MAX_ATTEMPTS:
                            place.counters["writeback_given_up"] += 1
                            log.warning("write-back of %r failed %d times; not trying it again", o.key, MAX_ATTEMPTS)
                    if s._open:
                        nvme.free(slot)
                place.release_slot_if_unpinned(o)
        return backed

    @staticmethod
    def _copy(place, cpu, nvme, o, slot) -> tuple[Any, Any]:
        """Write `o`'s bytes into the NVMe slot and seal it: (sealed slot, None) or
        (slot to free, the error)."""
        try:
            place.copy(cpu, o.slot, nvme, slot)
            if (not o.verified or place.verify_moves) and nvme.checksum(slot) != o.checksum:
                raise BadObject(f"object {o.key!r} fails its checksum while being written back")
            return nvme.seal(slot, object_name(o.key), place.header(o)), None
        except Exception as exc:  # noqa: BLE001 - logged, counted, freed by the caller
            log.warning("write-back of %r to nvme failed: %s", o.key, exc)
            return slot, exc
