"""Gated Linear Attention (Yang et al. 2024): data-dependent per-key-dim decay

    S_t = diag(exp(gk_t)) S_{t-1} + k_t v_t^T,   o_t = S_t^T (q_t / sqrt(dk)),
    gk_t = logsigmoid(W2 W1 x_t + b) / normalizer     (low-rank gate, normaliser 16)

with a swish-gated RMSNorm per head before the output projection. An optional short conv
over [q, k, v] is used only if `LinearConfig.conv_kinds` includes "gla". Pieces and PIC
hooks: see linear_base.py.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.config import ModelConfig
from engine.models.layers.linear_base import LinearMixer
from engine.models.layers.linear_ops import RecurrenceInputs
from engine.models.layers.norm import GatedRMSNorm


class GatedLinearAttention(LinearMixer):
    family = "diag"

    def __init__(self, cfg: ModelConfig, kind: str) -> None:
        lin = cfg.linear
        self.qk_dim = lin.num_heads * lin.key_dim
        self.v_dim = lin.num_v_heads * lin.value_dim
        super().__init__(cfg, kind, conv_channels=2 * self.qk_dim + self.v_dim)
        self.normalizer = lin.gla_gate_normalizer
        self.qkv_proj = nn.Linear(cfg.hidden_size, 2 * self.qk_dim + self.v_dim, bias=False)
        self.g_proj = nn.Linear(cfg.hidden_size, self.v_dim, bias=False)
        self.gk_down = nn.Linear(cfg.hidden_size, lin.gla_gate_rank, bias=False)
        self.gk_up = nn.Linear(lin.gla_gate_rank, lin.num_v_heads * lin.key_dim, bias=True)
        self.norm = GatedRMSNorm(lin.value_dim, cfg.rms_norm_eps, activation="silu")
        self.o_proj = nn.Linear(self.v_dim, cfg.hidden_size, bias=False)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
        return self.qkv_proj(x), {"g": self.g_proj(x), "gk": self.gk_up(self.gk_down(x))}

    def prepare(self, conv_out: torch.Tensor, extras: dict) -> RecurrenceInputs:
        bsz, t = conv_out.shape[:2]
        q, k, v = conv_out.split([self.qk_dim, self.qk_dim, self.v_dim], dim=-1)
        q = self.repeat_heads(q.reshape(bsz, t, self.num_heads, self.key_dim))
        k = self.repeat_heads(k.reshape(bsz, t, self.num_heads, self.key_dim))
        v = v.reshape(bsz, t, self.num_v_heads, self.value_dim)
        gk = F.logsigmoid(extras["gk"].float()).reshape(bsz, t, self.num_v_heads, self.key_dim) / self.normalizer
        return RecurrenceInputs(q=q, k=k, v=v, log_decay=gk, scale=self.key_dim ** -0.5)

    def output(self, o: torch.Tensor, extras: dict) -> torch.Tensor:
        g = extras["g"].reshape(*o.shape)
        return self.o_proj(self.norm(o, g).flatten(-2))
