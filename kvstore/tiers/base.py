"""The storage-tier interface: one abstract class every tier (GPU arena, CPU shared-memory
arena, NVMe files, the fault-injecting wrapper) implements.

A tier stores byte objects in *slots*. It knows nothing of keys' meaning, leases, eviction
or the index: the Store decides what goes where and when; a tier only allocates space,
moves bytes in and out of it, and tells clients where the bytes lie (`region`).

Lifecycle of a slot (all calls made by the Store)::

    slot = tier.allocate(size, name)        # None: no room (the Store may evict and retry)
    ... bytes written: by a client in place through tier.region(slot), or by the Store
        through tier.write_from(slot, src) when it moves an object between tiers ...
    slot = tier.seal(slot, name)            # make the bytes durable/final; may change the slot
    ... tier.read_into / view / checksum / region, any number of times ...
    tier.free(slot)                         # exactly once, after the last reader is done

Contract, for every implementation:

Buffers. The tier owns the memory or files behind its slots; callers own `src`/`dst`
tensors passed to `write_from`/`read_into` and must keep them alive for the call. A
tensor returned by `view` aliases the tier's memory: valid until `free(slot)` or `close`.

Threading. `allocate`, `free`, `seal`, `open` and `close` are serialised by the caller (the
Store calls them under its lock). `read_into`, `write_from`, `view`, `checksum` and
`region` may be called from any thread, concurrently, on distinct slots, without the
Store's lock; the caller guarantees a slot is not freed while an I/O on it runs.

Failure. "No room" is not an error: `allocate` returns None. Any failure of the medium
(I/O error, full disk, fsync failure, an injected fault) raises `StorageError` naming the
tier, the operation and the slot. After a failed `write_from` or `seal` the slot is still
allocated and its content undefined: the caller frees it. `free` does not raise for a
live slot (a failed unlink is logged; startup garbage collection removes leftovers).

Durability. `durable` tiers (NVMe) survive a restart: after `seal` returns, the bytes are
fsync'ed and at their final path, and the Store records the slot in its index only then.
Memory tiers (`durable = False`) lose everything on close.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch

from kvstore.records import Region

if TYPE_CHECKING:
    from kvstore.objheader import ObjectHeader


@dataclass(frozen=True)
class Slot:
    """Where one object's bytes live inside a tier (tier-private; `Region` is the client view).

    `size` is the object's length in bytes; `length` the bytes reserved for it (page
    rounded in the arenas); `path` the file of a file-backed slot ("" otherwise).
    """

    tier: str
    offset: int
    length: int
    size: int
    path: str = ""


class Tier(ABC):
    """Abstract storage tier; see the module docstring for the contract."""

    #: "gpu" | "cpu" | "nvme"
    name: str = ""
    #: True when sealed slots survive a restart.
    durable: bool = False

    @property
    @abstractmethod
    def capacity(self) -> int:
        """Bytes this tier may hold in total."""

    @property
    @abstractmethod
    def used_bytes(self) -> int:
        """Bytes currently reserved by live slots (including unsealed ones)."""

    @abstractmethod
    def open(self) -> None:
        """Acquire the medium (map the arena, create directories). Called once."""

    @abstractmethod
    def close(self) -> None:
        """Release the medium. Non-durable tiers drop their content. Idempotent."""

    @abstractmethod
    def allocate(self, size: int, name: str) -> Optional[Slot]:
        """Reserve room for an object of `size` bytes; None when there is no room.

        `name` is a filesystem-safe, unique-per-object token (file tiers name the object
        after it). Raises StorageError when the medium fails.
        """

    @abstractmethod
    def free(self, slot: Slot) -> None:
        """Give a slot's room back. Exactly once per slot; never raises for a live slot."""

    @abstractmethod
    def seal(self, slot: Slot, name: str, header: Optional["ObjectHeader"] = None) -> Slot:
        """Make a written slot final (NVMe: write `header` after the bytes, fsync, rename
        into place, fsync the directory) and return the slot as it now is. Memory tiers
        ignore `header`; durable tiers store it so the index can be rebuilt from the
        medium (kvstore.objheader). Raises StorageError; the slot is then unsealed and
        still the caller's to free."""

    def retire(self, slot: Slot) -> None:
        """Durable tiers: mark a sealed slot as dropped while a reader still holds it (it
        is freed at the last unpin), so a crash before that does not bring the object
        back at the next open. Memory tiers: nothing to do."""

    def free_bytes(self) -> int:
        """Bytes an allocation may still take now (the NVMe tier also counts the file
        system's real free space)."""
        return self.capacity - self.used_bytes

    @abstractmethod
    def region(self, slot: Slot) -> Region:
        """Where a client on this host reads or writes the slot's `size` bytes."""

    @abstractmethod
    def read_into(self, slot: Slot, dst: torch.Tensor) -> None:
        """Copy the slot's `size` bytes into `dst` (a contiguous uint8 tensor of at least
        `slot.size` elements, on any device). Raises StorageError."""

    @abstractmethod
    def write_from(self, slot: Slot, src: torch.Tensor) -> None:
        """Copy `src` (a contiguous uint8 tensor of exactly `slot.size` elements, any
        device) into the slot. Raises StorageError."""

    def view(self, slot: Slot) -> Optional[torch.Tensor]:
        """A uint8 tensor aliasing the slot's bytes, for memory tiers; None for file tiers."""
        return None

    def host_extent(self, slot: Slot) -> Optional[tuple[int, memoryview]]:
        """`(address, bytes)`: the host address of the slot's first byte and a writable
        memoryview of its whole extent (`slot.length` bytes: the object's `size` bytes,
        then any room past them), both valid while the slot is allocated and the tier
        open; None where the slot's bytes are not plain memory of this process (file and
        device tiers, wrappers). Costs no tensor call, for per-object paths that run right
        after a transfer has flushed the caches (the remote tier)."""
        return None

    @abstractmethod
    def checksum(self, slot: Slot) -> int:
        """`kvstore.format.checksum` of the slot's `size` bytes. Raises StorageError."""

    def read_into_hashed(self, slot: Slot, dst: torch.Tensor) -> int:
        """`read_into` a host (CPU) tensor, then the checksum of the bytes as they landed
        in `dst`. Tiers that read in chunks override this to hash each chunk while the
        next ones are read (one pass). Raises StorageError."""
        self.read_into(slot, dst)
        from kvstore.checksums import host_checksum

        return host_checksum(memoryview(dst[: slot.size].numpy()))

    def list_sealed(self) -> list[Slot]:
        """Durable tiers: every sealed slot found on the medium at open (for garbage
        collection against the index). Memory tiers: []."""
        return []

    def adopt(self, slot: Slot) -> None:
        """Durable tiers: account a sealed slot found at open that the index still
        references (it then counts in used_bytes and is freed with `free`)."""
        raise NotImplementedError(f"tier {self.name!r} holds nothing across restarts")

    def discard_unsealed(self) -> int:
        """Durable tiers: delete leftovers of writes that never sealed (a crash mid-put);
        returns how many. Memory tiers: 0."""
        return 0

    def stats(self) -> dict[str, Any]:
        """Tier-specific figures for `Store.stats()` (at least capacity and used bytes)."""
        return {"name": self.name, "capacity_bytes": self.capacity, "used_bytes": self.used_bytes}


def check_tensor_arg(tier: str, op: str, t: torch.Tensor, min_len: int) -> None:
    """Validate a uint8 src/dst tensor for read_into/write_from."""
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() != 1 or not t.is_contiguous():
        raise TypeError(f"{tier}.{op} needs a contiguous 1-D uint8 tensor, got {getattr(t, 'dtype', type(t))}")
    if t.numel() < min_len:
        raise ValueError(f"{tier}.{op}: tensor of {t.numel()} bytes, slot needs {min_len}")
