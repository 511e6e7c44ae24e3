"""What the two memory arenas (GPU, CPU shared memory) share: one contiguous uint8
buffer split into slots by ExtentAllocator, a slot's bytes being [offset, offset + size)
of that buffer. Sealing is a no-op by default (the bytes are already in place).
`tail_room` (0 unless set) makes every allocation reserve that many bytes past the
object (within the slot's page-rounded `length`, never part of the object): the remote
tier sets it on the memory tier so that it can append its envelope trailer in place and
send an object as one range (kvstore.remote.tier)."""

from __future__ import annotations

from abc import abstractmethod
from typing import Any, Optional

import torch

from kvstore.allocator import Extent, ExtentAllocator
from kvstore.errors import InvalidRequest
from kvstore.objheader import ObjectHeader
from kvstore.tiers.base import Slot, Tier


class ArenaTier(Tier):
    """A Tier over one buffer carved by ExtentAllocator. Subclasses own the buffer (`open`
    sets `self._base`, `close` clears it) and define `_require_open`, `region`, the copies
    and `checksum`; `stats` adds their own figures to `super().stats()`."""

    durable = False

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise InvalidRequest(f"{self.name} arena capacity must be > 0 bytes, got {capacity}")
        self._alloc = ExtentAllocator(capacity)
        self._base: Optional[torch.Tensor] = None
        #: bytes every new slot reserves past its object (module docstring)
        self.tail_room = 0

    @property
    def capacity(self) -> int:
        return self._alloc.capacity

    @property
    def used_bytes(self) -> int:
        return self._alloc.used

    @abstractmethod
    def _require_open(self) -> torch.Tensor:
        """The whole buffer; StorageError naming the arena when it is not open."""

    def allocate(self, size: int, name: str) -> Optional[Slot]:
        self._require_open()
        ext = self._alloc.allocate(size + self.tail_room)
        return None if ext is None else Slot(self.name, ext.offset, ext.length, size)

    def free(self, slot: Slot) -> None:
        self._alloc.free(Extent(slot.offset, slot.length))

    def seal(self, slot: Slot, name: str, header: Optional[ObjectHeader] = None) -> Slot:
        return slot

    def view(self, slot: Slot) -> torch.Tensor:
        return self._require_open()[slot.offset : slot.offset + slot.size]

    def stats(self) -> dict[str, Any]:
        s = self._alloc.stats()
        return {
            "name": self.name,
            "capacity_bytes": s.capacity,
            "used_bytes": s.used,
            "free_extents": s.free_extents,
            "largest_free_bytes": s.largest_free,
            "fragmentation": round(s.fragmentation, 4),
        }
