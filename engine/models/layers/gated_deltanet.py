"""Gated DeltaNet (Qwen3-Next / Qwen3.5 linear layers): gated delta rule

    S_t = g_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,   o_t = S_t^T (q_t / sqrt(dk))

with q, k L2-normalised per head, `g_t = exp(-exp(A_log) * softplus(a_t + dt_bias))`,
`beta_t = sigmoid(b_t)`, a short causal conv (SiLU) over [q, k, v], grouped value heads
(`num_v_heads` a multiple of `num_heads`), and a gated RMSNorm `rmsnorm(o) * silu(z)` per
head before the output projection. Pieces and PIC hooks: see linear_base.py.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.config import ModelConfig
from engine.models.layers.linear_base import LinearMixer, l2_normalize
from engine.models.layers.linear_ops import RecurrenceInputs
from engine.models.layers.norm import GatedRMSNorm


class GatedDeltaNet(LinearMixer):
    family = "delta"

    def __init__(self, cfg: ModelConfig, kind: str) -> None:
        lin = cfg.linear
        self.qk_dim = lin.num_heads * lin.key_dim
        self.v_dim = lin.num_v_heads * lin.value_dim
        super().__init__(cfg, kind, conv_channels=2 * self.qk_dim + self.v_dim)
        hv = lin.num_v_heads
        self.in_proj = nn.Linear(cfg.hidden_size, 2 * self.qk_dim + 2 * self.v_dim + 2 * hv, bias=False)
        self.A_log = nn.Parameter(torch.zeros(hv))
        self.dt_bias = nn.Parameter(torch.zeros(hv))
        self.norm = GatedRMSNorm(lin.value_dim, cfg.rms_norm_eps, activation="silu")
        self.out_proj = nn.Linear(self.v_dim, cfg.hidden_size, bias=False)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
        hv = self.num_v_heads
        qkv, z, b, a = self.in_proj(x).split([2 * self.qk_dim + self.v_dim, self.v_dim, hv, hv], dim=-1)
        return qkv, {"z": z, "b": b, "a": a}

    def prepare(self, conv_out: torch.Tensor, extras: dict) -> RecurrenceInputs:
        bsz, t = conv_out.shape[:2]
        q, k, v = conv_out.split([self.qk_dim, self.qk_dim, self.v_dim], dim=-1)
        q = self.repeat_heads(l2_normalize(q.reshape(bsz, t, self.num_heads, self.key_dim)))
        k = self.repeat_heads(l2_normalize(k.reshape(bsz, t, self.num_heads, self.key_dim)))
        v = v.reshape(bsz, t, self.num_v_heads, self.value_dim)
        g = -torch.exp(self.A_log.float()) * F.softplus(extras["a"].float() + self.dt_bias.float())
        beta = torch.sigmoid(extras["b"].float())
        return RecurrenceInputs(q=q, k=k, v=v, log_decay=g, beta=beta, scale=self.key_dim ** -0.5)

    def output(self, o: torch.Tensor, extras: dict) -> torch.Tensor:
        z = extras["z"].reshape(*o.shape)
        return self.out_proj(self.norm(o, z).flatten(-2))
