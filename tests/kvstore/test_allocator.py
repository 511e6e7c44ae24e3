"""ExtentAllocator: best fit, alignment, coalescing, accounting, bad frees."""

import random

import pytest

from kvstore.allocator import PAGE_SIZE, Extent, ExtentAllocator
from kvstore.errors import InvalidRequest


def test_allocations_are_page_aligned_and_rounded_up():
    a = ExtentAllocator(16 * PAGE_SIZE)
    e1 = a.allocate(1)
    e2 = a.allocate(PAGE_SIZE + 1)
    assert e1 == Extent(0, PAGE_SIZE) and e2 == Extent(PAGE_SIZE, 2 * PAGE_SIZE)
    assert a.used == 3 * PAGE_SIZE
    a.check_invariants()


def test_exhaustion_returns_none_and_frees_make_room():
    a = ExtentAllocator(4 * PAGE_SIZE)
    es = [a.allocate(PAGE_SIZE) for _ in range(4)]
    assert a.allocate(1) is None
    a.free(es[2])
    assert a.allocate(PAGE_SIZE) == es[2]


def test_best_fit_picks_the_smallest_hole_that_fits():
    a = ExtentAllocator(32 * PAGE_SIZE)
    big = a.allocate(8 * PAGE_SIZE)
    sep1 = a.allocate(PAGE_SIZE)
    small = a.allocate(2 * PAGE_SIZE)
    sep2 = a.allocate(PAGE_SIZE)
    a.free(big)  # hole of 8 pages at 0
    a.free(small)  # hole of 2 pages at 9
    e = a.allocate(2 * PAGE_SIZE)
    assert e.offset == small.offset  # the 2-page hole, not the 8-page one
    assert sep1 and sep2
    a.check_invariants()


def test_freeing_everything_coalesces_back_to_one_extent():
    a = ExtentAllocator(64 * PAGE_SIZE)
    rng = random.Random(1)
    live = []
    for _ in range(2000):
        if live and rng.random() < 0.45:
            a.free(live.pop(rng.randrange(len(live))))
        else:
            e = a.allocate(rng.randint(1, 5 * PAGE_SIZE))
            if e is not None:
                live.append(e)
        a.check_invariants()
    for e in live:
        a.free(e)
    s = a.stats()
    assert s.free_extents == 1 and s.largest_free == a.capacity and s.used == 0 and s.fragmentation == 0.0


def test_fragmentation_stat_reflects_split_free_space():
    a = ExtentAllocator(4 * PAGE_SIZE)
    es = [a.allocate(PAGE_SIZE) for _ in range(4)]
    a.free(es[0])
    a.free(es[2])
    s = a.stats()
    assert s.free == 2 * PAGE_SIZE and s.largest_free == PAGE_SIZE and s.fragmentation == 0.5
    assert a.allocate(2 * PAGE_SIZE) is None  # free bytes suffice, no single extent does


def test_double_free_and_bad_sizes_are_invalid_requests():
    a = ExtentAllocator(4 * PAGE_SIZE)
    e = a.allocate(10)
    a.free(e)
    with pytest.raises(InvalidRequest, match="double free"):
        a.free(e)
    with pytest.raises(InvalidRequest, match="> 0"):
        a.allocate(0)
    with pytest.raises(InvalidRequest, match="power of two"):
        ExtentAllocator(100, page_size=3)
