"""Placement of committed objects across the tiers: the object map, making room
(eviction and demotion), moving objects between tiers, dropping them, rebuilding the
durable tier from the index at open (kvstore.durable_recovery), and planning and settling the work the Store runs
outside its lock (verifying and promoting reads, prefetches, write-back copies). Tiers
are known by their roles (kvstore.tiers.registry.TierRoles), never by name.

Rules (the Store's module docstring explains them for users): each object has one
primary copy in one tier, plus possibly an NVMe *backing copy* left behind when it was
promoted; pinned objects (leased, or busy with an I/O outside the lock) are never moved
or freed, and a dropped pinned object's slot is freed at its last unpin.

Not thread-safe: the Store calls every method under its lock, except `copy`,
`verify_or_copy` and `write_backing`, which it runs outside the lock on pinned objects.

Demotions that write (a memory-tier victim without a durable copy, going to the durable
tier) do their disk write outside the lock too, through the Store's `outside_lock` hook:
the victim is pinned and given a durable slot under the lock, its bytes are written and
sealed (fsync, rename) with the lock released, then, under the lock again, the copy
becomes its backing copy and is recorded in the index, and the demotion itself moves
nothing (`demote`). So `allocate`, `move` and `demote` may release and retake the lock:
their callers re-check what may have changed meanwhile (a key committed or reserved, an
object deleted or leased). Without the hook (None) every demotion runs under the lock.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from kvstore.errors import BadObject, CapacityExhausted, KVStoreError, StorageError
from kvstore.eviction import Candidate, EvictionPolicy
from kvstore.index import IndexRecord, ObjectIndex
from kvstore.objheader import ObjectHeader
from kvstore.records import ObjectInfo, ObjectMeta
from kvstore.tiers.base import Slot, Tier
from kvstore.tiers.registry import TIERS, TierRoles

log = logging.getLogger(__name__)


class StoreClosed(StorageError):
    """The store closed while a demotion had released its lock (raised through
    `allocate`, `move` and `demote` to the Store call that needed the room)."""


class StoredObject:
    """A committed object's mutable state (guarded by the Store's lock)."""

    __slots__ = ("key", "tier", "slot", "backing", "checksum", "meta", "created", "last_access", "hits",
                 "leases", "busy", "verified", "removed", "freed", "writeback_failures")

    def __init__(self, key: bytes, tier: str, slot: Slot, checksum: int, meta: ObjectMeta,
                 created: float, last_access: float, hits: int = 0, verified: bool = True) -> None:
        self.key, self.tier, self.slot, self.checksum, self.meta = key, tier, slot, checksum, meta
        self.backing: Optional[Slot] = None  # an NVMe copy kept when the object was promoted
        self.created, self.last_access, self.hits = created, last_access, hits
        self.leases = 0  # live client leases
        self.busy = 0  # internal pins: a verify or promotion is running outside the lock
        self.verified = verified  # checksum confirmed (since open for NVMe; after commit for large memory objects)
        self.removed = False  # dropped: out of the map; its slot is freed when the last pin goes
        self.freed = False  # the primary slot went back to its tier
        self.writeback_failures = 0  # failed background copies to NVMe (kvstore.writeback gives up at a limit)

    @property
    def size(self) -> int:
        return self.slot.size

    @property
    def pinned(self) -> bool:
        return self.leases > 0 or self.busy > 0


def object_name(key: bytes) -> str:
    """Filesystem-safe name of a key's object (NVMe file names)."""
    return hashlib.blake2b(key, digest_size=16).hexdigest()


class Placement:
    """Where every committed object's bytes lie, and the moves that change it."""

    def __init__(self, tiers: dict[str, Tier], index: Optional[ObjectIndex], policy: EvictionPolicy,
                 counters: Counter, objects_root: Path) -> None:
        self.tiers = tiers  # enabled tiers, fastest first
        self.roles: TierRoles = TIERS.roles(tiers)  # the Store sets it again when it opens the tiers
        self.index = index  # durable records of NVMe copies (None without an NVMe tier)
        self.policy = policy
        self.counters = counters
        self.objects_root = objects_root
        self.objects: dict[bytes, StoredObject] = {}
        # StoreSettings.verify_memory == "always": a memory-tier object's bytes are not
        # trusted after commit, so a move or write-back out of it re-checks them
        self.verify_moves = False
        # set by the Store: `outside_lock(fn)` runs fn with the lock released and returns
        # whether the store is still open once it holds the lock again; `wait_room(s)`
        # waits up to s seconds on the lock's condition (woken when a demotion settles)
        # and returns the same. None: demotions write under the lock.
        self.outside_lock: Optional[Callable[[Callable[[], None]], bool]] = None
        self.wait_room: Optional[Callable[[float], bool]] = None
        self.demoting = 0  # demotions whose disk write runs outside the lock now

    def header(self, o: "StoredObject") -> ObjectHeader:
        """The header record an NVMe copy of `o` carries."""
        m = o.meta
        return ObjectHeader(o.key, o.size, o.checksum, m.fingerprint, m.token_count, m.cost, dict(m.extra),
                            o.created)

    def below(self, name: str) -> Optional[str]:
        return self.roles.below(name)

    def rank(self, name: str) -> int:
        return TIERS.rank(name)

    def durable_slot(self, o: StoredObject) -> Optional[Slot]:
        """The durable slot the index records for `o`: its own, or its backing copy."""
        return o.slot if o.tier == self.roles.durable else o.backing

    def record(self, o: StoredObject) -> IndexRecord:
        d = self.durable_slot(o)
        assert d is not None, f"object {o.key!r} has no durable copy"
        rel = os.path.relpath(d.path, self.objects_root)
        m = o.meta
        return IndexRecord(o.key, d.tier, rel, d.offset, d.length, d.size, o.checksum,
                           m.fingerprint, m.token_count, m.cost, dict(m.extra), o.created, o.last_access, o.hits)

    def info(self, o: StoredObject) -> ObjectInfo:
        """The client-facing record of `o` (where its bytes lie, whether it is durable)."""
        r = self.tiers[o.tier].region(o.slot)
        return ObjectInfo(o.key, o.tier, o.size, o.checksum, o.meta, o.hits, o.last_access, o.created, o.leases,
                          r.path, r.offset, self.tiers[o.tier].durable or o.backing is not None)

    def release_slot_if_unpinned(self, o: StoredObject) -> None:
        if o.removed and not o.pinned and not o.freed:
            o.freed = True  # exactly once
            self.tiers[o.tier].free(o.slot)

    def drop_backing(self, o: StoredObject) -> None:
        """Forget the NVMe copy of a promoted object (its primary copy stays). The file
        goes before its record: a crash in between leaves a record without a file
        (dropped at open), never a file that would bring the copy back."""
        if o.backing is not None:
            self.tiers[o.backing.tier].free(o.backing)
            o.backing = None
            if self.index is not None:
                self.index.delete(o.key)

    def drop(self, o: StoredObject) -> None:
        """Remove an object from the map and the index; free its slot now or at last unpin
        (pins hold the primary slot only; a backing copy goes at once). A durable slot
        still pinned is marked dropped in its header first, so a crash before its last
        unpin does not bring it back."""
        if o.removed:
            return
        if self.objects.get(o.key) is o:
            del self.objects[o.key]
        durable = self.tiers[o.tier].durable
        o.removed = True
        if durable and o.pinned:
            self.tiers[o.tier].retire(o.slot)
        self.drop_backing(o)  # (deletes the index record when the backing copy held it)
        self.release_slot_if_unpinned(o)
        if durable and self.index is not None:
            self.index.delete(o.key)

    # ------------------------------------------------------------------ room and movement
    def allocate(self, tier: str, size: int, key: bytes, exclude: frozenset = frozenset()) -> Slot:
        """A slot of `size` bytes in `tier`, demoting/evicting unpinned objects for room.
        May release and retake the lock (a demotion that writes; module docstring);
        StoreClosed when the store closed meanwhile, CapacityExhausted when no room can
        be made (pinned objects are never taken; while other demotions are writing, their
        room is waited for, 30 s at most)."""
        t = self.tiers[tier]
        deadline = time.monotonic() + 30.0
        name = object_name(key)
        slot = t.allocate(size, name)
        tried = set(exclude)
        while slot is None:
            cands = [Candidate(o.key, o.size, o.meta.cost, o.last_access, o.hits)
                     for o in self.objects.values()
                     if o.key not in tried and ((o.tier == tier and not o.pinned)
                                                or (o.backing is not None and o.backing.tier == tier))]
            if not cands and self.demoting and self.wait_room is not None and time.monotonic() < deadline:
                # every candidate is pinned, some by demotions writing outside the lock: the
                # room they make may be ours (or theirs): wait for one to settle, look again
                if not self.wait_room(0.05):
                    raise StoreClosed(f"the store closed while making room in tier {tier!r}")
                tried = set(exclude)
                slot = t.allocate(size, name)
                continue
            if not cands:
                pinned = sum(o.slot.length for o in self.objects.values() if o.tier == tier and o.pinned)
                raise CapacityExhausted(
                    f"tier {tier!r} cannot fit {size} bytes: {t.used_bytes} of {t.capacity} bytes in use "
                    f"({t.free_bytes()} free now), {pinned} of them pinned by leases; nothing left to evict"
                )
            need = max(size - t.free_bytes(), 1)
            backed = [c for c in cands if self.objects[c.key].tier == tier and self.objects[c.key].backing is not None]
            if backed and sum(c.size for c in backed) >= need:
                cands = backed  # demoting these costs no I/O (kvstore.writeback made their NVMe copies)
            for k in self.policy.choose_victims(cands, need):
                tried.add(k)
                o = self.objects.get(k)  # (re-checked: a demotion may have released the lock)
                if o is None:
                    continue
                if o.backing is not None and o.backing.tier == tier:
                    self.drop_backing(o)  # a copy: the object stays in its faster tier
                elif o.tier == tier and not o.pinned:
                    self.demote(o)
            slot = t.allocate(size, name)
        return slot

    def demote(self, o: StoredObject) -> None:
        """Move an unpinned object one tier down (dropped from the last tier, or when the
        move fails). A victim that needs a durable copy written gets it outside the lock
        first (`_back_outside_lock`); if it was leased or deleted meanwhile it is left as
        it is (a leased one keeps the new copy as its backing copy)."""
        below = self.below(o.tier)
        if below is not None:
            try:
                if (self.outside_lock is not None and self.tiers[below].durable
                        and not self.tiers[o.tier].durable and o.backing is None):
                    if not self._back_outside_lock(o, below):
                        return
                self.move(o, below, allow_evict=True)
                self.counters["demotions"] += 1
                return
            except StoreClosed:
                raise  # nothing to undo: close() dropped every object and tier
            except KVStoreError as exc:
                if o.removed or o.pinned:  # deleted or leased while the lock was released
                    return
                log.info("demoting %r from %s to %s failed (%s); dropping it", o.key, o.tier, below, exc)
        self.drop(o)
        self.counters["evictions"] += 1

    def _back_outside_lock(self, o: StoredObject, durable: str) -> bool:
        """Give `o` (unpinned, in a memory tier, no durable copy) a durable backing copy,
        written and sealed with the lock released (`outside_lock`); `o` stays readable from
        its memory copy throughout. The index records the copy only once it is sealed, so
        a crash before that leaves a sealed file the index does not name (adopted at open
        from its header) or a half-written one (deleted at open). Returns True when `o` is
        still present and unpinned (its demotion now moves nothing), False when it was
        deleted or leased meanwhile. Raises what the copy raised (StorageError, BadObject),
        or StoreClosed when the store closed meanwhile."""
        slot = self.allocate(durable, o.size, o.key, frozenset({o.key}))  # the last tier: drops, never writes
        job = BackingJob(o, self.tiers[o.tier], self.tiers[durable], slot)
        o.busy += 1
        self.demoting += 1
        try:
            still_open = self.outside_lock(lambda: self.write_backing(job, quiet=True))
        finally:
            o.busy -= 1
            self.demoting -= 1
        if not still_open:  # close() freed the tiers' slots with the tiers
            raise StoreClosed(f"the store closed while demoting {o.key!r} to {durable}")
        error = job.error
        if error is None and not o.removed:
            o.backing = job.slot
            try:
                assert self.index is not None
                self.index.put(self.record(o))
            except KVStoreError as exc:
                o.backing, error = None, exc
            else:
                return not o.pinned
        job.dst.free(job.slot)
        self.release_slot_if_unpinned(o)  # deleted meanwhile: its slot goes now
        if error is None:
            return False
        raise error if isinstance(error, KVStoreError) else StorageError(f"demoting {o.key!r}: {error}")

    def copy(self, src: Tier, s: Slot, dst: Tier, d: Slot) -> None:
        v = src.view(s)
        if v is not None:
            dst.write_from(d, v)
            return
        dv = dst.view(d)
        if dv is None:
            dv = torch.empty(s.size, dtype=torch.uint8)
            src.read_into(s, dv)
            dst.write_from(d, dv)
        else:
            src.read_into(s, dv)

    def move(self, o: StoredObject, dst_name: str, allow_evict: bool) -> None:
        """Move an unpinned object to another tier; on failure it stays where it was.
        Raises CapacityExhausted, StorageError, or BadObject (a corrupt NVMe source)."""
        src, dst = self.tiers[o.tier], self.tiers[dst_name]
        if o.backing is not None and o.backing.tier == dst_name:  # the bytes are there already
            old_slot, o.tier, o.slot, o.backing = o.slot, dst_name, o.backing, None
            src.free(old_slot)
            return
        if allow_evict:
            o.busy += 1  # making room may release the lock: nothing moves or frees o meanwhile
            try:
                slot = self.allocate(dst_name, o.size, o.key, frozenset({o.key}))
            finally:
                o.busy -= 1
            if o.removed or o.pinned:  # deleted or leased while room was made: it stays
                dst.free(slot)
                self.release_slot_if_unpinned(o)
                raise CapacityExhausted(f"object {o.key!r} was deleted or leased while room was made for it")
        else:
            slot = dst.allocate(o.size, object_name(o.key))
            if slot is None:
                raise CapacityExhausted(f"tier {dst_name!r} has no room for {o.size} bytes")
        try:
            self.copy(src, o.slot, dst, slot)
            if (src.durable or not o.verified or self.verify_moves) and dst.checksum(slot) != o.checksum:
                raise BadObject(f"object {o.key!r} in tier {o.tier} ({o.slot.path}) fails its checksum")
            slot = dst.seal(slot, object_name(o.key), self.header(o))
            old_tier, old_slot = o.tier, o.slot
            o.tier, o.slot = dst_name, slot
            if dst.durable:
                assert self.index is not None
                self.index.put(self.record(o))
        except BaseException:
            if o.tier == dst_name:
                o.tier, o.slot = old_tier, old_slot
            dst.free(slot)
            raise
        if src.durable:
            o.backing = old_slot  # keep the durable copy: demoting back is free, restarts keep it
        else:
            src.free(old_slot)
        o.verified = True

    def verify_or_copy(self, o: StoredObject, dst: Optional[Slot]) -> bool:
        src = self.tiers[o.tier]
        try:
            if dst is None:
                return src.checksum(o.slot) == o.checksum
            cpu = self.tiers[dst.tier]
            dv = cpu.view(dst)
            if dv is not None:  # read and hash in one pipelined pass over the arena copy
                return src.read_into_hashed(o.slot, dv) == o.checksum
            self.copy(src, o.slot, cpu, dst)
            return cpu.checksum(dst) == o.checksum
        except StorageError as exc:
            log.warning("reading %r from %s failed: %s", o.key, o.slot.path, exc)
            return False

    def write_back_all(self) -> None:
        """Move every memory-tier object without an NVMe copy down to NVMe, where room
        allows (StoreSettings.writeback_on_close; called with the lock)."""
        durable = self.roles.durable
        assert durable is not None
        for o in [o for o in self.objects.values() if o.tier != durable and o.backing is None]:
            try:
                self.move(o, durable, allow_evict=False)
            except KVStoreError as exc:
                log.warning("write-back of %r to %s skipped: %s", o.key, durable, exc)

    def evict_tier(self, tier: str) -> int:
        """Store.evict_tier's body (called with the lock): backing copies in `tier` dropped,
        unpinned objects demoted; how many left the tier."""
        victims = [o for o in self.objects.values() if o.tier == tier and not o.pinned]
        copies = [o for o in self.objects.values() if o.backing is not None and o.backing.tier == tier]
        for o in copies:
            self.drop_backing(o)
        for o in victims:
            if self.objects.get(o.key) is o and o.tier == tier and not o.pinned:
                self.demote(o)
        return len(victims) + len(copies)

    # ------------------------------------------------------------------ reads (Store.get, Store.prefetch)
    def plan_reads(self, keys: Sequence[bytes], promote: bool, verify_durable: bool,
                   verify_memory: bool) -> list[tuple[StoredObject, Optional[Slot]]]:
        """Store.get's work outside the lock, as (object, memory-tier slot or None) plans:
        durable hits to verify, promoted into the memory tier when `promote` and room can
        be made without touching pinned objects; memory-tier objects committed unverified
        (or every one, with `verify_memory`). Planned objects are pinned (`busy`) until
        `settle_reads`. Called with the lock."""
        plans: list[tuple[StoredObject, Optional[Slot]]] = []
        seen: set[bytes] = set()
        mem = self.roles.memory
        for key in keys:
            o = self.objects.get(key)
            if o is None or key in seen:
                continue
            durable = self.tiers[o.tier].durable
            if not durable and o.verified and not verify_memory:
                continue  # the common case: a verified memory-tier object
            seen.add(key)
            dst = None
            can_move = not o.pinned
            o.busy += 1  # pinned before making room, so making room cannot take it
            if durable and promote and mem is not None and can_move:
                try:
                    dst = self.allocate(mem, o.size, o.key, frozenset({o.key}))
                except KVStoreError as exc:  # no room (or a failed demotion): serve from the durable tier
                    log.debug("no promotion of %r: %s", key, exc)
                    dst = None
            always = (durable and verify_durable) or (not durable and verify_memory)
            if dst is not None or always or not o.verified:
                plans.append((o, dst))
            else:
                o.busy -= 1
        return plans

    def plan_prefetch(self, keys: Sequence[bytes], tier: str) -> tuple[int, list[tuple[StoredObject, Slot]]]:
        """Store.prefetch's moves: objects already in `tier` or above are counted, others
        moved up under the lock, except durable -> memory-tier promotions, which are
        returned as plans (pinned; read and hashed outside the lock, as a promoting get
        does). Returns (objects in place now, plans). Called with the lock."""
        n = 0
        plans: list[tuple[StoredObject, Slot]] = []
        for key in keys:
            o = self.objects.get(key)
            if o is None:
                continue
            if self.rank(o.tier) <= self.rank(tier):
                n += 1
                continue
            if o.pinned:
                continue
            if tier == self.roles.memory and self.tiers[o.tier].durable:
                o.busy += 1  # pinned before making room, so making room cannot take it
                try:
                    plans.append((o, self.allocate(tier, o.size, o.key, frozenset({o.key}))))
                except KVStoreError as exc:
                    o.busy -= 1
                    log.info("prefetch of %r to %s skipped: %s", key, tier, exc)
                continue
            try:
                self.move(o, tier, allow_evict=True)
                self.counters["promotions"] += 1
                n += 1
            except BadObject as exc:
                log.warning("%s; dropped", exc)
                self.drop(o)
                self.counters["corrupt_dropped"] += 1
            except (CapacityExhausted, StorageError) as exc:
                log.info("prefetch of %r to %s skipped: %s", key, tier, exc)
        return n, plans

    def settle_reads(self, plans: list, outcomes: list) -> None:
        """Unpin and settle (settle_nvme_read) the (object, CPU slot or None) plans whose
        reads ran outside the lock (called with the lock)."""
        for (o, dst), ok in zip(plans, outcomes):
            o.busy -= 1
            self.settle_nvme_read(o, dst, ok)
            self.release_slot_if_unpinned(o)

    def settle_nvme_read(self, o: StoredObject, dst: Optional[Slot], ok: bool) -> None:
        """Act on a verify (dst None) or verify-and-promote of `o` done outside the lock:
        an NVMe hit, or a memory-tier object committed unverified."""
        if not ok:
            if dst is not None:
                self.tiers[dst.tier].free(dst)
            if self.objects.get(o.key) is o:
                log.warning("object %r in tier %s (%s) fails its checksum; dropped", o.key, o.tier, o.slot.path)
                self.drop(o)
                self.counters["corrupt_dropped"] += 1
            return
        o.verified = True
        if dst is None:
            return
        if self.objects.get(o.key) is not o or o.tier != self.roles.durable or o.pinned:
            self.tiers[dst.tier].free(dst)  # deleted, moved or leased meanwhile: keep it where it is
            return
        o.tier, o.slot, o.backing = dst.tier, dst, o.slot  # the durable file stays as a backing copy
        self.counters["promotions"] += 1


    # ------------------------------------------------------------------ write-back (kvstore.writeback)
    def plan_backing(self, watermark: float, round_bytes: int, max_attempts: int) -> list["BackingJob"]:
        """Durable slots for the coldest memory-tier objects without a durable copy, until
        those objects' bytes are at `watermark` x the memory tier's capacity (at most
        `round_bytes`; objects whose copy failed `max_attempts` times are left out). Each
        object is pinned (`busy`) until `settle_backing`. Called with the lock."""
        mem, dur = self.roles.memory, self.roles.durable
        if mem is None or dur is None:
            return []
        unbacked = [o for o in self.objects.values() if o.tier == mem and o.backing is None]  # one scan
        excess = sum(o.size for o in unbacked) - int(watermark * self.tiers[mem].capacity)
        if excess <= 0:
            return []
        cands = [Candidate(o.key, o.size, o.meta.cost, o.last_access, o.hits) for o in unbacked
                 if not o.pinned and o.writeback_failures < max_attempts]
        jobs: list[BackingJob] = []
        for key in self.policy.choose_victims(cands, min(excess, round_bytes)):
            o = self.objects[key]
            try:
                slot = self.allocate(dur, o.size, o.key, frozenset({o.key}))
            except KVStoreError as exc:  # the durable tier is full of pinned objects: later
                log.debug("no %s room to back %r: %s", dur, o.key, exc)
                break
            o.busy += 1
            jobs.append(BackingJob(o, self.tiers[mem], self.tiers[dur], slot))
        return jobs

    def write_backing(self, job: "BackingJob", quiet: bool = False) -> None:
        """Write a planned job's bytes into its durable slot and seal it; a failure is
        logged (unless `quiet`: the caller reports it) and kept in `job.error` (the slot
        is freed by `settle_backing`). Runs outside the lock: the object is pinned."""
        o = job.obj
        try:
            self.copy(job.src, o.slot, job.dst, job.slot)
            if (not o.verified or self.verify_moves) and job.dst.checksum(job.slot) != o.checksum:
                raise BadObject(f"object {o.key!r} fails its checksum while being written back")
            job.slot = job.dst.seal(job.slot, object_name(o.key), self.header(o))
        except Exception as exc:  # noqa: BLE001 - logged, counted, freed by settle_backing
            if not quiet:
                log.warning("write-back of %r to %s failed: %s", o.key, job.dst.name, exc)
            job.error = exc

    def settle_backing(self, jobs: list["BackingJob"], is_open: bool, max_attempts: int) -> int:
        """Unpin written jobs; a good copy of an object still unbacked in the memory tier
        becomes its backing copy and is recorded in the index (one transaction for the
        round, so one sync under the lock), anything else is freed (when the store is
        still open) and a failure counted. Returns how many objects were backed. Called
        with the lock."""
        kept: list[BackingJob] = []
        for job in jobs:
            o = job.obj
            o.busy -= 1
            if (job.error is None and is_open and not o.removed and o.tier == self.roles.memory
                    and o.backing is None):
                o.backing = job.slot
                kept.append(job)
        if kept:
            try:
                assert self.index is not None
                self.index.put_many([self.record(job.obj) for job in kept])
            except KVStoreError as exc:
                log.warning("write-back of %d objects: index record failed (%s); copies dropped", len(kept), exc)
                for job in kept:
                    job.obj.backing, job.error = None, exc
                kept = []
        kept_ids = {id(job) for job in kept}
        for job in jobs:
            o = job.obj
            if id(job) in kept_ids:
                self.counters["writebacks"] += 1
                self.counters["writeback_bytes"] += o.size
            else:
                if job.error is not None:
                    self.counters["writeback_failures"] += 1
                    o.writeback_failures += 1
                    if o.writeback_failures == max_attempts:
                        self.counters["writeback_given_up"] += 1
                        log.warning("write-back of %r failed %d times; not trying it again", o.key, max_attempts)
                if is_open:
                    job.dst.free(job.slot)
            self.release_slot_if_unpinned(o)
        return len(kept)


@dataclass
class BackingJob:
    """One planned write-back copy: `obj`'s bytes from `src` into `slot` of `dst`."""

    obj: StoredObject
    src: Tier
    dst: Tier
    slot: Slot
    error: Optional[BaseException] = None
