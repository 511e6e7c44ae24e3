"""Fixtures of the runtime tests."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.models.presets import get_preset, list_presets
from engine.models.weights import build_model

TINY = [c.name for c in list_presets("tiny")]


@pytest.fixture(scope="module")
def models():
    """Tiny presets, initialised from their seeds; the Gemma-style window shrunk to 8 so
    short test sequences wrap the ring."""
    out = {}
    for name in TINY:
        cfg = get_preset(name)
        if cfg.attention.sliding_window:
            cfg = cfg.replace(attention=dataclasses.replace(cfg.attention, sliding_window=8))
        out[name] = build_model(cfg, "cpu", torch.float32)
    return out
