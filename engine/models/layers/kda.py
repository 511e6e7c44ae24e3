"""Kimi Delta Attention (Kimi-Linear's `KimiLinearDeltaAttention`): the gated delta rule
with a per-key-channel decay (recurrence family `kda`, see linear_ops.py)

    S_t = (I - beta_t k_t k_t^T) diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T,
    o_t = S_t^T (q_t / sqrt(dk))

with separate q, k, v projections (`num_heads` heads of `key_dim` each; values the same
heads and size), one short causal conv (SiLU) over [q | k | v], q and k L2-normalised per
head, the per-channel log decay `g = -exp(A_log_h) * softplus(f(x) + dt_bias)` (Kimi-Linear)
or `g = b * sigmoid(exp(A_log_h) * (f(x) + dt_bias))` with a lower bound b < 0 (Ling 3's
safe gate, `LinearConfig.kda_gate_lower_bound`), `beta = sigmoid(b_proj(x))` per head, and
a gated RMSNorm `rmsnorm(o) * sigmoid(z(x))` per head before the output projection. The
forget gate input f and the output gate z are low-rank pairs through `key_dim`
(`f_b(f_a(x))`, `g_b(g_a(x))`, Kimi-Linear) or single projections (`f_proj`, `g_proj`,
Ling 3; `LinearConfig.kda_full_rank_gates`). Pieces and PIC hooks: see linear_base.py;
the transition T of a segment is a dense `[H, dk, dk]` matrix, as for Gated DeltaNet.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.config import ModelConfig
from engine.models.layers.linear_base import LinearMixer, l2_normalize
from engine.models.layers.linear_ops import RecurrenceInputs
from engine.models.layers.norm import GatedRMSNorm


class KimiDeltaAttention(LinearMixer):
    family = "kda"

    def __init__(self, cfg: ModelConfig, kind: str) -> None:
        lin = cfg.linear
        if lin.num_v_heads != lin.num_heads or lin.value_dim != lin.key_dim:
            raise ValueError(f"kda layers need num_v_heads == num_heads and value_dim == key_dim, got {lin}")
        self.qkv_dim = lin.num_heads * lin.key_dim
        super().__init__(cfg, kind, conv_channels=3 * self.qkv_dim)
        d, h, dk = cfg.hidden_size, lin.num_heads, lin.key_dim
        self.q_proj = nn.Linear(d, self.qkv_dim, bias=False)
        self.k_proj = nn.Linear(d, self.qkv_dim, bias=False)
        self.v_proj = nn.Linear(d, self.qkv_dim, bias=False)
        self.full_rank_gates = lin.kda_full_rank_gates
        self.lower_bound = lin.kda_gate_lower_bound
        if self.full_rank_gates:
            self.f_proj = nn.Linear(d, self.qkv_dim, bias=False)
            self.g_proj = nn.Linear(d, self.qkv_dim, bias=False)
        else:
            self.f_a_proj = nn.Linear(d, dk, bias=False)
            self.f_b_proj = nn.Linear(dk, self.qkv_dim, bias=False)
            self.g_a_proj = nn.Linear(d, dk, bias=False)
            self.g_b_proj = nn.Linear(dk, self.qkv_dim, bias=False)
        self.A_log = nn.Parameter(torch.zeros(h))
        self.dt_bias = nn.Parameter(torch.zeros(self.qkv_dim))
        self.b_proj = nn.Linear(d, h, bias=False)
        self.norm = GatedRMSNorm(dk, cfg.rms_norm_eps, activation="sigmoid")
        self.out_proj = nn.Linear(self.qkv_dim, d, bias=False)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        if self.full_rank_gates:
            f, z = self.f_proj(x), self.g_proj(x)
        else:
            f, z = self.f_b_proj(self.f_a_proj(x)), self.g_b_proj(self.g_a_proj(x))
        return qkv, {"f": f, "b": self.b_proj(x), "z": z}

    def prepare(self, conv_out: torch.Tensor, extras: dict) -> RecurrenceInputs:
        bsz, t = conv_out.shape[:2]
        shape = (bsz, t, self.num_heads, self.key_dim)
        q, k, v = conv_out.split([self.qkv_dim] * 3, dim=-1)
        q, k, v = l2_normalize(q.reshape(shape)), l2_normalize(k.reshape(shape)), v.reshape(shape)
        raw = (extras["f"].float() + self.dt_bias.float()).reshape(shape)
        rate = torch.exp(self.A_log.float())[:, None]
        if self.lower_bound:
            g = self.lower_bound * torch.sigmoid(rate * raw)
        else:
            g = -rate * F.softplus(raw)
        beta = torch.sigmoid(extras["b"].float())
        return RecurrenceInputs(q=q, k=k, v=v, log_decay=g, beta=beta, scale=self.key_dim ** -0.5)

    def output(self, o: torch.Tensor, extras: dict) -> torch.Tensor:
        z = extras["z"].reshape(*o.shape)
        return self.out_proj(self.norm(o, z).flatten(-2))
