"""CacheManager and its allocators: ownership, on-demand blocks, addressing, and errors."""
from __future__ import annotations

import pytest
import torch

from engine.cache.allocators import BlockAllocator, SlotAllocator
from engine.cache.layer_caches import PagedKVCache, StateSlotCache, WindowRingCache
from engine.cache.manager import CacheConfig, CacheManager
from engine.errors import CacheError, CacheFullError
from engine.runtime.sequence import Sequence


def manager(make_config, make_model, layers=("gdn", "full", "swa"), **kw):
    model = make_model(make_config(list(layers)))
    cfg = dict(block_size=4, num_blocks=10, num_slots=2)
    cfg.update(kw)
    return CacheManager.for_model(model, CacheConfig(**cfg))


def test_manager_builds_one_cache_per_layer_in_the_contract_layouts(make_config, make_model):
    cm = manager(make_config, make_model)
    state, paged, ring = cm.layers
    assert isinstance(state, StateSlotCache) and state.state.shape == (2, 4, 8, 8)
    assert state.state.dtype == torch.float32 and state.conv_tail.shape == (2, 2 * 2 * 8 + 4 * 8, 2)
    assert isinstance(paged, PagedKVCache) and paged.k_pages.shape == (10, 4, 2, 8)
    assert isinstance(ring, WindowRingCache) and ring.k.shape == (2, 5, 2, 8)


def test_allocate_zeroes_states_and_free_returns_blocks_and_slot(make_config, make_model):
    cm = manager(make_config, make_model)
    a = cm.allocate(Sequence("a"))
    cm.layers[0].state[a.slot].fill_(3.0)
    cm.layers[0].conv_tail[a.slot].fill_(3.0)
    cm.ensure_capacity(a, 9)
    assert len(a.block_table) == 3 and cm.blocks.num_free == 7
    cm.free(a)
    assert cm.blocks.num_free == 10 and cm.slots.num_free == 2 and a.slot == -1 and a.block_table == []
    b, c = cm.allocate(Sequence("b")), cm.allocate(Sequence("c"))
    assert {b.slot, c.slot} == {0, 1}  # one of them reuses a's dirty slot
    for s in (b, c):
        assert float(cm.layers[0].state[s.slot].abs().sum()) == 0.0
        assert float(cm.layers[0].conv_tail[s.slot].abs().sum()) == 0.0
    # every linear layer's slot is zeroed (in one call), and only that slot
    linear = [x for x in cm.layers if isinstance(x, StateSlotCache)]
    for x in linear:
        x.state.fill_(5.0)
        x.conv_tail.fill_(5.0)
    cm.free(b)
    d = cm.allocate(Sequence("d"))
    for x in linear:
        assert float(x.state[d.slot].abs().sum()) == 0.0 and float(x.conv_tail[d.slot].abs().sum()) == 0.0
        assert bool((x.state[c.slot] == 5.0).all()) and bool((x.conv_tail[c.slot] == 5.0).all())


def test_capacity_grows_on_demand_all_or_nothing(make_config, make_model):
    cm = manager(make_config, make_model)
    a = cm.allocate(Sequence("a"))
    cm.ensure_capacity(a, 1)
    cm.ensure_capacity(a, 4)
    assert len(a.block_table) == 1
    assert cm.blocks_needed(a, 5) == 1
    with pytest.raises(CacheFullError, match="need 10 KV blocks, only 9"):
        cm.ensure_capacity(a, 44)
    assert len(a.block_table) == 1 and cm.blocks.num_free == 9
    assert cm.can_allocate(36) and not cm.can_allocate(37)


def test_flat_slots_follow_the_block_table(make_config, make_model):
    cm = manager(make_config, make_model)
    a, b = cm.allocate(Sequence("a")), cm.allocate(Sequence("b"))
    cm.ensure_capacity(a, 2)
    cm.ensure_capacity(b, 6)
    cm.ensure_capacity(a, 7)  # a's blocks interleave with b's
    flat = cm.flat_slots(a, 0, 7)
    expect = [a.block_table[p // 4] * 4 + p % 4 for p in range(7)]
    assert flat.tolist() == expect
    ctx = cm.batch_context_slots([a, b], [7, 3])
    assert ctx.shape == (2, 7) and ctx[0].tolist() == expect
    assert ctx[1, :3].tolist() == [b.block_table[0] * 4 + p for p in range(3)] and ctx[1, 3:].tolist() == [0] * 4
    with pytest.raises(CacheError, match="not enough for position 8"):
        cm.flat_slots(a, 0, 9)


def test_misuse_is_reported_with_the_sequence_named(make_config, make_model):
    cm = manager(make_config, make_model, num_slots=1)
    a = cm.allocate(Sequence("a"))
    with pytest.raises(CacheError, match="'a' already holds slot"):
        cm.allocate(a)
    with pytest.raises(CacheFullError, match="all 1 request slots"):
        cm.allocate(Sequence("b"))
    cm.free(a)
    with pytest.raises(CacheError, match="'a' holds no cache slot"):
        cm.free(a)


def test_models_without_full_layers_need_no_blocks(make_config, make_model):
    cm = manager(make_config, make_model, layers=("gdn", "swa"))
    a = cm.allocate(Sequence("a"))
    cm.ensure_capacity(a, 10_000)
    assert a.block_table == [] and cm.flat_slots(a, 0, 5) is None and cm.can_allocate(10_000)


def test_block_allocator_reference_counts_shared_blocks():
    alloc = BlockAllocator(3)
    blocks = alloc.allocate(2)
    alloc.incref(blocks[:1])
    alloc.free(blocks)
    assert alloc.num_free == 2 and alloc.refcount(blocks[0]) == 1
    alloc.free(blocks[:1])
    assert alloc.num_free == 3
    with pytest.raises(CacheError, match=f"block {blocks[0]} freed twice"):
        alloc.free(blocks[:1])
    with pytest.raises(CacheError, match="out of range"):
        alloc.incref([7])
    slots = SlotAllocator(1)
    with pytest.raises(CacheError, match="slot 0 is not allocated"):
        slots.free(0)


def test_state_slot_and_ring_hooks_write_where_the_contract_says(make_config, make_model):
    cm = manager(make_config, make_model)
    state, _, ring = cm.layers
    a = cm.allocate(Sequence("a"))
    s = torch.randn(4, 8, 8)
    state.set_state(a.slot, s)
    assert torch.equal(state.get_state(a.slot), s)
    with pytest.raises(CacheError, match=r"state shape \(4, 8\)"):
        state.set_state(a.slot, torch.zeros(4, 8))
    pos = torch.arange(3, 12)  # 9 positions into a window of 5: only 7..11 survive
    k = torch.randn(9, 2, 8)
    ring.write(a.slot, pos, k, k)
    got, _ = ring.read(a.slot, torch.arange(7, 12))
    assert torch.equal(got, k[-5:])
    assert torch.equal(ring.k[a.slot, 7 % 5], k[-5])


def test_shared_blocks_stay_allocated_until_every_owner_frees(make_config, make_model):
    cm = manager(make_config, make_model, layers=("full",))
    a, b = cm.allocate(Sequence("a")), cm.allocate(Sequence("b"))
    cm.ensure_capacity(a, 8)
    cm.share_blocks(b, a.block_table[:1])
    cm.ensure_capacity(b, 6)
    assert b.block_table[0] == a.block_table[0] and cm.blocks.num_free == 7
    cm.free(a)
    assert cm.blocks.num_free == 8
    cm.free(b)
    assert cm.blocks.num_free == 10
