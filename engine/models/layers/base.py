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

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Hashable, Sequence

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
    #: host copies of `positions` and `slots` (set by the eager decode step; caches that
    #: keep host-side bookkeeping, `ExternalKVCache`, need them without a device read)
    host_positions: list[int] | None = None
    host_slots: list[int] | None = None
    #: a static-buffer step (engine/runtime/cuda_graphs.py, what a CUDA graph captures):
    #: per `ExternalKVCache` of the model (keyed by the cache object) the plan its
    #: `plan_decode` returned for this step; such a cache then runs only the device part
    #: of its step, at the plan's fixed shapes (the runner does the host part around it)
    external_plans: dict[Any, Hashable] | None = None

    @property
    def context_lens(self) -> torch.Tensor:
        return self.positions + 1


class ExternalKVCache(ABC):
    """A full-attention layer's K/V kept outside the engine's paged pool (HiSparse offload,
    engine/hisparse/). The attention layer projects q/k/v (K after RoPE at its absolute
    position) and hands them over; the cache stores K/V at the call's positions and returns
    the attention output. Per slot, calls come in this order: `reset(slot)` when a
    sequence takes the slot, prefill chunks and decode steps at contiguous increasing
    positions, `release(slot)` when it gives the slot back."""

    @abstractmethod
    def attend_prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: PrefillContext,
                       scale: float) -> torch.Tensor:
        """q `[n, H, D]`, k/v `[n, Hkv, D]` of one chunk at `ctx.start_pos..` -> `[n, H, D]`
        (causal attention over the sequence's positions 0..end-1)."""

    @abstractmethod
    def attend_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: DecodeContext,
                      scale: float) -> torch.Tensor:
        """q `[B, H, D]`, k/v `[B, Hkv, D]` of one token per sequence (`ctx.host_positions`,
        `ctx.host_slots`) -> `[B, H, D]`. Where `ctx.external_plans` holds this cache, only
        the step's device part at that plan's shapes (no host reads: it may be captured)."""

    def plan_decode(self, slots: Sequence[int], positions: Sequence[int]) -> Hashable | None:
        """Host part before a decode step that a CUDA graph may replay: check the step and
        return the key of the static shapes its device part runs at (steps with equal keys
        share one graph), or None where the step cannot run from static buffers (it then
        runs eagerly through `attend_decode`). By default: None."""
        return None

    def finish_decode(self, slots: Sequence[int], positions: Sequence[int], plan: Hashable, rows: int,
                      graphed: bool) -> None:
        """Host part after a static-buffer step planned by `plan_decode` (`rows`: the step's
        padded batch; `graphed`: it was replayed from, or captured into, a CUDA graph)."""

    def append(self, slot: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write K/V `[n, Hkv, D]` (K rotated to its positions) at the sequence's next n
        positions, without attention (PIC writes spliced and fused rows through it)."""
        raise NotImplementedError(f"{type(self).__name__} takes no K/V rows from outside")

    def context_kv(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V `[num_tokens, Hkv, D]` of every position the sequence in `slot` holds."""
        raise NotImplementedError(f"{type(self).__name__} does not hand out its K/V")

    @abstractmethod
    def reset(self, slot: int) -> None:
        """A new sequence takes `slot`: it holds no positions."""

    @abstractmethod
    def release(self, slot: int) -> None:
        """The sequence in `slot` is done: drop what it held."""


class TokenMixer(nn.Module):
    """Base class of attention and linear-attention layers."""

    kind: str = ""

    def forward_train(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def forward_prefill(self, x: torch.Tensor, ctx: PrefillContext, cache) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError

    def forward_decode(self, x: torch.Tensor, ctx: DecodeContext, cache) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError
