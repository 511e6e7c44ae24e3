"""Fixtures of the PIC tests (helpers in pic_testlib.py)."""
from __future__ import annotations

import pytest
import torch

from engine.cache.manager import CacheConfig, CacheManager
from engine.models.weights import build_model
from engine.pic.config import PicConfig
from engine.pic.planner import make_planner
from engine.runtime.runner import ModelRunner
from pic_testlib import FakeTokenizer, pic_config


@pytest.fixture
def model_of():
    def factory(layers, seed: int = 0, **overrides):
        return build_model(pic_config(layers, **overrides), "cpu", torch.float32, seed=seed)
    return factory


@pytest.fixture
def runner_of():
    def factory(model, num_blocks: int = 256, num_slots: int = 4, block_size: int = 4) -> ModelRunner:
        cache = CacheManager.for_model(model, CacheConfig(block_size=block_size, num_blocks=num_blocks,
                                                          num_slots=num_slots))
        return ModelRunner(model, cache, backend="torch")
    return factory


@pytest.fixture
def planner_of():
    def factory(model, method: str = "pic", fingerprint: str = "test-model", **kw):
        return make_planner(PicConfig(method=method, **kw), model, fingerprint, FakeTokenizer())
    return factory
