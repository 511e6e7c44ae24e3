"""CUDA-graph decode: `HybridDecoder.decode` captured once per batch-size bucket and replayed.

A decode step of a hybrid model is hundreds of small kernels; launched one by one from
Python the GPU waits on the host most of the time. `DecodeGraphs` keeps, per bucket
(`decode_buckets(slots)`: 1, 2, 4, 8, 16, 32 sequences, then every 16 up to the cache's
sequence slots, at most 256), one static device tensor of packed decode rows
(engine/runtime/decode_batch.py: token ids, positions, state slots, KV write slots, block
tables padded to `max_blocks`), and one CUDA graph of `model.decode` over views of it.
A step of B sequences takes the smallest bucket >= B: its rows are packed on the host
(padding rows repeat row 0, so they rewrite sequence 0's values and change nothing), copied
into the static tensor in one host->device copy, the graph is replayed, and the first B rows
of the static logits are returned (a copy).

What makes the step capturable: attention reads K/V through the block tables and context
lengths with the paged decode kernel (`DecodeContext.paged_attention`; sliding-window
rings through a fixed two-column table), linear layers run fla's fused recurrent kernels
(or the torch step), and nothing in `model.decode` reads a device value on the host.

The first step of a bucket runs eagerly on a side stream (that is the real step, and it
compiles and autotunes every Triton kernel at the bucket's shapes), then the graph is
captured (capture runs nothing); later steps replay it. All buckets share one memory pool.
Off CUDA (`capture=False`) the same static-buffer step runs eagerly: tests compare it with
the runner's plain decode.

External KV caches (`ExternalKVCache`, HiSparse offload: engine/hisparse/) take part
through a host/device split: before a step, `plan(seqs, positions)` asks each one for its
`plan_decode` (host checks and a static shape key, e.g. HiSparse's score columns); the graph
of a step is keyed by `(bucket, plans)`; inside the step (`DecodeContext.external_plans`)
each such cache runs only its device part over static device tensors (its tables, pools,
summaries and the pinned host mirror, read by address); after it, `finish_decode` does the
host bookkeeping (advancing positions, queueing sealed blocks for the store). A step that
cannot run here (batch above the largest bucket, more blocks than the tables hold, a cache
that cannot plan it, a key whose capture failed) gets a `StepPlan` without a key and a
reason: the runner runs it eagerly, `fallbacks` counts it per kind and the first of each
kind is logged. A failed capture is logged with its error (`capture_errors`) and that key
runs eagerly from then on.

Contract: the model's parameters and the cache tensors must not be reallocated after a
capture (in-place updates such as `load_state_dict` are fine), nor host memory a cache
registered for device reads (the HiSparse mirrors are allocated and registered once, with
the cache); `ModelRunner.set_cuda_graphs` drops and rebuilds the graphs.
"""
from __future__ import annotations

import logging
import math
import traceback
from collections import Counter
from dataclasses import dataclass
from typing import Hashable, Optional
from typing import Sequence as Seq

import torch

from engine.models.layers.base import ExternalKVCache
from engine.runtime.decode_batch import COL_TOKEN, TABLE_COL, blocks_for, decode_context, pack_decode_rows
from engine.runtime.sequence import Sequence

log = logging.getLogger("engine.runtime")

#: batch buckets up to 32 sequences: powers of two
BUCKETS = (1, 2, 4, 8, 16, 32)
#: above BUCKETS[-1], a bucket every BUCKET_STEP sequences (a step pads at most 15 rows)...
BUCKET_STEP = 16
#: ...up to the cache's sequence slots, at most this many (larger batches run eagerly)
MAX_BUCKET = 256


def decode_buckets(max_seqs: int) -> tuple[int, ...]:
    """The batch buckets of a cache that holds `max_seqs` sequences at once: BUCKETS, then
    every BUCKET_STEP above them up to `max_seqs` rounded up to BUCKET_STEP, at most
    MAX_BUCKET. Buckets above `max_seqs` are never used (no step has more sequences than
    the cache has slots), so a small cache keeps BUCKETS as they are."""
    if max_seqs < 1:
        raise ValueError(f"max_seqs={max_seqs!r} must be >= 1")
    top = min(MAX_BUCKET, -(-max_seqs // BUCKET_STEP) * BUCKET_STEP)
    return BUCKETS + tuple(range(BUCKETS[-1] + BUCKET_STEP, top + 1, BUCKET_STEP))


@dataclass(frozen=True)
class StepPlan:
    """How a decode step runs: `key` `(bucket, plans)` of its graph, or None with the
    `kind` and `reason` why it runs eagerly."""

    key: Optional[tuple[int, tuple[Hashable, ...]]]
    kind: str = ""
    reason: str = ""


class DecodeGraphs:
    def __init__(self, model, cache, backend: str, buckets: Seq[int] | None = None,
                 max_blocks: int | None = None, capture: bool | None = None) -> None:
        """`buckets`: the batch sizes graphs are kept for (default `decode_buckets` of the
        cache's sequence slots)."""
        self.model = model
        self.cache = cache
        self.backend = backend
        self.device = model.device
        if buckets is None:
            buckets = decode_buckets(cache.config.num_slots)
        self.buckets = tuple(sorted(set(int(b) for b in buckets)))
        if not self.buckets or self.buckets[0] < 1:
            raise ValueError(f"buckets={buckets!r} must be positive batch sizes")
        self.capture = self.device.type == "cuda" if capture is None else capture
        if self.capture and self.device.type != "cuda":
            raise ValueError(f"capture=True needs a CUDA model, got device {self.device}")
        if max_blocks is None:
            max_blocks = 0
            if cache.has_paged:
                max_blocks = min(math.ceil(model.config.max_position_embeddings / cache.block_size),
                                 cache.blocks.num_blocks)
        self.max_blocks = max_blocks
        #: the caches kept outside the paged pool (HiSparse layers), planned around each step
        self.external: list[ExternalKVCache] = [c for c in cache.layers if isinstance(c, ExternalKVCache)]
        self._rows: dict[int, torch.Tensor] = {}  # bucket -> static packed rows on the device
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # key -> graph, logits
        self._failed: set[tuple] = set()  # keys whose capture failed: eager from then on
        self._pool = None
        #: bucket of the last step run here (for tests and metrics)
        self.last_bucket: int | None = None
        #: steps run here with a graph (replayed or captured) / eagerly off CUDA
        self.graph_steps = 0
        self.static_steps = 0
        #: steps that fell back to the runner's eager decode, per kind (see `plan`)
        self.fallbacks: Counter[str] = Counter()
        #: failed captures: (key, error line, last frames of project code)
        self.capture_errors: list[tuple[tuple, str, list[str]]] = []

    # ------------------------------------------------------------------ queries
    def bucket(self, batch: int) -> int | None:
        """The smallest bucket holding `batch` sequences (None: larger than every bucket)."""
        for b in self.buckets:
            if b >= batch:
                return b
        return None

    def fits(self, positions: Seq[int]) -> bool:
        """Whether a step at these positions can run through a bucket."""
        if self.bucket(len(positions)) is None:
            return False
        return not self.cache.has_paged or blocks_for(positions, self.cache.block_size) <= self.max_blocks

    @property
    def captured(self) -> tuple[int, ...]:
        """The buckets with at least one captured graph."""
        return tuple(sorted({key[0] for key in self._graphs}))

    @property
    def captured_keys(self) -> tuple[tuple, ...]:
        return tuple(self._graphs)

    def report(self) -> dict:
        """What the graphs did, for JSON output: steps replayed or captured (`graph_steps`),
        static steps run eagerly off CUDA, eager fallbacks per kind, captured keys and
        failed captures (with their error and frames)."""
        return {"capture": self.capture, "graph_steps": self.graph_steps, "static_steps": self.static_steps,
                "used": self.graph_steps > 0, "fallbacks": dict(self.fallbacks),
                "captured": [repr(k) for k in self._graphs],
                "capture_errors": [{"key": repr(k), "error": e, "frames": f} for k, e, f in self.capture_errors]}

    def plan(self, seqs: Seq[Sequence], positions: Seq[int]) -> StepPlan:
        """The step's graph key, or why it falls back to eager (counted in `fallbacks`,
        the first of each kind logged). Runs the external caches' host checks."""
        b = len(seqs)
        bucket = self.bucket(b)
        if bucket is None:
            return self._fallback("batch", f"a batch of {b} is above the largest bucket {self.buckets[-1]}")
        if not self.fits(positions):
            return self._fallback("blocks", f"positions up to {max(positions)} need more than the graphs' "
                                  f"{self.max_blocks} block-table columns")
        slots = [s.slot for s in seqs]
        plans = tuple(c.plan_decode(slots, positions) for c in self.external)
        if any(p is None for p in plans):
            return self._fallback("external", "an external KV cache cannot run this step from static buffers")
        key = (bucket, plans)
        if key in self._failed:
            return self._fallback("capture", f"the capture of graph {key} failed (see capture_errors)")
        return StepPlan(key)

    def _fallback(self, kind: str, reason: str) -> StepPlan:
        if not self.fallbacks[kind]:
            log.info("decode graphs: a step runs eagerly: %s (logged once per kind; counted in fallbacks)", reason)
        self.fallbacks[kind] += 1
        return StepPlan(None, kind, reason)

    # ------------------------------------------------------------------- warm-up
    def capture_buckets(self, max_batch: int, only: Optional[Seq[int]] = None) -> list[int]:
        """Run the step of every bucket up to the one holding `max_batch` sequences that
        has no graph yet, and on CUDA capture it, on one scratch sequence at position 0
        (the padding rows repeat it, as a real step's do): the kernels' compilation and
        autotuning at each bucket's shapes happen here, not in the first step of a batch of
        that size. The paged decode kernel's split count (its autotune key) follows the
        batch rows and the static table width, so each bucket is one key. Nothing is run
        over external KV caches (their plans key the graphs per request). Returns the
        buckets run. `only`: of those, just these buckets."""
        if self.external:
            return []
        top = self.bucket(max_batch) or self.buckets[-1]
        todo = [b for b in self.buckets if b <= top and (b, ()) not in self._graphs and (b, ()) not in self._failed
                and (only is None or b in only)]
        if not todo:
            return []
        seq = self.cache.allocate(Sequence("decode-graphs-warm-up"))
        try:
            self.cache.ensure_capacity(seq, 1)
            with torch.inference_mode():
                for b in todo:
                    self._run([seq], [0], [0], (b, ()))
        finally:
            self.cache.free(seq)
        return todo

    # ------------------------------------------------------------------- running
    def step(self, rows: torch.Tensor, plans: tuple[Hashable, ...] = ()) -> torch.Tensor:
        """The function that is captured: `model.decode` over a packed rows tensor
        `[bucket, TABLE_COL + max_blocks]` on the device -> logits `[bucket, vocab]`
        (`plans`: the external caches' plans, in `external` order)."""
        ctx = decode_context(rows, self.cache.has_paged, self.backend, paged_attention=True)
        if self.external:
            ctx.external_plans = dict(zip(self.external, plans))
        return self.model.decode(rows[:, COL_TOKEN], ctx, self.cache.layers)

    def _static_rows(self, bucket: int) -> torch.Tensor:
        if bucket not in self._rows:
            self._rows[bucket] = torch.zeros(bucket, TABLE_COL + self.max_blocks, dtype=torch.long,
                                             device=self.device)
        return self._rows[bucket]

    @torch.inference_mode()
    def run(self, seqs: Seq[Sequence], positions: Seq[int],
            tokens: Seq[int] | torch.Tensor, plan: Optional[StepPlan] = None) -> torch.Tensor:
        """Logits `[B, vocab]` of one decode step (caches updated, positions not advanced:
        the runner does that). `tokens` are host ints or a device tensor `[B]`; `plan`
        (default: `plan(seqs, positions)`) must have a key."""
        b = len(seqs)
        plan = self.plan(seqs, positions) if plan is None else plan
        if plan.key is None:
            raise ValueError(f"a decode step of {b} sequences at positions up to {max(positions)} cannot run "
                             f"from the graphs: {plan.reason}")
        bucket, plans = plan.key
        logits = self._run(seqs, positions, tokens, plan.key)
        graphed = self.capture and plan.key in self._graphs
        slots = [s.slot for s in seqs]
        for c, p in zip(self.external, plans):
            c.finish_decode(slots, positions, p, bucket, graphed)
        if graphed:
            self.graph_steps += 1
        else:
            self.static_steps += 1
        return logits

    def _run(self, seqs: Seq[Sequence], positions: Seq[int], tokens: Seq[int] | torch.Tensor,
             key: tuple[int, tuple[Hashable, ...]]) -> torch.Tensor:
        b = len(seqs)
        bucket, plans = key
        self.last_bucket = bucket
        host_tokens = None if isinstance(tokens, torch.Tensor) else list(tokens)
        packed = pack_decode_rows(seqs, positions, host_tokens, self.cache.block_size, self.cache.has_paged,
                                  rows=bucket)
        rows = self._static_rows(bucket)
        # one copy; block-table columns past the batch's need keep stale ids, never read
        on_cuda = self.device.type == "cuda"
        rows[:, :packed.shape[1]].copy_(packed.pin_memory() if on_cuda else packed, non_blocking=on_cuda)
        if host_tokens is None:
            ids = tokens.reshape(-1).to(self.device)
            rows[:b, COL_TOKEN].copy_(ids)
            if bucket > b:
                rows[b:, COL_TOKEN].copy_(ids[:1].expand(bucket - b))
        if not self.capture:
            return self.step(rows, plans)[:b].clone()
        if key not in self._graphs:
            return self._warm_up_and_capture(key, rows)[:b].clone()
        graph, out = self._graphs[key]
        graph.replay()
        return out[:b].clone()

    def _warm_up_and_capture(self, key: tuple[int, tuple[Hashable, ...]], rows: torch.Tensor) -> torch.Tensor:
        """Run the real step eagerly on a side stream (compiling/autotuning kernels at this
        key's shapes), then capture the graph (which runs nothing). Returns the eager logits.
        A capture that fails is logged with its error; the key then runs eagerly."""
        plans = key[1]
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            logits = self.step(rows, plans).clone()
        current.wait_stream(side)
        torch.cuda.synchronize(self.device)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: CUDA calls of other threads (HTTP server, store connector) do not void the capture
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                out = self.step(rows, plans)
        except RuntimeError as exc:
            frames = [f"{f.filename}:{f.lineno} in {f.name}" for f in traceback.extract_tb(exc.__traceback__)
                      if "/torch/" not in f.filename.replace("\\", "/")][-6:]
            self._failed.add(key)
            self.capture_errors.append((key, f"{type(exc).__name__}: {exc}".splitlines()[0], frames))
            log.warning("decode graphs: capturing graph %s failed (%s) at %s; its steps run eagerly", key,
                        self.capture_errors[-1][1], " <- ".join(reversed(frames)))
            torch.cuda.synchronize(self.device)
            return logits
        self._graphs[key] = (graph, out)
        return logits
