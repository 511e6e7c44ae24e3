"""`StoreConnectorConfig`: where the daemon is and how patient the connector is with it.

Every bound here exists so that a missing or slow daemon costs a request at most a
bounded wait before it is served by recomputation:

- `rpc_timeout_s`: deadline of one control-plane call (Lookup, Get, Reserve...). A call
  that misses it marks the daemon unavailable until a health probe succeeds.
- `load_timeout_s`: most time the engine loop waits for one request's loads before it
  recomputes the segments still missing.
- `inflight_wait_s`: most time to wait for a segment another engine is computing (the
  dedup through the daemon) before computing it here.
- `reconnect_min_s` / `reconnect_max_s`: exponential backoff of the reconnect loop.
- `put_queue_depth`: signatures waiting to be stored; a put beyond it is dropped and
  counted (the request is never held up by storage).
- `put_tier`: tier puts land in (None: the daemon's default tier).
- `prefetch_queued`: queued (not yet admitted) requests whose segments are looked up
  and hinted to the daemon (promotion NVMe -> CPU) while earlier requests prefill.
- `dedup`: claim a cold segment through the daemon before computing it, so other
  engines wait for it instead of computing it too.
- `verify`: check each loaded blob's checksum on the client (the daemon already
  verifies every commit and every NVMe read).
- `share_cold`: offer a request's cold segments to idle engines (engine.connector.
  coldshare) and, while this engine is idle, compute segments other engines offer.
  Needs `dedup` (the claims carry it); off when `dedup` is off.
- `share_min_segments`: cold segments a request needs before it offers any (with one,
  there is nothing to do in parallel).
- `share_poll_s`: how often an idle engine lists offered segments (one List RPC).
- `share_wait_s`: most time to wait for an offered segment a helper claimed before
  computing it here; also the lifetime of an offer. 5 s: a helper's packed pass of
  `share_pack_tokens` takes well under a second on a GPU; this bounds a stuck one (30 s
  would be far above any TTFT SLO).
- `share_keep`: share of a request's cold tokens its own engine computes before it
  turns to the rest: the smallest run of its first cold segments holding at least this
  share (one segment at least, all but one at most) is kept and computed (packed); only
  the others are offered, so helpers take them while it computes. After its share it
  claims and computes whatever no helper took, then waits for what helpers hold.
- `share_pack_tokens`: most tokens of cold segments computed in one packed alone pass
  while sharing, on both sides: the requester's passes (its share, then the rest no
  helper took), and what a helper takes per idle call. One pass per side is cheapest
  (an alone pass's cost is mostly per pass, not per token, on a GPU); it bounds memory.
- `device_cache_bytes`: capacity of the engine's own LRU of signatures it holds in its
  device memory (computed here, or copied here from a host tier), so a segment used
  again is spliced without a daemon round trip (the L1 of HiCache-style tiering; the
  daemon stays the shared tier every engine reads). None: bounded by
  `device_cache_fraction` instead.
- `device_cache_fraction` (when `device_cache_bytes` is None): the device cache holds at
  most this fraction of the device memory free when the connector is attached (after
  the engine allocated its weights and its KV pool: what a serving engine can spare next
  to its running requests), so the working set beyond it is served by the daemon's
  tiers. None: DEFAULT_DEVICE_CACHE_FRACTION (0.05) on CUDA, off (0 bytes) on the CPU;
  given on the CPU, a fraction of the host memory available (`device_cache_capacity`).
- `nvme_read_backend`: how NVMe hits reach a CUDA device (kvstore.tiers.nvme_read):
  `kvikio` (cuFile straight into device memory), `posix` (the Get promotes them to the
  CPU arena, then the pinned copy), or `auto` (kvikio where it reads with GPUDirect
  Storage, else posix). `kvikio` where kvikio cannot run is refused when attaching.
- `tier_admission`: which daemon-tier hits a PIC request loads (engine.connector.
  tier_admission). `cost`: a hit whose expected load time (its bytes over the measured
  read rate of its tier) exceeds the time computing its positions in context takes (the
  planner's measured full-pass cost per token) is not loaded but computed in the
  request's fused pass, counted in `skipped_slow_hits`; an NVMe one is promoted to the
  CPU tier in the background. `always`: every hit is loaded, however slow its tier.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Optional

import torch

from engine.connector.errors import ConnectorConfigError
from engine.connector.tier_admission import TIER_ADMISSIONS

TIERS = ("gpu", "cpu", "nvme")
#: how NVMe hits reach the device (kvstore.tiers.nvme_read)
NVME_READ_BACKENDS = ("auto", "posix", "kvikio")
#: share of the free device memory the engine's private signature cache may hold (CUDA):
#: on an H200 with a 4 GB model and its KV pool, a few GB (a few hundred bench-size
#: signatures); the rest of a working set comes from the store's tiers
DEFAULT_DEVICE_CACHE_FRACTION = 0.05


@dataclass(frozen=True)
class StoreConnectorConfig:
    """Options of the store connector (module docstring)."""

    socket: Optional[str] = None  # None: the daemon's default socket (KVSTORE_SOCKET, config file)
    tcp: Optional[str] = None  # HOST:PORT instead of a unix socket
    rpc_timeout_s: float = 5.0
    load_timeout_s: float = 10.0
    inflight_wait_s: float = 60.0
    reconnect_min_s: float = 0.05
    reconnect_max_s: float = 2.0
    put_queue_depth: int = 256
    put_tier: Optional[str] = None
    prefetch_queued: int = 4
    dedup: bool = True
    verify: bool = False
    share_cold: bool = True
    share_min_segments: int = 2
    share_poll_s: float = 0.01
    share_wait_s: float = 5.0
    share_pack_tokens: int = 8192
    share_keep: float = 0.5
    device_cache_bytes: Optional[int] = None
    device_cache_fraction: Optional[float] = None
    nvme_read_backend: str = "auto"
    tier_admission: str = "cost"

    @property
    def sharing(self) -> bool:
        """Cold segments are offered to and taken from other engines."""
        return self.share_cold and self.dedup

    def __post_init__(self) -> None:
        for name in ("rpc_timeout_s", "load_timeout_s", "inflight_wait_s", "reconnect_min_s", "reconnect_max_s",
                     "share_poll_s", "share_wait_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
                raise ConnectorConfigError(f"{name}={v!r} must be a finite number > 0")
        if self.reconnect_max_s < self.reconnect_min_s:
            raise ConnectorConfigError(
                f"reconnect_max_s={self.reconnect_max_s} must be >= reconnect_min_s={self.reconnect_min_s}")
        k = self.share_keep
        if not isinstance(k, (int, float)) or isinstance(k, bool) or not 0.0 < k <= 1.0:
            raise ConnectorConfigError(f"share_keep={k!r} must be a number in (0, 1]")
        d = self.device_cache_bytes
        if d is not None and (not isinstance(d, int) or isinstance(d, bool) or d < 0):
            raise ConnectorConfigError(f"device_cache_bytes={d!r} must be None or an int >= 0")
        f = self.device_cache_fraction
        if f is not None and (not isinstance(f, (int, float)) or isinstance(f, bool) or not 0.0 <= f <= 1.0):
            raise ConnectorConfigError(f"device_cache_fraction={f!r} must be None or a number in [0, 1]")
        for name in ("put_queue_depth", "prefetch_queued", "share_min_segments", "share_pack_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ConnectorConfigError(f"{name}={v!r} must be an int >= 0")
        if self.nvme_read_backend not in NVME_READ_BACKENDS:
            raise ConnectorConfigError(f"nvme_read_backend={self.nvme_read_backend!r} must be one of "
                                       f"{', '.join(NVME_READ_BACKENDS)}")
        if self.tier_admission not in TIER_ADMISSIONS:
            raise ConnectorConfigError(f"tier_admission={self.tier_admission!r} must be one of "
                                       f"{', '.join(TIER_ADMISSIONS)}")
        if self.put_tier is not None and self.put_tier not in TIERS:
            raise ConnectorConfigError(f"put_tier={self.put_tier!r} must be one of {', '.join(TIERS)} or None")
        if self.socket is not None and not str(self.socket):
            raise ConnectorConfigError("socket='' is not a path; pass None for the default socket")


def free_memory_bytes(device: torch.device) -> int:
    """Memory free for new allocations: on CUDA the device's (torch.cuda.mem_get_info),
    else the host's available physical memory."""
    if device.type == "cuda":  # pragma: no cover - GPU only
        return int(torch.cuda.mem_get_info(device)[0])
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def device_cache_capacity(config: StoreConnectorConfig, device: torch.device) -> int:
    """Bytes of the engine's private signature cache on `device` (module docstring:
    `device_cache_bytes`, else `device_cache_fraction` of the free memory now)."""
    if config.device_cache_bytes is not None:
        return config.device_cache_bytes
    f = config.device_cache_fraction
    if f is None:
        if device.type != "cuda":
            return 0
        f = DEFAULT_DEVICE_CACHE_FRACTION
    return int(f * free_memory_bytes(device))
