"""Short causal depthwise convolution with an explicit tail, so a sequence can be fed in
chunks or one token at a time and give the same result as one pass.

The tail is the last `width - 1` *pre-conv* inputs, `[B, channels, width - 1]` (zeros at the
start of a sequence, which is the causal zero padding). This is the contract's conv-tail
layout (`conv_tail[num_slots, channels, conv_size - 1]`); for PIC a segment's tail is its last
`width - 1` inputs and splicing feeds the previous segment's tail in front of it.

`float32=True` (Ling 3, whose reference keeps the conv float32 in a bf16 model): the
weight stays float32 (the loader keeps it), the conv and its SiLU run in float32 and only
the result is cast to the input's dtype; otherwise the conv runs in the input's dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.causal_conv import causal_conv1d


class ShortConv(nn.Module):
    def __init__(self, channels: int, width: int, bias: bool = False, activation: str | None = "silu",
                 float32: bool = False) -> None:
        super().__init__()
        if width < 2:
            raise ValueError(f"ShortConv width={width} must be >= 2")
        if activation not in (None, "silu"):
            raise ValueError(f"ShortConv activation={activation!r} must be None or 'silu'")
        self.channels = channels
        self.width = width
        self.activation = activation
        self.float32 = float32
        self.weight = nn.Parameter(torch.empty(channels, width))
        self.bias = nn.Parameter(torch.zeros(channels)) if bias else None

    def zero_tail(self, batch: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(batch, self.channels, self.width - 1, device=device, dtype=dtype)

    def _act(self, y: torch.Tensor) -> torch.Tensor:
        return F.silu(y) if self.activation == "silu" else y

    def forward(self, x: torch.Tensor, tail: torch.Tensor | None = None,
                force_kernel: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """x `[B, T, C]`, tail `[B, C, width-1]` or None (zeros) -> (y `[B, T, C]`, new tail).
        On CUDA (or with `force_kernel`) through kernels/causal_conv.py's time-first kernel;
        elsewhere the channel-first `F.conv1d` below, its reference."""
        b, t, c = x.shape
        if tail is None:
            tail = self.zero_tail(b, x.device, x.dtype)
        if x.is_cuda or force_kernel:
            y = causal_conv1d(x, self.weight, self.bias, tail, self.activation == "silu",
                              force_triton=True if force_kernel else None)
            w1 = self.width - 1
            if t >= w1:
                new = x[:, t - w1:].transpose(1, 2)
            else:
                new = torch.cat([tail[:, :, t:].to(x.dtype), x.transpose(1, 2)], dim=2)
            return y, new.contiguous()
        xx = torch.cat([tail.to(x.dtype), x.transpose(1, 2)], dim=2)  # [B, C, W-1+T]
        new_tail = xx[:, :, xx.shape[2] - (self.width - 1):]
        return self.valid_batch(xx).transpose(1, 2), new_tail.contiguous()

    def valid_batch(self, xx: torch.Tensor) -> torch.Tensor:
        """`[B, C, L]` pre-conv inputs with their left context -> `[B, C, L - (width-1)]`
        after the activation, in xx's dtype (computed as the module docstring says)."""
        dt = torch.float32 if self.float32 else xx.dtype
        bias = None if self.bias is None else self.bias.to(dt)
        y = self._act(F.conv1d(xx.to(dt), self.weight[:, None, :].to(dt), bias, groups=xx.shape[1]))
        return y.to(xx.dtype)

    def valid(self, xx: torch.Tensor) -> torch.Tensor:
        """The conv over pre-conv inputs that carry their own left context: xx `[C, L]` ->
        y `[C, L - (width-1)]`, output i from inputs [i, i + width). The same arithmetic
        as `forward` (which pads with its tail first): several ranges laid out one after
        another, each behind its own tail, convolve in one call."""
        return self.valid_batch(xx[None])[0]

    def step(self, x: torch.Tensor, tail: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per sequence: x `[B, C]`, tail `[B, C, width-1]` -> (y `[B, C]`, new tail)."""
        window = torch.cat([tail.to(x.dtype), x[:, :, None]], dim=2)  # [B, C, W]
        y = (window.float() * self.weight.float()).sum(-1)  # accumulate in fp32, as conv1d does
        if self.bias is not None:
            y = y + self.bias.float()
        y = self._act(y).to(x.dtype) if self.float32 else self._act(y.to(x.dtype))
        return y, window[:, :, 1:].contiguous()
