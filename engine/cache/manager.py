"""`CacheManager`: the one owner of every cache tensor of a model instance, and the one
allocation view over them.

Per layer (index = decoder layer index): a `PagedKVCache` for full attention, a
`WindowRingCache` for sliding-window attention, a `StateSlotCache` for linear attention.
All full layers share one block table per request (each layer has its own pool, same block
ids); SWA rings and linear state slots share one slot index per request.

Ownership: tensors belong to the manager; a `Sequence` only holds indices (slot, block
table). `allocate(seq)` gives it a slot (zeroing its states and conv tails: a new request
starts from zero state), `ensure_capacity(seq, n)` grows its block table to hold positions
0..n-1, `free(seq)` returns both. Nothing is freed behind a sequence's back.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from engine.cache.allocators import BlockAllocator, SlotAllocator
from engine.cache.layer_caches import PagedKVCache, StateSlotCache, WindowRingCache
from engine.errors import CacheError
from engine.models.layers.base import ExternalKVCache
from engine.runtime.sequence import Sequence

PAGED, WINDOW, STATE = "paged", "window", "state"


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_blocks: int = 256
    #: concurrent requests (state slots / window rings)
    num_slots: int = 8

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.num_blocks < 0 or self.num_slots < 1:
            raise CacheError(f"bad cache config {self}: block_size>=1, num_blocks>=0, num_slots>=1")

    @classmethod
    def for_tokens(cls, max_total_tokens: int, num_slots: int, block_size: int = 16) -> "CacheConfig":
        """Enough blocks for `max_total_tokens` positions over all live requests (plus one
        partial block per request)."""
        return cls(block_size=block_size, num_slots=num_slots,
                   num_blocks=math.ceil(max_total_tokens / block_size) + num_slots)


@dataclass(frozen=True)
class LayerCacheSpec:
    kind: str  # PAGED | WINDOW | STATE
    num_kv_heads: int = 0
    head_dim: int = 0
    window: int = 0
    state_shape: tuple[int, ...] = ()
    conv_tail_shape: tuple[int, ...] | None = None


def cache_specs(model) -> list[LayerCacheSpec]:
    """The cache each layer of a `HybridDecoder` needs (read from its mixers)."""
    specs = []
    for block in model.blocks:
        m = block.mixer
        if hasattr(m, "state_shape"):
            specs.append(LayerCacheSpec(STATE, state_shape=tuple(m.state_shape),
                                        conv_tail_shape=m.conv_tail_shape))
        elif getattr(m, "window", None):
            specs.append(LayerCacheSpec(WINDOW, m.num_kv_heads, m.head_dim, window=m.window))
        else:
            specs.append(LayerCacheSpec(PAGED, m.num_kv_heads, m.head_dim))
    return specs


class CacheManager:
    def __init__(self, specs: list[LayerCacheSpec], config: CacheConfig,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 external_kv: Callable[[int, LayerCacheSpec], ExternalKVCache] | None = None) -> None:
        """`external_kv(layer, spec)`: build full-attention layers' caches outside the paged
        pool (HiSparse offload); the manager then holds no paged blocks and calls each such
        cache's `reset(slot)` / `release(slot)` on allocate / free."""
        self.config = config
        self.specs = specs
        self.device = torch.device(device)
        self.dtype = dtype
        self.block_size = config.block_size
        self.has_paged = external_kv is None and any(s.kind == PAGED for s in specs)
        self.blocks = BlockAllocator(config.num_blocks if self.has_paged else 0)
        self.slots = SlotAllocator(config.num_slots)
        self.layers: list = []
        n, bs = config.num_slots, config.block_size
        for idx, s in enumerate(specs):
            if s.kind == PAGED and external_kv is not None:
                self.layers.append(external_kv(idx, s))
            elif s.kind == PAGED:
                shape = (self.blocks.num_blocks, bs, s.num_kv_heads, s.head_dim)
                self.layers.append(PagedKVCache(torch.zeros(shape, device=self.device, dtype=dtype),
                                                torch.zeros(shape, device=self.device, dtype=dtype)))
            elif s.kind == WINDOW:
                shape = (n, s.window, s.num_kv_heads, s.head_dim)
                self.layers.append(WindowRingCache(torch.zeros(shape, device=self.device, dtype=dtype),
                                                   torch.zeros(shape, device=self.device, dtype=dtype)))
            elif s.kind == STATE:
                state = torch.zeros((n, *s.state_shape), device=self.device, dtype=torch.float32)
                tail = None
                if s.conv_tail_shape is not None:
                    tail = torch.zeros((n, *s.conv_tail_shape), device=self.device, dtype=dtype)
                self.layers.append(StateSlotCache(state, tail))
            else:
                raise CacheError(f"unknown layer cache kind {s.kind!r}")

    @classmethod
    def for_model(cls, model, config: CacheConfig, device: torch.device | str | None = None,
                  dtype: torch.dtype | None = None) -> "CacheManager":
        return cls(cache_specs(model), config, device or model.device, dtype or model.dtype)

    # ------------------------------------------------------------------ queries
    def layer(self, idx: int):
        return self.layers[idx]

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `seq` still needs to hold positions 0..num_tokens-1."""
        if not self.has_paged:
            return 0
        return max(0, math.ceil(num_tokens / self.block_size) - len(seq.block_table))

    def can_allocate(self, num_tokens: int) -> bool:
        """Whether a new request of `num_tokens` positions fits now."""
        need = math.ceil(num_tokens / self.block_size) if self.has_paged else 0
        return self.slots.num_free > 0 and self.blocks.num_free >= need

    def bytes_per_block(self) -> int:
        if not self.has_paged:
            return 0
        esz = torch.empty((), dtype=self.dtype).element_size()
        return sum(2 * self.block_size * s.num_kv_heads * s.head_dim * esz for s in self.specs if s.kind == PAGED)

    def bytes_per_slot(self) -> int:
        esz = torch.empty((), dtype=self.dtype).element_size()
        total = 0
        for s in self.specs:
            if s.kind == WINDOW:
                total += 2 * s.window * s.num_kv_heads * s.head_dim * esz
            elif s.kind == STATE:
                total += math.prod(s.state_shape) * 4
                if s.conv_tail_shape:
                    total += math.prod(s.conv_tail_shape) * esz
        return total

    # -------------------------------------------------------------- allocation
    def allocate(self, seq: Sequence) -> Sequence:
        """Give `seq` a slot (states and conv tails zeroed) and an empty block table."""
        if seq.is_allocated:
            raise CacheError(f"sequence {seq.seq_id!r} already holds slot {seq.slot}")
        slot = self.slots.allocate()
        zero: list[torch.Tensor] = []  # every linear layer's slot, zeroed in one call
        for cache in self.layers:
            if isinstance(cache, StateSlotCache):
                zero += cache.slot_tensors(slot)
            elif isinstance(cache, ExternalKVCache):
                cache.reset(slot)
        if zero:
            torch._foreach_zero_(zero)
        seq.slot, seq.block_table, seq.num_computed_tokens = slot, [], 0
        return seq

    def ensure_capacity(self, seq: Sequence, num_tokens: int) -> None:
        """Grow `seq`'s block table to hold positions 0..num_tokens-1 (all or nothing)."""
        self._check_owned(seq)
        need = self.blocks_needed(seq, num_tokens)
        if need:
            seq.block_table.extend(self.blocks.allocate(need))

    def share_blocks(self, seq: Sequence, blocks: list[int]) -> None:
        """Append blocks another owner holds to `seq`'s table (reference counted: each is
        freed when its last owner frees it). For prefix sharing of whole blocks; the caller
        must not write into shared blocks."""
        self._check_owned(seq)
        self.blocks.incref(blocks)
        seq.block_table.extend(blocks)

    def free(self, seq: Sequence) -> None:
        """Return `seq`'s blocks and slot; the handle is left empty."""
        self._check_owned(seq)
        if seq.block_table:
            self.blocks.free(seq.block_table)
        for cache in self.layers:
            if isinstance(cache, ExternalKVCache):
                cache.release(seq.slot)
        self.slots.free(seq.slot)
        seq.slot, seq.block_table, seq.num_computed_tokens = -1, [], 0

    def _check_owned(self, seq: Sequence) -> None:
        if not seq.is_allocated:
            raise CacheError(f"sequence {seq.seq_id!r} holds no cache slot (allocate it first)")

    # ---------------------------------------------------------- addressing
    def flat_slots(self, seq: Sequence, start: int, end: int) -> torch.Tensor | None:
        """Flat paged-KV slots `[end - start]` of positions start..end-1 on the cache device
        (None: no full layers). As `prefill_slots`: only the block table crosses to the
        device, from pinned memory without a host sync; the slots are expanded there."""
        return self.prefill_slots(seq, start, end, with_context=False)[0]

    def prefill_slots(self, seq: Sequence, start: int, end: int,
                      with_context: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Flat slots of positions start..end-1 (writes) and, with `with_context`, of 0..end-1,
        both on the cache device. Only the block table crosses to the device (one copy); the
        slots are expanded there. (None, None) without full layers."""
        if not self.has_paged:
            return None, None
        need = math.ceil(end / self.block_size)
        if need > len(seq.block_table):
            raise CacheError(
                f"sequence {seq.seq_id!r} has {len(seq.block_table)} blocks, not enough for position {end - 1}")
        table = torch.tensor(seq.block_table[:need], dtype=torch.long)
        if self.device.type == "cuda":
            table = table.pin_memory().to(self.device, non_blocking=True)
        else:
            table = table.to(self.device)
        pos = torch.arange(0 if with_context else start, end, device=self.device)
        flat = table[pos // self.block_size] * self.block_size + pos % self.block_size
        if with_context:
            return flat[start:], flat
        return flat, None

    def batch_block_tables(self, seqs: list[Sequence], lengths: list[int]) -> torch.Tensor | None:
        """`[B, ceil(max(lengths) / block_size)]` block ids (0-padded) covering positions
        0..len-1 of each sequence, on the cache device (the layout paged decode kernels take)."""
        if not self.has_paged:
            return None
        nb = math.ceil(max(lengths) / self.block_size)
        rows = []
        for seq, n in zip(seqs, lengths):
            need = math.ceil(n / self.block_size)
            if need > len(seq.block_table):
                raise CacheError(f"sequence {seq.seq_id!r} has too few blocks for {n} tokens")
            rows.append(seq.block_table[:need] + [0] * (nb - need))
        return torch.tensor(rows, dtype=torch.long).to(self.device)

    def batch_context_slots(self, seqs: list[Sequence], lengths: list[int],
                            block_tables: torch.Tensor | None = None) -> torch.Tensor | None:
        """`[B, max(lengths)]` flat slots of positions 0..len-1 per sequence, 0-padded."""
        if not self.has_paged:
            return None
        lmax = max(lengths)
        # only the [B, blocks] table crosses to the device; slots are expanded there
        table = block_tables if block_tables is not None else self.batch_block_tables(seqs, lengths)
        lens = torch.tensor(lengths, dtype=torch.long).to(self.device)
        pos = torch.arange(lmax, device=self.device)
        flat = table[:, pos // self.block_size] * self.block_size + pos % self.block_size
        return torch.where(pos[None, :] < lens[:, None], flat, torch.zeros_like(flat))
