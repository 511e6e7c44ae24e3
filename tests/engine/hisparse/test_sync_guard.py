"""engine/hisparse/sync_guard.py: `HostSyncGuard` records each kind of operation that would
synchronise the host with a CUDA device or copy between host memory and the device (so it
can fail), leaves fixed-shape device ops alone, and a HiSparse `decode_step` (selecting per
KV head or per sequence, sealing blocks into the host mirror, evicting and fetching under a
tiny hot buffer, staging rows) records none of them, nor the step a decode graph captures (planned
score columns, a batch padded to its bucket), whose selections and counters are the eager step's."""
import math

import pytest
import torch

from engine.hisparse import HiSparseConfig, MemoryBlockStore
from engine.hisparse.layer_cache import HiSparseLayerCache
from engine.hisparse.metrics import HiSparseMetrics
from engine.hisparse.sync_guard import HostSyncGuard

HKV, H, D = 2, 4, 16


def _ops(fn, host=()):
    with HostSyncGuard(host_tensors=host) as guard:
        fn()
    return [r.op for r in guard.records]


x = torch.arange(6.0)
idx = torch.tensor([0, 2])
host = torch.zeros(4, 3)

OFFENDERS = {
    "tolist": lambda: x.tolist(),
    "item": lambda: x[0].item(),
    "bool": lambda: bool(x[1] > 0),
    "int": lambda: int(x[1]),
    "cpu": lambda: x.cpu(),
    "to_cpu": lambda: x.to("cpu"),
    "nonzero": lambda: torch.nonzero(x),
    "where_one_arg": lambda: torch.where(x > 2),
    "bool_mask_index": lambda: x[x > 2],
    "masked_select": lambda: torch.masked_select(x, x > 2),
    "unique": lambda: torch.unique(x),
    "repeat_interleave_tensor": lambda: torch.repeat_interleave(x, torch.ones(6, dtype=torch.long)),
    "setitem_python_scalar": lambda: x.clone().__setitem__(idx, -1.0),
}


@pytest.mark.parametrize("name", sorted(OFFENDERS))
def test_guard_records_each_synchronising_op(name):
    ops = _ops(OFFENDERS[name])
    assert ops, f"{name} was not recorded"


def test_guard_records_aten_ops_on_a_registered_host_tensor_but_not_views():
    assert _ops(lambda: host.index_select(0, idx), host=[host])
    assert _ops(lambda: torch.zeros(2, 3).copy_(host[:2]), host=[host])
    assert not _ops(lambda: host[1:3].view(6), host=[host])


def test_guard_leaves_fixed_shape_device_ops_alone_and_names_the_frame():
    def fixed():
        y = x.clone()
        y.index_fill_(0, idx, -1.0)
        y[idx] = torch.full_like(idx, 3, dtype=y.dtype)
        torch.where(y > 0, y, 0.0).sort().values.cumsum(0)
        torch.repeat_interleave(y, 2)
        y.masked_fill(y < 0, 0.0)
    assert _ops(fixed) == []
    with HostSyncGuard() as guard:
        x.tolist()
    assert "test_sync_guard.py" in guard.records[0].where[-1]


def _cache(cfg, slots=2, max_len=256):
    metrics = HiSparseMetrics()
    return HiSparseLayerCache(3, HKV, D, cfg, slots, math.ceil(max_len / cfg.block_size), torch.device("cpu"),
                              torch.float32, MemoryBlockStore(metrics), metrics, b"e" * 16)


@pytest.mark.parametrize("per_kv_head,summary", [(True, "minmax"), (False, "mean")])
def test_decode_step_records_no_host_sync_and_no_host_copy(per_kv_head, summary):
    cfg = HiSparseConfig(enabled=True, block_size=4, topk=2, hot_blocks=2 * 2 + 2, min_context=8,
                         summary=summary, per_kv_head=per_kv_head)
    cache = _cache(cfg)
    gen = torch.Generator().manual_seed(3)
    lens = [37, 42]
    for s, n in enumerate(lens):
        cache.reset(s)
        cache.append(s, torch.randn(n, HKV, D, generator=gen), torch.randn(n, HKV, D, generator=gen))
    slots = torch.tensor([0, 1])
    records = []
    for step in range(5):  # crosses block boundaries: seals into the mirror, places new blocks
        pos = torch.tensor(lens) + step
        q = torch.randn(2, H, D, generator=gen)
        k, v = torch.randn(2, HKV, D, generator=gen), torch.randn(2, HKV, D, generator=gen)
        cols = int(pos.max()) // cfg.block_size + 1
        with HostSyncGuard(host_tensors=[cache.mirror_k, cache.mirror_v]) as guard:
            cache.decode_step(q, k, v, slots, pos, D ** -0.5, cols)
        records += guard.records
    snap = cache.metrics.snapshot()
    assert snap["blocks_fetched"] > 0 and snap["blocks_evicted"] > 0  # the paths under watch ran
    assert [str(r) for r in records] == []
    assert guard.ops > 50  # the step's own aten ops were seen (the interpreter's are not counted)


def test_planned_step_with_padding_rows_records_nothing_and_counts_only_real_rows():
    """The step a decode graph captures: score columns from `plan_decode` (a power of two
    above the need) and a batch padded to its bucket by repeating row 0 (engine/runtime/
    cuda_graphs.py). Under the guard it records nothing; its selections and counters are
    those of the unpadded step at the exact columns."""
    cfg = HiSparseConfig(enabled=True, block_size=4, topk=2, hot_blocks=0, min_context=8)
    twin = [_cache(cfg, slots=3), _cache(cfg, slots=3)]
    gen = torch.Generator().manual_seed(8)
    lens = [37, 42, 29]
    for s, n in enumerate(lens):
        k, v = torch.randn(n, HKV, D, generator=gen), torch.randn(n, HKV, D, generator=gen)
        for c in twin:
            c.reset(s)
            c.append(s, k, v)
    exact, planned = twin
    records = []
    for step in range(6):
        pos = [n + step for n in lens]
        q = torch.randn(3, H, D, generator=gen)
        k, v = torch.randn(3, HKV, D, generator=gen), torch.randn(3, HKV, D, generator=gen)
        cols = planned.plan_decode([0, 1, 2], pos)
        assert cols & (cols - 1) == 0 and cols >= max(pos) // cfg.block_size  # a power of two above the need
        pad = lambda t: torch.cat([t, t[:1]])  # noqa: E731 - bucket 4: row 0 repeated
        with HostSyncGuard(host_tensors=[planned.mirror_k, planned.mirror_v]) as guard:
            got = planned.decode_step(pad(q), pad(k), pad(v), torch.tensor([0, 1, 2, 0]), pad(torch.tensor(pos)),
                                      D ** -0.5, cols)
        records += guard.records
        planned.finish_decode([0, 1, 2], pos, cols, 4, graphed=False)
        want = exact.attend_decode(q, k, v, _ctx(pos), D ** -0.5)
        torch.testing.assert_close(got[:3], want, rtol=0, atol=1e-5)
        assert planned.last_selection.first(3).head_lists(HKV) == exact.last_selection.head_lists(HKV)
    assert [str(r) for r in records] == []
    assert planned.table.counters() == exact.table.counters()
    assert planned.table.counters()["blocks_fetched"] > 0


def _ctx(pos):
    from engine.models.layers.base import DecodeContext

    ctx = DecodeContext(positions=torch.tensor(pos), slots=torch.tensor([0, 1, 2]))
    ctx.host_positions, ctx.host_slots = list(pos), [0, 1, 2]
    return ctx
