"""Prometheus metrics of the daemon, and the HTTP endpoint that serves them.

Owns: the daemon's metrics registry. Store-level figures (Get and Lookup hits and misses, evictions, bytes
and objects per tier, leases) are read from `Store.stats()` at scrape time by a
collector, so they are never double-counted or stale; per-RPC latency histograms and
error counters are recorded by the servicer through `DaemonMetrics.observe`, and TCP
requests refused for their token through `DaemonMetrics.refused`. The HTTP
server (GET /metrics) is off by default and started by `--metrics-port` /
KVSTORE_METRICS_PORT.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Iterator, Optional
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

log = logging.getLogger("kvstore.metrics")

# Latency buckets from 50 us to 5 s: lookups sit in the first few, NVMe gets further out.
LATENCY_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class _StoreCollector:
    """Reads `stats()` (the Store's stats dict) on every scrape."""

    def __init__(self, stats: Callable[[], dict[str, Any]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Any]:
        try:
            s = self._stats()
        except Exception:  # a scrape must not take the daemon down
            log.exception("stats() failed during a metrics scrape")
            return
        for name, help_text in (
            ("hits", "Keys a Get found (engines get only keys a Lookup found: see kvstore_lookup_*)"),
            ("misses", "Keys a Get did not find"),
            ("lookup_hits", "Keys a Lookup found"),
            ("lookup_misses", "Keys a Lookup did not find"),
            ("evictions", "Objects dropped from the last tier under pressure"),
            ("demotions", "Objects moved to a slower tier"),
            ("promotions", "Objects moved to a faster tier"),
            ("corrupt_dropped", "Objects dropped because their bytes failed the checksum"),
            ("writebacks", "CPU-tier objects given an NVMe copy ahead of need (background write-back)"),
            ("writeback_bytes", "Bytes written back to the NVMe tier in the background"),
            ("writeback_failures", "Background write-backs that failed (the object stayed as it was)"),
        ):
            if name in s:
                yield CounterMetricFamily(f"kvstore_{name}", help_text, value=float(s[name]))
        for name, help_text in (("leases", "Leases held now"), ("reservations", "Puts in flight now")):
            if name in s:
                yield GaugeMetricFamily(f"kvstore_{name}", help_text, value=float(s[name]))
        used = GaugeMetricFamily("kvstore_tier_used_bytes", "Bytes in use per tier", labels=["tier"])
        cap = GaugeMetricFamily("kvstore_tier_capacity_bytes", "Capacity per tier", labels=["tier"])
        objs = GaugeMetricFamily("kvstore_tier_objects", "Objects per tier", labels=["tier"])
        for t in s.get("tiers", []):
            used.add_metric([t["name"]], float(t["used_bytes"]))
            cap.add_metric([t["name"]], float(t["capacity_bytes"]))
            objs.add_metric([t["name"]], float(t["objects"]))
        yield used
        yield cap
        yield objs
        yield from _remote_metrics(s.get("remote") or {})


_REMOTE_COUNTERS = (
    ("hits", "Local misses found in the remote tier (verified, then served from the CPU tier)"),
    ("misses", "Local misses the remote tier did not hold either"),
    ("errors", "Remote operations that failed or timed out"),
    ("timeouts", "Remote operations that took longer than remote_timeout"),
    ("corrupt_dropped", "Remote objects that failed their checksum or header check (dropped, never served)"),
    ("objects_written", "Objects this daemon wrote to the remote tier"),
    ("bytes_written", "Bytes of objects this daemon wrote to the remote tier"),
    ("bytes_read", "Bytes of objects this daemon read from the remote tier"),
    ("put_skipped_unreachable", "Remote writes skipped while the remote store was unreachable"),
    ("lookups_skipped_unreachable", "Keys not asked of the remote tier while it was unreachable"),
    ("reconnects", "Times the remote store became reachable again"),
)


def _remote_metrics(r: dict[str, Any]) -> Iterator[Any]:
    """The remote tier's series (kvstore.remote.tier), when one is configured."""
    if not r.get("enabled"):
        return
    for name, help_text in _REMOTE_COUNTERS:
        yield CounterMetricFamily(f"kvstore_remote_{name}", help_text, value=float(r.get(name, 0)))
    yield GaugeMetricFamily("kvstore_remote_reachable", "1 while the remote store is reachable",
                            value=1.0 if r.get("reachable") else 0.0)
    yield GaugeMetricFamily("kvstore_remote_pending_writes", "Objects queued for or being written to the remote tier",
                            value=float(r.get("pending_writes", 0)))
    lat = GaugeMetricFamily("kvstore_remote_latency_seconds", "Remote operation latency over the last 4096 operations",
                            labels=["op", "quantile"])
    for op in ("get", "put"):
        d = r.get(f"{op}_latency") or {}
        lat.add_metric([op, "0.5"], float(d.get("p50_s", 0.0)))
        lat.add_metric([op, "0.99"], float(d.get("p99_s", 0.0)))
    yield lat


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        log.debug("metrics http: " + format, *args)


class DaemonMetrics:
    """The daemon's metrics: a private registry (so several daemons can live in one test
    process), the store collector, and per-RPC latency and error series."""

    def __init__(self, stats: Callable[[], dict[str, Any]]) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_StoreCollector(stats))
        self.latency = Histogram(
            "kvstore_request_seconds", "RPC latency by method", ["rpc"],
            registry=self.registry, buckets=LATENCY_BUCKETS,
        )
        self.errors = Counter(
            "kvstore_request_errors", "RPCs that ended in an error, by method and error code",
            ["rpc", "code"], registry=self.registry,
        )
        self.auth_refusals = Counter(
            "kvstore_tcp_auth_failures", "TCP requests refused for a missing or wrong token",
            registry=self.registry,
        )
        self.auth_failures = 0  # the same count, for Stats (tcp_auth_failures)
        self._auth_lock = threading.Lock()
        self._latency_by_rpc: dict[str, Any] = {}
        self._http: Optional[WSGIServer] = None
        self._thread: Optional[threading.Thread] = None

    def observe(self, rpc: str, seconds: float, error_code: Optional[str] = None) -> None:
        child = self._latency_by_rpc.get(rpc)
        if child is None:  # labels() takes a lock and builds a key per call: resolve once
            child = self._latency_by_rpc.setdefault(rpc, self.latency.labels(rpc))
        child.observe(seconds)
        if error_code is not None:
            self.errors.labels(rpc, error_code).inc()

    def refused(self, method: str) -> None:
        """Count one TCP request refused for its token (any thread)."""
        with self._auth_lock:
            self.auth_failures += 1
        self.auth_refusals.inc()

    def serve_http(self, host: str, port: int) -> int:
        """Serve GET /metrics on host:port in a daemon thread; returns the bound port."""
        app = make_wsgi_app(self.registry)
        self._http = make_server(host, port, app, handler_class=_QuietHandler)
        self._thread = threading.Thread(target=self._http.serve_forever, name="kvstore-metrics", daemon=True)
        self._thread.start()
        return self._http.server_port

    def stop_http(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
