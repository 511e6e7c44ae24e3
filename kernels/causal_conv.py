"""Short causal depthwise convolution over time-first inputs, with an explicit tail: the
prefill path of engine/models/layers/conv.py's `ShortConv` on CUDA.

    y[b, t, c] = act(bias[c] + sum_j weight[c, j] * xx[b, t + j, c]),  j in [0, W)

where `xx` is the sequence's last `W - 1` pre-conv inputs (`tail [B, C, W-1]`, oldest
first, zeros at a sequence's start) followed by `x [B, T, C]`, and `act` is SiLU or the
identity. Products are accumulated in float32 and rounded once to x's dtype (after the
activation).

Why a kernel: the torch path (`causal_conv1d_reference`) concatenates the tail in front of
a channel-first transpose of x and runs `F.conv1d(groups=C)`, which on CUDA is a generic
depthwise kernel: on a 16k-token prefill of qwen3.5-35b-a3b-real the concatenation and
the convolution took 39 and 42 ms of a 585 ms prefill (tools/profile_prefill.py). This
kernel reads x where it lies (any strides), the tail in place, and writes y time-first
in one pass.

Program (b, time tile, channel tile): `BLOCK_T x BLOCK_C` outputs, W shifted loads of x
(rows before 0 come from the tail). Dispatch follows kernels/backend.py (`force_triton`).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from kernels.backend import HAS_TRITON, tl, triton, use_triton
from kernels.errors import KernelInputError

__all__ = ["causal_conv1d", "causal_conv1d_reference"]

_BLOCK_T = 64
_BLOCK_C = 128


def _validate(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], tail: torch.Tensor) -> None:
    if x.dim() != 3:
        raise KernelInputError(f"x must be [B, T, C], got shape {tuple(x.shape)}")
    b, _, c = x.shape
    if weight.dim() != 2 or weight.shape[0] != c or weight.shape[1] < 2:
        raise KernelInputError(f"weight must be [C={c}, W>=2], got shape {tuple(weight.shape)}")
    w = weight.shape[1]
    if tail.shape != (b, c, w - 1):
        raise KernelInputError(f"tail must be [B={b}, C={c}, W-1={w - 1}], got shape {tuple(tail.shape)}")
    if bias is not None and bias.shape != (c,):
        raise KernelInputError(f"bias must be [C={c}], got shape {tuple(bias.shape)}")


def causal_conv1d_reference(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                            tail: torch.Tensor, silu: bool) -> torch.Tensor:
    """The torch definition (module docstring): x `[B, T, C]`, weight `[C, W]`, bias `[C]`
    or None, tail `[B, C, W-1]` -> y `[B, T, C]` in x's dtype."""
    _validate(x, weight, bias, tail)
    c = x.shape[2]
    xx = torch.cat([tail.to(x.dtype), x.transpose(1, 2)], dim=2)  # [B, C, W-1+T]
    y = F.conv1d(xx, weight[:, None, :].to(x.dtype), None if bias is None else bias.to(x.dtype), groups=c)
    y = y.transpose(1, 2)
    return F.silu(y) if silu else y


if HAS_TRITON:

    # T (the tokens of a call) only bounds masks and the batch strides (T times a row)
    # only offset whole sequences: no per-value key for them (a multiple of 16, or 1, would
    # otherwise compile a variant of its own at a request's first use)
    @triton.jit(do_not_specialize=["T", "s_xb", "s_yb"])
    def _causal_conv_kernel(x_ptr, w_ptr, b_ptr, tail_ptr, y_ptr, T, C,
                            s_xb, s_xt, s_xc, s_wc, s_ww, s_tb, s_tc, s_tw, s_yb, s_yt, s_yc,
                            W: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                            BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        tt = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
        cc = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
        tmask = tt < T
        cmask = cc < C
        tt64 = tt.to(tl.int64)
        cc64 = cc.to(tl.int64)
        acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
        for j in tl.static_range(W):
            src = tt64 + (j - (W - 1))  # input position; < 0: the tail's entry W-1+src
            wj = tl.load(w_ptr + cc64 * s_wc + j * s_ww, mask=cmask, other=0.0).to(tl.float32)
            in_x = tmask & (src >= 0)
            xv = tl.load(x_ptr + b * s_xb + src[:, None] * s_xt + cc64[None, :] * s_xc,
                         mask=in_x[:, None] & cmask[None, :], other=0.0).to(tl.float32)
            acc += xv * wj[None, :]
        if tl.program_id(1) == 0:  # only the first time tile reaches back into the tail
            for j in tl.static_range(W - 1):
                src = tt64 + (j - (W - 1))
                wj = tl.load(w_ptr + cc64 * s_wc + j * s_ww, mask=cmask, other=0.0).to(tl.float32)
                in_tail = tmask & (src < 0)
                tv = tl.load(tail_ptr + b * s_tb + cc64[None, :] * s_tc + (src + (W - 1))[:, None] * s_tw,
                             mask=in_tail[:, None] & cmask[None, :], other=0.0).to(tl.float32)
                acc += tv * wj[None, :]
        if HAS_BIAS:
            acc += tl.load(b_ptr + cc64, mask=cmask, other=0.0).to(tl.float32)[None, :]
        if SILU:
            acc = acc * tl.sigmoid(acc)
        tl.store(y_ptr + b * s_yb + tt64[:, None] * s_yt + cc64[None, :] * s_yc,
                 acc.to(y_ptr.dtype.element_ty), mask=tmask[:, None] & cmask[None, :])


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], tail: torch.Tensor,
                  silu: bool, force_triton: Optional[bool] = None) -> torch.Tensor:
    """y `[B, T, C]` (contiguous, x's dtype) of the module docstring; tail `[B, C, W-1]` is
    read, not changed. The Triton kernel or the torch reference per kernels/backend.py."""
    _validate(x, weight, bias, tail)
    if not use_triton([x, weight, bias, tail], force_triton, "causal_conv1d"):
        return causal_conv1d_reference(x, weight, bias, tail, silu)
    bsz, t, c = x.shape
    y = torch.empty(bsz, t, c, device=x.device, dtype=x.dtype)
    if y.numel() == 0:
        return y
    tail = tail.to(x.dtype)
    grid = (bsz, triton.cdiv(t, _BLOCK_T), triton.cdiv(c, _BLOCK_C))
    _causal_conv_kernel[grid](x, weight, bias if bias is not None else weight, tail, y, t, c,
                              *x.stride(), *weight.stride(), *tail.stride(), *y.stride(),
                              W=weight.shape[1], HAS_BIAS=bias is not None, SILU=silu,
                              BLOCK_T=_BLOCK_T, BLOCK_C=_BLOCK_C)
    return y
