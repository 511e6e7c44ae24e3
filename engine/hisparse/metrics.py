"""`HiSparseMetrics`: counters of HiSparse offload, shared by every layer cache and the block
store of one engine; `snapshot()` is what `--json` output and the Prometheus exporter show.

- blocks_fetched_per_step: blocks read back into the device per decode step (all layers
  and sequences of the step);
- hot_hit_rate: share of the blocks attended to that were already in the hot buffer;
- decode_graph_steps / decode_eager_steps: decode steps replayed from (or captured into)
  the runner's CUDA graphs / run eagerly (graphs off, or a step no graph takes);
- read/write bytes per second per tier ("cpu", "nvme" for the daemon's tiers, "process"
  for blocks still queued for their put or kept in this process): bytes over the seconds
  spent reading (writing) them; "mirror" read bytes (decode fetches and prefill reads from
  the pinned host mirror) are counted on the device, without a per-step clock, so they
  have no rate.
"""
from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any


@dataclass
class HiSparseMetrics:
    decode_steps: int = 0
    #: decode steps replayed from (or captured into) a CUDA graph / run eagerly
    graph_steps: int = 0
    eager_steps: int = 0
    blocks_attended: int = 0
    hot_hits: int = 0
    blocks_fetched: int = 0
    blocks_staged: int = 0
    blocks_evicted: int = 0
    blocks_stored: int = 0
    put_failures: int = 0
    blocks_lost: int = 0
    recomputes: int = 0
    read_bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    read_seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    write_bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    write_seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    #: device-side counters of the layer caches (engine/hisparse/residency.py COUNTER_NAMES)
    #: with each layer's block bytes; read (one device sync) by `snapshot` only
    _device: list[tuple[Any, int]] = field(default_factory=list, repr=False)

    def add_counters(self, counts: Any, block_nbytes: int) -> None:
        """Register a layer's device counters `[attended, hits, fetched, staged, evicted]`."""
        self._device.append((counts, block_nbytes))

    def add_read(self, tier: str, nbytes: int, seconds: float) -> None:
        with self._lock:
            self.read_bytes[tier] += nbytes
            self.read_seconds[tier] += seconds

    def add_write(self, tier: str, nbytes: int, seconds: float) -> None:
        with self._lock:
            self.write_bytes[tier] += nbytes
            self.write_seconds[tier] += seconds
            self.blocks_stored += 1

    def snapshot(self) -> dict[str, Any]:
        dev = [0] * 5
        fetched_bytes = 0
        for counts, nbytes in self._device:
            vals = counts.tolist()
            dev = [a + b for a, b in zip(dev, vals)]
            fetched_bytes += vals[2] * nbytes
        with self._lock:
            steps = self.decode_steps
            attended, hits = self.blocks_attended + dev[0], self.hot_hits + dev[1]
            fetched = self.blocks_fetched + dev[2]
            read_bytes = dict(self.read_bytes)
            if fetched_bytes:
                read_bytes["mirror"] = read_bytes.get("mirror", 0) + fetched_bytes
            return {
                "decode_steps": steps,
                "decode_graph_steps": self.graph_steps,
                "decode_eager_steps": self.eager_steps,
                "blocks_attended": attended,
                "blocks_fetched": fetched,
                "blocks_fetched_per_step": fetched / steps if steps else 0.0,
                "blocks_staged": self.blocks_staged + dev[3],
                "blocks_evicted": self.blocks_evicted + dev[4],
                "blocks_stored": self.blocks_stored,
                "hot_hit_rate": hits / attended if attended else None,
                "put_failures": self.put_failures,
                "blocks_lost": self.blocks_lost,
                "recomputes": self.recomputes,
                "read_bytes": read_bytes,
                "write_bytes": dict(self.write_bytes),
                "read_bytes_per_s": {t: b / self.read_seconds[t] for t, b in self.read_bytes.items()
                                     if self.read_seconds[t] > 0},
                "write_bytes_per_s": {t: b / self.write_seconds[t] for t, b in self.write_bytes.items()
                                      if self.write_seconds[t] > 0},
            }
