"""`HiSparseMetrics`: counters of HiSparse offload, shared by every layer cache and the block
store of one engine; `snapshot()` is what `--json` output and the Prometheus exporter show.

- blocks_fetched_per_step: blocks read back into the device per decode step (all layers
  and sequences of the step);
- hot_hit_rate: share of the blocks attended to that were already in the hot buffer;
- read/write bytes per second per tier ("cpu", "nvme" for the daemon's tiers, "process"
  for blocks still queued for their put or kept in this process): bytes over the seconds
  spent reading (writing) them.
"""
from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any


@dataclass
class HiSparseMetrics:
    decode_steps: int = 0
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
        with self._lock:
            steps = self.decode_steps
            return {
                "decode_steps": steps,
                "blocks_attended": self.blocks_attended,
                "blocks_fetched": self.blocks_fetched,
                "blocks_fetched_per_step": self.blocks_fetched / steps if steps else 0.0,
                "blocks_staged": self.blocks_staged,
                "blocks_evicted": self.blocks_evicted,
                "blocks_stored": self.blocks_stored,
                "hot_hit_rate": self.hot_hits / self.blocks_attended if self.blocks_attended else None,
                "put_failures": self.put_failures,
                "blocks_lost": self.blocks_lost,
                "recomputes": self.recomputes,
                "read_bytes": dict(self.read_bytes),
                "write_bytes": dict(self.write_bytes),
                "read_bytes_per_s": {t: b / self.read_seconds[t] for t, b in self.read_bytes.items()
                                     if self.read_seconds[t] > 0},
                "write_bytes_per_s": {t: b / self.write_seconds[t] for t, b in self.write_bytes.items()
                                      if self.write_seconds[t] > 0},
            }
