"""The runner's decode CUDA graphs over HiSparse layer caches (engine/runtime/cuda_graphs.py,
engine/hisparse/layer_cache.py `plan_decode` / `finish_decode`), on the CPU: the
static-buffer step a graph would capture (`DecodeGraphs.step`, run eagerly off CUDA) gives
the tokens, logits, selections and counters of the eager HiSparse step with top-k selection
active, a batch padded to its bucket included; the whole-model step records no host sync,
host copy or aten op on the pinned mirror under `HostSyncGuard`; graphs are keyed by the
power-of-two score columns; a step no graph can take falls back to eager (counted, logged once)."""
import logging

import torch

from engine.hisparse import HiSparseConfig
from engine.hisparse.sync_guard import CPU_ONLY_CHECKS, HostSyncGuard
from engine.runtime.cuda_graphs import DecodeGraphs
from engine.runtime.sequence import Sequence
from hisparse_testlib import greedy, hisparse_runner, random_prompts, tiny_model

PRESET = "qwen3next-tiny"
STEPS = 6
# block 4, top-3 per KV head from 8 tokens: every sequence selects from its 2nd decode step on
CFG = HiSparseConfig(enabled=True, block_size=4, topk=3, hot_blocks=0, min_context=8)
#: rope_cos_sin moves the inverse frequencies to the positions' device: on CUDA a no-op
#: device tensor, on the CPU a `.to(cpu)` the guard cannot tell from a host copy
EXEMPT = CPU_ONLY_CHECKS + (("engine/models/layers/rope.py", "rope_cos_sin"),)


class _Recorder:
    """Wraps `HiSparseLayerCache.decode_step` of every layer cache: each step's selection per
    sequence and KV head (host reads after the step, outside anything under watch)."""

    def __init__(self, off):
        self.steps: list[list] = []
        for cache in off.layers:
            inner = cache.decode_step

            def step(*a, _inner=inner, _cache=cache, **kw):
                out = _inner(*a, **kw)
                n = len(self.batch)
                self.steps.append(_cache.last_selection.first(n).head_lists(_cache.num_kv_heads))
                return out
            cache.decode_step = step
        self.batch: list = []


def _greedy(runner, prompts, rec=None):
    if rec is not None:
        rec.batch = prompts
    return greedy(runner, prompts, STEPS)


def test_static_step_equals_eager_hisparse_with_selection_and_padding():
    model = tiny_model(PRESET)
    prompts = random_prompts([45, 70, 33], seed=5)  # 3 sequences: bucket 4, one padding row
    eager, off_e = hisparse_runner(model, CFG, num_slots=3)
    rec_e = _Recorder(off_e)
    want = _greedy(eager, prompts, rec_e)
    static, off_s = hisparse_runner(model, CFG, num_slots=3)
    static.set_cuda_graphs(True)  # off CUDA: the graphs' static-buffer step, run eagerly
    rec_s = _Recorder(off_s)
    got = _greedy(static, prompts, rec_s)
    assert got.tokens == want.tokens
    for g, w in zip(got.logits, want.logits):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-4)
    assert rec_s.steps == rec_e.steps and len(rec_s.steps) == STEPS * len(off_s.layers)
    graphs = static.graphs
    assert graphs.static_steps == STEPS and graphs.graph_steps == 0 and not graphs.fallbacks
    assert graphs.last_bucket == 4
    se, ss = off_e.snapshot(), off_s.snapshot()
    assert ss["blocks_fetched"] > 0 and ss["blocks_evicted"] > 0  # selection really moved blocks
    for key in ("decode_steps", "blocks_attended", "blocks_fetched", "blocks_evicted", "blocks_staged"):
        assert ss[key] == se[key], key  # the padding row is not counted
    assert ss["decode_eager_steps"] == STEPS and ss["decode_graph_steps"] == 0


def test_whole_model_static_step_records_no_host_sync_or_mirror_copy():
    model = tiny_model(PRESET)
    runner, off = hisparse_runner(model, CFG, num_slots=3)
    runner.set_cuda_graphs(True)
    graphs = runner.graphs
    assert graphs.external == off.layers and off.layers
    mirrors = [t for c in off.layers for t in (c.mirror_k, c.mirror_v)]
    records, ops = [], []
    inner = graphs.step

    def guarded(rows, plans=()):
        with HostSyncGuard(host_tensors=mirrors, exempt=EXEMPT) as guard:
            out = inner(rows, plans)
        records.extend(guard.records)
        ops.append(guard.ops)
        return out
    graphs.step = guarded
    run = greedy(runner, random_prompts([41, 66, 30], seed=9), STEPS)  # crosses blocks: seals, evicts, fetches
    assert len(ops) == STEPS and min(ops) > 100  # every step ran under the guard
    snap = off.snapshot()
    assert snap["blocks_fetched"] > 0 and snap["blocks_evicted"] > 0
    assert [str(r) for r in records] == []
    assert all(len(t) == STEPS + 1 for t in run.tokens)


def test_graph_keys_are_bucket_and_power_of_two_score_columns():
    model = tiny_model(PRESET)
    runner, off = hisparse_runner(model, CFG, num_slots=2, max_len=1024)
    runner.set_cuda_graphs(True)
    cache = off.layers[0]
    seq = runner.cache.allocate(Sequence("a"))
    runner.prefill(seq, random_prompts([37])[0])
    # 37 tokens: blocks 0..9, sink 1 and recent 1: candidates 1..8 (8 > top-3): columns 9 -> 16
    assert cache.plan_decode([seq.slot], [37]) == 16
    short = runner.cache.allocate(Sequence("b"))
    runner.prefill(short, [1, 2, 3])
    assert cache.plan_decode([short.slot], [3]) == 0  # below min_context: no selection
    plan = runner.graphs.plan([seq, short], [37, 3])
    assert plan.key == (2, tuple(16 for _ in off.layers))


def test_step_above_the_largest_bucket_falls_back_to_eager_counted_and_logged_once(caplog):
    model = tiny_model(PRESET)
    prompts = random_prompts([20, 27, 33], seed=2)
    want = greedy(hisparse_runner(model, CFG, num_slots=3)[0], prompts, 3)
    runner, off = hisparse_runner(model, CFG, num_slots=3)
    runner.graphs = DecodeGraphs(runner.model, runner.cache, runner.backend, buckets=(1, 2), capture=False)
    with caplog.at_level(logging.INFO, logger="engine.runtime"):
        got = greedy(runner, prompts, 3)
    assert got.tokens == want.tokens
    assert runner.graphs.fallbacks == {"batch": 3} and runner.graphs.static_steps == 0
    lines = [r.getMessage() for r in caplog.records if "runs eagerly" in r.getMessage()]
    assert len(lines) == 1 and "a batch of 3 is above the largest bucket 2" in lines[0]
    assert off.snapshot()["decode_eager_steps"] == 3
