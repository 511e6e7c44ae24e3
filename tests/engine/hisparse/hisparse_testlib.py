"""Helpers of the HiSparse tests: dense and HiSparse runners over one tiny model (CPU,
fp32), and a greedy run of chunked prefill + batched decode that records every logit."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from engine.cache.manager import CacheConfig, CacheManager, cache_specs
from engine.hisparse import HiSparseConfig, HiSparseOffload
from engine.hisparse.store import BlockStore
from engine.runtime.runner import ModelRunner
from engine.runtime.sequence import Sequence

_MODELS: dict[str, object] = {}


def tiny_model(preset: str):
    """The tiny preset's model (cached per test session: loading costs seconds)."""
    from engine.models.weights import load_model

    if preset not in _MODELS:
        _MODELS[preset] = load_model(preset, device="cpu", dtype=torch.float32).model
    return _MODELS[preset]


def dense_runner(model, num_slots: int = 2) -> ModelRunner:
    return ModelRunner(model, CacheManager.for_model(model, CacheConfig(block_size=16, num_blocks=96,
                                                                        num_slots=num_slots)), cuda_graphs=False)


def hisparse_runner(model, config: HiSparseConfig, num_slots: int = 2, max_len: int = 1024,
                    store: Optional[BlockStore] = None) -> tuple[ModelRunner, HiSparseOffload]:
    off = HiSparseOffload(config, store, num_slots, max_len, torch.device("cpu"), torch.float32)
    manager = CacheManager(cache_specs(model), CacheConfig(block_size=16, num_blocks=0, num_slots=num_slots), "cpu",
                           torch.float32, external_kv=off.layer_cache)
    return ModelRunner(model, manager, cuda_graphs=False), off


@dataclass
class Run:
    tokens: list[list[int]]
    logits: list[torch.Tensor]  # prefill last-token logits, then one [B, vocab] per decode step


def greedy(runner: ModelRunner, prompts: list[list[int]], steps: int, chunk: int = 32) -> Run:
    """Prefill each prompt in chunks, then decode all of them together greedily."""
    seqs = [runner.cache.allocate(Sequence(f"s{i}")) for i in range(len(prompts))]
    logits, last = [], []
    for seq, prompt in zip(seqs, prompts):
        for a in range(0, len(prompt), chunk):
            out = runner.prefill(seq, prompt[a:a + chunk])
        logits.append(out)
        last.append(int(out.argmax()))
    tokens = [[t] for t in last]
    for _ in range(steps):
        out = runner.decode(seqs, last)
        logits.append(out)
        last = out.argmax(-1).tolist()
        for t, tok in zip(tokens, last):
            t.append(tok)
    for seq in seqs:
        runner.cache.free(seq)
    return Run(tokens, logits)


def random_prompts(lengths: list[int], seed: int = 0, vocab: int = 256) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in lengths]


def assert_same_run(got: Run, want: Run, atol: float = 1e-4) -> None:
    assert got.tokens == want.tokens
    for g, w in zip(got.logits, want.logits):
        torch.testing.assert_close(g, w, rtol=0, atol=atol)
