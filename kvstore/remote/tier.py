"""The remote tier of one Store: below NVMe, shared by the daemons of many hosts.

Owns: `RemoteSettings`, `RemoteTier` (the Store's side of a `RemoteAdapter`: writing
committed objects out in the background, filling local misses from the remote store,
and the counters `kvstore inspect` and /metrics show), and `make_adapter` (URL ->
adapter).

Writes: `offer(key, size, meta)` after a commit queues the key when the policy says so
(kvstore.remote.policy); a writer thread takes batches, pins each object (`busy`), and
submits one put per batch straight from the object's bytes in host memory (objects in a
file or device tier through a staging copy), each followed by the envelope's trailer
(kvstore.remote.envelope: key, meta, the store and transfer checksums). A memory-arena
object whose slot has tail room for the trailer (`TRAILER_ROOM`, which the memory tier
keeps past every object it allocates once a remote tier is on, or page rounding) gets
it written there and goes as one range; otherwise the trailer is a second range. The
pin is released when the put has ended, even when the writer stopped waiting for it.

Fills: a local miss (`Store.lookup`, the Lookup fast path through a worker thread, and
`Store.get`) asks `fill(keys)`: one stat of the missing names, then for each present
object a memory-tier slot of the whole remote object is allocated (making room as a put
would) and one get reads it into the slot as one range; the trailer (in the slot's tail,
past the object) is checked and the payload hashed (xxh3, the transfer checksum: a
`PayloadVerifier`, fed each chunk as it lands when the adapter reads in chunks) before
the object is committed to the memory tier as verified, with the store checksum the
trailer records, so the usual zero-copy read serves it.
A damaged object is freed, counted in `corrupt_dropped` and removed from the remote
store; it is never served.

Faults: every remote call (`RemoteAdapter.call`) is bounded by `timeout_s`: a wait on
the adapter's worker, or the client's own timeouts when the adapter runs it inline; a timeout or an error is counted
and the caller sees a miss (local tiers keep serving). A timeout also makes the adapter
suspect the store (a hung master): while the adapter reports the store unreachable,
fills and writes are skipped at once and counted; its probe reconnects by itself. A get that timed out keeps its slot until the get has ended.

The Store is reached through its public seam only (`StoreSeam`: pin/unpin committed
objects, allocate/adopt/free memory-tier slots); tiers are known by role, not name.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional, Protocol, Sequence

import torch

from kvstore.checksums import BLOB_MAGIC, PREFIX_BYTES, XXH3, algorithm_of
from kvstore.errors import BadObject, KVStoreError
from kvstore.placement import StoredObject
from kvstore.records import ObjectMeta
from kvstore.remote.base import (NOT_FOUND, PENDING, TIMED_OUT, GetItem, PutItem, RemoteAdapter,
                                RemoteConfigError)
from kvstore.remote.envelope import (FOOTER_BYTES, MAX_TRAILER_BYTES, PayloadVerifier, RemoteHeader, encode_trailer,
                                     remote_name, trailer_body, transfer_checksum)
from kvstore.remote.policy import RemotePolicy, parse_policy
from kvstore.tiers.arena import ArenaTier
from kvstore.tiers.base import Slot, Tier



log = logging.getLogger(__name__)

COUNTERS = ("hits", "misses", "errors", "timeouts", "corrupt_dropped", "bytes_read", "objects_written",
            "bytes_written", "put_errors", "put_skipped_policy", "put_skipped_unreachable",
            "put_queue_full", "lookups_skipped_unreachable", "fill_no_room")


@dataclass(frozen=True)
class RemoteSettings:
    """How the Store uses its remote tier."""

    url: str
    policy: str = "all"  # kvstore.remote.policy: all | none | cost:SECONDS
    timeout_s: float = 2.0  # bound on every remote wait (stat, get, put)
    queue_limit: int = 4096  # offers beyond this many queued keys are dropped (counted)
    batch: int = 16  # objects per put task


def check_url(url: str) -> None:
    """Parse a remote URL without connecting; RemoteConfigError naming the bad part."""
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme != "mooncake":
        raise RemoteConfigError(f"remote URL {url!r}: unknown scheme {scheme or '(none)'!r}; supported: mooncake://")
    from kvstore.remote.mooncake import MooncakeTarget

    MooncakeTarget.from_url(url)


def make_adapter(url: str) -> RemoteAdapter:
    """The adapter a remote URL names, connected; RemoteConfigError for a bad URL or a
    cluster that cannot be joined."""
    check_url(url)
    from kvstore.remote.mooncake import MooncakeAdapter, MooncakeTarget

    return MooncakeAdapter(MooncakeTarget.from_url(url))


class _Latency:
    """The last 4096 durations of one operation kind, for p50/p99."""

    def __init__(self) -> None:
        self._d: deque[float] = deque(maxlen=4096)
        self.count = 0
        self.total = 0.0

    def add(self, s: float) -> None:
        self._d.append(s)
        self.count += 1
        self.total += s

    def summary(self) -> dict[str, Any]:
        v = sorted(self._d)
        pick = (lambda q: v[min(len(v) - 1, int(q * len(v)))]) if v else (lambda q: 0.0)
        return {"count": self.count, "seconds_total": self.total, "p50_s": pick(0.5), "p99_s": pick(0.99)}


class StoreSeam(Protocol):
    """The calls a RemoteTier makes on its Store: kvstore.memory_seam.MemorySeam, which
    each Store builds (`Store.remote_seam`; kvstore.store imports this module, so it
    names this protocol instead)."""

    tiers: dict[str, Tier]

    @property
    def memory_tier(self) -> Optional[Tier]: ...

    def pin_objects(self, keys: Sequence[bytes]) -> list[StoredObject]: ...

    def unpin_objects(self, objs: Sequence[StoredObject]) -> None: ...

    def allocate_memory(self, key: bytes, size: int) -> Optional[Slot]: ...

    def adopt_memory(self, key: bytes, slot: Slot, checksum: int, meta: ObjectMeta) -> str: ...

    def free_memory(self, slots: Sequence[Slot]) -> None: ...


class _Made(NamedTuple):
    """What `RemoteTier.offer` made of a committed object for its write: the meta it
    packed, the trailer body, and (given the checksum) the whole trailer, valid for an
    object of `size` bytes with store checksum `checksum` that is not a kvsum64 blob."""

    meta: ObjectMeta
    body: bytes
    size: int = -1
    checksum: Optional[int] = None
    trailer: Optional[bytes] = None


@dataclass
class _Fill:
    key: bytes
    name: str
    size: int  # the remote object's bytes (trailer included)
    slot: Any  # a memory-tier slot of `size` bytes: the payload, then the trailer past it


TRAILER_ROOM = 512  # bytes the memory tier keeps past each object: most trailers fit (key + meta + 56)


def reserve_trailer_room(memory_tier: Tier) -> None:
    """Make a memory arena keep `TRAILER_ROOM` bytes past every object it allocates from
    now on (kvstore.tiers.arena), so the object and its trailer go as one range; at most
    a page per object, only with a remote tier."""
    if isinstance(memory_tier, ArenaTier):
        memory_tier.tail_room = max(memory_tier.tail_room, TRAILER_ROOM)


def object_ranges(key: bytes, meta: ObjectMeta, checksum: int, addr: int, size: int, room: int = 0,
                  body: Optional[bytes] = None, trailer: Optional[bytes] = None,
                  extent: Optional[memoryview] = None) -> tuple[tuple[tuple[int, int], ...], Any]:
    """The transfer ranges of one remote object (kvstore.remote.envelope): its `size`
    payload bytes at host address `addr`, with store checksum `checksum`, then its
    trailer; and the buffer (if any) that must live until the put has ended. `room`:
    how many bytes at `addr` may be written, the payload included (an arena slot's
    page-rounded extent, a staging buffer); when the trailer fits there it is written
    there and the object goes as one range. `body`: the trailer's key and meta part when
    already made (`offer` makes it). `trailer`: the whole trailer when already made
    (`offer` makes it) with the store checksum as the transfer checksum: used only when
    the bytes are not a kvsum64 blob (whose trailer records an xxh3 of its bytes, made
    here); it must be `encode_trailer(key, meta, size, checksum, checksum)`. `extent`:
    a writable memoryview of the `room` bytes at `addr` (`Tier.host_extent`), through
    which the blob header is read and the trailer written instead of ctypes calls.
    Kept lean (plain addresses and memoryviews, no tensor calls): it runs once per put,
    right after other transfers have flushed the caches, where every call costs several
    times what it does warm."""
    if extent is not None:
        prefix = extent[:PREFIX_BYTES] if size >= PREFIX_BYTES else b""
    else:
        prefix = ctypes.string_at(addr, min(size, PREFIX_BYTES))
    if prefix[:8] != BLOB_MAGIC or algorithm_of(prefix) == XXH3:  # the store's checksum is the transfer checksum
        if trailer is None:
            trailer = encode_trailer(key, meta, size, checksum, checksum, body)
    else:  # a kvsum64 blob: readers verify an xxh3 of its bytes
        data = extent[:size] if extent is not None else (ctypes.c_char * size).from_address(addr)
        trailer = encode_trailer(key, meta, size, checksum, transfer_checksum(memoryview(data).cast("B")), body)
    t = len(trailer)
    whole = size + t
    if room >= whole:
        if extent is not None:
            extent[size:whole] = trailer
        else:
            ctypes.memmove(addr + size, trailer, t)
        return ((addr, whole),), None
    tail = ctypes.create_string_buffer(trailer, t)
    return ((addr, size), (ctypes.addressof(tail), t)), tail


class RemoteTier:
    """The remote tier of `store` over `adapter` (module docstring). Thread-safe."""

    def __init__(self, store: StoreSeam, settings: RemoteSettings, adapter: RemoteAdapter) -> None:
        if not settings.timeout_s > 0:
            raise RemoteConfigError(f"remote_timeout must be > 0 seconds, got {settings.timeout_s!r}")
        self.store = store
        self.settings = settings
        self.adapter = adapter
        self.policy: RemotePolicy = parse_policy(settings.policy)
        self._counters: Counter = Counter()
        self._get_latency = _Latency()
        self._put_latency = _Latency()
        self._stat_lock = threading.Lock()
        self._queue: deque[bytes] = deque()
        # queued keys -> what offer made of them (`_Made`): it packs the meta to check that
        # it fits a trailer, and with the checksum makes the whole trailer; the writer
        # reuses those bytes when the object is still the one they describe
        self._queued: dict[bytes, _Made] = {}
        self._qcond = threading.Condition()
        self._stop = False
        self._writing = 0  # objects whose put has not ended
        self._thread: Optional[threading.Thread] = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="kvstore-remote-writer", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the writer (queued writes are dropped), then the adapter, whose running
        tasks end first. Call without the store's lock."""
        with self._qcond:
            self._stop = True
            self._qcond.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.adapter.close()

    def _count(self, name: str, n: int = 1) -> None:
        with self._stat_lock:
            self._counters[name] += n

    def _name(self, key: bytes) -> str:
        return remote_name(self.adapter.namespace, key)

    # ------------------------------------------------------------------ writes
    def offer(self, key: bytes, size: int, meta: ObjectMeta, checksum: Optional[int] = None) -> None:
        """A committed object: queue it for the remote tier when the policy says so.
        `checksum` (its store checksum, when the caller has it): the whole trailer is
        made now, off the write's path, for the writer to use when the object is not a
        kvsum64 blob (`object_ranges`)."""
        if not self.policy.should_write(size, meta):
            self._count("put_skipped_policy")
            return
        try:
            body = trailer_body(key, meta)
        except BadObject:  # key and meta too large for a trailer
            self._count("put_skipped_policy")
            return
        trailer = None if checksum is None else encode_trailer(key, meta, size, checksum, checksum, body)
        with self._qcond:
            if key in self._queued:
                return
            if len(self._queue) >= self.settings.queue_limit:
                self._count("put_queue_full")
                return
            self._queue.append(key)
            self._queued[key] = _Made(meta, body, size, checksum, trailer)
            self._qcond.notify()

    def pending(self) -> int:
        """Objects queued or being written now."""
        with self._qcond:
            return len(self._queue) + self._writing

    def _loop(self) -> None:
        while True:
            with self._qcond:
                while not self._queue and not self._stop:
                    self._qcond.wait()
                if self._stop:
                    return
                batch = [self._queue.popleft() for _ in range(min(self.settings.batch, len(self._queue)))]
                bodies = {k: self._queued.pop(k) for k in batch}
                self._writing += len(batch)
            try:
                self.write(batch, bodies)
            except Exception:  # never take the daemon down
                log.exception("remote write batch failed")
                self._count("put_errors", len(batch))
                self._written(len(batch))

    def _written(self, n: int) -> None:
        with self._qcond:
            self._writing -= n

    def write(self, keys: Sequence[bytes], bodies: Optional[dict[bytes, Any]] = None) -> None:
        """Write the committed objects among `keys` to the remote tier (one put task).
        `bodies`: what `offer` made, by key: a `_Made`, or a (meta, trailer body) pair;
        each is used only for an object that is still the one it describes."""
        if not self.adapter.reachable():
            self._count("put_skipped_unreachable", len(keys))
            self._written(len(keys))
            return
        s = self.store
        jobs = s.pin_objects(keys)  # [] once the store closed
        self._written(len(keys) - len(jobs))
        items: list[tuple[str, tuple[tuple[int, int], ...]]] = []  # (name, ranges)
        keep: list[Any] = []  # buffers that must live until the put has ended
        sent: list[StoredObject] = []
        for o in jobs:
            try:
                body = trailer = None
                made = bodies.get(o.key) if bodies else None
                if made is not None and (made[0] is o.meta or made[0] == o.meta):
                    body = made[1]
                    if isinstance(made, _Made) and made.size == o.size and made.checksum == o.checksum:
                        trailer = made.trailer
                ranges, bufs = self._put_ranges(o, s.tiers[o.tier], body, trailer)
            except (KVStoreError, OSError) as exc:
                log.warning("remote write of %r skipped: %s", o.key, exc)
                self._count("put_errors")
                self._unpin([o])
                continue
            items.append((self._name(o.key), ranges))
            keep.append(bufs)
            sent.append(o)
        if not items:
            return

        def settle(codes: Sequence[int], seconds: float) -> None:
            keep.clear()
            with self._stat_lock:
                self._put_latency.add(seconds)
            for o, code in zip(sent, codes):
                if code >= 0:
                    self._count("objects_written")
                    self._count("bytes_written", o.size)
                else:
                    self._count("put_errors")
                    self._count("errors")
            self._unpin(sent)

        late = lambda r: settle(r.codes, r.seconds)  # noqa: E731 - a put that outlived its wait
        if len(items) == 1 and len(items[0][1]) == 1:  # one object in one range (RemoteAdapter.put_one)
            name, ((addr, size),) = items[0]
            t0 = time.perf_counter()
            code = self.adapter.put_one(name, addr, size, self.settings.timeout_s, late)
            seconds = time.perf_counter() - t0
            if code == PENDING or code == TIMED_OUT:
                self._timed_out("put")
            if code != PENDING:
                settle((code,), seconds)
            return
        res = self.adapter.call("put", [PutItem(n, r) for n, r in items], self.settings.timeout_s, late)
        if res.timed_out:
            self._timed_out("put")
        if not res.pending:
            settle(res.codes, res.seconds)

    @staticmethod
    def _put_ranges(o: StoredObject, tier: Tier, body: Optional[bytes],
                    trailer: Optional[bytes] = None) -> tuple[tuple[tuple[int, int], ...], tuple[Any, ...]]:
        """The transfer ranges of pinned object `o` followed by its trailer, and the
        buffers that must live until the put has ended. One range when the bytes are in a
        memory arena whose slot has tail room for the trailer (written there: past the
        object, bytes no reader of the object sees) or were staged; else two. `body`,
        `trailer`: as `object_ranges` takes them."""
        host = tier.host_extent(o.slot)
        if host is not None:  # plain host memory: no tensor calls (object_ranges)
            if not o.verified and tier.checksum(o.slot) != o.checksum:
                raise BadObject(f"object {o.key!r} fails its checksum; not written to the remote tier")
            addr, extent = host
            ranges, tail = object_ranges(o.key, o.meta, o.checksum, addr, o.size, len(extent), body, trailer, extent)
            return ranges, (extent, tail)
        view = tier.view(o.slot)
        staged: Optional[torch.Tensor] = None
        if view is None or not view.is_cpu:  # a file or GPU tier: stage the bytes in host memory
            staged = torch.empty(o.size + MAX_TRAILER_BYTES, dtype=torch.uint8)
            tier.read_into(o.slot, staged)
            addr, room = staged.data_ptr(), staged.numel()
        else:  # an arena slot may be written up to its page-rounded extent (past the object: unseen)
            addr, room = view.data_ptr(), (o.slot.length if isinstance(tier, ArenaTier) else o.size)
        if not o.verified and tier.checksum(o.slot) != o.checksum:
            raise BadObject(f"object {o.key!r} fails its checksum; not written to the remote tier")
        ranges, tail = object_ranges(o.key, o.meta, o.checksum, addr, o.size, room, body, trailer)
        return ranges, (view, staged, tail)

    def _unpin(self, objs: Sequence[StoredObject]) -> None:
        self.store.unpin_objects(objs)
        self._written(len(objs))

    # ------------------------------------------------------------------ fills
    def fill(self, keys: Sequence[bytes]) -> int:
        """Bring the remote copies of `keys` (absent locally) into the memory tier, verified;
        returns how many now sit there. Never raises for remote trouble (counted)."""
        keys = list(dict.fromkeys(keys))
        if not keys:
            return 0
        if not self.adapter.reachable():
            self._count("lookups_skipped_unreachable", len(keys))
            return 0
        names = [self._name(k) for k in keys]
        res = self.adapter.call("stat", names, self.settings.timeout_s)
        if res.timed_out:
            self._timed_out("stat")
        if res.pending:
            return 0
        found: list[tuple[bytes, str, int]] = []
        for k, n, code in zip(keys, names, res.codes):
            if code == NOT_FOUND:
                self._count("misses")
            elif code < 0:
                self._count("errors")
            elif code <= FOOTER_BYTES:
                self._drop_corrupt(k, n, f"remote object of {k!r} is only {code} bytes")
            else:
                found.append((k, n, code))
        if not found:
            return 0
        s = self.store
        mem = s.memory_tier
        if mem is None:
            return 0
        plans: list[_Fill] = []
        for k, n, size in found:
            try:
                slot = s.allocate_memory(k, size)  # the payload, then the trailer past it
            except KVStoreError as exc:
                log.info("no memory-tier room for remote object %r: %s", k, exc)
                self._count("fill_no_room")
                continue
            if slot is not None:  # None: committed meanwhile, or the store closed
                plans.append(_Fill(k, n, size, slot))
        if not plans:
            return 0
        views = []
        for p in plans:  # (address, memoryview of the slot's extent); no tensor calls where the tier has them
            host = mem.host_extent(p.slot)
            if host is None:
                v = mem.view(p.slot)
                host = (v.data_ptr(), memoryview(v.numpy()))
            views.append(host)
        checks = [PayloadVerifier(ext[:p.size], p.key) for p, (_, ext) in zip(plans, views)]
        late = lambda r: self._free([p.slot for p in plans], views)  # noqa: E731 - a get that outlived its wait
        if len(plans) == 1:  # one object in one range: no item or result records (RemoteAdapter.get_one)
            t0 = time.perf_counter()
            code = self.adapter.get_one(plans[0].name, views[0][0], plans[0].size, self.settings.timeout_s,
                                        checks[0].landed, late)
            seconds = time.perf_counter() - t0
            codes: Sequence[int] = (code,)
            pending, timed_out = code == PENDING, code == PENDING or code == TIMED_OUT
        else:
            items = [GetItem(p.name, ((addr, p.size),), c.landed) for p, (addr, _), c in zip(plans, views, checks)]
            res = self.adapter.call("get", items, self.settings.timeout_s, late)
            codes, seconds, pending, timed_out = res.codes, res.seconds, res.pending, res.timed_out
        if timed_out:
            self._timed_out("get")
        if pending:
            return 0
        with self._stat_lock:
            self._get_latency.add(seconds)
        done: list[tuple[_Fill, RemoteHeader]] = []
        bad: list[_Fill] = []
        for p, check, code in zip(plans, checks, codes):
            if code != p.size:
                self._count("misses" if code == NOT_FOUND else "errors")
                bad.append(p)
                continue
            try:
                h = check.finish()  # what `landed` has not hashed yet, and the trailer
            except (BadObject, KVStoreError) as exc:
                self._drop_corrupt(p.key, p.name, str(exc))
                bad.append(p)
                continue
            done.append((p, h))
        self._free([p.slot for p in bad], ())
        return self._commit(done)

    def _commit(self, done: list[tuple[_Fill, RemoteHeader]]) -> int:
        """Adopt verified fills as objects of their payload's size (the trailer stays in
        the slot's tail, past the object, until the slot is freed)."""
        n = 0
        for p, h in done:
            f = p.slot  # the same slot, as an object of the payload's size (not dataclasses.replace: per fill)
            slot = Slot(f.tier, f.offset, f.length, h.payload_bytes, f.path)
            outcome = self.store.adopt_memory(p.key, slot, h.checksum, h.meta)
            if outcome == "closed":
                return n
            if outcome == "adopted":  # else filled or put meanwhile: that copy is kept
                self._count("hits")
                self._count("bytes_read", h.payload_bytes)
            n += 1
        return n

    def _free(self, slots: Sequence[Slot], views: Any) -> None:
        self.store.free_memory(slots)

    def _timed_out(self, what: str) -> None:
        """A remote call ran out of time: counted, and the store suspected (fail fast)."""
        self._count("timeouts")
        self._count("errors")
        self.adapter.suspect()
        log.info("remote %s timed out after %.2f s", what, self.settings.timeout_s)

    def _drop_corrupt(self, key: bytes, name: str, why: str) -> None:
        log.warning("%s; dropped from the remote tier, not served", why)
        self._count("corrupt_dropped")
        try:
            self.adapter.add_done_callback(self.adapter.submit_remove([name]), lambda r: None)
        except KVStoreError as exc:
            log.info("removing damaged remote object %s failed: %s", name, exc)

    # ------------------------------------------------------------------ figures
    def stats(self) -> dict[str, Any]:
        with self._stat_lock:
            c = dict(self._counters)
            get_lat, put_lat = self._get_latency.summary(), self._put_latency.summary()
        out: dict[str, Any] = {"url": self.settings.url, "enabled": True, "adapter": self.adapter.kind,
                               "policy": self.policy.name if not hasattr(self.policy, "min_cost_s")
                               else f"cost:{getattr(self.policy, 'min_cost_s'):g}",
                               "reachable": self.adapter.reachable(), "timeout_s": self.settings.timeout_s,
                               "pending_writes": self.pending()}
        for name in COUNTERS:
            out[name] = c.get(name, 0)
        out.update(self.adapter.stats())
        out["get_latency"], out["put_latency"] = get_lat, put_lat
        return out


def disabled_stats() -> dict[str, Any]:
    """The `remote` stats object of a daemon without a remote tier (same keys, zeros)."""
    out: dict[str, Any] = {"url": "", "enabled": False, "adapter": "", "policy": "", "reachable": False,
                           "timeout_s": 0.0, "pending_writes": 0, "reconnects": 0, "unreachable_fast_fails": 0}
    for name in COUNTERS:
        out[name] = 0
    empty = {"count": 0, "seconds_total": 0.0, "p50_s": 0.0, "p99_s": 0.0}
    out["get_latency"], out["put_latency"] = dict(empty), dict(empty)
    return out
