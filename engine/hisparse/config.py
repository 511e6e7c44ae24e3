"""`HiSparseConfig`: the settings of HiSparse offload (the CLI's `--hisparse*` options map
one to one onto its fields; docs/hisparse.md)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from engine.hisparse.errors import HiSparseConfigError

SUMMARIES = ("minmax", "mean")


@dataclass(frozen=True)
class HiSparseConfig:
    """Per sequence and full-attention layer: KV in blocks of `block_size` tokens, a summary
    per block, a hot buffer of `hot_blocks` blocks on the device holding the `sink_blocks`
    first blocks and the `recent_blocks` last ones (always) plus recently used ones; each
    decode step attends to the sink, the recent blocks and the `topk` best-scoring other
    blocks once the context holds `min_context` tokens (below that, to every block).

    `hot_blocks` 0 (the default) sizes the hot buffer to the blocks one step may attend to
    (`step_blocks`): with per-KV-head selection the union of the heads' picks, up to
    `num_kv_heads * topk` besides the sink and recent blocks. The layer cache allocates that
    many rows per sequence anyway (rows past the hot buffer are staging rows, refilled every
    step), so the auto size costs no device memory and keeps a step's union resident."""

    enabled: bool = False
    block_size: int = 64
    topk: int = 32
    #: 0: auto, `step_blocks(num_kv_heads)`; else at least sink + recent
    hot_blocks: int = 0
    min_context: int = 4096
    sink_blocks: int = 1
    recent_blocks: int = 1
    #: block summary: "minmax" (per-channel key min/max, Quest) or "mean" (mean key)
    summary: str = "minmax"
    #: the first `dense_layers` full-attention layers attend to every block (Quest leaves the
    #: first layers dense); their hot buffer holds the whole context
    dense_layers: int = 0
    #: select the top-k blocks per KV head (Quest) instead of one set per sequence; the hot
    #: buffer then admits the union, and each KV head attends to its own blocks (on the
    #: trained tiny models at a 25% budget: mean task delta 0.0 points vs -12.5 for one set,
    #: docs/hisparse.md)
    per_kv_head: bool = True

    def __post_init__(self) -> None:
        checks = (("block_size", self.block_size, 1), ("topk", self.topk, 1), ("min_context", self.min_context, 0),
                  ("sink_blocks", self.sink_blocks, 0), ("recent_blocks", self.recent_blocks, 1),
                  ("dense_layers", self.dense_layers, 0), ("hot_blocks", self.hot_blocks, 0))
        for name, value, low in checks:
            if not isinstance(value, int) or value < low:
                raise HiSparseConfigError(f"hisparse {name} must be an int >= {low}, got {value!r}")
        if self.hot_blocks and self.hot_blocks < self.sink_blocks + self.recent_blocks:
            raise HiSparseConfigError(
                f"hisparse hot_blocks={self.hot_blocks} must hold the sink and recent blocks "
                f"({self.sink_blocks} + {self.recent_blocks}; 0: auto)")
        if self.summary not in SUMMARIES:
            raise HiSparseConfigError(f"hisparse summary must be one of {SUMMARIES}, got {self.summary!r}")

    @property
    def max_selected(self) -> int:
        """The most blocks one decode step attends to: sink + recent + topk once selecting;
        every block of a context shorter than `min_context` before."""
        dense = math.ceil(max(0, self.min_context - 1) / self.block_size)
        return max(self.sink_blocks + self.recent_blocks + self.topk, dense)

    def step_blocks(self, num_kv_heads: int) -> int:
        """The most blocks one decode step of a layer with `num_kv_heads` KV heads attends to
        (the union over its KV heads with `per_kv_head`): the fixed width of a step."""
        heads = num_kv_heads if self.per_kv_head else 1
        return max(self.max_selected, self.sink_blocks + self.recent_blocks + heads * self.topk)

    def hot_rows(self, num_kv_heads: int) -> int:
        """The hot buffer's blocks in a layer with `num_kv_heads` KV heads: `hot_blocks`, or
        `step_blocks` when it is 0 (auto)."""
        return self.hot_blocks or self.step_blocks(num_kv_heads)

    def staging_blocks(self, num_kv_heads: int) -> int:
        """Device rows per sequence for selected blocks the hot buffer cannot keep (a step
        that attends to more blocks than the hot buffer reads the rest into these rows)."""
        return max(0, self.step_blocks(num_kv_heads) - self.hot_rows(num_kv_heads))


@dataclass(frozen=True)
class HiSparseSettings:
    """What the CLI's `--hisparse*` options set: the config, and the kvstore daemon socket
    for the blocks (`store`: "" the default socket; None: this process's memory)."""

    config: HiSparseConfig
    store: Optional[str] = None
