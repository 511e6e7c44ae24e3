"""RMSNorm and the gated RMSNorm used at the output of linear-attention layers
(`rmsnorm(o) * act(z)` per head, Mamba2 / Qwen3-Next / GLA style). Statistics in float32."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(torch.float32)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.to(torch.float32)).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """RMSNorm over the last dim (a head), then multiply by `act(gate)`."""

    def __init__(self, dim: int, eps: float = 1e-6, activation: str = "silu") -> None:
        super().__init__()
        if activation not in ("silu", "sigmoid"):
            raise ValueError(f"GatedRMSNorm activation={activation!r} must be 'silu' or 'sigmoid'")
        self.eps = eps
        self.activation = activation
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        xf = x.to(torch.float32)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        xf = xf * self.weight.to(torch.float32)
        g = gate.to(torch.float32)
        g = F.silu(g) if self.activation == "silu" else torch.sigmoid(g)
        return (xf * g).to(x.dtype)
