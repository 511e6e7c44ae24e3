"""RMSNorm and the gated RMSNorm used at the output of linear-attention layers
(`rmsnorm(o) * act(z)` per head, Mamba2 / Qwen3-Next / GLA style). Statistics in float32.

Both go through `torch.nn.functional.rms_norm` (one fused kernel on CUDA in recent torch;
it upcasts to float32 inside, so the result equals the explicit float32 form), and
`l2_normalize` is the same op with a constant weight. On CUDA the gated norms and
`l2_normalize` run as one fused kernel each (kernels/fused_norms.py), the torch forms here
being their reference."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.fused_norms import gated_rms_norm_rows, l2_normalize_rows


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
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
        if x.is_cuda:  # one fused kernel (kernels/fused_norms.py); the lines below are its reference
            return gated_rms_norm_rows(x, gate, self.weight, self.eps, self.activation, self.weight.numel())
        xf = F.rms_norm(x.to(torch.float32), self.weight.shape, self.weight.to(torch.float32), self.eps)
        g = gate.to(torch.float32)
        g = F.silu(g) if self.activation == "silu" else torch.sigmoid(g)
        return (xf * g).to(x.dtype)


class GroupGatedRMSNorm(nn.Module):
    """Gate first, then RMSNorm over groups of `group_size` channels (Nemotron-H's Mamba2
    output norm): `rmsnorm_group(x * silu(gate)) * weight`, weight over all channels."""

    def __init__(self, dim: int, group_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        if group_size < 1 or dim % group_size:
            raise ValueError(f"GroupGatedRMSNorm group_size={group_size} must divide dim={dim}")
        self.eps = eps
        self.group_size = group_size
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        xf = x.to(torch.float32) * F.silu(gate.to(torch.float32))
        lead = xf.shape[:-1]
        g = xf.reshape(*lead, -1, self.group_size)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * g.reshape(*lead, -1).to(x.dtype)).to(x.dtype)


class GroupRMSNormGate(nn.Module):
    """Norm first, then gate (Ring-linear's `g_norm`): RMSNorm over each of `groups` equal
    groups of the channels, times the weight (over all channels), times `sigmoid(gate)`."""

    def __init__(self, dim: int, groups: int, eps: float = 1e-6) -> None:
        super().__init__()
        if groups < 1 or dim % groups:
            raise ValueError(f"GroupRMSNormGate groups={groups} must divide dim={dim}")
        self.eps = eps
        self.groups = groups
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:  # one fused kernel (kernels/fused_norms.py); the lines below are its reference
            return gated_rms_norm_rows(x, gate, self.weight, self.eps, "sigmoid", x.shape[-1] // self.groups)
        lead = x.shape[:-1]
        g = x.to(torch.float32).reshape(*lead, self.groups, -1)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        y = g.reshape(*lead, -1) * self.weight.to(torch.float32)
        return (y * torch.sigmoid(gate.to(torch.float32))).to(x.dtype)


_L2_WEIGHTS: dict[tuple[int, torch.device], torch.Tensor] = {}


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim, as fla's in-kernel l2norm does, in float32:
    rms_norm with eps/d and the constant float32 weight d^-1/2 (one fused op)."""
    if x.is_cuda:  # one fused kernel (kernels/fused_norms.py); the lines below are its reference
        return l2_normalize_rows(x, eps)
    d = x.shape[-1]
    w = _L2_WEIGHTS.get((d, x.device))
    if w is None:
        with torch.inference_mode(False):  # a normal tensor: autograd may save it later
            w = _L2_WEIGHTS[(d, x.device)] = torch.full((d,), d ** -0.5, dtype=torch.float32, device=x.device)
    return F.rms_norm(x.to(torch.float32), (d,), w, eps / d).to(x.dtype)
