"""`ConnectorMetrics`: what the store connector did, as counters and one gauge, readable
as a dict (`snapshot`, for `kvengine run` and the benchmarks) and as Prometheus metric
families (`PrometheusCollector`, registered in the HTTP server's registry by
`kvengine serve --store`).

Updated from the engine loop thread, the loader thread, the put thread and the
reconnect thread; every update takes one lock (counters are cheap, updates are rare:
a few per request).

Names (snapshot keys; Prometheus adds the prefix `kvengine_store_`):
- `store_available` (gauge, 1/0): the daemon answers now.
- lookups: `lookup_rpcs`, `lookup_keys`, `lookup_hits` (keys present at lookup).
- gets (one per distinct segment a request splices): `hits`, `misses`, `sync_loads`
  (a get that found no prefetch and loaded on the spot).
- loads by the tier that held the segment at lookup: `loads{tier}`, `load_bytes{tier}`,
  `load_ms{tier}` (loader wall time: lease, decode, copy to the device, copy done);
  `promotions` (an NVMe hit served from the CPU arena after promotion).
- `skipped_slow_hits{tier}`: hits at lookup not loaded because their load was expected
  to take longer than computing them in context (StoreConnectorConfig.tier_admission
  "cost", engine.connector.tier_admission); the planner computed them.
- overlap: `load_ms_total` (loader time for admitted requests), `load_wait_ms_total`
  (time the engine loop blocked on loads); `overlap` = 1 - wait / load.
- fallbacks: `fallback_requests` (requests that found the daemon unavailable),
  `fallback_segments` (segments recomputed because of it), `load_timeouts`,
  `store_errors` (logical errors from the daemon, e.g. a corrupt object).
- puts: `puts_queued`, `puts_stored`, `puts_exists`, `puts_dropped` (queue full),
  `puts_failed{reason}` (capacity, unavailable, daemon_restarted, invalid, error),
  `put_bytes`, `put_ms_total`.
- dedup: `computes` (segments computed alone here), `claims` (claims this engine won),
  `inflight_waits`, `inflight_wait_hits`, `inflight_wait_misses`.
- connection: `disconnects`, `reconnects`, `daemon_restarts`.
- cold sharing (engine.connector.coldshare): `cold_offered` (wanted records published),
  `cold_offloaded` (offered segments another engine computed), `cold_wait_ms_total`
  (time waited for them), `cold_helped` (segments computed for other engines),
  `cold_help_ms_total`, `cold_rejected` (offers whose tokens do not give their key).
- host -> device copies of CPU-tier segments (CUDA): `h2d_copy_bytes` and
  `h2d_copy_ms_total` (device time from the first copy to the last, per segment: the
  PCIe rate the serving path reaches is bytes / time); layered copies also count
  `h2d_copy_groups` and `h2d_issue_ms_total` (host time issuing them on the loader
  thread, waits for the GIL included: near the device time, the host bounds the copies).
- `near_hits`: segments spliced from the engine's own device cache (no daemon round
  trip; StoreConnectorConfig.device_cache_bytes / device_cache_fraction).
- cold fallback (PicConfig.cold_full_fraction): `deferred_computed` (queued misses
  computed alone while idle, and stored), `deferred_batches` (idle calls that computed
  some), `deferred_tokens`, `deferred_ms_total` (whole calls) split into
  `deferred_alone_ms_total` (the packed alone pass) and `deferred_store_ms_total`
  (queueing the puts).
- `captured`: signatures of misses taken from the requests' own passes and stored
  (PicConfig.miss_signatures="context", engine.pic.capture): alone passes not run.
- `prefix_lookups`, `prefix_hits`, `prefix_puts`, `prefix_load_bytes`: exact-prefix
  checkpoints (engine.connector.prefix_store): requests that asked the daemon for one,
  the ones it served, checkpoints queued for storage, and the bytes loaded.
- `peer_loads`, `peer_load_bytes`: GPU-tier loads whose bytes sat on another device
  than the engine's (copied device to device; CUDA IPC across GPUs).
"""
from __future__ import annotations

import threading
from typing import Any, Iterator

TIERS = ("gpu", "cpu", "nvme")
PUT_FAILURE_REASONS = ("capacity", "unavailable", "daemon_restarted", "invalid", "error")

_COUNTERS = (
    "lookup_rpcs", "lookup_keys", "lookup_hits", "hits", "misses", "sync_loads", "promotions",
    "load_timeouts", "fallback_requests", "fallback_segments", "store_errors",
    "puts_queued", "puts_stored", "puts_exists", "puts_dropped", "put_bytes",
    "computes", "claims", "inflight_waits", "inflight_wait_hits", "inflight_wait_misses",
    "disconnects", "reconnects", "daemon_restarts",
    "cold_offered", "cold_offloaded", "cold_helped", "cold_rejected", "peer_loads", "peer_load_bytes",
    "h2d_copy_bytes", "h2d_copy_groups",
    "deferred_computed", "deferred_batches", "deferred_tokens", "idle_stopped", "near_hits", "captured",
    "prefix_lookups", "prefix_hits", "prefix_puts", "prefix_load_bytes",
)
_TIMERS = ("load_ms_total", "load_wait_ms_total", "put_ms_total", "cold_wait_ms_total", "cold_help_ms_total",
           "deferred_ms_total", "deferred_alone_ms_total", "deferred_store_ms_total", "h2d_copy_ms_total",
           "h2d_issue_ms_total")


class ConnectorMetrics:
    """Thread-safe counters of one connector (module docstring for the names)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._c: dict[str, float] = dict.fromkeys(_COUNTERS + _TIMERS, 0)
        self._loads = {t: 0 for t in TIERS}
        self._load_bytes = {t: 0 for t in TIERS}
        self._load_ms = {t: 0.0 for t in TIERS}
        self._skipped = {t: 0 for t in TIERS}
        self._put_failed = {r: 0 for r in PUT_FAILURE_REASONS}
        self._available = 0

    # ------------------------------------------------------------------ updates
    def inc(self, name: str, n: float = 1) -> None:
        with self._lock:
            if name not in self._c:
                raise KeyError(f"unknown connector metric {name!r}")
            self._c[name] += n

    def set_available(self, up: bool) -> None:
        with self._lock:
            self._available = 1 if up else 0

    def add_load(self, tier: str, nbytes: int, ms: float) -> None:
        tier = tier if tier in self._loads else "cpu"
        with self._lock:
            self._loads[tier] += 1
            self._load_bytes[tier] += int(nbytes)
            self._load_ms[tier] += ms

    def add_skipped(self, tier: str) -> None:
        """A hit in `tier` the cost admission did not load."""
        tier = tier if tier in self._skipped else "cpu"
        with self._lock:
            self._skipped[tier] += 1

    def add_put_failure(self, reason: str) -> None:
        reason = reason if reason in self._put_failed else "error"
        with self._lock:
            self._put_failed[reason] += 1

    # ------------------------------------------------------------------ reads
    @property
    def available(self) -> bool:
        return bool(self._available)

    def get(self, name: str) -> float:
        with self._lock:
            return self._c[name]

    def snapshot(self) -> dict[str, Any]:
        """Every metric as a JSON-able dict (module docstring for the keys)."""
        with self._lock:
            out: dict[str, Any] = {"store_available": self._available}
            for k, v in self._c.items():
                out[k] = round(v, 3) if k in _TIMERS else int(v)
            out["loads"] = dict(self._loads)
            out["load_bytes"] = dict(self._load_bytes)
            out["load_ms"] = {t: round(v, 3) for t, v in self._load_ms.items()}
            out["skipped_slow_hits"] = dict(self._skipped)
            out["puts_failed"] = dict(self._put_failed)
            load, wait = self._c["load_ms_total"], self._c["load_wait_ms_total"]
        out["overlap"] = overlap_fraction(load, wait)
        return out


def overlap_fraction(load_ms: float, wait_ms: float) -> float | None:
    """Share of load time hidden behind compute: 1 - (time the engine waited for loads) /
    (time loads took); None when nothing was loaded."""
    if load_ms <= 0:
        return None
    return round(max(0.0, min(1.0, 1.0 - wait_ms / load_ms)), 4)


class PrometheusCollector:
    """A prometheus_client collector over a `ConnectorMetrics` (register it in a
    registry; values are read at scrape time)."""

    PREFIX = "kvengine_store_"

    def __init__(self, metrics: ConnectorMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self.metrics.snapshot()
        p = self.PREFIX
        yield GaugeMetricFamily(p + "available", "1 when the kvstore daemon answers, else 0 (serving by recompute).",
                                value=s["store_available"])
        for name in _COUNTERS:
            yield CounterMetricFamily(p + name, f"Store connector: {name.replace('_', ' ')}.", value=s[name])
        for name in _TIMERS:
            yield CounterMetricFamily(p + name.replace("_ms_total", "_seconds"),
                                      f"Store connector: {name.replace('_ms_total', '').replace('_', ' ')} time.",
                                      value=s[name] / 1e3)
        loads = CounterMetricFamily(p + "segment_loads", "Segments loaded, by the tier that held them.", labels=["tier"])
        nbytes = CounterMetricFamily(p + "segment_load_bytes", "Bytes loaded, by tier.", labels=["tier"])
        secs = CounterMetricFamily(p + "segment_load_seconds", "Loader time, by tier.", labels=["tier"])
        skipped = CounterMetricFamily(p + "skipped_slow_hits", "Hits not loaded (slower than computing them), by tier.",
                                      labels=["tier"])
        for t in TIERS:
            loads.add_metric([t], s["loads"][t])
            nbytes.add_metric([t], s["load_bytes"][t])
            secs.add_metric([t], s["load_ms"][t] / 1e3)
            skipped.add_metric([t], s["skipped_slow_hits"][t])
        yield loads
        yield nbytes
        yield secs
        yield skipped
        failed = CounterMetricFamily(p + "puts_failed", "Signature puts that failed, by reason.", labels=["reason"])
        for r in PUT_FAILURE_REASONS:
            failed.add_metric([r], s["puts_failed"][r])
        yield failed
        if s["overlap"] is not None:
            yield GaugeMetricFamily(p + "load_overlap_ratio", "Share of load time hidden behind compute.",
                                    value=s["overlap"])
