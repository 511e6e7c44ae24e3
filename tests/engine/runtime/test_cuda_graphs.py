"""The CUDA-graph decode step (engine/runtime/cuda_graphs.py), run eagerly on the CPU with
its static, bucket-padded buffers: it gives the runner's plain decode logits on every tiny
preset for sequences of mixed lengths, padding rows change no cache, batches past the
largest bucket fall back to the plain path; the paged decode attention equals the
gather path it replaced; and the warm-up of every bucket (`capture_buckets`) launches the
paged decode kernel at every shape (autotune key: batch rows, kv heads, attended range)
that batched steps of up to max_batch sequences launch, leaving no cache touched."""
from __future__ import annotations


import pytest
import torch

from engine.cache.manager import CacheConfig, CacheManager
from engine.models.presets import list_presets
from engine.runtime.cuda_graphs import DecodeGraphs
from engine.runtime.runner import ModelRunner
from engine.runtime.sequence import Sequence

TOL = dict(rtol=1e-5, atol=5e-5)
TINY = [c.name for c in list_presets("tiny")]


def ids_for(n, seed):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))


def runner_for(model, **kw) -> ModelRunner:
    cache = CacheManager.for_model(model, CacheConfig(block_size=4, num_blocks=96, num_slots=5))
    return ModelRunner(model, cache, backend="torch", **kw)


def prefilled(runner, lengths, steps):
    seqs = [runner.cache.allocate(Sequence(f"s{i}")) for i in range(len(lengths))]
    streams = [ids_for(n + steps, 10 + i) for i, n in enumerate(lengths)]
    for s, ids, n in zip(seqs, streams, lengths):
        runner.prefill(s, ids[:n])
    return seqs, streams


@pytest.mark.parametrize("preset", TINY)
def test_static_bucket_step_equals_plain_decode_for_mixed_lengths(preset, models):
    model = models[preset]
    lengths, steps = [3, 11, 20], 4
    plain = runner_for(model, cuda_graphs=False, decode_attention="gather")
    graphed = runner_for(model, cuda_graphs=True)
    assert isinstance(graphed.graphs, DecodeGraphs) and not graphed.graphs.capture
    p_seqs, streams = prefilled(plain, lengths, steps)
    g_seqs, _ = prefilled(graphed, lengths, steps)
    idle = graphed.cache.allocate(Sequence("idle"))  # holds a slot no step touches
    for t in range(steps):
        toks = torch.stack([ids[n + t] for ids, n in zip(streams, lengths)])
        want = plain.decode(p_seqs, toks)
        got = graphed.decode(g_seqs, toks)
        assert graphed.graphs.last_bucket == 4  # 3 sequences padded to the bucket of 4
        torch.testing.assert_close(got, want, **TOL)
    assert [s.num_computed_tokens for s in g_seqs] == [n + steps for n in lengths]
    for layer in graphed.cache.layers:  # padding rows repeat row 0: the idle slot stays zero
        if hasattr(layer, "state"):
            assert not layer.state[idle.slot].any()
        elif hasattr(layer, "k") and not hasattr(layer, "k_pages"):
            assert not layer.k[idle.slot].any()


def test_batch_past_the_largest_bucket_runs_the_plain_step(models):
    model = models["qwen3next-tiny"]
    graphed = runner_for(model, cuda_graphs=True)
    graphed.graphs = DecodeGraphs(model, graphed.cache, "torch", buckets=(1, 2), capture=False)
    plain = runner_for(model, cuda_graphs=False)
    lengths = [5, 9, 2]
    g_seqs, streams = prefilled(graphed, lengths, 1)
    p_seqs, _ = prefilled(plain, lengths, 1)
    toks = torch.stack([ids[n] for ids, n in zip(streams, lengths)])
    graphed.graphs.last_bucket = None
    torch.testing.assert_close(graphed.decode(g_seqs, toks), plain.decode(p_seqs, toks), **TOL)
    assert graphed.graphs.last_bucket is None  # 3 > 2: not through a bucket
    torch.testing.assert_close(graphed.decode(g_seqs[:2], toks[:2]), plain.decode(p_seqs[:2], toks[:2]), **TOL)
    assert graphed.graphs.last_bucket == 2


def test_step_past_the_static_block_table_width_falls_back(models):
    model = models["gla-tiny"]
    runner = runner_for(model, cuda_graphs=True)
    runner.graphs = DecodeGraphs(model, runner.cache, "torch", max_blocks=3, capture=False)
    seq = runner.cache.allocate(Sequence("long"))
    runner.prefill(seq, ids_for(12, 0))  # positions 0..11 fill 3 blocks of 4; position 12 needs a 4th
    assert runner.graphs.fits([11]) and not runner.graphs.fits([12])
    runner.graphs.last_bucket = None
    runner.decode([seq], [7])
    assert runner.graphs.last_bucket is None


@pytest.mark.parametrize("preset", ["gemma3-tiny", "qwen3next-tiny"])
def test_paged_decode_attention_equals_the_gather_path(preset, models):
    """Full layers read pages through block tables, windowed layers their ring as a
    two-column pool; contexts shorter than, equal to and past the window (8)."""
    model = models[preset]
    lengths, steps = [2, 7, 8, 19], 10
    gather = runner_for(model, cuda_graphs=False, decode_attention="gather")
    paged = runner_for(model, cuda_graphs=False, decode_attention="paged")
    a, streams = prefilled(gather, lengths, steps)
    b, _ = prefilled(paged, lengths, steps)
    for t in range(steps):
        toks = torch.stack([ids[n + t] for ids, n in zip(streams, lengths)])
        torch.testing.assert_close(paged.decode(b, toks), gather.decode(a, toks), **TOL)


def test_cuda_graphs_need_the_paged_attention_and_capture_needs_cuda(models):
    model = models["ring-tiny"]
    with pytest.raises(ValueError, match="decode_attention='paged'"):
        runner_for(model, cuda_graphs=True, decode_attention="gather")
    with pytest.raises(ValueError, match="decode_attention='dense'"):
        runner_for(model, decode_attention="dense")
    cache = CacheManager.for_model(model, CacheConfig(block_size=4, num_blocks=8, num_slots=1))
    with pytest.raises(ValueError, match="needs a CUDA model"):
        DecodeGraphs(model, cache, "torch", capture=True)
    assert runner_for(model).graphs is None  # default: graphs only where the device is CUDA


def _decode_keys(monkeypatch):
    """What the paged decode kernel's split count (its autotune key) is computed from, for
    every launch: (batch rows, kv heads, attended range)."""
    import importlib

    pda = importlib.import_module("kernels.paged_decode_attention")  # the module (kernels/__init__ re-exports the function)
    keys = set()
    real = pda.paged_decode_attention

    def recording(q, k_pages, v_pages, tables, lens, scale=None, *, window=None, **kw):
        span = tables.shape[1] * k_pages.shape[1]
        keys.add((q.shape[0], k_pages.shape[2], span if window is None else min(span, window)))
        return real(q, k_pages, v_pages, tables, lens, scale, window=window, **kw)

    monkeypatch.setattr(pda, "paged_decode_attention", recording)
    return keys


def test_capturing_every_bucket_covers_the_decode_kernel_keys_of_batched_steps(models, monkeypatch):
    model = models["qwen3next-tiny"]
    runner = runner_for(model, cuda_graphs=True)
    keys = _decode_keys(monkeypatch)
    assert runner.capture_decode_graphs(5) == [1, 2, 4, 8]  # 5 slots: up to the bucket of 8
    warm = set(keys)
    assert {k[0] for k in warm} == {1, 2, 4, 8}
    assert runner.cache.blocks.num_free == runner.cache.blocks.num_blocks  # the scratch sequence is gone
    keys.clear()
    seqs, streams = prefilled(runner, [3, 9, 14, 6, 21], 1)
    for b in range(1, 6):
        runner.decode(seqs[:b], torch.stack([ids[0] for ids in streams[:b]]))
    assert keys and keys <= warm


def test_decode_graph_warmup_modes_capture_every_bucket_ahead_of_requests(models):
    """DecodeGraphWarmup (engine/runtime/prefill_graphs.py): upfront runs every bucket up to
    max_batch's in the constructor; idle one bucket per step, in order; lazy none; no decode
    graphs: nothing pending. Afterwards the decode of each batch size finds its bucket done."""
    from engine.runtime.prefill_graphs import DecodeGraphWarmup

    model = models["qwen3next-tiny"]
    up = DecodeGraphWarmup(runner_for(model, cuda_graphs=True), 5, "upfront")
    assert up.captured == [1, 2, 4, 8] and up.pending == [] and up.failed is None
    idle_runner = runner_for(model, cuda_graphs=True)
    ran = []
    step_fn = idle_runner.graphs._run
    idle_runner.graphs._run = lambda *a: (ran.append(a[-1][0]), step_fn(*a))[1]  # the bucket of each step run
    idle = DecodeGraphWarmup(idle_runner, 3, "idle")
    assert idle.pending == [1, 2, 4] and idle.captured == []
    assert idle.step() and idle.captured == [1] and idle.pending == [2, 4]
    while idle.step():
        pass
    assert idle.captured == [1, 2, 4] and idle.snapshot()["pending_buckets"] == []
    assert ran == [1, 2, 4]  # one step per bucket, each bucket once
    assert DecodeGraphWarmup(runner_for(model, cuda_graphs=True), 5, "lazy").pending == []
    assert DecodeGraphWarmup(runner_for(model, cuda_graphs=False), 5, "idle").pending == []
    with pytest.raises(ValueError, match="sometimes"):
        DecodeGraphWarmup(runner_for(model, cuda_graphs=True), 5, "sometimes")


def test_an_idle_decode_capture_that_fails_leaves_the_rest_to_first_use(models, monkeypatch):
    from engine.runtime.prefill_graphs import DecodeGraphWarmup

    runner = runner_for(models["qwen3next-tiny"], cuda_graphs=True)
    warm = DecodeGraphWarmup(runner, 5, "idle")

    def boom(b, only=None):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(runner, "capture_decode_graphs", boom)
    assert warm.step() and warm.pending == [] and "out of memory" in warm.failed
    with pytest.raises(RuntimeError, match="out of memory"):
        DecodeGraphWarmup(runner, 5, "upfront")


def test_decode_buckets_follow_the_cache_slots():
    from engine.runtime.cuda_graphs import BUCKETS, MAX_BUCKET, decode_buckets

    assert decode_buckets(1) == decode_buckets(32) == BUCKETS  # a small cache keeps the powers of two
    assert decode_buckets(33) == decode_buckets(48) == BUCKETS + (48,)
    assert decode_buckets(76) == BUCKETS + (48, 64, 80)
    assert decode_buckets(10_000)[-1] == MAX_BUCKET
    with pytest.raises(ValueError, match="max_seqs"):
        decode_buckets(0)


def test_batch_above_32_runs_through_a_slot_sized_bucket(models):
    """A cache of 40 slots gets a bucket of 48: a step of 35 sequences goes through it (12
    padding rows) and gives the plain decode's logits."""
    model = models["qwen3next-tiny"]

    def runner(graphs: bool) -> ModelRunner:
        cache = CacheManager.for_model(model, CacheConfig(block_size=4, num_blocks=400, num_slots=40))
        return ModelRunner(model, cache, backend="torch", cuda_graphs=graphs,
                           **({} if graphs else {"decode_attention": "gather"}))

    graphed, plain = runner(True), runner(False)
    assert graphed.graphs.buckets[-1] == 48
    lengths = [2 + i % 7 for i in range(35)]
    g_seqs, streams = prefilled(graphed, lengths, 1)
    p_seqs, _ = prefilled(plain, lengths, 1)
    toks = torch.stack([ids[n] for ids, n in zip(streams, lengths)])
    torch.testing.assert_close(graphed.decode(g_seqs, toks), plain.decode(p_seqs, toks), **TOL)
    assert graphed.graphs.last_bucket == 48 and not graphed.graphs.fallbacks
