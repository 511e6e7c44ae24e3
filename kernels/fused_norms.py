"""Fused row norms of the linear-attention layers, float32 inside, one read of each input and
one write: the CUDA path of engine/models/layers/norm.py's `GatedRMSNorm`,
`GroupRMSNormGate` and `l2_normalize`.

    l2:     y = x * rsqrt(sum_d x^2 + eps)
    gated:  y = x * rsqrt(mean_d x^2 + eps) * weight[seg(r)] * act(gate),  act = silu | sigmoid

over rows of `G` channels: x viewed as `[R, G]` (its last dim split into groups of G when
G divides it), row r using weight segment `r % P` of a weight `[P * G]` (P = 1 for a
per-head norm whose weight spans one head; P = groups for Ring's group norm whose weight
spans every group of a token). Outputs have x's dtype.

Why: the torch forms upcast to float32 copies, run `rms_norm` in float32 and convert back
(`.to(float32)`, norm, gate, multiply, `.to(dtype)`: 4-6 kernels and 3-5 passes over
float32 copies per call); on a 16k-token prefill of qwen3.5-35b-a3b-real those norms and
copies took ~45 ms of 409 (tools/profile_prefill.py). Dispatch per kernels/backend.py.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from kernels.backend import HAS_TRITON, next_pow2, tl, triton, use_triton
from kernels.errors import KernelInputError

__all__ = ["l2_normalize_rows", "l2_normalize_rows_reference", "gated_rms_norm_rows",
           "gated_rms_norm_rows_reference"]

_ACTS = ("silu", "sigmoid")


def _rows(x: torch.Tensor, g: int) -> torch.Tensor:
    if g < 1 or x.shape[-1] % g:
        raise KernelInputError(f"row size {g} must divide the last dim {x.shape[-1]}")
    return x.reshape(-1, g)


def l2_normalize_rows_reference(x: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.to(torch.float32)
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


def gated_rms_norm_rows_reference(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                                  activation: str, group: int) -> torch.Tensor:
    """The torch definition (module docstring); x, gate `[..., C]`, weight `[P * group]`."""
    if activation not in _ACTS:
        raise KernelInputError(f"activation must be one of {_ACTS}, got {activation!r}")
    lead = x.shape[:-1]
    xf = _rows(x, group).to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    xf = xf.reshape(*lead, -1, group) * weight.to(torch.float32).reshape(-1, group)
    g = gate.to(torch.float32).reshape(*lead, -1, group)
    g = F.silu(g) if activation == "silu" else torch.sigmoid(g)
    return (xf * g).reshape(x.shape).to(x.dtype)


if HAS_TRITON:

    @triton.jit
    def _row_norm_kernel(x_ptr, g_ptr, w_ptr, y_ptr, R, G, P, eps,
                         GATED: tl.constexpr, SILU: tl.constexpr, ROWS: tl.constexpr, BLOCK_G: tl.constexpr):
        r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
        d = tl.arange(0, BLOCK_G)
        rmask = r < R
        dmask = d < G
        m = rmask[:, None] & dmask[None, :]
        off = r[:, None] * G + d[None, :]
        x = tl.load(x_ptr + off, mask=m, other=0.0).to(tl.float32)
        ss = tl.sum(x * x, axis=1)
        if GATED:
            inv = 1.0 / tl.sqrt(ss / G + eps)
            w = tl.load(w_ptr + (r % P)[:, None] * G + d[None, :], mask=m, other=0.0).to(tl.float32)
            gt = tl.load(g_ptr + off, mask=m, other=0.0).to(tl.float32)
            if SILU:
                act = gt * tl.sigmoid(gt)
            else:
                act = tl.sigmoid(gt)
            y = x * inv[:, None] * w * act
        else:
            inv = 1.0 / tl.sqrt(ss + eps)
            y = x * inv[:, None]
        tl.store(y_ptr + off, y.to(y_ptr.dtype.element_ty), mask=m)


def _launch(x2: torch.Tensor, g2: Optional[torch.Tensor], w: Optional[torch.Tensor], p: int, eps: float,
            silu: bool) -> torch.Tensor:
    r, g = x2.shape
    y = torch.empty_like(x2)
    if r == 0:
        return y
    block = next_pow2(g)
    rows = max(1, min(64, 4096 // block))
    _row_norm_kernel[(triton.cdiv(r, rows),)](x2, g2 if g2 is not None else x2, w if w is not None else x2, y,
                                              r, g, p, float(eps), GATED=g2 is not None, SILU=silu,
                                              ROWS=rows, BLOCK_G=block)
    return y


def l2_normalize_rows(x: torch.Tensor, eps: float, force_triton: Optional[bool] = None) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim, float32 inside, x's dtype out."""
    if not use_triton([x], force_triton, "l2_normalize_rows"):
        return l2_normalize_rows_reference(x, eps)
    x2 = _rows(x, x.shape[-1]).contiguous()
    return _launch(x2, None, None, 1, eps, False).view(x.shape)


def gated_rms_norm_rows(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, activation: str,
                        group: int, force_triton: Optional[bool] = None) -> torch.Tensor:
    """RMSNorm over rows of `group` channels times `weight` (segment r % P), times act(gate)."""
    if activation not in _ACTS:
        raise KernelInputError(f"activation must be one of {_ACTS}, got {activation!r}")
    if gate.shape != x.shape:
        raise KernelInputError(f"gate must have x's shape {tuple(x.shape)}, got {tuple(gate.shape)}")
    if weight.dim() != 1 or weight.numel() % group or x.shape[-1] % weight.numel():
        raise KernelInputError(f"weight [{weight.numel()}] must be P x {group} channels and divide "
                               f"x's last dim {x.shape[-1]}")
    if not use_triton([x, gate, weight], force_triton, "gated_rms_norm_rows"):
        return gated_rms_norm_rows_reference(x, gate, weight, eps, activation, group)
    x2 = _rows(x, group).contiguous()
    g2 = _rows(gate, group).contiguous()
    return _launch(x2, g2, weight.contiguous(), weight.numel() // group, eps, activation == "silu").view(x.shape)
