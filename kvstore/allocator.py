"""Extent allocator for the arenas (CPU shared memory, GPU): best-fit over 4 KiB pages
with coalescing free lists.

The allocator only does arithmetic on offsets; it never touches memory. An arena of
`capacity` bytes is split into extents whose offsets and lengths are multiples of
`page_size`. `allocate(n)` takes the smallest free extent that fits `align_up(n)` (lowest
offset among equals, so allocations pack toward the start) and splits it; `free` returns
an extent and merges it with free neighbours, so freeing everything always gives back one
extent of the whole capacity.

Complexity: free extents are kept in two sorted lists (by offset, for coalescing; by
(length, offset), for best fit), so allocate and free are O(log n) searches plus O(n)
memmoves in C, with n the number of *free* extents (small in practice).

Not thread-safe: the owner (an arena, under the Store's lock) serialises calls.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from kvstore.errors import InvalidRequest

PAGE_SIZE = 4096


@dataclass(frozen=True, order=True)
class Extent:
    """A run of bytes [offset, offset + length) inside one arena."""

    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True)
class AllocatorStats:
    capacity: int
    used: int
    free: int
    allocations: int
    free_extents: int
    largest_free: int

    @property
    def fragmentation(self) -> float:
        """1 - largest free extent / free bytes: 0 when free space is one extent."""
        return 0.0 if self.free == 0 else 1.0 - self.largest_free / self.free


class ExtentAllocator:
    """Best-fit, coalescing allocator of page-aligned extents in [0, capacity)."""

    def __init__(self, capacity: int, page_size: int = PAGE_SIZE) -> None:
        if page_size <= 0 or page_size & (page_size - 1):
            raise InvalidRequest(f"page_size must be a power of two, got {page_size}")
        if capacity < 0:
            raise InvalidRequest(f"allocator capacity must be >= 0, got {capacity}")
        self.page_size = page_size
        self.capacity = capacity // page_size * page_size
        self._free_offs: list[int] = []  # sorted offsets of free extents
        self._free_len: dict[int, int] = {}  # offset -> length of each free extent
        self._by_size: list[tuple[int, int]] = []  # sorted (length, offset) of free extents
        self._allocated: dict[int, int] = {}  # offset -> length of each live allocation
        self._used = 0
        if self.capacity:
            self._add_free(0, self.capacity)

    def round_up(self, n: int) -> int:
        return (n + self.page_size - 1) // self.page_size * self.page_size

    # -- free-list bookkeeping -------------------------------------------------------
    def _add_free(self, off: int, length: int) -> None:
        bisect.insort(self._free_offs, off)
        self._free_len[off] = length
        bisect.insort(self._by_size, (length, off))

    def _remove_free(self, off: int) -> int:
        length = self._free_len.pop(off)
        del self._free_offs[bisect.bisect_left(self._free_offs, off)]
        del self._by_size[bisect.bisect_left(self._by_size, (length, off))]
        return length

    # -- public API ------------------------------------------------------------------
    def allocate(self, size: int) -> Extent | None:
        """Reserve `size` bytes (rounded up to pages); None when no free extent fits."""
        if size <= 0:
            raise InvalidRequest(f"allocation size must be > 0, got {size}")
        need = self.round_up(size)
        i = bisect.bisect_left(self._by_size, (need, -1))
        if i == len(self._by_size):
            return None
        length, off = self._by_size[i]
        self._remove_free(off)
        if length > need:
            self._add_free(off + need, length - need)
        self._allocated[off] = need
        self._used += need
        return Extent(off, need)

    def free(self, extent: Extent) -> None:
        """Return an extent from `allocate`; merges with free neighbours.

        Raises InvalidRequest for an extent that is not a live allocation (double free).
        """
        if self._allocated.get(extent.offset) != extent.length:
            raise InvalidRequest(f"free of {extent} which is not a live allocation (double free?)")
        del self._allocated[extent.offset]
        self._used -= extent.length
        off, length = extent.offset, extent.length
        i = bisect.bisect_left(self._free_offs, off)
        if i > 0:
            prev = self._free_offs[i - 1]
            if prev + self._free_len[prev] == off:
                length += self._remove_free(prev)
                off = prev
        nxt = off + length
        if nxt in self._free_len:
            length += self._remove_free(nxt)
        self._add_free(off, length)

    def is_allocated(self, extent: Extent) -> bool:
        return self._allocated.get(extent.offset) == extent.length

    def largest_free(self) -> int:
        return self._by_size[-1][0] if self._by_size else 0

    @property
    def used(self) -> int:
        return self._used

    @property
    def free_bytes(self) -> int:
        return self.capacity - self._used

    def stats(self) -> AllocatorStats:
        return AllocatorStats(
            capacity=self.capacity,
            used=self._used,
            free=self.capacity - self._used,
            allocations=len(self._allocated),
            free_extents=len(self._free_offs),
            largest_free=self.largest_free(),
        )

    def check_invariants(self) -> None:
        """Assert the free lists and allocations tile [0, capacity) exactly (for tests)."""
        spans = sorted([(o, l, "free") for o, l in self._free_len.items()] +
                       [(o, l, "used") for o, l in self._allocated.items()])
        cursor = 0
        prev_kind = None
        for off, length, kind in spans:
            assert off == cursor, f"gap or overlap at {cursor}: next span starts at {off}"
            assert length > 0 and off % self.page_size == 0 and length % self.page_size == 0
            assert not (kind == "free" and prev_kind == "free"), f"uncoalesced free extents at {off}"
            cursor = off + length
            prev_kind = kind
        assert cursor == self.capacity, f"spans end at {cursor}, capacity {self.capacity}"
        assert sorted(self._by_size) == self._by_size and len(self._by_size) == len(self._free_offs)
        assert self._used == sum(self._allocated.values())
