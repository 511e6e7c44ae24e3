"""`ManagedCachePool`: the scheduler's view (engine.runtime.scheduler.CachePool) of a
model's `CacheManager`.

A sequence costs one request slot (its linear-layer states and window rings) plus
paged-KV blocks for its full-attention layers, one block per `block_size` positions.
The scheduler allocates a whole prefill at admission and grows sequences one position
per decode step; this class answers whether that fits and does it. Admission keeps a
watermark of free blocks (default 1% of the pool, as vLLM does) while other sequences
run, so running decodes can grow without an immediate preemption; an idle pool admits
anything that fits. The manager stays the owner of every tensor; this class only
decides and delegates.
"""
from __future__ import annotations

import math
from typing import Optional

from engine.cache.manager import CacheManager
from engine.runtime.sequence import Sequence


class ManagedCachePool:
    """Adapts a `CacheManager` to the scheduler's `CachePool` protocol."""

    def __init__(self, manager: CacheManager, watermark: float = 0.01) -> None:
        self.manager = manager
        self.watermark_blocks = math.ceil(watermark * manager.blocks.num_blocks) if manager.has_paged else 0

    def max_tokens_per_sequence(self) -> Optional[int]:
        """Positions one sequence could hold with the whole block pool (None: the model
        has no full-attention layer, so only the context length bounds a sequence)."""
        if not self.manager.has_paged:
            return None
        return self.manager.blocks.num_blocks * self.manager.block_size

    def can_allocate(self, num_tokens: int) -> bool:
        if not self.manager.can_allocate(num_tokens):
            return False
        if self.num_used_slots == 0:
            return True
        return self.manager.blocks.num_free - self.blocks_for(num_tokens) >= self.watermark_blocks

    def allocate(self, request_id: str, num_tokens: int) -> Sequence:
        seq = self.manager.allocate(Sequence(request_id))
        try:
            self.manager.ensure_capacity(seq, num_tokens)
        except BaseException:
            self.manager.free(seq)
            raise
        return seq

    def can_extend(self, seq: Sequence, num_tokens: int) -> bool:
        return self.manager.blocks_needed(seq, num_tokens) <= self.manager.blocks.num_free

    def extend(self, seq: Sequence, num_tokens: int) -> None:
        self.manager.ensure_capacity(seq, num_tokens)

    def free(self, seq: Sequence) -> None:
        self.manager.free(seq)

    # ---- usage --------------------------------------------------------------------

    @property
    def num_used_blocks(self) -> int:
        return self.manager.blocks.num_blocks - self.manager.blocks.num_free

    @property
    def num_used_slots(self) -> int:
        return self.manager.slots.num_slots - self.manager.slots.num_free

    def usage(self) -> float:
        """The larger of block usage and slot usage (whichever runs out first)."""
        slots = self.num_used_slots / self.manager.slots.num_slots
        if not self.manager.has_paged or self.manager.blocks.num_blocks == 0:
            return slots
        return max(slots, self.num_used_blocks / self.manager.blocks.num_blocks)

    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.manager.block_size) if self.manager.has_paged else 0
