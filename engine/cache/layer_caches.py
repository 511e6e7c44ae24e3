"""The per-layer cache tensors and their read/write primitives (docs/ARCHITECTURE.md layouts).

- `PagedKVCache` (full attention): `k_pages`/`v_pages` `[num_blocks, block_size, Hkv, D]`,
  K after RoPE at its absolute position. Addressed by *flat slots*
  `block_id * block_size + p % block_size`.
- `WindowRingCache` (sliding window): `k`/`v` `[num_slots, window, Hkv, D]`, position p at
  ring index `p % window`, K after RoPE.
- `StateSlotCache` (linear attention): `state` `[num_slots, H, dk, dv]` float32 in the
  orientation `S_t = T_t S_{t-1} + k_t v_t^T`, and `conv_tail` `[num_slots, C, conv-1]`
  (last conv-1 pre-conv inputs) or None for layers without a conv.

These objects own no allocation policy (engine/cache/manager.py does); their methods are
the hooks that layers and position-independent caching use to write K/V at any position
and to read or set a state slot directly.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.errors import CacheError


@dataclass
class PagedKVCache:
    k_pages: torch.Tensor
    v_pages: torch.Tensor

    @property
    def block_size(self) -> int:
        return self.k_pages.shape[1]

    def _flat(self, pages: torch.Tensor) -> torch.Tensor:
        return pages.view(-1, *pages.shape[2:])

    def write(self, flat_slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V `[n, Hkv, D]` at flat slots `[n]`."""
        self._flat(self.k_pages)[flat_slots] = k.to(self.k_pages.dtype)
        self._flat(self.v_pages)[flat_slots] = v.to(self.v_pages.dtype)

    def gather(self, flat_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V at flat slots of any shape `[...]` -> `[..., Hkv, D]`."""
        return self._flat(self.k_pages)[flat_slots], self._flat(self.v_pages)[flat_slots]


@dataclass
class WindowRingCache:
    k: torch.Tensor
    v: torch.Tensor

    @property
    def window(self) -> int:
        return self.k.shape[1]

    def write(self, slot: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V `[n, Hkv, D]` of tokens at absolute `positions` `[n]` into `slot`'s ring.
        Only the last `window` of them can survive; pass at most that many (later tokens
        overwrite earlier ones that map to the same ring index)."""
        if positions.numel() > self.window:
            positions, k, v = positions[-self.window:], k[-self.window:], v[-self.window:]
        idx = positions % self.window
        self.k[slot, idx] = k.to(self.k.dtype)
        self.v[slot, idx] = v.to(self.v.dtype)

    def read(self, slot: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of absolute `positions` (each within the last `window` written) -> `[n, Hkv, D]`."""
        idx = positions % self.window
        return self.k[slot, idx], self.v[slot, idx]


@dataclass
class StateSlotCache:
    state: torch.Tensor
    conv_tail: torch.Tensor | None

    def reset(self, slot: int) -> None:
        torch._foreach_zero_(self.slot_tensors(slot))

    def slot_tensors(self, slot: int) -> list[torch.Tensor]:
        """Views of what `slot` holds (its state, its conv tail if any): what `reset`
        zeroes, for a caller that zeroes many layers' slots in one call."""
        return [self.state[slot]] if self.conv_tail is None else [self.state[slot], self.conv_tail[slot]]

    def get_state(self, slot: int) -> torch.Tensor:
        return self.state[slot]

    def set_state(self, slot: int, value: torch.Tensor) -> None:
        if tuple(value.shape) != tuple(self.state.shape[1:]):
            raise CacheError(f"state shape {tuple(value.shape)} != slot shape {tuple(self.state.shape[1:])}")
        self.state[slot] = value.to(torch.float32)

    def get_conv_tail(self, slot: int) -> torch.Tensor | None:
        return None if self.conv_tail is None else self.conv_tail[slot]

    def set_conv_tail(self, slot: int, value: torch.Tensor) -> None:
        if self.conv_tail is None:
            raise CacheError("this layer has no short conv, so no conv tail to set")
        if tuple(value.shape) != tuple(self.conv_tail.shape[1:]):
            raise CacheError(
                f"conv tail shape {tuple(value.shape)} != slot shape {tuple(self.conv_tail.shape[1:])}")
        self.conv_tail[slot] = value.to(self.conv_tail.dtype)


LayerCache = PagedKVCache | WindowRingCache | StateSlotCache
