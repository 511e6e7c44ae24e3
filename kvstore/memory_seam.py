"""The Store's seam to its remote tier (kvstore.remote.tier.RemoteTier, whose StoreSeam
protocol this implements): read committed objects out (pinned, outside the lock) and fill
remote hits into the memory tier. The Store builds one over its own lock, object map
(kvstore.placement.Placement) and tiers; each call takes that lock itself, and all of
them are no-ops (None / [] / "closed") once the store is closed."""
from __future__ import annotations

import threading
import time
from typing import Callable, Optional, Sequence

from kvstore.placement import Placement, StoredObject, object_name
from kvstore.records import ObjectMeta
from kvstore.tiers.base import Slot, Tier
from kvstore.tiers.registry import TierRoles


class MemorySeam:
    """The remote tier's calls on one Store (module docstring); thread-safe."""

    def __init__(self, lock: threading.Lock, place: Placement, tiers: dict[str, Tier],
                 roles: Callable[[], TierRoles], is_open: Callable[[], bool]) -> None:
        self._lock, self._place, self.tiers = lock, place, tiers
        self._roles, self._is_open = roles, is_open

    @property
    def memory_tier(self) -> Optional[Tier]:
        """The memory tier (`roles.memory`: remote hits land there), None without one."""
        name = self._roles().memory
        return self.tiers.get(name) if name is not None else None

    def pin_objects(self, keys: Sequence[bytes]) -> list[StoredObject]:
        """Pin the committed objects among `keys` against moves and frees, so their
        bytes can be read outside the lock (`tiers[o.tier]`, `o.slot`); absent keys are
        left out; [] when closed. Give each back with `unpin_objects`."""
        with self._lock:
            if not self._is_open():
                return []
            out = []
            for k in keys:
                o = self._place.objects.get(k)
                if o is not None and not o.removed:
                    o.busy += 1
                    out.append(o)
            return out

    def unpin_objects(self, objs: Sequence[StoredObject]) -> None:
        """End `pin_objects` pins (a dropped object's slot is freed at its last pin)."""
        with self._lock:
            for o in objs:
                o.busy -= 1
                if self._is_open():
                    self._place.release_slot_if_unpinned(o)

    def allocate_memory(self, key: bytes, size: int) -> Optional[Slot]:
        """A memory-tier slot of `size` bytes to fill `key`'s bytes into, making room
        as a put would; None when closed, without a memory tier, or when `key` is
        already committed. KVStoreError (CapacityExhausted) when no room can be made.
        The slot ends in `adopt_memory` or `free_memory`."""
        with self._lock:
            name = self._roles().memory
            if not self._is_open() or name is None or key in self._place.objects:
                return None
            return self._place.allocate(name, size, key)

    def adopt_memory(self, key: bytes, slot: Slot, checksum: int, meta: ObjectMeta) -> str:
        """Commit a filled `allocate_memory` slot, whose bytes the caller has checked
        hash to `checksum`, as `key`'s verified memory-tier object: "adopted"; "exists"
        when `key` was committed meanwhile (the slot is freed, that object kept);
        "closed" when the store closed (nothing done)."""
        with self._lock:
            t = self.memory_tier
            if not self._is_open() or t is None:
                return "closed"
            if key in self._place.objects:
                t.free(slot)
                return "exists"
            slot = t.seal(slot, object_name(key))
            now = time.time()
            self._place.objects[key] = StoredObject(key, self._roles().memory, slot, checksum, meta, now, now,
                                                    verified=True)
            return "adopted"

    def free_memory(self, slots: Sequence[Slot]) -> None:
        """Give `allocate_memory` slots back unused (nothing once closed)."""
        with self._lock:
            t = self.memory_tier
            if self._is_open() and t is not None:
                for slot in slots:
                    t.free(slot)
