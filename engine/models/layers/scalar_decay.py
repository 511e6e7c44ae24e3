"""Scalar-decay linear attention, two production flavours (both the `scalar` family:
`S_t = exp(g_t) S_{t-1} + k_t v_t^T`, one decay per head):

- `LightningAttention` (Ring-linear / MiniMax lightning style): SiLU q, k, v; a fixed,
  data-independent decay per head, ALiBi slopes scaled by depth
  (`g_h = -slope_h * (1 - layer/(L-1) + 1e-5)`); RMSNorm per head times a sigmoid output gate.
- `Mamba2Mixer` (Nemotron-H / Jamba style SSD): in_proj -> [z, xBC, dt]; short conv (SiLU,
  with bias) over xBC; `dt = softplus(dt_raw + dt_bias)`, `g = -exp(A_log) * dt`;
  q = C, k = B (B/C shared by a group of heads), v = dt * x, scale 1; y = o + D * x;
  gated RMSNorm `rmsnorm(y) * silu(z)` per head (or, `mamba_norm="group"` as Nemotron-H,
  `rmsnorm(y * silu(z))` over each B/C group's channels); out_proj. dt may be clamped
  from below (`mamba_dt_min`).

Pieces and PIC hooks: see linear_base.py.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.config import ModelConfig
from engine.models.layers.linear_base import LinearMixer
from engine.models.layers.linear_ops import RecurrenceInputs
from engine.models.layers.norm import GatedRMSNorm, GroupGatedRMSNorm


def alibi_slopes(n: int) -> list[float]:
    """ALiBi head slopes (Press et al.), also used for lightning-attention decay rates."""
    def pow2(m: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(m) - 3)))
        return [start * start ** i for i in range(m)]

    if math.log2(n).is_integer():
        return pow2(n)
    closest = 2 ** math.floor(math.log2(n))
    return pow2(closest) + alibi_slopes(2 * closest)[0::2][: n - closest]


class LightningAttention(LinearMixer):
    family = "scalar"

    def __init__(self, cfg: ModelConfig, kind: str, layer_idx: int) -> None:
        lin = cfg.linear
        self.qk_dim = lin.num_heads * lin.key_dim
        self.v_dim = lin.num_v_heads * lin.value_dim
        super().__init__(cfg, kind, conv_channels=2 * self.qk_dim + self.v_dim)
        self.qkv_proj = nn.Linear(cfg.hidden_size, 2 * self.qk_dim + self.v_dim, bias=False)
        self.g_proj = nn.Linear(cfg.hidden_size, self.v_dim, bias=False)
        self.norm = GatedRMSNorm(lin.value_dim, cfg.rms_norm_eps, activation="sigmoid")
        self.o_proj = nn.Linear(self.v_dim, cfg.hidden_size, bias=False)
        depth = 1.0 - layer_idx / max(1, cfg.num_layers - 1) + 1e-5
        #: fixed per-head log decay (python floats: kept float32 whatever the model dtype)
        self.head_log_decay = [-slope * depth for slope in alibi_slopes(lin.num_v_heads)]
        self._log_decay: dict[torch.device, torch.Tensor] = {}

    def log_decay_tensor(self, device: torch.device) -> torch.Tensor:
        """`head_log_decay` as a float32 tensor on `device`, made once per device (a fresh
        host->device copy every step would sync, and cannot run inside a CUDA graph)."""
        if device not in self._log_decay:
            with torch.inference_mode(False):  # a normal tensor: training may use it later
                self._log_decay[device] = torch.tensor(self.head_log_decay, dtype=torch.float32, device=device)
        return self._log_decay[device]

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
        return self.qkv_proj(x), {"g": self.g_proj(x)}

    def prepare(self, conv_out: torch.Tensor, extras: dict) -> RecurrenceInputs:
        bsz, t = conv_out.shape[:2]
        q, k, v = F.silu(conv_out).split([self.qk_dim, self.qk_dim, self.v_dim], dim=-1)
        q = self.repeat_heads(q.reshape(bsz, t, self.num_heads, self.key_dim))
        k = self.repeat_heads(k.reshape(bsz, t, self.num_heads, self.key_dim))
        v = v.reshape(bsz, t, self.num_v_heads, self.value_dim)
        g = self.log_decay_tensor(conv_out.device).expand(bsz, t, self.num_v_heads)
        return RecurrenceInputs(q=q, k=k, v=v, log_decay=g, scale=self.key_dim ** -0.5)

    def output(self, o: torch.Tensor, extras: dict) -> torch.Tensor:
        g = extras["g"].reshape(*o.shape)
        return self.o_proj(self.norm(o, g).flatten(-2))


class Mamba2Mixer(LinearMixer):
    family = "scalar"

    def __init__(self, cfg: ModelConfig, kind: str) -> None:
        lin = cfg.linear
        self.d_inner = lin.num_v_heads * lin.value_dim
        self.bc_dim = lin.num_heads * lin.key_dim  # groups * d_state
        super().__init__(cfg, kind, conv_channels=self.d_inner + 2 * self.bc_dim, conv_bias=True)
        hv = lin.num_v_heads
        self.in_proj = nn.Linear(cfg.hidden_size, 2 * self.d_inner + 2 * self.bc_dim + hv, bias=False)
        self.A_log = nn.Parameter(torch.zeros(hv))
        self.dt_bias = nn.Parameter(torch.zeros(hv))
        self.D = nn.Parameter(torch.ones(hv))
        self.dt_min = lin.mamba_dt_min
        if lin.mamba_norm == "group":
            self.norm = GroupGatedRMSNorm(self.d_inner, self.d_inner // lin.num_heads, cfg.rms_norm_eps)
        else:
            self.norm = GatedRMSNorm(lin.value_dim, cfg.rms_norm_eps, activation="silu")
        self.out_proj = nn.Linear(self.d_inner, cfg.hidden_size, bias=False)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
        z, xbc, dt = self.in_proj(x).split(
            [self.d_inner, self.d_inner + 2 * self.bc_dim, self.num_v_heads], dim=-1)
        return xbc, {"z": z, "dt": dt}

    def prepare(self, conv_out: torch.Tensor, extras: dict) -> RecurrenceInputs:
        bsz, t = conv_out.shape[:2]
        x, b, c = conv_out.split([self.d_inner, self.bc_dim, self.bc_dim], dim=-1)
        x = x.reshape(bsz, t, self.num_v_heads, self.value_dim)
        b = self.repeat_heads(b.reshape(bsz, t, self.num_heads, self.key_dim))
        c = self.repeat_heads(c.reshape(bsz, t, self.num_heads, self.key_dim))
        dt = F.softplus(extras["dt"].float() + self.dt_bias.float())  # [B, T, Hv]
        if self.dt_min:
            dt = dt.clamp(min=self.dt_min)
        g = -torch.exp(self.A_log.float()) * dt
        extras["x"] = x
        v = (x.float() * dt[..., None]).to(x.dtype)
        return RecurrenceInputs(q=c, k=b, v=v, log_decay=g, scale=1.0)

    def output(self, o: torch.Tensor, extras: dict) -> torch.Tensor:
        x = extras["x"]
        y = o + x * self.D.to(x.dtype)[:, None]
        if isinstance(self.norm, GroupGatedRMSNorm):
            return self.out_proj(self.norm(y.flatten(-2), extras["z"]))
        z = extras["z"].reshape(*o.shape)
        return self.out_proj(self.norm(y, z).flatten(-2))
