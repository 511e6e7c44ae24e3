"""Records of the Store API: settings, regions, reservations, leases, object infos.

Plain frozen dataclasses shared by the Store, the tiers, the gRPC server and the client
library (kept apart from kvstore/store.py so tiers can name `Region` without importing
the Store). `kvstore.store` re-exports every name here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

VERIFY_MODES = ("always", "first")  # StoreSettings.verify_nvme
INDEX_RECOVERY_MODES = ("rebuild", "refuse")  # StoreSettings.index_recovery


@dataclass(frozen=True)
class StoreSettings:
    """Configuration of one Store (the daemon's config registry builds this)."""

    dir: Path  # cache directory: index.lmdb and objects/ live here
    cpu_capacity: int  # bytes of the shared-memory arena (0 = no CPU tier)
    nvme_capacity: int  # bytes of object files allowed under dir/objects (0 = no NVMe tier)
    gpu_capacity: int = 0  # bytes of the CUDA arena; 0 = no GPU tier (also none without CUDA)
    shm_name: str = "kvstore"  # the arena file is /dev/shm/<shm_name>.<random>.arena (derive it from the socket path)
    lease_ttl_s: float = 30.0  # leases and reservations expire this long after their last renew
    eviction: str = "cost"  # "lru" | "cost"
    default_tier: str = "cpu"  # a name in kvstore.tiers.registry.TIERS (checked by the Store)
    writeback_on_close: bool = False  # on close, copy CPU-only objects down to NVMe
    # Keep CPU-tier bytes without an NVMe copy at or below this share of the CPU tier:
    # a background thread writes the coldest ones back ahead of need, so making room
    # never writes under the lock (kvstore.writeback). 1: off.
    writeback_watermark: float = 0.5
    # When a get serves an object from NVMe, check its checksum: "always" (every get;
    # free when the hit is promoted, since the promoted copy is hashed in memory) or
    # "first" (only the first read since the daemon opened the object's record).
    verify_nvme: str = "always"
    # Commit hashes memory-tier (cpu/gpu) objects of up to this many bytes in full and
    # rejects a mismatch at once. Larger ones are committed unverified and hashed in full
    # before they are first served (a get) or copied to another tier; a mismatch then
    # drops them (`corrupt_dropped`). NVMe commits are always hashed in full (they are
    # made durable). -1: hash every commit in full.
    commit_verify_max_bytes: int = 1 << 20
    # The remote tier (kvstore.remote): its URL ("" = none), which objects it receives
    # (all | none | cost:SECONDS) and the bound on every remote wait, in seconds.
    remote_url: str = ""
    remote_policy: str = "all"
    remote_timeout_s: float = 2.0
    # A damaged LMDB index (truncated, not LMDB, unreadable) found at open: "rebuild" it
    # from the object files' headers (the old one is moved aside), or "refuse" to start
    # with one line naming the damage and `kvstore repair --dir DIR`.
    index_recovery: str = "rebuild"
    # Memory-tier (cpu/gpu) objects: "commit" checksums them once (at commit, or at the
    # first get when committed unverified); "always" also before every get, so bytes a
    # client changed in shared memory after commit are caught before they are served.
    verify_memory: str = "commit"
    arena_mode: int = 0o600  # file mode of the CPU arena (0o640 / 0o660 share it with the group)
    max_key_bytes: int = 511  # longest key (LMDB's limit: the NVMe tier's index)

    def validate(self) -> None:
        """InvalidRequest naming the first bad setting."""
        from kvstore.errors import InvalidRequest

        for name in ("cpu_capacity", "nvme_capacity", "gpu_capacity"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise InvalidRequest(f"{name} must be an int >= 0 bytes, got {v!r}")
        if self.verify_nvme not in VERIFY_MODES:
            raise InvalidRequest(f"verify_nvme must be one of {VERIFY_MODES}, got {self.verify_nvme!r}")
        if self.index_recovery not in INDEX_RECOVERY_MODES:
            raise InvalidRequest(f"index_recovery must be one of {INDEX_RECOVERY_MODES}, got {self.index_recovery!r}")
        if self.verify_memory not in ("commit", "always"):
            raise InvalidRequest(f"verify_memory must be 'commit' or 'always', got {self.verify_memory!r}")
        if self.arena_mode not in (0o600, 0o640, 0o660):
            raise InvalidRequest(f"arena_mode must be 0600, 0640 or 0660, got {self.arena_mode:o}")
        if not 1 <= self.max_key_bytes <= 511:
            raise InvalidRequest(f"max_key_bytes must be 1..511 (the index's key limit), got {self.max_key_bytes}")
        if not self.lease_ttl_s > 0:
            raise InvalidRequest(f"lease_ttl_s must be > 0, got {self.lease_ttl_s!r}")
        if not 0.0 <= self.writeback_watermark <= 1.0:
            raise InvalidRequest(f"writeback_watermark must be in [0, 1], got {self.writeback_watermark!r}")


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

    def __init__(self, key: bytes, hit: bool, tier: Optional[str], size: int) -> None:
        # Hand-written: the generated __init__ of a frozen dataclass goes through
        # object.__setattr__ per field, ~4x slower, and a Lookup builds one per key on
        # both ends of the wire (the lookup latency target is per 64-key batch).
        d = self.__dict__
        d["key"] = key
        d["hit"] = hit
        d["tier"] = tier
        d["size"] = size


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
    path: str = ""  # where the primary copy lies: the NVMe object file or the shm arena file
    offset: int = 0  # byte offset of the object in `path` (arenas)
    backed: bool = False  # an NVMe backing copy exists (the object survives a restart)
