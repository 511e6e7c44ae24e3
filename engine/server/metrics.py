"""Prometheus metrics of one serving engine, in their own registry (so several servers
in one process, as in tests, do not collide).

Updated from the engine loop thread (`observe_step`, `observe_finished`) and from the
HTTP handlers (`observe_rejected`); prometheus_client is thread-safe. Names follow
vLLM's where one exists, under the prefix `kvengine_`.
"""
from __future__ import annotations

import collections
import threading
import time
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

if TYPE_CHECKING:
    from engine.engine import LLMEngine, RequestOutput

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
THROUGHPUT_WINDOW_S = 10.0

CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    """The metric families and the sliding window behind the tokens/s gauge."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kvengine_requests", "Finished requests, by finish reason.", ["finish_reason"], registry=r
        )
        self.rejected = Counter(
            "kvengine_requests_rejected", "Requests refused before running, by reason.", ["reason"], registry=r
        )
        self.ttft = Histogram(
            "kvengine_time_to_first_token_seconds", "Arrival to first output token.", buckets=TTFT_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            "kvengine_e2e_request_latency_seconds", "Arrival to finish.", buckets=LATENCY_BUCKETS, registry=r
        )
        self.queue = Histogram(
            "kvengine_request_queue_time_seconds", "Arrival to first admission.", buckets=LATENCY_BUCKETS, registry=r
        )
        self.prompt_tokens = Counter("kvengine_prompt_tokens", "Prompt tokens computed.", registry=r)
        self.reused_tokens = Counter("kvengine_prompt_tokens_reused", "Prompt tokens filled from a cache.", registry=r)
        self.generation_tokens = Counter("kvengine_generation_tokens", "Output tokens sampled.", registry=r)
        self.tokens_per_s = Gauge(
            "kvengine_generation_tokens_per_second",
            f"Output tokens per second over the last {THROUGHPUT_WINDOW_S:g} s.",
            registry=r,
        )
        self.running = Gauge("kvengine_num_requests_running", "Requests holding caches.", registry=r)
        self.waiting = Gauge("kvengine_num_requests_waiting", "Requests queued for admission.", registry=r)
        self.cache_usage = Gauge("kvengine_cache_usage_ratio", "Fraction of the limiting cache in use.", registry=r)
        self.preemptions = Counter("kvengine_preemptions", "Requests preempted for lack of cache.", registry=r)
        self.graphs_ready = Gauge("kvengine_prefill_graphs_ready",
                                  "1 once every prefill-stage CUDA graph bucket is captured (or none is needed).",
                                  registry=r)
        self.graphs_captured = Gauge("kvengine_prefill_graphs_captured", "Prefill-stage CUDA graphs held.",
                                     registry=r)
        self.steps = Counter("kvengine_engine_steps", "Scheduler steps run.", registry=r)
        # HiSparse offload (engine/hisparse/): set from its metrics snapshot after each step
        self.hs_fetched = Counter("kvengine_hisparse_blocks_fetched", "HiSparse blocks read back to the device.",
                                  registry=r)
        self.hs_fetched_per_step = Gauge("kvengine_hisparse_blocks_fetched_per_step",
                                         "HiSparse blocks read back per decode step (mean since start).", registry=r)
        self.hs_hit_rate = Gauge("kvengine_hisparse_hot_hit_ratio",
                                 "Share of attended HiSparse blocks found in the hot buffer.", registry=r)
        self.hs_read_rate = Gauge("kvengine_hisparse_read_bytes_per_second",
                                  "HiSparse block reads: bytes per second of reading, by tier.", ["tier"], registry=r)
        self.hs_write_rate = Gauge("kvengine_hisparse_write_bytes_per_second",
                                   "HiSparse block writes: bytes per second of writing, by tier.", ["tier"], registry=r)
        self.hs_recomputes = Counter("kvengine_hisparse_recomputes",
                                     "Requests recomputed because HiSparse blocks were lost.", registry=r)
        self.hs_decode_steps = Counter("kvengine_hisparse_decode_steps",
                                       "HiSparse decode steps, by how they ran: replayed from a CUDA graph or eagerly.",
                                       ["mode"], registry=r)
        self._hs_last = {"fetched": 0, "recomputes": 0, "graph": 0, "eager": 0}
        info = Gauge("kvengine_model_info", "The served model.", ["model"], registry=r)
        info.labels(model=model_name).set(1)
        self._window: collections.deque[tuple[float, int]] = collections.deque()
        self._last = {"prompt": 0, "reused": 0, "gen": 0, "preempt": 0}
        self._started = time.monotonic()
        self._window_lock = threading.Lock()

    def observe_step(self, engine: "LLMEngine", outputs: list["RequestOutput"]) -> None:
        """After each engine step: counters from the engine's stats, gauges, finishes."""
        s = engine.stats
        self.steps.inc()
        self.prompt_tokens.inc(s.num_prompt_tokens_computed - self._last["prompt"])
        self.reused_tokens.inc(s.num_prompt_tokens_reused - self._last["reused"])
        new_gen = s.num_generated_tokens - self._last["gen"]
        self.generation_tokens.inc(new_gen)
        self.preemptions.inc(s.num_preemptions - self._last["preempt"])
        self._last = {
            "prompt": s.num_prompt_tokens_computed,
            "reused": s.num_prompt_tokens_reused,
            "gen": s.num_generated_tokens,
            "preempt": s.num_preemptions,
        }
        self._record_tokens(new_gen)
        self.observe_gauges(engine)
        for out in outputs:
            if out.finished:
                self.observe_finished(out)

    def observe_gauges(self, engine: "LLMEngine") -> None:
        self.running.set(engine.num_running)
        self.waiting.set(engine.num_waiting)
        self.cache_usage.set(engine.cache_usage())
        self.observe_prefill_graphs(engine)
        offload = getattr(engine, "kv_offload", None)
        if offload is not None:
            self.observe_hisparse(offload.snapshot())

    def observe_prefill_graphs(self, engine: "LLMEngine") -> None:
        graphs = getattr(engine, "prefill_graphs", None)
        self.graphs_ready.set(1 if graphs is None or graphs.ready else 0)
        self.graphs_captured.set(0 if graphs is None else graphs.captured)

    def observe_hisparse(self, snap: dict) -> None:
        """HiSparse metrics from `HiSparseOffload.snapshot()`."""
        self.hs_fetched.inc(snap["blocks_fetched"] - self._hs_last["fetched"])
        self.hs_recomputes.inc(snap["recomputes"] - self._hs_last["recomputes"])
        for mode in ("graph", "eager"):
            n = snap.get(f"decode_{mode}_steps", 0)
            self.hs_decode_steps.labels(mode=mode).inc(n - self._hs_last[mode])
            self._hs_last[mode] = n
        self._hs_last.update(fetched=snap["blocks_fetched"], recomputes=snap["recomputes"])
        self.hs_fetched_per_step.set(snap["blocks_fetched_per_step"])
        if snap["hot_hit_rate"] is not None:
            self.hs_hit_rate.set(snap["hot_hit_rate"])
        for tier, rate in snap["read_bytes_per_s"].items():
            self.hs_read_rate.labels(tier=tier).set(rate)
        for tier, rate in snap["write_bytes_per_s"].items():
            self.hs_write_rate.labels(tier=tier).set(rate)

    def observe_finished(self, out: "RequestOutput") -> None:
        self.requests.labels(finish_reason=out.finish_reason or "abort").inc()
        tl = out.timeline
        if tl.ttft is not None:
            self.ttft.observe(tl.ttft)
        if tl.queue_time is not None:
            self.queue.observe(tl.queue_time)
        if tl.e2e is not None:
            self.e2e.observe(tl.e2e)

    def observe_rejected(self, reason: str) -> None:
        self.rejected.labels(reason=reason).inc()

    def _record_tokens(self, n: int, now: float | None = None) -> None:
        """Tokens/s averaged over the last THROUGHPUT_WINDOW_S seconds (or since start,
        when the server is younger than that, but over at least one second)."""
        now = time.monotonic() if now is None else now
        with self._window_lock:
            if n:
                self._window.append((now, n))
            while self._window and self._window[0][0] < now - THROUGHPUT_WINDOW_S:
                self._window.popleft()
            span = max(1.0, min(THROUGHPUT_WINDOW_S, now - self._started))
            self.tokens_per_s.set(sum(k for _, k in self._window) / span)

    def render(self) -> bytes:
        self._record_tokens(0)  # let the rate decay while the engine is idle
        return generate_latest(self.registry)
