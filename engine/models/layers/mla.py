"""Multi-head latent attention (DeepSeek-V2's MLA as Kimi-Linear's `KimiLinearAttention`
defines it), mapped onto the attention family by expanding the latent to per-head K and V.

    q        = q_proj(x)                 or q_b(rmsnorm(q_a(x)))       [H, nope + rope]
    c, k_sh  = split(kv_a(x), [kv_lora_rank, rope])
    k_n, v   = split(kv_b(rmsnorm(c)), [nope, v_dim]) per head
    k        = [k_n | k_sh] (k_sh shared by every head),  softmax scale (nope + rope)^-1/2

Kimi-Linear uses no RoPE (NoPE: `k_sh` is not rotated, `rotary_dim` 0); Ling 3 rotates
the shared part of k and the rope part of q (`rotary_dim = mla_rope_dim`, rotate-half: a
checkpoint with DeepSeek's interleaved pairs has those projection rows permuted to
[even | odd] at load time, the same dot products) and gates each head's output by
`sigmoid(g_proj(x))` (`mla_head_gate`). The caches hold the expanded K and V, one KV head
per query head, each `head_dim = max(nope + rope, v_dim)` wide with zero padding: K as
[k_sh | k_n | 0], q in the same order (RoPE on the first `rotary_dim` dims, as the
attention family rotates and PIC re-rotates them), V as [v | 0], and only the first
`v_dim` output dims of each head enter `o_proj`. The dot products, hence the
outputs, are the reference's exactly; a cache of the latent itself (smaller) is future
work. Everything else (caches, PIC hooks, decode) is the attention family's unchanged.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.config import ModelConfig
from engine.models.layers.attention import Attention
from engine.models.layers.base import TokenMixer
from engine.models.layers.norm import RMSNorm
from engine.models.layers.rope import apply_rope_cos_sin, rope_cos_sin


class LatentAttention(Attention):
    def __init__(self, cfg: ModelConfig, kind: str) -> None:
        TokenMixer.__init__(self)
        self._init_geometry(cfg, kind)
        a = cfg.attention
        if not a.is_mla:
            raise ValueError("LatentAttention needs an AttentionConfig with mla_kv_lora_rank > 0")
        d, h = cfg.hidden_size, a.num_heads
        self.nope_dim, self.rope_dim, self.v_dim = a.mla_nope_dim, a.mla_rope_dim, a.mla_v_dim
        self.kv_lora_rank = a.mla_kv_lora_rank
        qk = self.nope_dim + self.rope_dim
        if a.mla_q_lora_rank:
            self.q_proj = None
            self.q_a_proj = nn.Linear(d, a.mla_q_lora_rank, bias=False)
            self.q_a_norm = RMSNorm(a.mla_q_lora_rank, 1e-6)
            self.q_b_proj = nn.Linear(a.mla_q_lora_rank, h * qk, bias=False)
        else:
            self.q_proj = nn.Linear(d, h * qk, bias=False)
        self.kv_a_proj = nn.Linear(d, self.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_a_norm = RMSNorm(self.kv_lora_rank, 1e-6)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, h * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(h * self.v_dim, d, bias=False)
        self.g_proj = nn.Linear(d, h, bias=False) if a.mla_head_gate else None
        self.q_norm = self.k_norm = None

    def _pad(self, x: torch.Tensor) -> torch.Tensor:
        extra = self.head_dim - x.shape[-1]
        return x if extra == 0 else F.pad(x, (0, extra))

    def project(self, x: torch.Tensor, positions: torch.Tensor):
        """x `[..., T, D]`, positions `[T]` -> q `[..., T, H, hd]`, k and v `[..., T, H, hd]`
        (expanded, zero padded, q/k rotated to `positions` when `rotary_dim`), gate
        `[..., T, H, 1]` or None."""
        lead = x.shape[:-1]
        h = self.num_heads
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))
        q_nope, q_sh = q.view(*lead, h, self.nope_dim + self.rope_dim).split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_sh = self.kv_a_proj(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_norm(latent)).view(*lead, h, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k_sh = k_sh[..., None, :].expand(*lead, h, self.rope_dim)
        q = self._pad(torch.cat([q_sh, q_nope], dim=-1))
        k = self._pad(torch.cat([k_sh, k_nope], dim=-1))
        if self.rotary_dim:
            cos, sin = rope_cos_sin(positions, self.inv_freq)
            cos, sin = cos[..., None, :], sin[..., None, :]
            q, k = apply_rope_cos_sin(q, cos, sin), apply_rope_cos_sin(k, cos, sin)
        gate = None if self.g_proj is None else self.g_proj(x)[..., None]
        return q, k, self._pad(v), gate

    def output(self, o: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        o = o[..., :self.v_dim]
        if gate is not None:
            o = o * torch.sigmoid(gate.float()).to(o.dtype)
        return self.o_proj(o.flatten(-2))
