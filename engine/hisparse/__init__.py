"""HiSparse offload: long-context full-attention KV in fixed blocks off the device (the
kvstore daemon's CPU and NVMe tiers, or this process's memory), per-block summaries and a
bounded hot buffer on the device, top-k block selection per decode step and layer
(docs/hisparse.md). Decode fetches missing blocks from a pinned host mirror with no host
synchronisation (kernels/hisparse_gather.py).

- config.py: `HiSparseConfig` (the `--hisparse*` options);
- store.py: the `BlockStore` interface, keys, `MemoryBlockStore`;
- daemon_store.py: `DaemonBlockStore` (asynchronous puts, zero-copy reads);
- layer_cache.py: `HiSparseLayerCache`, one layer's blocks, hot buffer and selection;
- residency.py: `HotBufferTable`, the device-side block -> row table and eviction;
- host_memory.py: the page-locked host mirror of sealed blocks;
- offload.py: `HiSparseOffload`, an engine's store, metrics and layer caches;
- metrics.py: `HiSparseMetrics`; errors.py: the exceptions;
- sync_guard.py: `HostSyncGuard`, records host syncs and host<->device copies of a step
  (tests and tools/check_hisparse_gpu.py).
"""
from engine.hisparse.config import HiSparseConfig
from engine.hisparse.errors import BlocksLost, HiSparseConfigError, HiSparseError
from engine.hisparse.offload import HiSparseOffload
from engine.hisparse.store import KEY_PREFIX, OBJECT_KIND, BlockStore, MemoryBlockStore

__all__ = ["HiSparseConfig", "HiSparseOffload", "BlockStore", "MemoryBlockStore", "BlocksLost", "HiSparseError",
           "HiSparseConfigError", "KEY_PREFIX", "OBJECT_KIND"]
