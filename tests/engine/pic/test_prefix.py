"""PrefixTree: segment-granular matching, LRU eviction of unpinned leaves by bytes."""
from __future__ import annotations

import torch

from engine.pic.prefix import BoundaryCheckpoint, PrefixTree


def cp(start: int, end: int, nbytes: int) -> BoundaryCheckpoint:
    return BoundaryCheckpoint(start, end, kv={0: (torch.zeros(nbytes // 8), torch.zeros(nbytes // 8))})


def test_match_follows_whole_segments_only():
    tree = PrefixTree(1 << 20)
    a = tree.insert(tree.root, (1, 2), cp(0, 2, 64))
    tree.insert(a, (3,), cp(2, 3, 64))
    assert [n.edge for n in tree.match([(1, 2), (3,), (4,)])] == [(1, 2), (3,)]
    assert tree.match([(1,), (2, 3)]) == []  # same tokens, other boundaries: no match
    assert tree.stats()["hit_tokens"] == 3


def test_eviction_takes_the_least_recently_used_unpinned_leaf():
    tree = PrefixTree(3 * 64)
    a = tree.insert(tree.root, (1,), cp(0, 1, 64))
    b = tree.insert(a, (2,), cp(1, 2, 64))
    c = tree.insert(tree.root, (3,), cp(0, 1, 64))
    tree.match([(3,)])  # c is now more recent than b
    b.pins += 1
    d = tree.insert(tree.root, (4,), cp(0, 1, 64))  # b is pinned and a has a child: c goes
    assert d is not None and (3,) not in tree.root.children and tree.stats()["evictions"] == 1
    b.pins -= 1
    tree.insert(tree.root, (5,), cp(0, 1, 64))  # now b (oldest leaf) goes
    assert (2,) not in a.children and tree.bytes == 3 * 64


def test_a_checkpoint_larger_than_the_tree_is_not_kept():
    tree = PrefixTree(100)
    assert tree.insert(tree.root, (1,), cp(0, 1, 256)) is None
    assert tree.stats()["nodes"] == 0


def test_clear_drops_every_unpinned_branch_and_keeps_pinned_ones():
    tree = PrefixTree(1 << 20)
    a = tree.insert(tree.root, (1,), cp(0, 1, 64))
    tree.insert(a, (2,), cp(1, 2, 64))
    c = tree.insert(tree.root, (3,), cp(0, 1, 64))
    c.pins += 1  # a live request's path stays
    assert tree.clear() == 2
    assert list(tree.root.children) == [(3,)] and tree.bytes == 64 and tree.stats()["nodes"] == 1
    c.pins -= 1
    assert tree.clear() == 1 and tree.bytes == 0 and tree.stats()["nodes"] == 0
