"""`HiSparseLayerCache`: one full-attention layer's K/V under HiSparse offload, for every
sequence slot of an engine (an `ExternalKVCache`, engine/models/layers/base.py).

Device memory, per slot: a hot buffer of `hot_blocks` block rows and `staging_blocks`
rows for a step that attends to more blocks than the hot buffer keeps (both in one pool
`[num_slots * rows_per_slot, block, Hkv, D]`, the layout of the paged decode kernel), and
a summary per block `[num_slots, max_blocks, 2, Hkv, D]` (kernels/hisparse_select.py).
Host bookkeeping per slot: which block sits in which hot row, and when each row was last
attended to (least recently used rows are evicted first).

- Writing: a token goes to its block's hot row; a new block takes a free row or evicts
  the least recently used unpinned one. A block that fills is *sealed*: its summary is
  written and it goes to the block store (asynchronously; engine/hisparse/store.py). The
  sink blocks (the first `sink_blocks`) and the recent ones (the last `recent_blocks`,
  including the one being written) never leave the hot buffer.
- Prefill of a chunk: attention over the positions before it reads every earlier block
  from its hot row or from the store (the whole context is never held on the device,
  one layer's at most, transiently), the chunk's blocks are written and sealed as they
  fill, so a long prompt streams its blocks out as it goes. Causal attention over the
  exact K/V: the same numbers as dense prefill.
- Decode step: with a context of at least `min_context` tokens and more candidate
  blocks than `topk`, the unpinned blocks are scored against the query and the `topk`
  best kept (kernels/hisparse_select.py); else every block is attended to. Selected
  blocks missing from the hot buffer are read from the store in one batch, on CUDA on a
  side stream (into hot rows when some can be evicted, else into staging rows), and the
  query attends to the
  selected blocks in position order through the paged decode kernel.
With every block selected, decoding is dense attention over the same K/V.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Optional

import torch

from engine.errors import RuntimeStateError
from engine.hisparse.config import HiSparseConfig
from engine.hisparse.errors import HiSparseError
from engine.hisparse.metrics import HiSparseMetrics
from engine.hisparse.store import BlockMeta, BlockStore, block_key
from engine.models.layers.attention import causal_attention
from engine.models.layers.base import DecodeContext, ExternalKVCache, PrefillContext


@dataclass
class SlotBlocks:
    """Host bookkeeping of one sequence in one layer."""

    nonce: bytes
    hot_blocks: int
    num_tokens: int = 0
    sealed: int = 0  # blocks 0..sealed-1 are full and in the block store
    rows: dict[int, int] = field(default_factory=dict)  # block -> hot row
    row_block: list[int] = field(default_factory=list)  # hot row -> block (-1 free)
    last_use: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.row_block = [-1] * self.hot_blocks
        self.last_use = [0] * self.hot_blocks


class HiSparseLayerCache(ExternalKVCache):
    """See the module docstring."""

    def __init__(self, layer: int, num_kv_heads: int, head_dim: int, config: HiSparseConfig, num_slots: int,
                 max_blocks: int, device: torch.device, dtype: torch.dtype, store: BlockStore,
                 metrics: HiSparseMetrics, engine_nonce: bytes, fingerprint: str = "",
                 counts_steps: bool = False) -> None:
        self.layer = layer
        self.config = config
        self.block = config.block_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.rows_per_slot = config.hot_blocks + config.staging_blocks
        shape = (num_slots * self.rows_per_slot, self.block, num_kv_heads, head_dim)
        self.k_pool = torch.zeros(shape, device=device, dtype=dtype)
        self.v_pool = torch.zeros(shape, device=device, dtype=dtype)
        self.summaries = torch.zeros(num_slots, max_blocks, 2, num_kv_heads, head_dim, device=device, dtype=dtype)
        self.max_blocks = max_blocks
        self.device = torch.device(device)
        self.store = store
        self.metrics = metrics
        self.engine_nonce = engine_nonce
        self.fingerprint = fingerprint
        self.counts_steps = counts_steps
        self._slots: dict[int, SlotBlocks] = {}
        self._clock = 0
        self._fetch_stream = None  # CUDA side stream of block reads
        #: the blocks each sequence of the last decode step attended to (ascending)
        self.last_selection: list[list[int]] = []

    # ------------------------------------------------------------------ sizes
    def device_bytes_per_slot(self) -> int:
        """Device bytes one sequence holds in this layer: its pool rows and summaries."""
        esz = self.k_pool.element_size()
        row = self.block * self.num_kv_heads * self.head_dim * esz
        return 2 * self.rows_per_slot * row + self.max_blocks * 2 * self.num_kv_heads * self.head_dim * esz

    # ------------------------------------------------------------------ slots
    def reset(self, slot: int) -> None:
        self._slots[slot] = SlotBlocks(os.urandom(16), self.config.hot_blocks)

    def release(self, slot: int) -> None:
        st = self._slots.pop(slot, None)
        if st is not None and st.sealed:
            self.store.discard([self._key(st, j) for j in range(st.sealed)])

    def resident_blocks(self, slot: int) -> list[int]:
        """Blocks of the sequence in `slot` now in its hot buffer (ascending)."""
        return sorted(self._state(slot).rows)

    def key_of(self, slot: int, block: int) -> bytes:
        """The block-store key of block `block` of the sequence in `slot`."""
        return self._key(self._state(slot), block)

    def _state(self, slot: int) -> SlotBlocks:
        st = self._slots.get(slot)
        if st is None:
            raise RuntimeStateError(f"hisparse layer {self.layer}: slot {slot} holds no sequence (reset it first)")
        return st

    def _key(self, st: SlotBlocks, block: int) -> bytes:
        return block_key(self.engine_nonce, st.nonce, self.layer, block)

    def _global(self, slot: int, row: int) -> int:
        return slot * self.rows_per_slot + row

    def _pinned(self, num_blocks: int) -> set[int]:
        c = self.config
        return set(range(min(c.sink_blocks, num_blocks))) | set(range(max(0, num_blocks - c.recent_blocks), num_blocks))

    def _take_row(self, st: SlotBlocks, keep: set[int]) -> Optional[int]:
        """A hot row for a new resident block: a free one, else the least recently used row
        whose block is not in `keep` (evicted: it is sealed, so the store holds it)."""
        best = None
        for row, blk in enumerate(st.row_block):
            if blk < 0:
                return row
            if blk not in keep and (best is None or st.last_use[row] < st.last_use[best]):
                best = row
        if best is not None:
            evicted = st.row_block[best]
            if evicted >= st.sealed:
                raise HiSparseError(f"hisparse layer {self.layer}: block {evicted} would be evicted before it is sealed")
            del st.rows[evicted]
            st.row_block[best] = -1
            self.metrics.blocks_evicted += 1
        return best

    def _place(self, slot: int, st: SlotBlocks, block: int) -> int:
        """Give a new block (the sequence's last) a hot row; returns its global row."""
        if block >= self.max_blocks:
            raise RuntimeStateError(
                f"hisparse layer {self.layer}: block {block} is past the {self.max_blocks} blocks of max_model_len")
        row = self._take_row(st, self._pinned(block + 1))
        if row is None:
            raise HiSparseError(f"hisparse layer {self.layer}: no hot row for block {block} (hot buffer too small)")
        st.rows[block], st.row_block[row] = row, block
        st.last_use[row] = self._clock
        return self._global(slot, row)

    def _seal(self, slot: int, st: SlotBlocks, block: int) -> None:
        g = self._global(slot, st.rows[block])
        kb, vb = self.k_pool[g], self.v_pool[g]
        if self.config.summary == "minmax":
            self.summaries[slot, block, 0] = kb.amin(0)
            self.summaries[slot, block, 1] = kb.amax(0)
        else:
            self.summaries[slot, block, 0] = kb.float().mean(0).to(kb.dtype)
        self.store.put(self._key(st, block), kb, vb,
                       BlockMeta(self.layer, block, self.block, self.fingerprint))
        st.sealed = block + 1

    # ------------------------------------------------------------------ prefill
    def attend_prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: PrefillContext,
                       scale: float) -> torch.Tensor:
        slot, s = ctx.slot, ctx.start_pos
        st = self._state(slot)
        n = k.shape[0]
        e = s + n
        if s != st.num_tokens:
            raise RuntimeStateError(f"hisparse layer {self.layer}: prefill at {s}, but slot {slot} holds "
                                    f"{st.num_tokens} tokens")
        k_new, v_new = k.to(self.k_pool.dtype), v.to(self.v_pool.dtype)
        if s > 0:
            past_k, past_v = self._past(slot, st, s)
            k_ctx, v_ctx = torch.cat([past_k, k_new]), torch.cat([past_v, v_new])
        else:
            k_ctx, v_ctx = k_new, v_new
        self.append(slot, k_new, v_new)
        o = causal_attention(q[None], k_ctx[None].to(q.dtype), v_ctx[None].to(q.dtype), ctx.positions,
                             torch.arange(e, device=q.device), None, scale, s, 0)
        return o[0]

    def append(self, slot: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write K/V `[n, Hkv, D]` at the sequence's next n positions, sealing (summary, store)
        each block that fills; no attention (prefill uses it, and benchmarks fill contexts
        with it)."""
        st = self._state(slot)
        s, bs = st.num_tokens, self.block
        e = s + k.shape[0]
        for j in range(s // bs, math.ceil(e / bs)):
            a, b = max(s, j * bs), min(e, (j + 1) * bs)
            g = self._global(slot, st.rows[j]) if j in st.rows else self._place(slot, st, j)
            self.k_pool[g, a - j * bs:b - j * bs] = k[a - s:b - s]
            self.v_pool[g, a - j * bs:b - j * bs] = v[a - s:b - s]
            st.num_tokens = b
            if b == (j + 1) * bs:
                self._seal(slot, st, j)

    def context_kv(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V `[num_tokens, Hkv, D]` of every position of the sequence in `slot` (resident
        blocks from the device, the rest read from the store): for fidelity measurements."""
        st = self._state(slot)
        return self._past(slot, st, st.num_tokens)

    def _past(self, slot: int, st: SlotBlocks, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of positions 0..s-1: resident blocks from their rows, the rest from the store."""
        nb = math.ceil(s / self.block)
        shape = (nb, self.block, self.num_kv_heads, self.head_dim)
        past_k = torch.empty(shape, device=self.device, dtype=self.k_pool.dtype)
        past_v = torch.empty(shape, device=self.device, dtype=self.v_pool.dtype)
        keys, dst, res_at, res_rows = [], [], [], []
        for j in range(nb):
            if j in st.rows:
                res_at.append(j)
                res_rows.append(self._global(slot, st.rows[j]))
            else:
                keys.append(self._key(st, j))
                dst.append(j)
        if res_at:
            at = torch.tensor(res_at, dtype=torch.long).to(self.device)
            src = torch.tensor(res_rows, dtype=torch.long).to(self.device)
            past_k.index_copy_(0, at, self.k_pool.index_select(0, src))
            past_v.index_copy_(0, at, self.v_pool.index_select(0, src))
        if keys:
            self._fetch(keys, past_k, past_v, dst)
        return past_k.flatten(0, 1)[:s], past_v.flatten(0, 1)[:s]

    def _fetch(self, keys: list[bytes], k_dst: torch.Tensor, v_dst: torch.Tensor, rows: list[int]) -> None:
        """Read blocks from the store into rows of `k_dst`/`v_dst`: on CUDA on a side stream
        (after the compute stream's work so far, which may still read the rows being
        replaced), which the compute stream then waits for."""
        if self.device.type != "cuda":
            self.store.read_into(keys, k_dst, v_dst, rows)
            return
        if self._fetch_stream is None:
            self._fetch_stream = torch.cuda.Stream(self.device)
        compute = torch.cuda.current_stream(self.device)
        self._fetch_stream.wait_stream(compute)
        with torch.cuda.stream(self._fetch_stream):
            self.store.read_into(keys, k_dst, v_dst, rows)
        compute.wait_stream(self._fetch_stream)

    # ------------------------------------------------------------------ decode
    def attend_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: DecodeContext,
                      scale: float) -> torch.Tensor:
        from kernels.paged_decode_attention import paged_decode_attention

        slots, positions = ctx.host_slots, ctx.host_positions
        if slots is None or positions is None:
            raise HiSparseError("hisparse decode needs the step's host positions and slots (run without CUDA graphs)")
        self._clock += 1
        bs = self.block
        flat = []
        for slot, p in zip(slots, positions):
            st = self._state(slot)
            if p != st.num_tokens:
                raise RuntimeStateError(f"hisparse layer {self.layer}: decode at {p}, but slot {slot} holds "
                                        f"{st.num_tokens} tokens")
            blk = p // bs
            g = self._place(slot, st, blk) if p % bs == 0 else self._global(slot, st.rows[blk])
            flat.append(g * bs + p % bs)
        idx = torch.tensor(flat, dtype=torch.long).to(self.device)
        self.k_pool.view(-1, self.num_kv_heads, self.head_dim)[idx] = k.to(self.k_pool.dtype)
        self.v_pool.view(-1, self.num_kv_heads, self.head_dim)[idx] = v.to(self.v_pool.dtype)
        for slot, p in zip(slots, positions):
            st = self._slots[slot]
            st.num_tokens = p + 1
            if (p + 1) % bs == 0:
                self._seal(slot, st, p // bs)
        selected = self._select(q, slots, positions)
        self.last_selection = selected
        tables, lens = self._gather(slots, positions, selected)
        if self.counts_steps:
            self.metrics.decode_steps += 1
        return paged_decode_attention(q, self.k_pool, self.v_pool, tables, lens, scale,
                                      force_triton=None if q.is_cuda else False)

    def _select(self, q: torch.Tensor, slots: list[int], positions: list[int]) -> list[list[int]]:
        """Blocks each sequence attends to this step, ascending (its current block last)."""
        c = self.config
        bs = self.block
        selected: list[list[int]] = []
        active: list[int] = []
        bounds: list[tuple[int, int]] = []
        for b, p in enumerate(positions):
            n = p // bs + 1
            lo = min(c.sink_blocks, n)
            hi = max(lo, n - c.recent_blocks)
            if p + 1 >= c.min_context and hi - lo > c.topk:
                active.append(b)
                bounds.append((lo, hi))
                selected.append([])
            else:
                selected.append(list(range(n)))
        if active:
            from kernels.hisparse_select import block_scores, topk_blocks

            dev = self.device
            cols = max(hi for _, hi in bounds)
            sel_idx = torch.tensor(active, dtype=torch.long).to(dev)
            scores = block_scores(
                q.index_select(0, sel_idx), self.summaries,
                torch.tensor([slots[b] for b in active], dtype=torch.long).to(dev),
                torch.tensor([lo for lo, _ in bounds], dtype=torch.long).to(dev),
                torch.tensor([hi for _, hi in bounds], dtype=torch.long).to(dev), cols, c.summary)
            top = topk_blocks(scores, c.topk).tolist()  # one device-to-host read per layer and step
            for b, chosen in zip(active, top):
                n = positions[b] // bs + 1
                selected[b] = sorted(self._pinned(n) | set(chosen))
        return selected

    def _gather(self, slots: list[int], positions: list[int],
                selected: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Bring the selected blocks in (hot rows, else staging rows) and return the block
        tables `[B, max selected]` (global rows) and lengths `[B]` for the paged kernel."""
        bs = self.block
        hot = self.config.hot_blocks
        keys, fetch_rows = [], []
        tables, lens = [], []
        for slot, p, sel in zip(slots, positions, selected):
            st = self._slots[slot]
            keep = set(sel)
            staged = 0
            rows = []
            for j in sel:
                row = st.rows.get(j)
                if row is not None:
                    self.metrics.hot_hits += 1
                else:
                    row = self._take_row(st, keep)
                    if row is None:
                        row = hot + staged
                        staged += 1
                        self.metrics.blocks_staged += 1
                        if row >= self.rows_per_slot:
                            raise HiSparseError(f"hisparse layer {self.layer}: {len(sel)} blocks selected, more than "
                                                f"{self.rows_per_slot} rows per sequence")
                    else:
                        st.rows[j], st.row_block[row] = row, j
                    keys.append(self._key(st, j))
                    fetch_rows.append(self._global(slot, row))
                if row < hot:
                    st.last_use[row] = self._clock
                rows.append(self._global(slot, row))
            tables.append(rows)
            lens.append((len(sel) - 1) * bs + p % bs + 1)
            self.metrics.blocks_attended += len(sel)
        if keys:
            self.metrics.blocks_fetched += len(keys)
            self._fetch(keys, self.k_pool, self.v_pool, fetch_rows)
        width = max(len(r) for r in tables)
        table = torch.tensor([r + [0] * (width - len(r)) for r in tables], dtype=torch.int32).to(self.device)
        return table, torch.tensor(lens, dtype=torch.int32).to(self.device)
