"""CUDA-graph decode: `HybridDecoder.decode` captured once per batch-size bucket and replayed.

A decode step of a hybrid model is hundreds of small kernels; launched one by one from
Python the GPU waits on the host most of the time. `DecodeGraphs` keeps, per bucket
(`BUCKETS`: 1, 2, 4, 8, 16, 32 sequences), one static device tensor of packed decode rows
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

Contract: the model's parameters and the cache tensors must not be reallocated after a
capture (in-place updates such as `load_state_dict` are fine); `ModelRunner.set_cuda_graphs`
drops and rebuilds the graphs.
"""
from __future__ import annotations

import math
from typing import Sequence as Seq

import torch

from engine.runtime.decode_batch import COL_TOKEN, TABLE_COL, blocks_for, decode_context, pack_decode_rows
from engine.runtime.sequence import Sequence

BUCKETS = (1, 2, 4, 8, 16, 32)


class DecodeGraphs:
    def __init__(self, model, cache, backend: str, buckets: Seq[int] = BUCKETS,
                 max_blocks: int | None = None, capture: bool | None = None) -> None:
        self.model = model
        self.cache = cache
        self.backend = backend
        self.device = model.device
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
        self._rows: dict[int, torch.Tensor] = {}  # bucket -> static packed rows on the device
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        #: bucket of the last step run here (for tests and metrics)
        self.last_bucket: int | None = None

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
        return tuple(sorted(self._graphs))

    # ------------------------------------------------------------------- running
    def step(self, rows: torch.Tensor) -> torch.Tensor:
        """The function that is captured: `model.decode` over a packed rows tensor
        `[bucket, TABLE_COL + max_blocks]` on the device -> logits `[bucket, vocab]`."""
        ctx = decode_context(rows, self.cache.has_paged, self.backend, paged_attention=True)
        return self.model.decode(rows[:, COL_TOKEN], ctx, self.cache.layers)

    def _static_rows(self, bucket: int) -> torch.Tensor:
        if bucket not in self._rows:
            self._rows[bucket] = torch.zeros(bucket, TABLE_COL + self.max_blocks, dtype=torch.long,
                                             device=self.device)
        return self._rows[bucket]

    @torch.inference_mode()
    def run(self, seqs: Seq[Sequence], positions: Seq[int],
            tokens: Seq[int] | torch.Tensor) -> torch.Tensor:
        """Logits `[B, vocab]` of one decode step (caches updated, positions not advanced:
        the runner does that). `tokens` are host ints or a device tensor `[B]`."""
        b = len(seqs)
        bucket = self.bucket(b)
        if bucket is None or not self.fits(positions):
            raise ValueError(f"a decode step of {b} sequences at positions up to {max(positions)} fits no "
                             f"bucket of {self.buckets} with {self.max_blocks} blocks")
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
            return self.step(rows)[:b].clone()
        if bucket not in self._graphs:
            return self._warm_up_and_capture(bucket, rows)[:b].clone()
        graph, out = self._graphs[bucket]
        graph.replay()
        return out[:b].clone()

    def _warm_up_and_capture(self, bucket: int, rows: torch.Tensor) -> torch.Tensor:
        """Run the real step eagerly on a side stream (compiling/autotuning kernels at this
        bucket's shapes), then capture the graph (which runs nothing). Returns the eager logits."""
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            logits = self.step(rows).clone()
        current.wait_stream(side)
        torch.cuda.synchronize(self.device)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA calls of other threads (HTTP server, store connector) do not void the capture
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            out = self.step(rows)
        self._graphs[bucket] = (graph, out)
        return logits
