"""Feed-forward blocks: gated `down(act(gate(x)) * up(x))`, act SiLU (SwiGLU) or tanh-GELU
(GeGLU, Gemma's `gelu_pytorch_tanh`); and plain `down(act(up(x)))` (Nemotron-H's squared
ReLU)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def gated_activation(name: str):
    """The gate nonlinearity named by `ModelConfig.hidden_act`."""
    if name == "silu":
        return F.silu
    if name == "gelu_tanh":
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "relu2":
        return lambda x: torch.square(F.relu(x))
    raise ValueError(f"hidden_act={name!r} must be 'silu', 'gelu_tanh' or 'relu2'")


class SwiGLU(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, activation: str = "silu") -> None:
        super().__init__()
        self.gate_up = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act = gated_activation(activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(self.act(gate) * up)


class PlainMLP(nn.Module):
    """Ungated feed-forward block: `down(act(up(x)))`."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str = "relu2") -> None:
        super().__init__()
        self.up = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act = gated_activation(activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(x)))
