"""Scalar-decay linear attention, two production flavours (both the `scalar` family:
`S_t = exp(g_t) S_{t-1} + k_t v_t^T`, one decay per head):

- `LightningAttention` (Ring-linear / MiniMax lightning style): SiLU q, k, v; a fixed,
  data-independent decay per head, ALiBi slopes scaled by depth
  (`g_h = -slope_h * (1 - layer/(L-1) + 1e-5)`); RMSNorm per head times a sigmoid output gate.
  Ring-linear-2.0's checkpoints switch on, through `LinearConfig`: no SiLU (`qkv_silu`),
  q/k RMSNorm per head (`qk_norm`), RoPE on q and k at the absolute positions
  (`rotary_dim`, `rope_theta`), a group RMSNorm over all channels before the gate
  (`norm_groups`), and the depth term `layer - 1` (`decay_layer_offset=-1`).
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
from engine.errors import ConfigError
from engine.models.layers.norm import GatedRMSNorm, GroupGatedRMSNorm, GroupRMSNormGate, RMSNorm
from engine.models.layers.rope import apply_rope_cos_sin, rope_cos_sin, rope_inv_freq


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
        if lin.norm_groups:
            self.norm = GroupRMSNormGate(self.v_dim, lin.norm_groups, cfg.rms_norm_eps)
        else:
            self.norm = GatedRMSNorm(lin.value_dim, cfg.rms_norm_eps, activation="sigmoid")
        self.o_proj = nn.Linear(self.v_dim, cfg.hidden_size, bias=False)
        self.qkv_silu = lin.qkv_silu
        self.q_norm = RMSNorm(lin.key_dim, cfg.rms_norm_eps) if lin.qk_norm else None
        self.k_norm = RMSNorm(lin.key_dim, cfg.rms_norm_eps) if lin.qk_norm else None
        self.rotary_dim, self.rope_theta = lin.rotary_dim, lin.rope_theta
        self.uses_positions = lin.rotary_dim > 0
        self._inv_freq: dict[torch.device, torch.Tensor] = {}
        depth = 1.0 - (layer_idx + lin.decay_layer_offset) / max(1, cfg.num_layers - 1) + 1e-5
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

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        if device not in self._inv_freq:
            with torch.inference_mode(False):
                self._inv_freq[device] = rope_inv_freq(self.rotary_dim, self.rope_theta, device)
        return self._inv_freq[device]

    def rotate_state(self, state: torch.Tensor, delta: int | torch.Tensor) -> torch.Tensor:
        """A state `[..., H, dk, dv]` whose keys sat at positions p, moved to p + delta: the
        key dims rotate by delta's angles (`R_delta S`; the decay commutes with it). Identity
        without RoPE. `delta`: an int, or a tensor broadcasting against the leading dims."""
        if not self.uses_positions:
            return state
        d = torch.as_tensor(delta, device=state.device)
        cos, sin = rope_cos_sin(d, self.inv_freq(state.device))  # [..., rot]
        rotated = apply_rope_cos_sin(state.transpose(-1, -2), cos[..., None, None, :], sin[..., None, None, :])
        return rotated.transpose(-1, -2)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
        return self.qkv_proj(x), {"g": self.g_proj(x)}

    def prepare(self, conv_out: torch.Tensor, extras: dict) -> RecurrenceInputs:
        bsz, t = conv_out.shape[:2]
        qkv = F.silu(conv_out) if self.qkv_silu else conv_out
        q, k, v = qkv.split([self.qk_dim, self.qk_dim, self.v_dim], dim=-1)
        q = q.reshape(bsz, t, self.num_heads, self.key_dim)
        k = k.reshape(bsz, t, self.num_heads, self.key_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.uses_positions:
            positions = extras.get("positions")
            if positions is None:
                raise ConfigError("this lightning layer applies RoPE to q and k (linear rotary_dim="
                                  f"{self.rotary_dim}): its recurrence inputs need the tokens' positions")
            cos, sin = rope_cos_sin(positions, self.inv_freq(conv_out.device))
            q = apply_rope_cos_sin(q, cos[..., None, :], sin[..., None, :])
            k = apply_rope_cos_sin(k, cos[..., None, :], sin[..., None, :])
        q, k = self.repeat_heads(q), self.repeat_heads(k)
        v = v.reshape(bsz, t, self.num_v_heads, self.value_dim)
        g = self.log_decay_tensor(conv_out.device).expand(bsz, t, self.num_v_heads)
        return RecurrenceInputs(q=q, k=k, v=v, log_decay=g, scale=self.key_dim ** -0.5)

    def output(self, o: torch.Tensor, extras: dict) -> torch.Tensor:
        if isinstance(self.norm, GroupRMSNormGate):
            return self.o_proj(self.norm(o.flatten(-2), extras["g"]))
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
