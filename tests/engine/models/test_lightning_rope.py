"""Lightning attention with RoPE inside the recurrence (Ring-linear-2.0): a segment's end
state computed alone at positions 0.. and placed at offset d is `R_d E` (R_d rotates the
key dims; the scalar decay commutes with it), so the state of [A; B] composes exactly from
A's state and B's state computed alone. A prepare without positions is refused."""
from __future__ import annotations

import pytest
import torch

from engine.errors import ConfigError
from engine.models.config import LinearConfig, ModelConfig
from engine.models.layers.scalar_decay import LightningAttention

CFG = ModelConfig(hidden_size=32, layers=("lightning", "full"),
                  linear=LinearConfig(num_heads=2, num_v_heads=2, key_dim=16, value_dim=16, qkv_silu=False,
                                      qk_norm=True, rotary_dim=8, rope_theta=100.0, norm_groups=2))


def _end_state(layer: LightningAttention, x: torch.Tensor, start: int = 0) -> torch.Tensor:
    conv_in, extras = layer.project(x[None])
    extras["positions"] = torch.arange(start, start + x.shape[0])
    return layer.run_recurrence(layer.prepare(conv_in, extras), None, "torch")[1][0]


@torch.no_grad()
def test_a_segment_state_alone_rotated_by_its_offset_composes_exactly():
    torch.manual_seed(0)
    layer = LightningAttention(CFG, "lightning", 0)
    for p in layer.parameters():
        p.normal_(0, 0.3)
    x = torch.randn(23, CFG.hidden_size)
    a, n1 = x[:9], 9
    full = _end_state(layer, x)
    e_b = _end_state(layer, x[n1:])  # B alone, from position 0
    decay = torch.exp(layer.log_decay_tensor(x.device) * (x.shape[0] - n1))[:, None, None]
    composed = decay * _end_state(layer, a) + layer.rotate_state(e_b, n1)
    assert float(full.abs().max()) > 0.1
    torch.testing.assert_close(composed, full, rtol=1e-5, atol=1e-5)
    assert float((decay * _end_state(layer, a) + e_b - full).abs().max()) > 1e-2  # unrotated E is wrong
    torch.testing.assert_close(layer.rotate_state(e_b, n1), _end_state(layer, x[n1:], start=n1), rtol=1e-5,
                               atol=1e-5)


def test_prepare_without_positions_is_refused_naming_the_rotary_dim():
    layer = LightningAttention(CFG, "lightning", 0)
    conv_in, extras = layer.project(torch.randn(1, 3, CFG.hidden_size))
    with pytest.raises(ConfigError, match="rotary_dim=8"):
        layer.prepare(conv_in, extras)
