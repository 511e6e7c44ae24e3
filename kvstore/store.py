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

from typing import Any, Optional, Sequence

from kvstore.records import (  # noqa: F401  (re-exported: the Store API's records)
    TIER_NAMES,
    Lease,
    LookupEntry,
    ObjectInfo,
    ObjectMeta,
    Region,
    Reservation,
    StoreSettings,
)


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
