"""`HiSparseOffload`: HiSparse for one engine: the block store, the metrics, and the layer
caches of every full-attention layer (built through `CacheManager(external_kv=...)`).

    offload = HiSparseOffload(config, store, num_slots, max_model_len, device, dtype)
    manager = CacheManager(specs, cache_cfg, device, dtype, external_kv=offload.layer_cache)
    ...
    offload.snapshot()   # metrics (engine/hisparse/metrics.py)
    offload.close()      # waits for queued puts

Keys of blocks carry a random per-engine nonce (and a per-sequence one), so engines never
see each other's blocks (engine/hisparse/store.py).
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import replace
from typing import Any, Optional

import torch

from engine.hisparse.config import HiSparseConfig
from engine.hisparse.errors import HiSparseConfigError
from engine.hisparse.layer_cache import HiSparseLayerCache
from engine.hisparse.metrics import HiSparseMetrics
from engine.hisparse.store import BlockStore

log = logging.getLogger("engine.hisparse")


class HiSparseOffload:
    """See the module docstring."""

    def __init__(self, config: HiSparseConfig, store: Optional[BlockStore], num_slots: int, max_model_len: int,
                 device: torch.device, dtype: torch.dtype, fingerprint: str = "") -> None:
        if not config.enabled:
            raise HiSparseConfigError("HiSparseOffload needs a config with enabled=True")
        self.config = config
        self.metrics = store.metrics if store is not None else HiSparseMetrics()
        #: where sealed blocks go besides the layer caches' pinned host mirrors (None: nowhere)
        self.store = store
        self.num_slots = num_slots
        self.max_blocks = math.ceil(max_model_len / config.block_size)
        self.device, self.dtype = torch.device(device), dtype
        self.fingerprint = fingerprint
        self.engine_nonce = os.urandom(16)
        self.layers: list[HiSparseLayerCache] = []

    def layer_cache(self, layer: int, spec: Any) -> HiSparseLayerCache:
        """The cache of full-attention layer `layer` (`spec`: its LayerCacheSpec)."""
        cfg = self.config
        if not self.layers and 0 < cfg.hot_blocks < cfg.step_blocks(spec.num_kv_heads):
            log.warning("hisparse: hot buffer of %d blocks < the %d a step may attend to (sink %d + recent %d + "
                        "%d KV head(s) x top-%d): the rest are staged and fetched again every step (0: auto size)",
                        cfg.hot_blocks, cfg.step_blocks(spec.num_kv_heads), cfg.sink_blocks, cfg.recent_blocks,
                        spec.num_kv_heads if cfg.per_kv_head else 1, cfg.topk)
        if len(self.layers) < cfg.dense_layers:  # attends to every block: the whole context stays resident
            hot = max(self.max_blocks, cfg.sink_blocks + cfg.recent_blocks)
            cfg = replace(cfg, hot_blocks=hot, topk=hot, min_context=self.max_blocks * cfg.block_size + 1)
        cache = HiSparseLayerCache(layer, spec.num_kv_heads, spec.head_dim, cfg, self.num_slots,
                                   self.max_blocks, self.device, self.dtype, self.store, self.metrics,
                                   self.engine_nonce, self.fingerprint, counts_steps=not self.layers)
        self.layers.append(cache)
        return cache

    @property
    def hot_blocks(self) -> int:
        """The hot buffer's blocks per sequence in the selecting layers (the auto size
        resolved once a layer exists; the configured value before)."""
        return self.layers[-1].hot if self.layers else self.config.hot_blocks

    @property
    def store_name(self) -> str:
        """The block store's name, or "mirror" (blocks in the layer caches' host mirrors only)."""
        return self.store.name if self.store is not None else "mirror"

    def device_bytes_per_slot(self) -> int:
        """Device bytes of one sequence's HiSparse state over all full-attention layers."""
        return sum(c.device_bytes_per_slot() for c in self.layers)

    def snapshot(self) -> dict[str, Any]:
        snap = self.metrics.snapshot()
        snap.update(store=self.store_name, block_size=self.config.block_size, topk=self.config.topk,
                    hot_blocks=self.hot_blocks, min_context=self.config.min_context)
        return snap

    def flush(self) -> None:
        if self.store is not None:
            self.store.flush()

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
