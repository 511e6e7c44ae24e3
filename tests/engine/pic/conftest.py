"""Fixtures of the PIC tests (helpers in pic_testlib.py)."""
from __future__ import annotations

import functools

import pytest

from engine.pic.config import PicConfig
from engine.pic.planner import make_planner
from pic_testlib import FakeTokenizer, pic_config


@pytest.fixture
def model_of(make_model):
    """(layers, seed=0, **config overrides) -> a model of `pic_config` (make_model's build)."""
    def factory(layers, seed: int = 0, **overrides):
        return make_model(pic_config(layers, **overrides), seed=seed)
    return factory


@pytest.fixture
def runner_of(make_runner):
    """make_runner with room for the longer PIC prompts: 256 blocks unless told otherwise."""
    return functools.partial(make_runner, num_blocks=256)


@pytest.fixture
def planner_of():
    def factory(model, method: str = "pic", fingerprint: str = "test-model", **kw):
        # step-by-step plans unless told otherwise: the invariants below pin that path, and
        # test_fused.py pins the one-pass path to it
        kw.setdefault("fused", False)
        kw.setdefault("miss_path", "alone")  # the alone path: a miss computed alone, spliced like a hit
        return make_planner(PicConfig(method=method, **kw), model, fingerprint, FakeTokenizer())
    return factory
