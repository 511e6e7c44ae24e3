"""CUDA-graph stages of a short prefill pass: the token-wise parts of a fused prefill
(engine.pic.fused), captured per computed-token bucket and replayed.

A warm PIC prefill computes few tokens (seams and the question: tens to hundreds) through
every layer; launched op by op from Python it is host-bound (H200 serving traces: 4-16 ms
of GPU work inside 26-68 ms of TTFT, ~1100 kernel launches a request).
Most of those ops act on each token alone: the embedding, norms, projections, q/k
normalisation and decay gates (a linear layer's `prepare`), output gates and projections,
residuals and MLPs. `PrefillStages.run(name, fn, inputs, n)` runs such a token-wise
function over n tokens as a CUDA graph captured at the smallest bucket >= n (`buckets`),
its inputs copied into the graph's static buffers. Rows n.. of a bucket hold whatever an
earlier pass left there: a token-wise function never mixes rows, so the real rows never
see them. What depends on the request's layout (attention over the context, the short
convs across ranges, recurrences and compositions, cache writes) runs eagerly between the
graphs, on the first n rows of their outputs.

Inputs and outputs are token-major (token dim first) tensors or None; outputs may be any
pytree of them (tuples, dicts). An input that is an output of an earlier graph of the
same bucket is read in place (the residual stream goes from one layer's graph to the
next without a copy). The first use of a (stage, bucket) runs eagerly on a side stream
(that is the real computation, and it compiles Triton kernels at the bucket's shape),
then captures the graph, which later passes replay. A stage that fails to capture (a
host sync inside) runs eagerly from then on, logged once. All graphs share one memory pool
and replay in the order they were captured (one pass's stages, in layer order).

Off CUDA, `capture=False` runs the same bucketed, static-buffer path eagerly: tests
compare it with the plain pass.

Contract (as for decode graphs): parameters must not be reallocated after a capture, and
the outputs returned by `run` are valid until the same stage runs again (the next pass):
callers copy what they keep.

When the graphs are captured is a setting (`PREFILL_GRAPH_MODES`, EngineConfig.prefill_graphs,
`kvengine serve --prefill-graphs`): `upfront` captures every bucket before the engine is
returned (today's library default), `idle` leaves them to `PrefillGraphWarmup`, which the
server's engine loop steps one bucket at a time while no request is in the engine (the
server answers before they exist), `lazy` captures a (stage, bucket) on its first use by a
request. Whatever the mode, a bucket not yet captured is captured by the first pass that
uses it, so results never depend on the mode.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional, Sequence

import torch
from torch.utils import _pytree as pytree

log = logging.getLogger("engine.runtime")

#: computed-token buckets of the captured stages; a pass of more tokens runs eagerly (it
#: is GPU-bound anyway). Graph memory grows with the sum of the buckets (every layer's
#: stage outputs stay allocated: ~2 MB per bucket token for a 2B model of 24 layers).
BUCKETS = (32, 64, 128, 256, 512)

#: when the prefill-stage graphs are captured (module docstring)
PREFILL_GRAPH_MODES = ("upfront", "idle", "lazy")


class _Stage:
    __slots__ = ("inputs", "outputs", "spec", "graph")

    def __init__(self, inputs: list, outputs: list, spec: Any, graph: Optional[Any]) -> None:
        self.inputs, self.outputs, self.spec, self.graph = inputs, outputs, spec, graph


class PrefillStages:
    """The captured token-wise stages of one model (module docstring)."""

    def __init__(self, device: torch.device, buckets: Sequence[int] = BUCKETS, capture: Optional[bool] = None) -> None:
        self.device = torch.device(device)
        self.buckets = tuple(sorted({int(b) for b in buckets}))
        if not self.buckets or self.buckets[0] < 1:
            raise ValueError(f"buckets={buckets!r} must be positive token counts")
        self.capture = self.device.type == "cuda" if capture is None else capture
        if self.capture and self.device.type != "cuda":
            raise ValueError(f"capture=True needs a CUDA device, got {self.device}")
        self._stages: dict[tuple, _Stage] = {}
        self._eager: set[tuple] = set()  # stages that failed to capture
        self._owned: dict[int, dict[int, torch.Tensor]] = {}  # bucket -> data_ptr -> stage output
        self._pool = None
        #: counters for tests and metrics: replays, captures, eager runs (no bucket / failed)
        self.replays = self.captures = self.eager_runs = 0

    def bucket(self, n: int) -> Optional[int]:
        """The smallest bucket holding n tokens (None: more than every bucket)."""
        for b in self.buckets:
            if b >= n:
                return b
        return None

    @property
    def captured(self) -> int:
        return sum(1 for s in self._stages.values() if s.graph is not None)

    def has_bucket(self, b: int) -> bool:
        """Whether any stage of bucket b is laid out (captured, or set up eagerly off CUDA)."""
        return any(key[1] == b for key in self._stages)

    # ------------------------------------------------------------------ running
    def run(self, name: Any, fn: Callable[..., Any], inputs: Sequence[Optional[torch.Tensor]], n: int) -> Any:
        """`fn(*inputs)` over n tokens (every input holds at least n token-major rows);
        returns fn's outputs, each tensor cut to its first n rows. `name` identifies the
        function: the same name must always mean the same computation on inputs of the
        same trailing shapes and dtypes."""
        b = self.bucket(n)
        if b is None or (name, b) in self._eager:
            self.eager_runs += 1
            return fn(*[None if t is None else t[:n] for t in inputs])
        key = (name, b)
        stage = self._stages.get(key)
        if stage is None:
            return self._first(key, fn, inputs, n, b)
        self._fill(stage.inputs, inputs, n)
        if stage.graph is None:  # capture=False: the same buffers, run eagerly
            stage.outputs, _ = pytree.tree_flatten(fn(*stage.inputs))
        else:
            stage.graph.replay()
            self.replays += 1
        return self._cut(stage, n)

    def _first(self, key: tuple, fn, inputs, n: int, b: int) -> Any:
        static = []
        owned = self._owned.setdefault(b, {})
        for t in inputs:
            if t is None:
                static.append(None)
                continue
            mine = owned.get(t.data_ptr()) if self.capture else None
            if mine is not None and mine.shape[1:] == t.shape[1:] and mine.dtype == t.dtype \
                    and mine.stride()[1:] == t.stride()[1:]:
                static.append(mine)  # an earlier stage's output: read in place
                continue
            buf = torch.zeros((b, *t.shape[1:]), dtype=t.dtype, device=t.device)
            buf[:n].copy_(t[:n])
            static.append(buf)
        if not self.capture:
            leaves, spec = pytree.tree_flatten(fn(*static))
            stage = _Stage(static, leaves, spec, None)
            self._stages[key] = stage
            return self._cut(stage, n)
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            eager = fn(*static)  # the real computation; compiles kernels at this shape
        current.wait_stream(side)
        torch.cuda.synchronize(self.device)
        leaves, spec = pytree.tree_flatten(eager)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: CUDA calls of other threads (store connector, HTTP server) do not void the capture
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                outs = fn(*static)
        except Exception:
            log.warning("prefill stage %r (bucket %d) could not be captured; it runs eagerly", key[0], b,
                        exc_info=True)
            self._eager.add(key)
            torch.cuda.synchronize(self.device)
            self.eager_runs += 1
            return pytree.tree_unflatten([x if not isinstance(x, torch.Tensor) else x[:n] for x in leaves], spec)
        out_leaves, out_spec = pytree.tree_flatten(outs)
        graph.replay()  # capture ran nothing: fill the static outputs
        stage = _Stage(static, out_leaves, out_spec, graph)
        self._stages[key] = stage
        self._own(b, out_leaves)
        self.captures += 1
        return self._cut(stage, n)

    @staticmethod
    def _fill(static: list, inputs: Sequence[Optional[torch.Tensor]], n: int) -> None:
        if len(static) != len(inputs):
            raise ValueError(f"a stage captured with {len(static)} inputs got {len(inputs)}")
        for buf, t in zip(static, inputs):
            if (buf is None) != (t is None):
                raise ValueError("a stage's inputs changed from tensor to None or back")
            if t is None or t.data_ptr() == buf.data_ptr():
                continue
            buf[:n].copy_(t[:n])

    def _own(self, b: int, leaves: list) -> None:
        owned = self._owned.setdefault(b, {})
        for x in leaves:
            if isinstance(x, torch.Tensor):
                owned.setdefault(x.data_ptr(), x)

    @staticmethod
    def _cut(stage: _Stage, n: int) -> Any:
        return pytree.tree_unflatten([x[:n] if isinstance(x, torch.Tensor) else x for x in stage.outputs], stage.spec)


class BucketWarmup:
    """Buckets of CUDA graphs captured ahead of requests, and when (`mode`, one of
    `PREFILL_GRAPH_MODES`): `upfront` captures every bucket in the constructor; `idle` keeps
    them `pending` for `step`, which the engine loop calls while no request is in the
    engine, one bucket a call (a request arriving meanwhile waits for one bucket at most);
    `lazy` leaves every capture to first use. `capture(b)` captures bucket b. An idle
    capture that fails (e.g. out of memory) is logged and leaves the rest to first use; an
    upfront one raises. Not thread-safe: the engine loop's thread only. Subclasses name
    what they capture (`what`) and may note each capture's result (`_captured`)."""

    what = "graphs"

    def __init__(self, pending: Sequence[int], capture: Callable[[int], Any], mode: str) -> None:
        if mode not in PREFILL_GRAPH_MODES:
            raise ValueError(f"{self.what} mode {mode!r} is not one of {', '.join(PREFILL_GRAPH_MODES)}")
        self.mode, self._capture = mode, capture
        self.pending: list[int] = list(pending) if mode != "lazy" else []
        #: seconds spent capturing (upfront or idle), None until every bucket is done
        self.capture_s: Optional[float] = None
        #: why an idle capture failed (the buckets left are then captured on first use)
        self.failed: Optional[str] = None
        self._spent = 0.0
        if mode == "upfront":
            while self.step():
                pass

    def _captured(self, bucket: int, result: Any) -> None:
        """Called after bucket `bucket` was captured, with what `capture` returned."""

    def step(self) -> bool:
        """Capture the next pending bucket; False when none was pending."""
        if not self.pending:
            return False
        b = self.pending[0]  # popped once captured: `ready` never holds while a capture runs
        t0 = time.perf_counter()
        try:
            self._captured(b, self._capture(b))
        except Exception as exc:  # noqa: BLE001  (e.g. out of memory: the server goes on without them)
            if self.mode == "upfront":
                raise
            log.warning("capturing %s of bucket %d failed (%s); buckets %s are left to first use",
                        self.what, b, exc, self.pending, exc_info=True)
            self.failed = f"bucket {b}: {exc}"
            self.pending = []
            return True
        self.pending = self.pending[1:]
        self._spent += time.perf_counter() - t0
        if not self.pending:
            self.capture_s = self._spent
            self._log_ready()
        return True

    def _log_ready(self) -> None:
        log.info("%s ready (%s) in %.1f s", self.what, self.mode, self._spent)

    def _times(self) -> dict:
        return {"mode": self.mode, "pending_buckets": list(self.pending),
                "capture_s": None if self.capture_s is None else round(self.capture_s, 3), "failed": self.failed}


class PrefillGraphWarmup(BucketWarmup):
    """The prefill-stage graphs of one engine and when they are captured (BucketWarmup).
    `capture_bucket(b)` runs one placeholder pass of bucket b
    (engine.pic.fused.capture_prefill_stages for that bucket). `stages` None: nothing to
    capture (off CUDA, or CUDA graphs off)."""

    what = "prefill-stage graphs"

    def __init__(self, stages: Optional[PrefillStages], capture_bucket: Callable[[int], Any], mode: str) -> None:
        self.stages = stages
        super().__init__(stages.buckets if stages is not None else (), capture_bucket, mode)

    @property
    def ready(self) -> bool:
        """Every bucket captured (always true without stages; never in lazy mode, where
        buckets are captured by the requests that first use them)."""
        return self.stages is None or (self.mode != "lazy" and not self.pending and self.failed is None)

    @property
    def captured(self) -> int:
        return 0 if self.stages is None else self.stages.captured

    def _log_ready(self) -> None:  # tools/bench_models.py reads this line from serve's log
        log.info("prefill-stage graphs ready (%s): %d graphs of buckets %s captured in %.1f s", self.mode,
                 self.captured, self.stages.buckets, self._spent)

    def snapshot(self) -> dict:
        """For /health: mode, ready, graphs captured, buckets left, capture seconds, failure."""
        return {**self._times(), "ready": self.ready, "captured": self.captured}


class DecodeGraphWarmup(BucketWarmup):
    """The decode-step CUDA graph buckets up to `max_batch` sequences of one engine
    (engine/runtime/cuda_graphs.py), captured in the prefill-stage graphs' mode
    (BucketWarmup; the server loop's idle turns take them after the prefill-stage
    buckets). Capturing a bucket ahead compiles and autotunes its kernels too (each bucket
    is one autotune key of the paged decode kernel), so the first batch of each size does
    not pay for it. `runner.graphs` None (no decode graphs) or over external KV caches
    (HiSparse, keyed per request): nothing to do."""

    what = "decode graphs"

    def __init__(self, runner: Any, max_batch: int, mode: str) -> None:
        graphs = runner.graphs
        buckets: list[int] = []
        if graphs is not None and not graphs.external:
            top = graphs.bucket(max_batch) or graphs.buckets[-1]
            buckets = [b for b in graphs.buckets if b <= top]
        #: the buckets this warm-up captured (one already captured elsewhere is not counted)
        self.captured: list[int] = []
        super().__init__(buckets, lambda b: runner.capture_decode_graphs(b, only=(b,)), mode)

    def _captured(self, bucket: int, result: Any) -> None:
        self.captured += result

    def snapshot(self) -> dict:
        """For /health: mode, buckets captured and left, capture seconds, failure."""
        return {**self._times(), "captured_buckets": list(self.captured)}
