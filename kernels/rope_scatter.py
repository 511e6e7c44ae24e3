"""RoPE re-rotation fused with the scatter of a cached segment's K/V into a paged KV pool.

Owns the position-independent-caching splice of full-attention layers: a segment's keys
were cached rotated at base positions 0..n-1; placing the segment at its true start
position `offset` needs keys rotated at offset..offset+n-1. RoPE rotations compose,
R(p + offset) = R(offset) R(p), so the splice rotates every cached key by the same delta
R(offset) and writes it (and V, unchanged) into the pool slots in one pass.

Convention (docs/ARCHITECTURE.md): rotate-half (HF Llama / vLLM neox style) on the first
`rotary_dim` dims of each head, the rest pass through; for pair i < rotary_dim / 2,
    out[i]        = x[i] cos(a_i) - x[i + half] sin(a_i)
    out[i + half] = x[i + half] cos(a_i) + x[i] sin(a_i)
with a_i = position * inv_freq[i] and `rope_inv_freq` the frequencies.

Angle precision of the delta rotation (`angle_precision`):
  * "fp64" (default): inv_freq as the model holds it (float32 values), the angle
    offset * inv_freq and its cos/sin evaluated in float64 on the host side, then rounded
    to float32. The delta is then exact to float32 rounding at any offset, so a re-rotated
    key sits closer to the exact key at its true position than the model's own float32
    RoPE at that position (whose angle fl32(p * inv_freq) is off by up to half a float32
    ulp of p * inv_freq, ~4e-3 rad at p = 1e5).
  * "fp32": the angle fl32(fl32(offset) * inv_freq) and cos/sin in float32, exactly as the
    model computes the rotation of a token at position `offset`.
Either way the 2x2 rotation itself runs in float32 and the result is rounded once to the
pool dtype.

Destination: `slot_mapping[t]` is the flat slot block_id * block_size + in-block offset of
token t (-1: skip the token). A sliding-window ring `[num_slots, window, H, D]` is a pool
with block_size = window; `ring_slot_mapping` builds its slots (ring index p % window).
Duplicate slots in one call are not detected; which write wins is then unspecified.
"""
from __future__ import annotations

import operator
from typing import Optional, Union

import torch

from kernels.backend import HAS_TRITON, next_pow2, tl, triton, use_triton
from kernels.errors import KernelInputError

__all__ = [
    "rope_inv_freq",
    "rope_delta_cos_sin",
    "apply_rope_reference",
    "rope_scatter",
    "rope_scatter_reference",
    "ring_slot_mapping",
]

_ANGLE_PRECISIONS = ("fp64", "fp32")
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def rope_inv_freq(rotary_dim: int, theta: float = 10000.0,
                  device: Optional[torch.device] = None) -> torch.Tensor:
    """float32 `[rotary_dim // 2]`: theta ** (-2i / rotary_dim), computed as HF Llama does
    (1 / theta ** (arange(0, rotary_dim, 2) / rotary_dim) in float32), so the values are
    bit-identical to the model's."""
    if rotary_dim <= 0 or rotary_dim % 2:
        raise KernelInputError(f"rotary_dim must be a positive even int, got {rotary_dim!r}")
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device).float() / rotary_dim
    return 1.0 / (float(theta) ** exponent)


def rope_delta_cos_sin(offset: Union[int, torch.Tensor], inv_freq: torch.Tensor,
                       angle_precision: str = "fp64") -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the delta rotation by `offset`, float32 `[rows, rotary_dim // 2]`
    (rows = 1 for an int offset, n for a per-token offset tensor `[n]`)."""
    if angle_precision not in _ANGLE_PRECISIONS:
        raise KernelInputError(
            f"angle_precision must be one of {_ANGLE_PRECISIONS}, got {angle_precision!r}")
    if isinstance(offset, torch.Tensor):
        off = offset.to(device=inv_freq.device).reshape(-1, 1)
    else:
        off = torch.tensor([[int(offset)]], dtype=torch.int64, device=inv_freq.device)
    if angle_precision == "fp64":
        angle = off.double() * inv_freq.float().double()[None, :]
    else:
        angle = off.float() * inv_freq.float()[None, :]
    return angle.cos().float().contiguous(), angle.sin().float().contiguous()


def apply_rope_reference(x: torch.Tensor, positions: torch.Tensor, rotary_dim: int,
                         inv_freq: torch.Tensor, compute_dtype: torch.dtype = torch.float32
                         ) -> torch.Tensor:
    """RoPE of `x [n, H, D]` at `positions [n]` the way the model applies it: angle
    positions * inv_freq and cos/sin in `compute_dtype` (float32 for the model; float64
    gives the exact rotation for the model's float32 inv_freq). Returns `compute_dtype`."""
    angle = positions.to(compute_dtype)[:, None] * inv_freq.to(compute_dtype)[None, :]
    return _rotate(x.to(compute_dtype), angle.cos()[:, None, :], angle.sin()[:, None, :], rotary_dim)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    half = rotary_dim // 2
    x1, x2, rest = x[..., :half], x[..., half:rotary_dim], x[..., rotary_dim:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


def ring_slot_mapping(ring_slot: int, positions: torch.Tensor, window: int) -> torch.Tensor:
    """Flat slots of `positions` in ring `ring_slot` of a sliding-window buffer
    `[num_slots, window, H, D]` viewed as a pool with block_size = window: position p goes
    to ring index p % window. Positions not among the last `window` of `positions` get -1
    (a later position overwrites their ring index anyway), so one call never writes the
    same slot twice."""
    if window <= 0:
        raise KernelInputError(f"window must be positive, got {window!r}")
    if ring_slot < 0:
        raise KernelInputError(f"ring_slot must be >= 0, got {ring_slot!r}")
    positions = positions.to(torch.int64)
    if positions.numel() == 0:
        return positions.clone()
    newest = positions.max()
    slots = ring_slot * window + positions % window
    return torch.where(positions > newest - window, slots, torch.full_like(slots, -1))


# --------------------------------------------------------------------------- validation
def _validate(k, v, k_pages, v_pages, slot_mapping, offset, rotary_dim, inv_freq, theta, check_slots):
    if k.dim() != 3:
        raise KernelInputError(f"k must be [n, num_kv_heads, head_dim], got shape {tuple(k.shape)}")
    if v.shape != k.shape:
        raise KernelInputError(f"v shape {tuple(v.shape)} != k shape {tuple(k.shape)}")
    if k_pages.dim() != 4:
        raise KernelInputError(
            f"k_pages must be [num_blocks, block_size, num_kv_heads, head_dim], got {tuple(k_pages.shape)}")
    if v_pages.shape != k_pages.shape:
        raise KernelInputError(f"v_pages shape {tuple(v_pages.shape)} != k_pages shape {tuple(k_pages.shape)}")
    if tuple(k_pages.shape[2:]) != tuple(k.shape[1:]):
        raise KernelInputError(
            f"pages hold [num_kv_heads, head_dim] = {tuple(k_pages.shape[2:])} but k has {tuple(k.shape[1:])}")
    for name, t in (("k", k), ("v", v), ("k_pages", k_pages), ("v_pages", v_pages)):
        if t.dtype not in _FLOAT_DTYPES:
            raise KernelInputError(f"{name} dtype must be one of {_FLOAT_DTYPES}, got {t.dtype}")
    n, _, head_dim = k.shape
    if slot_mapping.shape != (n,) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise KernelInputError(
            f"slot_mapping must be int32/int64 [{n}], got {slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    devices = {t.device for t in (k, v, k_pages, v_pages, slot_mapping)}
    if len(devices) != 1:
        raise KernelInputError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    rotary_dim = head_dim if rotary_dim is None else int(rotary_dim)
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_dim:
        raise KernelInputError(f"rotary_dim must be even and in (0, head_dim={head_dim}], got {rotary_dim}")
    if isinstance(offset, torch.Tensor):
        if offset.shape != (n,) or offset.dtype not in (torch.int32, torch.int64):
            raise KernelInputError(
                f"a per-token offset must be int32/int64 [{n}], got {offset.dtype} {tuple(offset.shape)}")
    else:
        try:
            if isinstance(offset, bool):
                raise TypeError
            offset = operator.index(offset)
        except TypeError:
            raise KernelInputError(f"offset must be an int or an int tensor [n], got {offset!r}") from None
    if inv_freq is None:
        inv_freq = rope_inv_freq(rotary_dim, theta, device=k.device)
    elif inv_freq.shape != (rotary_dim // 2,):
        raise KernelInputError(
            f"inv_freq must have shape [{rotary_dim // 2}] for rotary_dim={rotary_dim}, got {tuple(inv_freq.shape)}")
    num_slots = k_pages.shape[0] * k_pages.shape[1]
    if n and check_slots:
        lo, hi = int(slot_mapping.min()), int(slot_mapping.max())
        if lo < -1 or hi >= num_slots:
            raise KernelInputError(
                f"slot_mapping values must be -1 or in [0, {num_slots}), got range [{lo}, {hi}]")
    return rotary_dim, inv_freq.to(k.device), offset


# --------------------------------------------------------------------------- reference
def rope_scatter_reference(k: torch.Tensor, v: torch.Tensor, k_pages: torch.Tensor,
                           v_pages: torch.Tensor, slot_mapping: torch.Tensor,
                           offset: Union[int, torch.Tensor], *, rotary_dim: Optional[int] = None,
                           theta: float = 10000.0, inv_freq: Optional[torch.Tensor] = None,
                           angle_precision: str = "fp64", check_slots: bool = True) -> None:
    """Torch reference of `rope_scatter` (same arguments, same in-place effect)."""
    rotary_dim, inv_freq, offset = _validate(k, v, k_pages, v_pages, slot_mapping, offset,
                                             rotary_dim, inv_freq, theta, check_slots)
    cos, sin = rope_delta_cos_sin(offset, inv_freq, angle_precision)
    _rope_scatter_torch(k, v, k_pages, v_pages, slot_mapping, cos, sin, rotary_dim)


def _rope_scatter_torch(k, v, k_pages, v_pages, slot_mapping, cos, sin, rotary_dim) -> None:
    rotated = _rotate(k.float(), cos[:, None, :], sin[:, None, :], rotary_dim)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].to(torch.int64)
    block_size = k_pages.shape[1]
    blk, off = slots // block_size, slots % block_size
    k_pages[blk, off] = rotated[keep].to(k_pages.dtype)
    v_pages[blk, off] = v[keep].to(v_pages.dtype)


# --------------------------------------------------------------------------- triton
if HAS_TRITON:

    @triton.jit
    def _rope_scatter_kernel(
        k_ptr, v_ptr, kp_ptr, vp_ptr, slot_ptr, cos_ptr, sin_ptr,
        num_heads, head_dim, half_rot, block_size,
        s_kn, s_kh, s_kd, s_vn, s_vh, s_vd,
        s_kpb, s_kpo, s_kph, s_kpd,
        s_vpb, s_vpo, s_vph, s_vpd,
        s_cs,
        BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        tok = tl.program_id(0)
        head_block = tl.program_id(1)
        slot = tl.load(slot_ptr + tok).to(tl.int64)
        valid = slot >= 0
        slot = tl.where(valid, slot, 0)
        blk = slot // block_size
        off = slot % block_size

        heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        hmask = (heads < num_heads) & valid
        mask = hmask[:, None] & (d < head_dim)[None, :]

        # rotate-half: dim d pairs with d + half (d < half) or d - half (half <= d < rot);
        # dims >= rot pass through (cos 1, sin 0).
        rot = 2 * half_rot
        lower = d < half_rot
        in_rot = d < rot
        partner = tl.where(lower, d + half_rot, tl.where(in_rot, d - half_rot, d))
        freq = tl.where(lower, d, d - half_rot)
        row = tok.to(tl.int64) * s_cs
        c = tl.load(cos_ptr + row + freq, mask=in_rot, other=1.0)
        s = tl.load(sin_ptr + row + freq, mask=in_rot, other=0.0)
        s = tl.where(lower, -s, s)

        k_row = k_ptr + tok.to(tl.int64) * s_kn + heads[:, None].to(tl.int64) * s_kh
        x = tl.load(k_row + d[None, :] * s_kd, mask=mask, other=0.0).to(tl.float32)
        xp = tl.load(k_row + partner[None, :] * s_kd, mask=mask, other=0.0).to(tl.float32)
        out = x * c[None, :] + xp * s[None, :]
        kp_row = kp_ptr + blk * s_kpb + off * s_kpo + heads[:, None].to(tl.int64) * s_kph
        tl.store(kp_row + d[None, :] * s_kpd, out.to(kp_ptr.dtype.element_ty), mask=mask)

        v_row = v_ptr + tok.to(tl.int64) * s_vn + heads[:, None].to(tl.int64) * s_vh
        vals = tl.load(v_row + d[None, :] * s_vd, mask=mask, other=0.0)
        vp_row = vp_ptr + blk * s_vpb + off * s_vpo + heads[:, None].to(tl.int64) * s_vph
        tl.store(vp_row + d[None, :] * s_vpd, vals.to(vp_ptr.dtype.element_ty), mask=mask)


def _rope_scatter_triton(k, v, k_pages, v_pages, slot_mapping, cos, sin, rotary_dim) -> None:
    n, num_heads, head_dim = k.shape
    if n == 0:
        return
    block_d = next_pow2(head_dim)
    block_h = min(next_pow2(num_heads), max(1, 4096 // block_d))
    grid = (n, triton.cdiv(num_heads, block_h))
    _rope_scatter_kernel[grid](
        k, v, k_pages, v_pages, slot_mapping, cos, sin,
        num_heads, head_dim, rotary_dim // 2, k_pages.shape[1],
        *k.stride(), *v.stride(), *k_pages.stride(), *v_pages.stride(),
        cos.stride(0) if cos.shape[0] > 1 else 0,
        BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4,
    )


def rope_scatter(k: torch.Tensor, v: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                 slot_mapping: torch.Tensor, offset: Union[int, torch.Tensor], *,
                 rotary_dim: Optional[int] = None, theta: float = 10000.0,
                 inv_freq: Optional[torch.Tensor] = None, angle_precision: str = "fp64",
                 check_slots: bool = True, force_triton: Optional[bool] = None,
                 cos_sin: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> None:
    """Rotate cached keys `k [n, Hkv, D]` (at base positions 0..n-1) by `offset` and write
    them, with `v [n, Hkv, D]`, into `k_pages`/`v_pages [num_blocks, block_size, Hkv, D]`
    at `slot_mapping [n]` (-1 skips a token). In place; returns None.

    offset: int (the segment's true start position) or an int tensor `[n]` of per-token
    deltas (several segments spliced in one call). rotary_dim: defaults to head_dim.
    inv_freq: the model's float32 frequencies `[rotary_dim // 2]` (for scaled RoPE
    variants); defaults to `rope_inv_freq(rotary_dim, theta)`. angle_precision: "fp64" or
    "fp32", see the module docstring. check_slots: verify every slot is -1 or inside the
    pool before writing (reads slot_mapping's range: one device sync on CUDA); pass False
    on a hot path whose slots come from the engine's own allocator. cos_sin: the
    `rope_delta_cos_sin(offset, inv_freq, angle_precision)` of this call, made once by a
    caller that writes the same offsets for several layers (owned by the caller, read
    only); None makes it here."""
    rotary_dim, inv_freq, offset = _validate(k, v, k_pages, v_pages, slot_mapping, offset,
                                             rotary_dim, inv_freq, theta, check_slots)
    if cos_sin is None:
        cos, sin = rope_delta_cos_sin(offset, inv_freq, angle_precision)
    else:
        cos, sin = cos_sin
        rows = 1 if not isinstance(offset, torch.Tensor) else k.shape[0]
        if cos.shape != (rows, rotary_dim // 2) or sin.shape != cos.shape or cos.device != k.device:
            raise KernelInputError(f"cos_sin must be two [{rows}, {rotary_dim // 2}] tensors on {k.device}, "
                                   f"got {tuple(cos.shape)} and {tuple(sin.shape)} on {cos.device}")
    if not use_triton((k, v, k_pages, v_pages), force_triton, "rope_scatter"):
        _rope_scatter_torch(k, v, k_pages, v_pages, slot_mapping, cos, sin, rotary_dim)
        return
    _rope_scatter_triton(k, v, k_pages, v_pages, slot_mapping, cos, sin, rotary_dim)
