"""The linear-attention recurrence's inputs and its token-by-token reference.

All four families share one recurrence over a state S of shape `[B, H, K, V]` (float32):
S_t = T_t S_{t-1} + u_t, o_t = S_t^T (scale * q_t), with T_t and u_t per family as
tabled in engine.models.layers.linear_ops (which holds the chunked torch forms and the
transition operators built on this). `naive_recurrence` is the reference every faster
form, the seam-chain kernel (kernels.seam_chain) included, is tested against.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kernels.errors import KernelInputError

FAMILIES = ("scalar", "diag", "delta", "kda")
#: families whose transition T is a dense `[H, K, K]` matrix (a delta-rule update inside)
DENSE_FAMILIES = ("delta", "kda")
#: families whose log decay is per key channel, `[B, T, H, K]`
CHANNEL_DECAY_FAMILIES = ("diag", "kda")


@dataclass
class RecurrenceInputs:
    """Per-token inputs of one linear layer's recurrence (time-first)."""

    q: torch.Tensor  # [B, T, H, K]
    k: torch.Tensor  # [B, T, H, K]
    v: torch.Tensor  # [B, T, H, V]
    log_decay: torch.Tensor  # [B, T, H] (scalar, delta) or [B, T, H, K] (diag, kda); <= 0, float32
    beta: torch.Tensor | None = None  # [B, T, H] (delta, kda only)
    scale: float = 1.0

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        b, t, h, kd = self.k.shape
        return b, t, h, kd, self.v.shape[-1]

    def slice_time(self, start: int, end: int) -> "RecurrenceInputs":
        return replace(
            self,
            q=self.q[:, start:end], k=self.k[:, start:end], v=self.v[:, start:end],
            log_decay=self.log_decay[:, start:end],
            beta=None if self.beta is None else self.beta[:, start:end],
        )


def check_family(family: str, inp: RecurrenceInputs) -> None:
    """Raise KernelInputError (a ValueError) when `inp` does not fit `family`."""
    if family not in FAMILIES:
        raise KernelInputError(f"recurrence family={family!r} must be one of {FAMILIES}")
    want = 4 if family in CHANNEL_DECAY_FAMILIES else 3
    if inp.log_decay.dim() != want:
        raise KernelInputError(f"{family} log_decay must have {want} dims, got shape {tuple(inp.log_decay.shape)}")
    if family in DENSE_FAMILIES and inp.beta is None:
        raise KernelInputError(f"{family} family needs beta")


def checked_state(inp: RecurrenceInputs, state: torch.Tensor | None) -> torch.Tensor:
    """`state` as float32 `[B, H, K, V]` checked against `inp`, or zeros when None."""
    b, _, h, kd, vd = inp.shape
    if state is None:
        return torch.zeros(b, h, kd, vd, dtype=torch.float32, device=inp.k.device)
    if tuple(state.shape) != (b, h, kd, vd):
        raise KernelInputError(f"initial_state shape {tuple(state.shape)} != {(b, h, kd, vd)}")
    return state.to(torch.float32)


def naive_recurrence(family: str, inp: RecurrenceInputs,
                     initial_state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token loop, float32. Returns (o `[B, T, H, V]` in v's dtype, S `[B, H, K, V]`)."""
    check_family(family, inp)
    s = checked_state(inp, initial_state).clone()
    q = inp.q.to(torch.float32) * inp.scale
    k, v = inp.k.to(torch.float32), inp.v.to(torch.float32)
    g = inp.log_decay.to(torch.float32)
    outs = []
    for t in range(q.shape[1]):
        kt, vt = k[:, t], v[:, t]
        if family in CHANNEL_DECAY_FAMILIES:
            s = torch.exp(g[:, t])[..., :, None] * s
        else:
            s = torch.exp(g[:, t])[..., None, None] * s
        if family in DENSE_FAMILIES:
            beta = inp.beta[:, t].to(torch.float32)[..., None]
            vt = beta * (vt - torch.einsum("bhkv,bhk->bhv", s, kt))
        s = s + kt[..., :, None] * vt[..., None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", s, q[:, t]))
    o = torch.stack(outs, dim=1) if outs else inp.v.new_zeros(inp.v.shape).float()
    return o.to(inp.v.dtype), s
