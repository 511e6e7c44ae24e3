"""What every token mixer (attention or linear layer) implements, and the per-call contexts
the runner hands it.

Three entry points, all on hidden states in the model dtype:
- `forward_train(x [B, T, D])`: whole sequences from position 0, no cache (training,
  references, and the parallel form tests compare against).
- `forward_prefill(x [n, D], ctx: PrefillContext, cache)`: one chunk of one sequence at
  positions `ctx.start_pos .. start_pos+n-1`; reads the sequence's cache for earlier tokens
  and appends the chunk to it.
- `forward_decode(x [B, D], ctx: DecodeContext, cache)`: one new token for each of B
  sequences of different lengths; reads and updates their caches.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class PrefillContext:
    start_pos: int
    positions: torch.Tensor  # [n] long: start_pos .. start_pos + n - 1
    slot: int  # state / window-ring slot of the sequence
    write_slots: torch.Tensor | None = None  # [n] flat paged-KV slots of the chunk's tokens
    context_slots: torch.Tensor | None = None  # [start_pos + n] flat slots of positions 0..end-1
    backend: str = "torch"  # resolved linear-layer backend: "torch" | "fla"

    @property
    def num_tokens(self) -> int:
        return int(self.positions.numel())


@dataclass
class DecodeContext:
    positions: torch.Tensor  # [B] long: position of each sequence's new token
    slots: torch.Tensor  # [B] long: state / window-ring slots
    write_slots: torch.Tensor | None = None  # [B] flat paged-KV slot of each new token
    context_slots: torch.Tensor | None = None  # [B, Lmax] flat slots of positions 0..Lmax-1 (0-padded)
    backend: str = "torch"
    block_tables: torch.Tensor | None = None  # [B, max_blocks] block ids (for paged decode kernels)
    #: attention reads K/V through `block_tables` + `context_lens` (full layers) and the ring
    #: slots (sliding window) with the paged decode kernel: no host-side shapes, so a step can
    #: be captured in a CUDA graph. False: gather `context_slots` (the reference path).
    paged_attention: bool = False

    @property
    def context_lens(self) -> torch.Tensor:
        return self.positions + 1


class TokenMixer(nn.Module):
    """Base class of attention and linear-attention layers."""

    kind: str = ""

    def forward_train(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def forward_prefill(self, x: torch.Tensor, ctx: PrefillContext, cache) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError

    def forward_decode(self, x: torch.Tensor, ctx: DecodeContext, cache) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError
