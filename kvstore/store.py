"""The in-process core of the kvstore daemon: `Store` owns the tiers, the index, the
leases and reservations, and object movement between tiers.

The gRPC server (kvstore/server/) is a thin shell over one `Store`; it calls it from a
thread pool, so every public method is thread-safe. Objects are opaque bytes plus a
checksum (`kvstore.format.checksum`); the tensor blob format is a client convention.

Lifecycle of a put (bulk bytes never pass through the Store's API)::

    res = store.reserve(key, size, "cpu", meta)      # status "reserved" -> write into res.region
    ... client writes its bytes in place (shm file / object file / CUDA IPC) ...
    store.commit(res.reservation_id, checksum)        # verified in place, then visible
                                                      # (memory tiers over commit_verify_max_bytes:
                                                      # verified before first served or moved)

A get pins: `leases = store.get([key], client_id)`, read `lease.region`, then `release`.

Placement: each object has one primary copy, in one tier; tiers are ordered gpu > cpu >
nvme. When a tier needs room, the eviction policy picks unpinned victims, which are
demoted to the next enabled tier down (and dropped from the bottom one). An NVMe hit is
promoted to the CPU arena when room can be made (the copy is checksummed in memory on
the way); the NVMe file stays behind as a *backing copy*, so the object survives a
restart and demoting it again costs no I/O. Backing copies count in the NVMe tier's used
bytes and are the first thing NVMe pressure may drop (the object keeps its fast copy).
Pinned objects (leased, being written, being moved or verified) are never evicted,
moved or freed; an object deleted or found corrupt while pinned leaves the index at once
and its space is freed when the last pin goes.

Durability (NVMe): bytes and their header record (kvstore.objheader) fsync'ed and renamed
into place, then the LMDB record committed; `open` rebuilds the NVMe tier from LMDB,
drops records whose file is missing or short, adopts object files the index does not
name from their headers (never deleting one for that), and deletes half-written files
and those of dropped objects. A damaged index is rebuilt from the headers or refused
(settings.index_recovery; kvstore.index). Memory tiers start empty.

Locking: one lock guards all metadata, taken with `with`. Checksumming a commit and
verifying/promoting an NVMe hit run outside it (the object or reservation is pinned);
so do prefetches from NVMe to the CPU tier, and the NVMe write of a demotion to NVMe
(the victim is pinned, stays readable from its memory copy, and becomes durable in the
index only once its file is sealed; the put or promotion that needed the room waits for
it, other clients' lookups and gets do not: kvstore.placement). Memory-to-memory
demotions and other prefetch moves still copy bytes under the lock; kvstore.writeback
gives the coldest CPU-tier objects NVMe copies ahead of need, so demoting them writes
nothing.

Remote tier (optional, `settings.remote_url`; kvstore.remote): committed objects are
offered to it after commit and written in the background; a key absent from every local
tier is looked up there by `lookup`/`presence` (wait=True) and `get`, and a remote hit is
verified and committed to the CPU tier before it is answered.

The Store is the API and the lock; its parts live by job: kvstore.storemedia (directory
lock, tiers built from kvstore.tiers.registry, index), kvstore.placement (object map,
room, moves, read and write-back plans), kvstore.reservations (open puts, their waiters),
kvstore.writeback (the thread driving the public `write_back_round`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from kvstore.errors import BadObject, InvalidRequest, StorageError, UnknownKey
from kvstore.eviction import make_policy
from kvstore.index import ObjectIndex
from kvstore.leases import LeaseEntry, LeaseTable
from kvstore.memory_seam import MemorySeam
from kvstore.objheader import ObjectHeader
from kvstore.writeback import WriteBack
from kvstore.remote.base import RemoteAdapter
from kvstore.remote.tier import (RemoteSettings, RemoteTier, check_url, disabled_stats, make_adapter,
                                 reserve_trailer_room)
from kvstore.durable_recovery import recover_durable
from kvstore.placement import Placement, StoredObject, object_name
from kvstore.reservations import PendingPut, Reservations, check_put
from kvstore.records import (  # noqa: F401  (re-exported: the Store API's records)
    Lease,
    LookupEntry,
    ObjectInfo,
    ObjectMeta,
    Region,
    Reservation,
    StoreSettings,
)
from kvstore.storemedia import StoreMedia
from kvstore.tiers.base import Tier
from kvstore.tiers.registry import TIERS, TierRoles

TIER_NAMES = TIERS.names  # (re-exported) fastest first; demotion goes left to right

log = logging.getLogger(__name__)


class Store:
    """The tiered object store. Thread-safe; see the module docstring."""

    def __init__(self, settings: StoreSettings, *, wrap_tier: Optional[Callable[[Tier], Tier]] = None,
                 remote_adapter: Optional[RemoteAdapter] = None) -> None:
        """Validate settings (InvalidRequest naming the bad one); allocate nothing until
        `open`. `wrap_tier` (tests) wraps each tier as it is created, e.g. in a FaultyTier;
        `remote_adapter` (tests) is the remote tier's adapter instead of the one
        `settings.remote_url` names (the Store closes it)."""
        s = settings
        s.validate()
        TIERS.check(s.default_tier, "default tier")
        self.settings = s
        self.dir = Path(s.dir)
        self._policy = make_policy(s.eviction)
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._counters: Counter = Counter()
        self._media = StoreMedia(s, wrap_tier, self._counters)
        self.tiers: dict[str, Tier] = self._media.tiers  # enabled tiers, fastest first (filled by open)
        self._place = Placement(self.tiers, None, self._policy, self._counters, self.dir / "objects")
        self._place.verify_moves = s.verify_memory == "always"
        self._place.outside_lock = self._outside_lock  # demotions write to NVMe without the lock
        self._place.wait_room = self._wait_room
        #: what the remote tier does to the objects (kvstore.memory_seam); locks self._lock
        self.remote_seam = MemorySeam(self._lock, self._place, self.tiers, lambda: self.roles, lambda: self._open)
        self._leases = LeaseTable(s.lease_ttl_s)
        self._reservations = Reservations(s.lease_ttl_s, self._cond)
        self._index: Optional[ObjectIndex] = None
        self._open = False
        self._writeback = WriteBack(self, s.writeback_watermark)  # started by open (CPU + NVMe tiers, < 1)
        self._remote_adapter = remote_adapter
        self._remote: Optional[RemoteTier] = None  # made by open when a remote tier is configured
        if s.remote_url or remote_adapter is not None:
            from kvstore.remote.policy import parse_policy

            parse_policy(s.remote_policy)  # bad settings fail here, before anything opens
            if remote_adapter is None:
                check_url(s.remote_url)

    # ------------------------------------------------------------------ lifecycle
    def open(self) -> None:
        """Lock the cache directory, create/map the tiers, open the LMDB index and rebuild
        the NVMe tier from it (records whose file is missing or short are dropped and
        counted; object files from a crash between write and index commit are adopted
        from their headers); kvstore.storemedia opens the media."""
        with self._lock:
            if self._open:
                return
            self._media.open()
            self._index = self._place.index = self._media.index
            self._place.roles = self._media.roles
            try:
                if self.roles.durable is not None:
                    recover_durable(self._place)
            except BaseException:
                self._close_media()
                raise
            self._open = True
        if self.roles.can_write_back and self.settings.writeback_watermark < 1.0:
            self._writeback.start()
        if self.settings.remote_url or self._remote_adapter is not None:
            self._open_remote()

    @property
    def roles(self) -> TierRoles:
        """What the enabled tiers are for (kvstore.tiers.registry; none while closed)."""
        return self._media.roles

    def _open_remote(self) -> None:
        s = self.settings
        try:
            if self.roles.memory is None:
                raise InvalidRequest("the remote tier needs a CPU tier (remote hits land there): give --cpu-capacity a size")
            adapter = self._remote_adapter if self._remote_adapter is not None else make_adapter(s.remote_url)
            reserve_trailer_room(self.tiers[self.roles.memory])
            self._remote = RemoteTier(self.remote_seam, RemoteSettings(s.remote_url or f"({adapter.kind})", s.remote_policy,
                                                           s.remote_timeout_s), adapter)
        except BaseException:
            self.close()
            raise
        self._remote.start()

    def close(self) -> None:
        """Abort open reservations, optionally write the CPU tier back to NVMe, flush and
        close the index, unmap and unlink the arenas. Idempotent."""
        self._writeback.stop()  # first: its rounds take the lock and copy outside it
        if self._remote is not None:  # its writes and fills end before the tiers close
            self._remote.stop()
            self._remote = None
        with self._lock:
            if not self._open:
                return
            for e in self._reservations.table.entries():
                self._end_reservation_locked(e, free=True)
            if self.settings.writeback_on_close and self.roles.durable is not None:
                self._place.write_back_all()
            if self._index is not None:
                try:
                    self._index.put_many([self._place.record(o) for o in self._place.objects.values()
                                          if self._place.durable_slot(o) is not None])
                except StorageError as exc:
                    log.warning("flushing access stats to the index failed: %s", exc)
            self._place.objects.clear()
            self._leases = LeaseTable(self.settings.lease_ttl_s)
            self._reservations.reset()
            self._open = False
            self._close_media()
            self._reservations.notify(None)

    def _close_media(self) -> None:
        self._media.close()
        self._index = self._place.index = None
        self._place.roles = self._media.roles

    def __enter__(self) -> "Store":
        self.open()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ helpers
    def _outside_lock(self, fn: Callable[[], None]) -> bool:
        """Placement's hook (called with the lock): run `fn` with the lock released, take
        it again, wake the waiters for room; whether the store is still open."""
        self._lock.release()
        try:
            fn()
        finally:
            self._lock.acquire()
        self._cond.notify_all()
        return self._open

    def _wait_room(self, timeout_s: float) -> bool:
        """Placement's hook (called with the lock): wait on the condition up to
        `timeout_s` (a demotion settling wakes it); whether the store is still open."""
        self._cond.wait(timeout_s)
        return self._open

    def _require_open(self) -> None:
        if not self._open:
            raise StorageError(f"the store at {self.dir} is not open")

    def _tier(self, name: str) -> Tier:
        t = self.tiers.get(TIERS.check(name))
        if t is None:
            raise InvalidRequest(f"tier {name!r} is not enabled in this daemon (enabled: {', '.join(self.tiers)})")
        return t

    # ------------------------------------------------------------------ public API
    def lookup(self, keys: Sequence[bytes]) -> list[LookupEntry]:
        """Presence of each key (no pin, no movement; counted in `lookup_hits` /
        `lookup_misses`, not in the objects' hits)."""
        return [LookupEntry(k, True, f[0], f[1]) if f else LookupEntry(k, False, None, 0)
                for k, f in zip(keys, self.presence(keys))]

    def presence(self, keys: Sequence[bytes], *, wait: bool = True) -> Optional[list[Optional[tuple[str, int]]]]:
        """`lookup` without the records: (tier, size) per present key, None per absent
        one. The server's Lookup fast path (one dict probe per key under the lock). With
        `wait=False` it returns None at once when the lock is busy (the asyncio server
        then retries on a worker thread instead of stalling its event loop); with a
        remote tier also when some key is absent locally (asking the remote tier blocks),
        and with `wait=True` such keys are filled from the remote tier first."""
        out = self._presence(keys, wait)
        if out is None or self._remote is None or all(out):
            return out
        if not wait:
            return None  # a remote look-up blocks: the caller retries on a worker thread
        if self._remote.fill([k for k, f in zip(keys, out) if f is None]):
            return self._presence(keys, True)
        return out

    def _presence(self, keys: Sequence[bytes], wait: bool) -> Optional[list[Optional[tuple[str, int]]]]:
        if not self._lock.acquire(blocking=wait):
            return None
        try:
            self._require_open()
            get = self._place.objects.get
            out: list[Optional[tuple[str, int]]] = []
            found = 0
            for k in keys:
                o = get(k)
                if o is not None:
                    found += 1
                    out.append((o.tier, o.slot.size))
                else:
                    out.append(None)
            self._counters["lookup_hits"] += found
            self._counters["lookup_misses"] += len(out) - found
            return out
        finally:
            self._lock.release()

    def reserve(self, key: bytes, size: int, tier: str, meta: ObjectMeta, client_id: str = "") -> Reservation:
        """Reserve `size` bytes in `tier` for `key` (see Reservation for the statuses).

        Makes room by demoting/evicting unleased objects per the eviction policy. Raises
        CapacityExhausted (naming the tier, the size and what is in use) when no room can
        be made, InvalidRequest for size <= 0, a size over the tier's capacity, an
        unknown or absent tier, or a bad key.
        """
        key = check_put(key, size, meta, self.settings.max_key_bytes)
        with self._lock:
            self._require_open()
            t = self._tier(tier)
            if size > t.capacity:
                raise InvalidRequest(f"object of {size} bytes exceeds the {tier!r} tier's capacity of {t.capacity} bytes")
            o = self._place.objects.get(key)
            if o is not None:
                return Reservation(0, key, o.tier, None, "exists")
            if self._reservations.in_flight(key):
                return Reservation(0, key, self._reservations.tier_of(key) or tier, None, "in_flight")
            slot = self._place.allocate(tier, size, key)
            o = self._place.objects.get(key)  # (making room may have released the lock: Placement.demote)
            if o is not None or self._reservations.in_flight(key):
                t.free(slot)
                if o is not None:
                    return Reservation(0, key, o.tier, None, "exists")
                return Reservation(0, key, self._reservations.tier_of(key) or tier, None, "in_flight")
            e = self._reservations.open(PendingPut(key, tier, slot, meta), client_id)
            return Reservation(e.lease_id, key, tier, t.region(slot), "reserved", e.expires_at)

    def _end_reservation_locked(self, e: LeaseEntry, free: bool) -> None:
        if free:
            self.tiers[e.payload.tier].free(e.payload.slot)
        self._reservations.end(e)

    def commit(self, reservation_id: int, checksum: int, client_id: Optional[str] = None) -> LookupEntry:
        """Verify the reserved bytes hash to `checksum` and make the object visible.

        NVMe: the file is fsync'ed and renamed, then the index txn commits. On mismatch
        raises BadObject and frees the space; an unknown/expired id, or (with `client_id`)
        one another client reserved, raises UnknownKey.
        """
        with self._lock:
            self._require_open()
            e = self._owned_locked(self._reservations.table, reservation_id, client_id)
            if e is None:
                raise UnknownKey(f"reservation {reservation_id} is unknown, expired or already finished")
            p: PendingPut = e.payload
            if p.committing:
                raise InvalidRequest(f"reservation {reservation_id} is already being committed")
            p.committing = True
            t = self.tiers[p.tier]
        slot = p.slot
        # Large memory-tier objects are verified lazily (before first served or moved; see
        # StoreSettings.commit_verify_max_bytes): the client hashed them while writing, and
        # a second full pass here would halve put bandwidth. Durable commits always verify.
        limit = self.settings.commit_verify_max_bytes
        verify_now = t.durable or limit < 0 or slot.size <= limit
        try:  # outside the lock: hashing and fsync take time; the reservation pins the slot
            actual = t.checksum(slot) if verify_now else checksum
            if actual != checksum:
                raise BadObject(
                    f"checksum mismatch committing key {p.key!r}: client sent {checksum:#x}, the {slot.size} "
                    f"bytes in tier {p.tier!r} hash to {actual:#x}; the reservation is dropped"
                )
            now = time.time()
            m = p.meta
            header = ObjectHeader(p.key, slot.size, checksum, m.fingerprint, m.token_count, m.cost, dict(m.extra), now)
            slot = t.seal(slot, object_name(p.key), header)
            o = StoredObject(p.key, p.tier, slot, checksum, p.meta, now, now, verified=verify_now)
            if t.durable:
                assert self._index is not None
                self._index.put(self._place.record(o))
        except BaseException as exc:
            with self._lock:
                if isinstance(exc, BadObject):
                    self._counters["bad_commits"] += 1
                if self._open:
                    p.slot = slot  # free the bytes where they now lie (sealed or not)
                    self._end_reservation_locked(e, free=True)
            raise
        with self._lock:
            if not self._open:  # closed while we hashed: close() freed the reservation
                raise StorageError(f"the store at {self.dir} closed while committing key {p.key!r}")
            self._end_reservation_locked(e, free=False)
            self._place.objects[p.key] = o
            self._counters["puts"] += 1
        if p.tier == self.roles.memory:
            self._writeback.kick()
        if self._remote is not None:
            self._remote.offer(p.key, slot.size, p.meta, checksum)
        return LookupEntry(p.key, True, p.tier, slot.size)

    def _owned_locked(self, table: LeaseTable, lease_id: int, client_id: Optional[str]) -> Optional[LeaseEntry]:
        """table's entry `lease_id` when `client_id` (None: any) took it; a live entry
        of another client is counted in `foreign_requests_refused` and not returned."""
        e = table.owned(lease_id, client_id)
        if e is None and table.get(lease_id) is not None:
            self._counters["foreign_requests_refused"] += 1
            log.warning("client %r named lease/reservation %d of another client; refused", client_id, lease_id)
        return e

    def abort(self, reservation_id: int, client_id: Optional[str] = None) -> None:
        """Drop a reservation and free its space; waiters on its key are woken (False).
        An unknown or finished id, or (with `client_id`) another client's, is ignored
        (abort is idempotent)."""
        with self._lock:
            e = self._owned_locked(self._reservations.table, reservation_id, client_id)
            if e is None:
                return
            if e.payload.committing:
                raise InvalidRequest(f"reservation {reservation_id} is being committed and cannot be aborted")
            self._end_reservation_locked(e, free=True)
            self._counters["aborted_puts"] += 1

    def add_settle_listener(self, fn: Callable[[Optional[bytes]], None]) -> None:
        """Call `fn(key)` whenever a reservation of `key` ends (committed, aborted or
        expired), and `fn(None)` when the store closes. It runs under the store's lock, on
        whatever thread ended the reservation: it must only hand the news on (e.g.
        `loop.call_soon_threadsafe`), never block or call back into the store. This is how
        the server waits for keys without holding a thread per waiter (`key_state`)."""
        with self._lock:
            self._reservations.add_listener(fn)

    def key_state(self, key: bytes, *, wait: bool = True) -> Optional[str]:
        """"present", "in_flight" (a reservation is open) or "absent" (also once the
        store is closed); None when `wait` is False and the lock is busy."""
        if not self._lock.acquire(blocking=wait):
            return None
        try:
            if not self._open:
                return "absent"
            if key in self._place.objects:
                return "present"
            return "in_flight" if self._reservations.in_flight(key) else "absent"
        finally:
            self._lock.release()

    def wait_for(self, key: bytes, timeout_s: float) -> bool:
        """Block until `key` is committed (True) or its in-flight put is aborted, or the
        timeout passes (False). Returns at once when the key is already present."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        with self._cond:
            while True:
                if key in self._place.objects:
                    return True
                left = deadline - time.monotonic()
                if not self._reservations.in_flight(key) or left <= 0 or not self._open:
                    return False
                self._cond.wait(left)

    def get(self, keys: Sequence[bytes], client_id: str, promote: bool = True,
            client_verifies: bool = False) -> list[Optional[Lease]]:
        """Pin each present key with a lease (None for a miss); counts hits and misses.

        With `promote`, an NVMe hit is moved to the CPU arena when room can be made
        without touching pinned objects; its copy is checksummed in memory. An object
        served from NVMe is checksummed first (settings.verify_nvme), and so is a memory
        tier object committed unverified (its first get). A bad object is dropped,
        counted in `corrupt_dropped` and reported as a miss. `client_verifies`: the
        client checks the bytes it reads, so an NVMe object verified before is served
        without the read-back (verify_nvme "always" acts as "first" for this get; a
        corrupt object is then the client's BadObject, and stays in the store).
        """
        if self._remote is not None:
            found = self._presence(keys, True)
            if found is not None and not all(found):
                self._remote.fill([k for k, f in zip(keys, found) if f is None])
        with self._lock:
            self._require_open()
            plans = self._place.plan_reads(keys, promote,
                                           self.settings.verify_nvme == "always" and not client_verifies,
                                           self.settings.verify_memory == "always")
        outcomes = [self._place.verify_or_copy(o, dst) for o, dst in plans]  # outside the lock
        with self._lock:
            self._place.settle_reads(plans, outcomes)
            now = time.time()
            out: list[Optional[Lease]] = []
            for key in keys:
                o = self._place.objects.get(key)
                if o is None or not o.verified:
                    self._counters["misses"] += 1
                    out.append(None)
                    continue
                self._counters["hits"] += 1
                o.hits += 1
                o.last_access = now
                o.leases += 1
                e = self._leases.acquire(o.key, client_id, o)
                out.append(Lease(e.lease_id, o.key, o.tier, self.tiers[o.tier].region(o.slot), o.size,
                                 o.checksum, e.expires_at, o.meta))
            return out

    def release(self, lease_ids: Sequence[int], client_id: Optional[str] = None, *, wait: bool = True) -> bool:
        """Unpin. Unknown or expired lease ids, and (with `client_id`) other clients'
        leases, are ignored (release is idempotent). With `wait=False`, returns False
        without doing anything when the lock is busy."""
        if not self._lock.acquire(blocking=wait):
            return False
        try:
            for i in lease_ids:
                if self._owned_locked(self._leases, i, client_id) is None:
                    continue
                e = self._leases.release(i)
                if e is not None:
                    self._unlease_locked(e.payload)
            return True
        finally:
            self._lock.release()

    def _unlease_locked(self, o: StoredObject) -> None:
        o.leases -= 1
        self._place.release_slot_if_unpinned(o)

    def renew(self, client_id: str, *, wait: bool = True) -> bool:
        """Extend every lease and reservation of `client_id` by lease_ttl_s. With
        `wait=False`, returns False without doing anything when the lock is busy."""
        if not self._lock.acquire(blocking=wait):
            return False
        try:
            self._leases.renew(client_id)
            self._reservations.table.renew(client_id)
            return True
        finally:
            self._lock.release()

    def delete(self, keys: Sequence[bytes]) -> int:
        """Delete the keys that are present and unleased; returns how many were deleted.
        A leased key is left in place."""
        n = 0
        with self._lock:
            self._require_open()
            for key in keys:
                o = self._place.objects.get(key)
                if o is not None and o.leases == 0:
                    self._place.drop(o)
                    n += 1
            if n:
                self._counters["deletes"] += n
        return n

    def prefetch(self, keys: Sequence[bytes], tier: str) -> int:
        """Move present keys up to `tier` where room can be made; returns how many now
        sit in `tier` or above. NVMe -> CPU promotions read and hash outside the lock, as
        a promoting get does (other moves copy under it)."""
        with self._lock:
            self._require_open()
            self._tier(tier)
            n, plans = self._place.plan_prefetch(keys, tier)
        outcomes = [self._place.verify_or_copy(o, dst) for o, dst in plans]  # outside the lock
        with self._lock:
            self._place.settle_reads(plans, outcomes)
            return n + sum(self._place.objects.get(o.key) is o and o.tier == tier for o, _ in plans)

    def write_back_round(self, watermark: float, round_bytes: int, max_attempts: int) -> int:
        """One write-back round (kvstore.writeback): give the coldest memory-tier objects
        without a durable copy one, until their bytes are at `watermark` x the memory
        tier's capacity (at most `round_bytes`; objects whose copy failed `max_attempts`
        times are skipped). Copies run outside the lock on pinned objects. Returns how
        many objects were backed (0 when closed or without a memory and a durable tier)."""
        with self._lock:
            if not self._open:
                return 0
            jobs = self._place.plan_backing(watermark, round_bytes, max_attempts)
        for job in jobs:
            self._place.write_backing(job)
        with self._lock:
            return self._place.settle_backing(jobs, self._open, max_attempts)

    def evict_tier(self, tier: str) -> int:
        """Demote every unleased object out of `tier` one tier down (gpu -> cpu -> nvme ->
        dropped; write-back pins waited out, 10 s at most); how many objects left it."""
        deadline = time.monotonic() + 10.0
        with self._lock:
            self._require_open()
            self._tier(tier)
            n = self._place.evict_tier(tier)
            while time.monotonic() < deadline:
                left = [o for o in self._place.objects.values() if o.tier == tier and o.leases == 0]
                if not left:
                    break
                if all(o.busy for o in left):
                    self._cond.wait(0.05)  # lets the write-back settle its copies
                n += self._place.evict_tier(tier)  # (demotions release the lock: objects unpinned meanwhile)
            return n

    def stats(self) -> dict[str, Any]:
        """{"tiers": [{"name", "capacity_bytes", "used_bytes", "objects", ...}], "hits",
        "misses" (keys Get found / did not find), "lookup_hits", "lookup_misses" (keys
        Lookup found / did not find), "evictions", "demotions", "promotions", "leases",
        "reservations", "corrupt_dropped", ...}."""
        with self._lock:
            per_tier = Counter(o.tier for o in self._place.objects.values())
            copies = Counter(o.backing.tier for o in self._place.objects.values() if o.backing is not None)
            tiers = [{**t.stats(), "name": name, "objects": per_tier[name], "backing_copies": copies[name]}
                     for name, t in self.tiers.items()]
            out: dict[str, Any] = {"tiers": tiers, "objects": len(self._place.objects),
                                   "leases": len(self._leases), "reservations": len(self._reservations),
                                   "eviction_policy": self._policy.name}
            for k in ("hits", "misses", "lookup_hits", "lookup_misses", "evictions", "demotions", "promotions", "corrupt_dropped", "puts",
                      "bad_commits", "aborted_puts", "deletes", "expired_leases", "expired_reservations",
                      "recovered_objects", "recovery_dropped", "orphans_removed", "partial_writes_removed",
                      "recovered_from_files", "files_set_aside", "index_rebuilds", "foreign_requests_refused",
                      "writebacks", "writeback_bytes", "writeback_failures", "writeback_given_up"):
                out[k] = self._counters[k]
            remote = self._remote
        out["remote"] = remote.stats() if remote is not None else disabled_stats()
        return out

    def list_objects(self, fingerprint: Optional[str] = None, prefix: Optional[bytes] = None,
                     tier: Optional[str] = None, limit: Optional[int] = None) -> list[ObjectInfo]:
        """Committed objects matching every given filter, most-hit first."""
        if tier is not None:
            TIERS.check(tier)
        if limit is not None and limit < 0:
            raise InvalidRequest(f"limit must be >= 0, got {limit}")
        with self._lock:
            hits = [self._place.info(o) for o in self._place.objects.values()
                    if (fingerprint is None or o.meta.fingerprint == fingerprint)
                    and (prefix is None or o.key.startswith(prefix))
                    and (tier is None or o.tier == tier)]
        hits.sort(key=lambda i: (-i.hits, i.key))
        return hits if limit is None else hits[:limit]

    def object_info(self, key: bytes) -> ObjectInfo:
        """The record of one committed object; UnknownKey when absent."""
        with self._lock:
            o = self._place.objects.get(key)
            if o is None:
                raise UnknownKey(f"no object with key {bytes(key)!r}")
            return self._place.info(o)

    def expire(self, now: Optional[float] = None) -> None:
        """Expire leases and reservations whose time has passed (the server calls this
        periodically; `now` defaults to time.monotonic())."""
        with self._lock:
            for e in self._leases.expire(now):
                self._unlease_locked(e.payload)
                self._counters["expired_leases"] += 1
            for e in self._reservations.table.expire(now, keep=lambda e: e.payload.committing):
                self._end_reservation_locked(e, free=True)
                self._counters["expired_reservations"] += 1
