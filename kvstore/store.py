"""The in-process core of the kvstore daemon: `Store` owns the tiers, the index, the
leases and reservations, and object movement between tiers.

The gRPC server (kvstore/server/) is a thin shell over one `Store`; it calls it from a
thread pool, so every public method is thread-safe. Objects are opaque bytes plus a
checksum (`kvstore.format.checksum`); the tensor blob format is a client convention.

Lifecycle of a put (bulk bytes never pass through the Store's API):
    res = store.reserve(key, size, "cpu", meta)      # status "reserved" -> write into res.region
    ... client writes its bytes in place (shm file / object file / CUDA IPC) ...
    store.commit(res.reservation_id, checksum)        # verified in place, then visible
A get pins:  leases = store.get([key], client_id) -> read lease.region -> store.release([id]).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

TIER_NAMES = ("gpu", "cpu", "nvme")  # fastest first; demotion goes left to right


@dataclass(frozen=True)
class StoreSettings:
    """Configuration of one Store (the daemon's config registry builds this)."""

    dir: Path  # cache directory: index.lmdb and objects/ live here
    cpu_capacity: int  # bytes of the shared-memory arena (0 = no CPU tier)
    nvme_capacity: int  # bytes of object files allowed under dir/objects (0 = no NVMe tier)
    gpu_capacity: int = 0  # bytes of the CUDA arena; 0 = no GPU tier (also none without CUDA)
    shm_name: str = "kvstore"  # the arena file is /dev/shm/<shm_name>.arena (derive it from the socket path)
    lease_ttl_s: float = 30.0  # leases and reservations expire this long after their last renew
    eviction: str = "cost"  # "lru" | "cost"
    default_tier: str = "cpu"
    writeback_on_close: bool = False  # on close, copy CPU-only objects down to NVMe


@dataclass(frozen=True)
class Region:
    """Where an object's bytes lie, for a client on the same host.

    kind "shm": `path` is the arena file under /dev/shm; map it (once) and use
    [offset, offset + length). kind "file": `path` is an object file; pread/pwrite
    [offset, offset + length). kind "cuda_ipc": `handle` is the pickled CUDA IPC handle
    of the daemon's GPU arena (see kvstore/tiers/gpu_arena.py); `offset`/`length` are
    within that allocation; `path` is "".
    """

    kind: str
    path: str
    offset: int
    length: int
    handle: bytes = b""


@dataclass(frozen=True)
class ObjectMeta:
    """What the putter says about an object; stored with it and returned on get."""

    fingerprint: str = ""
    token_count: int = 0
    cost: float = 0.0  # seconds of recompute a hit saves (the cost-aware policy weighs it)
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class LookupEntry:
    """One key's presence: which tier holds it (None on a miss) and its size in bytes."""

    key: bytes
    hit: bool
    tier: Optional[str]
    size: int


@dataclass(frozen=True)
class Reservation:
    """The answer to `reserve`.

    status "reserved": write exactly `region.length` bytes into `region`, then `commit`
    (or `abort`). "exists": the key is committed already; nothing to write, no commit.
    "in_flight": another client is writing the key now; nothing to write, no commit;
    `wait_for(key)` blocks until it lands. For the last two, `reservation_id` is 0.
    """

    reservation_id: int
    key: bytes
    tier: str
    region: Optional[Region]
    status: str
    expires_at: float = 0.0  # time.monotonic() on the daemon host


@dataclass(frozen=True)
class Lease:
    """A pinned object: its bytes stay at `region` until release or `expires_at` passes."""

    lease_id: int
    key: bytes
    tier: str
    region: Region
    size: int
    checksum: int
    expires_at: float  # time.monotonic() on the daemon host (CLOCK_MONOTONIC, shared by local processes)
    meta: ObjectMeta


@dataclass(frozen=True)
class ObjectInfo:
    """A committed object's record, as `list_objects` and `object_info` report it."""

    key: bytes
    tier: str
    size: int
    checksum: int
    meta: ObjectMeta
    hits: int
    last_access: float
    created: float
    leases: int = 0


class Store:
    """The tiered object store. Thread-safe; see the module docstring for the put/get flow."""

    def __init__(self, settings: StoreSettings) -> None:
        """Validate settings; allocate nothing until `open`."""
        raise NotImplementedError

    def open(self) -> None:
        """Create/map the tiers, open the LMDB index and rebuild the NVMe tier from it
        (records whose file is missing or short are dropped and counted; orphan files from
        a crash between write and index commit are deleted)."""
        raise NotImplementedError

    def close(self) -> None:
        """Abort open reservations, optionally write the CPU tier back to NVMe, flush and
        close the index, unmap and unlink the arenas. Idempotent."""
        raise NotImplementedError

    def lookup(self, keys: Sequence[bytes]) -> list[LookupEntry]:
        """Presence of each key (no pin, no hit counting, no movement)."""
        raise NotImplementedError

    def reserve(self, key: bytes, size: int, tier: str, meta: ObjectMeta, client_id: str = "") -> Reservation:
        """Reserve `size` bytes in `tier` for `key` (see Reservation for the statuses).

        Makes room by demoting/evicting unleased objects per the eviction policy. Raises
        CapacityExhausted (naming the tier, the size and what is free) when no room can be
        made, InvalidRequest for size <= 0, a size over the tier's capacity, an unknown or
        absent tier, or an empty key.
        """
        raise NotImplementedError

    def commit(self, reservation_id: int, checksum: int) -> LookupEntry:
        """Verify the reserved bytes hash to `checksum` and make the object visible.

        NVMe: the file is fsync'ed and renamed before the index txn commits. On mismatch
        raises BadObject and frees the space; unknown/expired id -> UnknownKey.
        """
        raise NotImplementedError

    def abort(self, reservation_id: int) -> None:
        """Drop a reservation and free its space; waiters on its key are woken (False)."""
        raise NotImplementedError

    def wait_for(self, key: bytes, timeout_s: float) -> bool:
        """Block until `key` is committed (True) or its in-flight put is aborted, or the
        timeout passes (False). Returns at once when the key is already present."""
        raise NotImplementedError

    def get(self, keys: Sequence[bytes], client_id: str, promote: bool = True) -> list[Optional[Lease]]:
        """Pin each present key with a lease (None for a miss); counts hits and misses.

        With `promote`, a hit below the top tier may be moved up first (an NVMe hit to the
        CPU arena) when room can be made without touching leased objects. An NVMe object's
        checksum is verified on its first read since open; a bad one is dropped, counted
        in `corrupt_dropped` and reported as a miss.
        """
        raise NotImplementedError

    def release(self, lease_ids: Sequence[int]) -> None:
        """Unpin. Unknown or expired lease ids are ignored (release is idempotent)."""
        raise NotImplementedError

    def renew(self, client_id: str) -> None:
        """Extend every lease and reservation of `client_id` by lease_ttl_s."""
        raise NotImplementedError

    def delete(self, keys: Sequence[bytes]) -> int:
        """Delete the keys that are present and unleased; returns how many were deleted.
        A leased key is left in place."""
        raise NotImplementedError

    def prefetch(self, keys: Sequence[bytes], tier: str) -> int:
        """Move present keys up to `tier` where room can be made; returns how many now
        sit in `tier` or above."""
        raise NotImplementedError

    def evict_tier(self, tier: str) -> int:
        """Demote every unleased object out of `tier` to the next tier down
        (gpu -> cpu -> nvme -> dropped); returns how many objects left the tier."""
        raise NotImplementedError

    def stats(self) -> dict[str, Any]:
        """{"tiers": [{"name", "capacity_bytes", "used_bytes", "objects", ...}], "hits",
        "misses", "evictions", "demotions", "promotions", "leases", "reservations",
        "corrupt_dropped", ...}."""
        raise NotImplementedError

    def list_objects(
        self,
        fingerprint: Optional[str] = None,
        prefix: Optional[bytes] = None,
        tier: Optional[str] = None,
        limit: Optional[int] = None,
    ) -> list[ObjectInfo]:
        """Committed objects matching every given filter, most-hit first."""
        raise NotImplementedError

    def object_info(self, key: bytes) -> ObjectInfo:
        """The record of one committed object; UnknownKey when absent."""
        raise NotImplementedError

    def expire(self, now: Optional[float] = None) -> None:
        """Expire leases and reservations whose time has passed (the server calls this
        periodically; `now` defaults to time.monotonic())."""
        raise NotImplementedError
