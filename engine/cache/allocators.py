"""Index allocators behind the caches: `BlockAllocator` hands out paged-KV block ids with
reference counts (so a block can be shared, e.g. by prefix caching, and is returned to the
free list only when its last owner lets go); `SlotAllocator` hands out per-request slots
(state slots of linear layers and window rings of SWA layers share one slot index)."""
from __future__ import annotations

from collections import deque

from engine.errors import CacheError, CacheFullError


class BlockAllocator:
    """Reference-counted pool of block ids `0..num_blocks-1`."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise CacheError(f"num_blocks={num_blocks} must be >= 0")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def refcount(self, block: int) -> int:
        self._check(block)
        return self._refs[block]

    def allocate(self, n: int) -> list[int]:
        """n fresh blocks with refcount 1; all or nothing."""
        if n < 0:
            raise CacheError(f"cannot allocate n={n} blocks")
        if n > len(self._free):
            raise CacheFullError(f"need {n} KV blocks, only {len(self._free)} of {self.num_blocks} free")
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            self._refs[b] = 1
        return out

    def incref(self, blocks: list[int]) -> None:
        for b in blocks:
            self._check(b)
            if self._refs[b] == 0:
                raise CacheError(f"block {b} is free; cannot share it")
        for b in blocks:
            self._refs[b] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; blocks reaching 0 return to the free list."""
        for b in blocks:
            self._check(b)
            if self._refs[b] == 0:
                raise CacheError(f"block {b} freed twice")
        for b in blocks:
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)

    def _check(self, block: int) -> None:
        if not 0 <= block < self.num_blocks:
            raise CacheError(f"block id {block} out of range [0, {self.num_blocks})")


class SlotAllocator:
    """Pool of slot indices `0..num_slots-1`, each owned by at most one request."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise CacheError(f"num_slots={num_slots} must be >= 1")
        self.num_slots = num_slots
        self._free: deque[int] = deque(range(num_slots))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise CacheFullError(f"all {self.num_slots} request slots are in use")
        s = self._free.popleft()
        self._used.add(s)
        return s

    def free(self, slot: int) -> None:
        if slot not in self._used:
            raise CacheError(f"slot {slot} is not allocated")
        self._used.remove(slot)
        self._free.append(slot)
