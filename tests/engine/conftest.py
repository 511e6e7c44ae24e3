"""Shared fixtures of the engine tests: small model configs (fp32, CPU) and a runner factory."""
from __future__ import annotations

import pytest
import torch

from engine.cache.manager import CacheConfig, CacheManager
from engine.models.config import AttentionConfig, LinearConfig, ModelConfig
from engine.models.weights import build_model
from engine.runtime.runner import ModelRunner

SMALL_ATTENTION = AttentionConfig(num_heads=4, num_kv_heads=2, head_dim=8, rotary_dim=4,
                                  sliding_window=5, output_gate=True, qk_norm=True)
SMALL_LINEAR = LinearConfig(num_heads=2, num_v_heads=4, key_dim=8, value_dim=8, conv_size=3, chunk_size=8)


def small_config(layers, **overrides) -> ModelConfig:
    base = dict(name="test", family="test", scale="custom", vocab_size=50, hidden_size=32,
                intermediate_size=64, layers=tuple(layers), attention=SMALL_ATTENTION, linear=SMALL_LINEAR,
                max_position_embeddings=4096)
    base.update(overrides)
    return ModelConfig(**base)


@pytest.fixture(autouse=True)
def _deterministic_single_thread():
    """Seeded, and one intra-op thread: these tests run many tiny ops, which on a shared
    2-core machine are ~10x slower with torch's default thread pool spinning."""
    torch.manual_seed(1234)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def make_config():
    return small_config


@pytest.fixture
def make_runner():
    """(model) -> ModelRunner over a fresh cache with small, unaligned blocks."""
    def factory(model, block_size: int = 4, num_blocks: int = 128, num_slots: int = 4) -> ModelRunner:
        cache = CacheManager.for_model(model, CacheConfig(block_size=block_size, num_blocks=num_blocks,
                                                          num_slots=num_slots))
        return ModelRunner(model, cache, backend="torch")
    return factory


@pytest.fixture
def make_model():
    def factory(cfg: ModelConfig, seed: int = 0):
        return build_model(cfg, "cpu", torch.float32, seed=seed)
    return factory
