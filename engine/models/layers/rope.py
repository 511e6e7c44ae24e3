"""Rotary position embedding, rotate-half convention (HF Llama / vLLM neox style) on the
first `rotary_dim` dims of each head; the remaining dims pass through unchanged.

`inv_freq[i] = theta ** (-2i / rotary_dim)`; the angle of position p in pair i is
`p * inv_freq[i]`, computed in float32. Rotation is additive in the position, so keys
stored at base 0 are moved to offset d with `apply_rope(k, positions=d)` (for PIC re-rotation;
a fused Triton kernel in kernels/ does the same while scattering into the paged KV).
"""
from __future__ import annotations

import torch


def rope_inv_freq(rotary_dim: int, theta: float, device: torch.device | str | None = None) -> torch.Tensor:
    """`[rotary_dim // 2]` float32 inverse frequencies."""
    idx = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device)
    return 1.0 / (theta ** (idx / rotary_dim))


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape `[*positions.shape, rotary_dim]` (float32; halves repeated)."""
    angles = positions.to(torch.float32)[..., None] * inv_freq.to(positions.device)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate `x[..., T, H, D]` (any leading dims matching `positions[..., T]`) by the angle of
    each token's position. Only the first `2 * len(inv_freq)` dims rotate."""
    if inv_freq.numel() == 0:
        return x
    cos, sin = rope_cos_sin(positions, inv_freq)
    return apply_rope_cos_sin(x, cos[..., None, :], sin[..., None, :])


def apply_rope_cos_sin(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`apply_rope` with the angles' cos/sin given (`[..., T, 1, rotary_dim]`, from
    `rope_cos_sin`), so q and k of one call share them."""
    rot = cos.shape[-1]
    xr = x[..., :rot].to(torch.float32)
    half = rot // 2
    rotated = torch.cat([-xr[..., half:], xr[..., :half]], dim=-1)
    out = (xr * cos + rotated * sin).to(x.dtype)
    if rot == x.shape[-1]:
        return out
    return torch.cat([out, x[..., rot:]], dim=-1)
