"""Unit tests of engine.hisparse.layer_cache on random K/V (no model): top-k selection picks
the blocks the scoring reference ranks first and attends exactly to them; prefill streams
sealed blocks to the store while the hot buffer stays bounded; a freed sequence's blocks
leave the store; a block missing from the store raises BlocksLost; bad settings are
refused naming the setting."""
import math

import pytest
import torch

from engine.errors import RuntimeStateError
from engine.hisparse import BlocksLost, HiSparseConfig, HiSparseConfigError, MemoryBlockStore
from engine.hisparse.layer_cache import HiSparseLayerCache
from engine.hisparse.metrics import HiSparseMetrics
from engine.models.layers.base import DecodeContext, PrefillContext
from kernels.hisparse_select import block_scores_reference, topk_blocks_reference

HKV, H, D = 2, 4, 16


def make_cache(config, num_slots=2, max_len=256):
    metrics = HiSparseMetrics()
    store = MemoryBlockStore(metrics)
    cache = HiSparseLayerCache(3, HKV, D, config, num_slots, math.ceil(max_len / config.block_size),
                               torch.device("cpu"), torch.float32, store, metrics, b"e" * 16, counts_steps=True)
    return cache, store


def prefill(cache, slot, k, v, start=0):
    n = k.shape[0]
    ctx = PrefillContext(start_pos=start, positions=torch.arange(start, start + n), slot=slot)
    return cache.attend_prefill(torch.randn(n, H, D), k, v, ctx, D ** -0.5)


def decode(cache, slots, positions, q, k, v):
    ctx = DecodeContext(positions=torch.tensor(positions), slots=torch.tensor(slots), host_positions=positions,
                        host_slots=slots)
    return cache.attend_decode(q, k, v, ctx, D ** -0.5)


def attention(q, k, v):
    """q [H, D] over k/v [L, Hkv, D] (GQA), float64."""
    k = k.double().repeat_interleave(H // HKV, dim=1)
    v = v.double().repeat_interleave(H // HKV, dim=1)
    p = torch.softmax(torch.einsum("hd,lhd->hl", q.double(), k) * D ** -0.5, dim=-1)
    return torch.einsum("hl,lhd->hd", p, v)


@pytest.mark.parametrize("summary", ["minmax", "mean"])
def test_decode_attends_to_sink_recent_and_the_reference_top_k_blocks(summary):
    cfg = HiSparseConfig(enabled=True, block_size=4, topk=2, hot_blocks=4, min_context=8, summary=summary,
                         per_kv_head=False)
    cache, _ = make_cache(cfg)
    gen = torch.Generator().manual_seed(5)
    k, v = torch.randn(41, HKV, D, generator=gen), torch.randn(41, HKV, D, generator=gen)
    q = torch.randn(1, H, D, generator=gen)
    k[20:24] = 3 * q[0].view(HKV, H // HKV, D).mean(1)  # block 5 matches the query strongly
    cache.reset(0)
    prefill(cache, 0, k[:40], v[:40])
    out = decode(cache, [0], [40], q, k[40:41], v[40:41])
    blocks = k[:40].view(10, 4, HKV, D)
    summ = torch.zeros(1, 11, 2, HKV, D)
    summ[0, :10, 0] = blocks.amin(1) if summary == "minmax" else blocks.mean(1)
    summ[0, :10, 1] = blocks.amax(1) if summary == "minmax" else 0
    ref = block_scores_reference(q, summ, torch.tensor([0]), torch.tensor([1]), torch.tensor([10]), 10, summary)
    chosen = topk_blocks_reference(ref, 2)[0].tolist()
    assert 5 in chosen
    want_blocks = sorted({0, 10, *chosen})
    pos = torch.cat([torch.arange(j * 4, min(41, j * 4 + 4)) for j in want_blocks])
    want = attention(q[0], k[pos], v[pos])
    torch.testing.assert_close(out[0].double(), want, rtol=1e-5, atol=1e-5)
    snap = cache.metrics.snapshot()
    assert snap["blocks_attended"] == 4 and snap["decode_steps"] == 1


def test_per_kv_head_selection_attends_each_head_to_its_own_reference_top_k():
    cfg = HiSparseConfig(enabled=True, block_size=4, topk=2, hot_blocks=3, min_context=0, per_kv_head=True)
    cache, _ = make_cache(cfg)
    gen = torch.Generator().manual_seed(9)
    k, v = torch.randn(41, HKV, D, generator=gen), torch.randn(41, HKV, D, generator=gen)
    q = torch.randn(1, H, D, generator=gen)
    cache.reset(0)
    prefill(cache, 0, k[:40], v[:40])
    out = decode(cache, [0], [40], q, k[40:41], v[40:41])
    blocks = k[:40].view(10, 4, HKV, D)
    summ = torch.stack([blocks.amin(1), blocks.amax(1)], 1)[None]
    g = H // HKV
    heads = cache.last_selection.head_lists(HKV)[0]
    for h in range(HKV):
        ref = block_scores_reference(q[:, h * g:(h + 1) * g], summ[:, :, :, h:h + 1], torch.tensor([0]),
                                     torch.tensor([1]), torch.tensor([10]), 10)
        want = sorted({0, 10, *topk_blocks_reference(ref, 2)[0].tolist()})
        assert heads[h] == want
        pos = torch.cat([torch.arange(j * 4, min(41, j * 4 + 4)) for j in want])
        exact = attention(q[0], k[pos], v[pos]).view(HKV, g, D)[h]  # this head group over its own blocks
        torch.testing.assert_close(out[0, h * g:(h + 1) * g].double(), exact, rtol=1e-5, atol=1e-5)
    assert cache.last_selection.lists()[0] == sorted(set(heads[0]) | set(heads[1]))  # the hot buffer admits the union


def test_prefill_streams_sealed_blocks_out_and_keeps_the_hot_buffer_bounded():
    cfg = HiSparseConfig(enabled=True, block_size=8, topk=4, hot_blocks=3, min_context=0)
    cache, store = make_cache(cfg)
    cache.reset(1)
    gen = torch.Generator().manual_seed(1)
    k, v = torch.randn(100, HKV, D, generator=gen), torch.randn(100, HKV, D, generator=gen)
    for a in range(0, 100, 30):  # chunks of 30 cross block boundaries
        prefill(cache, 1, k[a:a + 30], v[a:a + 30], start=a)
    assert len(store) == 12  # blocks 0..11 are full and stored; block 12 holds 4 tokens
    resident = cache.resident_blocks(1)
    assert len(resident) <= 3 and 0 in resident and 12 in resident
    cache.release(1)
    assert len(store) == 0


def test_prefill_after_eviction_reads_earlier_blocks_back_and_equals_dense_causal_attention():
    cfg = HiSparseConfig(enabled=True, block_size=4, topk=4, hot_blocks=2, min_context=0)
    cache, _ = make_cache(cfg)
    cache.reset(0)
    gen = torch.Generator().manual_seed(2)
    k, v = torch.randn(30, HKV, D, generator=gen), torch.randn(30, HKV, D, generator=gen)
    prefill(cache, 0, k[:22], v[:22])
    q = torch.randn(8, H, D, generator=gen)
    ctx = PrefillContext(start_pos=22, positions=torch.arange(22, 30), slot=0)
    out = cache.attend_prefill(q, k[22:], v[22:], ctx, D ** -0.5)
    for i in range(8):
        p = 22 + i
        torch.testing.assert_close(out[i].double(), attention(q[i], k[:p + 1], v[:p + 1]), rtol=1e-5, atol=1e-5)
    assert cache.metrics.snapshot()["read_bytes"]["mirror"] > 0  # evicted blocks came from the host mirror


def test_decode_fetches_from_the_host_mirror_so_a_store_that_lost_a_block_changes_nothing():
    cfg = HiSparseConfig(enabled=True, block_size=4, topk=8, hot_blocks=2, min_context=0)
    cache, store = make_cache(cfg)
    cache.reset(0)
    gen = torch.Generator().manual_seed(4)
    k, v = torch.randn(13, HKV, D, generator=gen), torch.randn(13, HKV, D, generator=gen)
    prefill(cache, 0, k[:12], v[:12])
    store.discard([cache.key_of(0, 1)])  # the store (the daemon's copy) lost block 1
    q = torch.randn(1, H, D, generator=gen)
    out = decode(cache, [0], [12], q, k[12:], v[12:])
    torch.testing.assert_close(out[0].double(), attention(q[0], k, v), rtol=1e-5, atol=1e-5)
    assert cache.metrics.snapshot()["blocks_fetched"] == 2  # blocks 1 and 2: the hot buffer held 0 and 3


def test_tiny_hot_buffer_evicts_unselected_rows_and_refetches_exactly_over_many_steps():
    """hot 3 (sink, recent, one more), top-2 over 10-15 blocks: every step some selected block
    is missing, evicted rows get reused and staging rows hold the overflow; each step's output
    is exact attention over the blocks the reference scoring picks."""
    cfg = HiSparseConfig(enabled=True, block_size=4, topk=2, hot_blocks=3, min_context=0, per_kv_head=False)
    cache, _ = make_cache(cfg, num_slots=2, max_len=64)
    gen = torch.Generator().manual_seed(11)
    n0, steps = 40, 20
    ks = [torch.randn(n0 + steps, HKV, D, generator=gen) for _ in range(2)]
    vs = [torch.randn(n0 + steps, HKV, D, generator=gen) for _ in range(2)]
    for slot in (0, 1):
        cache.reset(slot)
        prefill(cache, slot, ks[slot][:n0 - 2 * slot], vs[slot][:n0 - 2 * slot])
    for step in range(steps):
        pos = [n0 + step, n0 - 2 + step]
        q = torch.randn(2, H, D, generator=gen)
        out = decode(cache, [0, 1], pos, q, torch.stack([ks[b][pos[b]] for b in (0, 1)]),
                     torch.stack([vs[b][pos[b]] for b in (0, 1)]))
        for b in (0, 1):
            p = pos[b]
            nb = p // 4 + 1
            full = ks[b][:nb * 4].view(nb, 4, HKV, D)
            summ = torch.zeros(1, nb, 2, HKV, D)
            summ[0, :, 0], summ[0, :, 1] = full.amin(1), full.amax(1)
            ref = block_scores_reference(q[b:b + 1], summ, torch.tensor([0]), torch.tensor([1]),
                                         torch.tensor([nb - 1]), nb, "minmax")
            want_blocks = sorted({0, nb - 1, *topk_blocks_reference(ref, 2)[0].tolist()})
            assert cache.last_selection.blocks[b][cache.last_selection.valid[b]].tolist() == want_blocks
            idx = torch.cat([torch.arange(j * 4, min(p + 1, j * 4 + 4)) for j in want_blocks])
            torch.testing.assert_close(out[b].double(), attention(q[b], ks[b][idx], vs[b][idx]), rtol=1e-5, atol=1e-5)
            assert len(cache.resident_blocks(b)) <= 3
    snap = cache.metrics.snapshot()
    assert snap["blocks_fetched"] > steps and snap["blocks_evicted"] > 0 and 0 < snap["hot_hit_rate"] < 1


def test_positions_must_continue_the_sequence():
    cfg = HiSparseConfig(enabled=True, block_size=4, topk=8, hot_blocks=2, min_context=0)
    cache, _ = make_cache(cfg)
    cache.reset(0)
    prefill(cache, 0, torch.randn(5, HKV, D), torch.randn(5, HKV, D))
    with pytest.raises(RuntimeStateError, match="holds 5 tokens"):
        decode(cache, [0], [7], torch.randn(1, H, D), torch.randn(1, HKV, D), torch.randn(1, HKV, D))


@pytest.mark.parametrize("kwargs,field", [
    (dict(block_size=0), "block_size"), (dict(topk=0), "topk"), (dict(hot_blocks=1), "hot_blocks"),
    (dict(summary="max"), "summary"), (dict(min_context=-1), "min_context")])
def test_bad_settings_are_refused_naming_the_setting(kwargs, field):
    with pytest.raises(HiSparseConfigError, match=field):
        HiSparseConfig(enabled=True, **kwargs)


def test_staging_rows_cover_a_step_wider_than_the_hot_buffer():
    cfg = HiSparseConfig(enabled=True, block_size=64, topk=8, hot_blocks=4, min_context=1024)
    assert cfg.max_selected == 16 and cfg.staging_blocks(1) == 12  # 1023 tokens: 16 blocks before selection
    assert cfg.step_blocks(2) == 18 and cfg.staging_blocks(2) == 14  # per KV head: the union of two top-8s


def test_auto_hot_buffer_holds_the_union_of_the_kv_heads_picks_at_no_extra_device_rows():
    auto = HiSparseConfig(enabled=True)  # block 64, top-32, sink 1, recent 1, hot 0 (auto)
    assert auto.hot_blocks == 0 and auto.hot_rows(2) == 66 and auto.hot_rows(8) == 258
    assert auto.staging_blocks(2) == 0
    one_set = HiSparseConfig(enabled=True, per_kv_head=False)
    assert one_set.hot_rows(2) == 64  # max(min_context 4096 / 64 blocks, 1 + 1 + 32)
    explicit = HiSparseConfig(enabled=True, hot_blocks=64)
    assert explicit.hot_rows(2) == 64 and explicit.staging_blocks(2) == 2
    cfg = HiSparseConfig(enabled=True, block_size=4, topk=2, min_context=8)
    small = HiSparseConfig(enabled=True, block_size=4, topk=2, min_context=8, hot_blocks=3)
    a, _ = make_cache(cfg)
    b, _ = make_cache(small)
    assert a.hot == a.width == a.rows_per_slot == 6  # 1 + 1 + 2 heads x 2
    assert b.hot == 3 and b.rows_per_slot == a.rows_per_slot  # the same device rows: 3 of them staging
    with pytest.raises(HiSparseConfigError, match="hot_blocks"):
        HiSparseConfig(enabled=True, hot_blocks=-1)


def test_block_keys_are_unguessable_per_engine_and_per_sequence():
    from engine.cache.manager import LayerCacheSpec
    from engine.hisparse import KEY_PREFIX, HiSparseOffload

    cfg = HiSparseConfig(enabled=True, block_size=4, topk=2, hot_blocks=4)
    spec = LayerCacheSpec("paged", HKV, D)
    a = HiSparseOffload(cfg, None, 2, 64, torch.device("cpu"), torch.float32).layer_cache(3, spec)
    b = HiSparseOffload(cfg, None, 2, 64, torch.device("cpu"), torch.float32).layer_cache(3, spec)
    a.reset(0)
    b.reset(0)
    first = a.key_of(0, 0)
    assert first.startswith(KEY_PREFIX) and first != b.key_of(0, 0)  # same slot, layer, block; other engine
    a.release(0)
    a.reset(0)
    assert a.key_of(0, 0) != first  # the slot's next sequence never names the previous one's blocks


def test_dense_layers_leave_the_first_full_layers_attending_to_every_block():
    from engine.cache.manager import LayerCacheSpec
    from engine.hisparse import HiSparseOffload

    cfg = HiSparseConfig(enabled=True, block_size=4, topk=2, hot_blocks=3, min_context=0, dense_layers=1)
    off = HiSparseOffload(cfg, None, 1, 64, torch.device("cpu"), torch.float32)
    first, second = (off.layer_cache(i, LayerCacheSpec("paged", HKV, D)) for i in (3, 7))
    gen = torch.Generator().manual_seed(6)
    k, v = torch.randn(41, HKV, D, generator=gen), torch.randn(41, HKV, D, generator=gen)
    q = torch.randn(1, H, D, generator=gen)
    for cache in (first, second):
        cache.reset(0)
        prefill(cache, 0, k[:40], v[:40])
    out = decode(first, [0], [40], q, k[40:], v[40:])
    decode(second, [0], [40], q, k[40:], v[40:])
    assert first.last_selection.lists() == [list(range(11))] and len(first.resident_blocks(0)) == 11
    torch.testing.assert_close(out[0].double(), attention(q[0], k, v), rtol=1e-5, atol=1e-5)
    assert len(second.last_selection.lists()[0]) < 11  # the second full layer selects
