"""`HiSparseLayerCache`: one full-attention layer's K/V under HiSparse offload, for every
sequence slot of an engine (an `ExternalKVCache`, engine/models/layers/base.py).

Memory, per slot:
- device: a hot buffer of `hot` block rows (`HiSparseConfig.hot_rows`) and staging rows for a step that
  attends to more blocks than the hot buffer keeps (one pool `[num_slots * rows_per_slot,
  block, Hkv, D]`, the paged decode kernel's layout), a summary per block `[num_slots,
  max_blocks, 2, Hkv, D]` (kernels/hisparse_select.py) and the block -> row table
  (engine/hisparse/residency.py);
- host: the *mirror*, every sealed (full) block `[num_slots * max_blocks, block, Hkv, D]`,
  pinned on CUDA. Decode reads missing blocks straight from it (kernels/hisparse_gather.py:
  a Triton kernel reading pinned memory through its device address). The block store
  (the kvstore daemon, engine/hisparse/store.py) receives every sealed block too,
  asynchronously and off the decode path, as the tier other processes and NVMe see.

- Writing: a token goes to its block's hot row; a new block takes a free row or evicts the
  least recently used row holding no pinned block (the first `sink_blocks`, the last
  `recent_blocks`). A block that fills is *sealed*: its summary is final, it is copied to
  the mirror and queued for the block store.
- Prefill of a chunk: attention over the positions before it reads earlier blocks from the
  mirror (the partial last block from its row); the chunk's full blocks go straight to the
  mirror, only the sink and recent blocks take hot rows, so a long prompt streams out as it
  goes. Causal attention over the exact K/V: the numbers of dense prefill.
- Decode step (`attend_decode`), all on the device with fixed shapes (no host reads; the
  host contributes the step's positions it already has): write the token, update its
  block's summary, seal full blocks into the mirror (masked copy); select blocks (sink,
  recent, and the `topk` best-scoring others once the context holds `min_context` tokens
  and there are more than `topk` candidates, per KV head when `per_kv_head`; else every
  block), admit them (the union over KV heads) to the hot
  buffer (evicting rows not selected this step, least recently used first, else staging
  rows), copy the missing ones in from the mirror, and attend with the paged decode kernel
  over the selected rows in position order (the current, partial block last; per KV head
  one call over that head's blocks).
With every block selected, decoding is dense attention over the same K/V.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Hashable, Optional, Sequence

import torch

from engine.errors import RuntimeStateError
from engine.hisparse.config import HiSparseConfig
from engine.hisparse.host_memory import mirror_empty
from engine.hisparse.metrics import HiSparseMetrics
from engine.hisparse.residency import HotBufferTable
from engine.hisparse.store import BlockMeta, BlockStore, HostBlock, block_key
from engine.models.layers.attention import causal_attention
from engine.models.layers.base import DecodeContext, ExternalKVCache, PrefillContext
from kernels.hisparse_gather import copy_blocks


@dataclass
class SlotBlocks:
    """Host bookkeeping of one sequence in one layer (positions only; rows live on the device)."""

    nonce: bytes
    num_tokens: int = 0
    sealed: int = 0  # blocks 0..sealed-1 are full (in the mirror, queued for the store)


@dataclass
class Selection:
    """The blocks a decode step attends to: `blocks [B, K]` ascending where `valid` (the
    current block the last valid entry)."""

    blocks: torch.Tensor
    valid: torch.Tensor
    #: per KV head, which entries it attends to `[B, Hkv, K]` (None: every head all of them)
    heads: Optional[torch.Tensor] = None

    def first(self, n: int) -> "Selection":
        """The selection of the first `n` sequences (a step padded to a graph's batch)."""
        return Selection(self.blocks[:n], self.valid[:n], None if self.heads is None else self.heads[:n])

    def lists(self) -> list[list[int]]:
        """Per sequence the selected blocks, ascending (a host read)."""
        return [row[ok].tolist() for row, ok in zip(self.blocks.cpu(), self.valid.cpu())]

    def head_lists(self, num_kv_heads: int) -> list[list[list[int]]]:
        """Per sequence and KV head the blocks it attends to, ascending (a host read)."""
        if self.heads is None:
            return [[row] * num_kv_heads for row in self.lists()]
        blocks, heads = self.blocks.cpu(), self.heads.cpu()
        return [[blocks[b][heads[b, h]].tolist() for h in range(heads.shape[1])] for b in range(blocks.shape[0])]


class HiSparseLayerCache(ExternalKVCache):
    """See the module docstring."""

    def __init__(self, layer: int, num_kv_heads: int, head_dim: int, config: HiSparseConfig, num_slots: int,
                 max_blocks: int, device: torch.device, dtype: torch.dtype, store: Optional[BlockStore],
                 metrics: HiSparseMetrics, engine_nonce: bytes, fingerprint: str = "",
                 counts_steps: bool = False) -> None:
        self.layer = layer
        self.config = config
        self.block = config.block_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.width = config.step_blocks(num_kv_heads)  # blocks one decode step attends to at most (fixed shape)
        self.hot = config.hot_rows(num_kv_heads)
        self.rows_per_slot = self.hot + config.staging_blocks(num_kv_heads)
        self.device = torch.device(device)
        shape = (num_slots * self.rows_per_slot, self.block, num_kv_heads, head_dim)
        self.k_pool = torch.zeros(shape, device=device, dtype=dtype)
        self.v_pool = torch.zeros(shape, device=device, dtype=dtype)
        self.summaries = torch.zeros(num_slots, max_blocks, 2, num_kv_heads, head_dim, device=device, dtype=dtype)
        mshape = (num_slots * max_blocks, self.block, num_kv_heads, head_dim)
        self.mirror_k = mirror_empty(mshape, dtype, self.device)
        self.mirror_v = mirror_empty(mshape, dtype, self.device)
        self.table = HotBufferTable(num_slots, max_blocks, self.hot, self.rows_per_slot, self.device)
        metrics.add_counters(self.table.counts, self._block_nbytes())
        self.max_blocks = max_blocks
        self.store = store
        self.metrics = metrics
        self.engine_nonce = engine_nonce
        self.fingerprint = fingerprint
        self.counts_steps = counts_steps
        self._slots: dict[int, SlotBlocks] = {}
        self._puts: list[tuple[int, int]] = []  # (slot, block) sealed, not yet handed to the store
        #: the blocks each sequence of the last decode step attended to (ascending; kept on
        #: the device, read by measurements only)
        self.last_selection: Optional[Selection] = None
        #: per (padded batch, plan) of a static-buffer step, its selection tensors (after a
        #: capture: the graph's own outputs, rewritten by each replay)
        self._static_selections: dict[tuple[int, Hashable], Selection] = {}

    # ------------------------------------------------------------------ sizes
    def _block_nbytes(self) -> int:
        return 2 * self.block * self.num_kv_heads * self.head_dim * self.k_pool.element_size()

    def device_bytes_per_slot(self) -> int:
        """Device bytes one sequence holds in this layer: its pool rows and summaries."""
        esz = self.k_pool.element_size()
        table = (self.max_blocks + 2 * self.hot) * 8  # block -> row, row -> block, last use
        return (self.rows_per_slot * self._block_nbytes()
                + self.max_blocks * 2 * self.num_kv_heads * self.head_dim * esz + table)

    # ------------------------------------------------------------------ slots
    def reset(self, slot: int) -> None:
        self._slots[slot] = SlotBlocks(os.urandom(16))
        self.table.reset_slot(slot)

    def release(self, slot: int) -> None:
        self._flush_puts()
        st = self._slots.pop(slot, None)
        if st is not None and st.sealed and self.store is not None:
            self.store.discard([self._key(st, j) for j in range(st.sealed)])

    def resident_blocks(self, slot: int) -> list[int]:
        """Blocks of the sequence in `slot` now in its hot buffer (ascending; a host read)."""
        self._state(slot)
        return self.table.resident(slot)

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

    def _check_block(self, block: int) -> None:
        if block >= self.max_blocks:
            raise RuntimeStateError(
                f"hisparse layer {self.layer}: block {block} is past the {self.max_blocks} blocks of max_model_len")

    # ------------------------------------------------------------------ sealing
    def _summarize(self, kb: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        """Summaries `[B, 2, Hkv, D]` of blocks `kb [B, block, Hkv, D]` over their first
        `count[b]` tokens."""
        live = (torch.arange(self.block, device=kb.device)[None, :] < count[:, None])[:, :, None, None]
        if self.config.summary == "minmax":
            lo = kb.masked_fill(~live, float("inf")).amin(1)
            hi = kb.masked_fill(~live, float("-inf")).amax(1)
            return torch.stack([lo, hi], 1)
        mean = kb.float().masked_fill(~live, 0.0).sum(1) / count.clamp(min=1)[:, None, None].float()
        return torch.stack([mean.to(kb.dtype), torch.zeros_like(mean, dtype=kb.dtype)], 1)

    def _queue_puts(self, slot: int, st: SlotBlocks, upto: int) -> None:
        if self.store is not None:
            self._puts.extend((slot, j) for j in range(st.sealed, upto))
        st.sealed = upto

    def _flush_puts(self) -> None:
        """Hand the sealed blocks queued so far to the block store, batched: one event marks
        when their mirror copies are complete (the store's put thread waits for it)."""
        if not self._puts or self.store is None:
            self._puts.clear()
            return
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        for slot, j in self._puts:
            st = self._slots.get(slot)
            if st is None:
                continue
            i = slot * self.max_blocks + j
            self.store.put_host(self._key(st, j), HostBlock(self.mirror_k[i], self.mirror_v[i], event),
                                BlockMeta(self.layer, j, self.block, self.fingerprint))
        self._puts.clear()

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
        """Write K/V `[n, Hkv, D]` at the sequence's next n positions; no attention (prefill
        uses it, and benchmarks fill contexts with it). Every block the chunk touches gets its
        summary, full ones go to the mirror (and the store queue); the hot buffer then holds
        the sink blocks, the chunk's last blocks and, in rows left over, the blocks resident
        before, most recently used first (planned on the host: one read of the slot's rows)."""
        st = self._state(slot)
        n = k.shape[0]
        if n == 0:
            return
        c, bs, dev = self.config, self.block, self.device
        s, e = st.num_tokens, st.num_tokens + n
        first, last = s // bs, (e - 1) // bs
        self._check_block(last)
        head = s % bs
        rb, lu, clock = self.table.read_slot(slot)
        k, v = k.to(self.k_pool.dtype), v.to(self.v_pool.dtype)
        if head:  # the partial block resident at the start: its earlier tokens from its row
            g = slot * self.rows_per_slot + rb.index(first)
            k, v = torch.cat([self.k_pool[g, :head], k]), torch.cat([self.v_pool[g, :head], v])
        nblk = last - first + 1
        pad = nblk * bs - k.shape[0]
        if pad:
            k = torch.cat([k, k.new_zeros(pad, *k.shape[1:])])
            v = torch.cat([v, v.new_zeros(pad, *v.shape[1:])])
        kb = k.view(nblk, bs, self.num_kv_heads, self.head_dim)
        vb = v.view(nblk, bs, self.num_kv_heads, self.head_dim)
        counts = torch.full((nblk,), bs, device=dev)
        counts[-1] = e - last * bs
        self.summaries[slot, first:last + 1] = self._summarize(kb, counts)
        full_hi = e // bs
        if full_hi > first:
            m0 = slot * self.max_blocks
            self.mirror_k[m0 + first:m0 + full_hi].copy_(kb[:full_hi - first], non_blocking=True)
            self.mirror_v[m0 + first:m0 + full_hi].copy_(vb[:full_hi - first], non_blocking=True)
        # the hot buffer after the chunk: sink blocks, then the newest blocks, then earlier ones
        h = self.hot
        before = {blk: row for row, blk in enumerate(rb) if blk >= 0}
        sinks = [j for j in range(min(c.sink_blocks, last + 1))]
        chunk = [j for j in range(last, first - 1, -1) if j >= c.sink_blocks]
        older = sorted((blk for blk in before if blk < first and blk >= c.sink_blocks),
                       key=lambda blk: (blk > last - c.recent_blocks, lu[before[blk]], blk), reverse=True)
        keep = (sinks + chunk + older)[:h]
        keep_set = set(keep)
        new_rb = [blk if blk in keep_set else -1 for blk in rb]
        free = [row for row, blk in enumerate(new_rb) if blk < 0]
        write_blocks, write_rows = [], []
        for blk in keep:
            if blk in before:
                row = before[blk]
            else:
                row = free.pop(0)
                new_rb[row] = blk
            if first <= blk <= last:
                write_blocks.append(blk - first)
                write_rows.append(slot * self.rows_per_slot + row)
        new_lu = [clock if blk >= first else lu[row] for row, blk in enumerate(new_rb)]
        self.metrics.blocks_evicted += sum(1 for blk in before if blk not in keep_set)
        self.table.write_slot(slot, new_rb, new_lu)
        if write_rows:
            src = torch.tensor(write_blocks, dtype=torch.long).to(dev)
            dst = torch.tensor(write_rows, dtype=torch.long).to(dev)
            self.k_pool.index_copy_(0, dst, kb.index_select(0, src))
            self.v_pool.index_copy_(0, dst, vb.index_select(0, src))
        st.num_tokens = e
        self._queue_puts(slot, st, full_hi)
        self._flush_puts()

    def context_kv(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V `[num_tokens, Hkv, D]` of every position of the sequence in `slot` (sealed
        blocks from the mirror, the partial one from its row): for fidelity measurements."""
        st = self._state(slot)
        return self._past(slot, st, st.num_tokens)

    def _past(self, slot: int, st: SlotBlocks, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of positions 0..s-1: full blocks from the mirror, the partial one from its row."""
        bs = self.block
        full = s // bs
        m0 = slot * self.max_blocks
        parts_k = [self.mirror_k[m0:m0 + full].to(self.device, non_blocking=True)]
        parts_v = [self.mirror_v[m0:m0 + full].to(self.device, non_blocking=True)]
        if s % bs:
            slot_t = torch.tensor([slot], device=self.device)
            g = slot_t * self.rows_per_slot + self.table.rows_of(slot_t, torch.tensor([full], device=self.device))
            parts_k.append(self.k_pool[g])
            parts_v.append(self.v_pool[g])
        shape = (-1, self.num_kv_heads, self.head_dim)
        pk = torch.cat(parts_k).view(shape)[:s]
        pv = torch.cat(parts_v).view(shape)[:s]
        nbytes = full * self._block_nbytes()
        if nbytes:
            self.metrics.add_read("mirror", nbytes, 0.0)
        return pk, pv

    # ------------------------------------------------------------------ decode
    def attend_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: DecodeContext,
                      scale: float) -> torch.Tensor:
        """One decode step (module docstring). Eagerly: the host part (check the positions
        continue each sequence, then note sealed blocks for the store) around `decode_step`.
        In a static-buffer step (`ctx.external_plans`, what the runner's CUDA graphs capture)
        only `decode_step` at the plan's score columns; the runner calls `plan_decode` before
        and `finish_decode` after."""
        plans = ctx.external_plans
        if plans is not None and self in plans:
            cols = plans[self]
            out = self.decode_step(q, k, v, ctx.slots.long(), ctx.positions.long(), scale, cols)
            self._static_selections[(q.shape[0], cols)] = self.last_selection
            return out
        slots, positions = ctx.host_slots, ctx.host_positions
        if slots is None or positions is None:
            raise RuntimeStateError("hisparse decode needs the step's host positions and slots")
        cols = self._check_decode(slots, positions)
        out = self.decode_step(q, k, v, ctx.slots.to(self.device).long(), ctx.positions.to(self.device).long(),
                               scale, cols)
        self._advance(slots, positions)
        if self.counts_steps:
            self.metrics.decode_steps += 1
            self.metrics.eager_steps += 1
        return out

    def plan_decode(self, slots: Sequence[int], positions: Sequence[int]) -> int:
        """The host part before a static-buffer step: the checks of `attend_decode`, and the
        score columns its device part runs at (the plan, the graph's shape key): 0 where no
        sequence selects, else the power of two at or above the columns the step needs
        (capped at `max_blocks`), so a growing context changes graphs only at powers of two.
        More columns select the same blocks (the extra ones are masked off)."""
        cols = self._check_decode(slots, positions)
        return 0 if cols == 0 else min(self.max_blocks, 1 << (cols - 1).bit_length())

    def finish_decode(self, slots: Sequence[int], positions: Sequence[int], plan: Hashable, rows: int,
                      graphed: bool) -> None:
        """The host part after a static-buffer step: advance the sequences, hand sealed
        blocks to the store, point `last_selection` at the step's selection."""
        sel = self._static_selections.get((rows, plan))
        if sel is not None:
            self.last_selection = sel.first(len(slots))
        self._advance(slots, positions)
        if self.counts_steps:
            self.metrics.decode_steps += 1
            if graphed:
                self.metrics.graph_steps += 1
            else:
                self.metrics.eager_steps += 1

    def _check_decode(self, slots: Sequence[int], positions: Sequence[int]) -> int:
        """Check a step's positions continue each sequence; the score columns it needs (0: no
        sequence selects)."""
        bs, c = self.block, self.config
        cols = 0
        for slot, p in zip(slots, positions):
            st = self._state(slot)
            if p != st.num_tokens:
                raise RuntimeStateError(f"hisparse layer {self.layer}: decode at {p}, but slot {slot} holds "
                                        f"{st.num_tokens} tokens")
            self._check_block(p // bs)
            nb = p // bs + 1
            lo = min(c.sink_blocks, nb)
            hi = max(lo, nb - c.recent_blocks)
            if p + 1 >= c.min_context and hi - lo > c.topk:
                cols = max(cols, hi)
        return cols

    def _advance(self, slots: Sequence[int], positions: Sequence[int]) -> None:
        """After a step: each sequence holds one more token; blocks it sealed go to the store."""
        bs = self.block
        for slot, p in zip(slots, positions):
            st = self._slots[slot]
            st.num_tokens = p + 1
            if (p + 1) % bs == 0:
                self._queue_puts(slot, st, (p + 1) // bs)
        self._flush_puts()

    def decode_step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
                    positions: torch.Tensor, scale: float, score_cols: int) -> torch.Tensor:
        """The device part of a decode step: no host reads, shapes fixed by the batch,
        `width` and `score_cols` (0: no sequence selects; else the score columns, at least
        every candidate block of a selecting sequence), so it can be captured in a CUDA graph."""
        from kernels.paged_decode_attention import paged_decode_attention

        c, bs, t = self.config, self.block, self.table
        blk, off = positions // bs, positions % bs
        # rows padding a graph's batch repeat row 0 (same writes): the counters skip them
        live = torch.cat([torch.ones_like(slots[:1], dtype=torch.bool), slots[1:] != slots[:1]])
        t.tick()
        rows = t.place(slots, blk, off == 0, c.sink_blocks, c.recent_blocks, live)
        g = slots * self.rows_per_slot + rows
        flat = g * bs + off
        self.k_pool.view(-1, self.num_kv_heads, self.head_dim)[flat] = k.to(self.k_pool.dtype)
        self.v_pool.view(-1, self.num_kv_heads, self.head_dim)[flat] = v.to(self.v_pool.dtype)
        self.summaries[slots, blk] = self._summarize(self.k_pool[g], off + 1)
        sealed = off == bs - 1
        mdst = slots * self.max_blocks + blk
        copy_blocks(self.k_pool, g, self.mirror_k, mdst, sealed)
        copy_blocks(self.v_pool, g, self.mirror_v, mdst, sealed)
        sel = self._select(q, slots, positions, score_cols)
        self.last_selection = sel
        adm = t.admit(slots, sel.blocks, sel.valid, live)
        grow = slots[:, None] * self.rows_per_slot + adm.rows
        src = (slots[:, None] * self.max_blocks + sel.blocks.clamp(min=0)).flatten()
        copy_blocks(self.mirror_k, src, self.k_pool, grow.flatten(), adm.missing.flatten())
        copy_blocks(self.mirror_v, src, self.v_pool, grow.flatten(), adm.missing.flatten())
        force = None if q.is_cuda else False
        if sel.heads is None:
            tables = torch.where(sel.valid, grow, 0).to(torch.int32)
            lens = ((sel.valid.sum(1) - 1) * bs + off + 1).to(torch.int32)
            return paged_decode_attention(q, self.k_pool, self.v_pool, tables, lens, scale, force_triton=force)
        g = q.shape[1] // self.num_kv_heads
        ar = torch.arange(self.width, device=self.device)[None, :]
        outs = []
        for h in range(self.num_kv_heads):  # each KV head over its own blocks, in position order
            m = sel.heads[:, h]
            order = torch.where(m, ar, ar + self.width).argsort(1)
            tables = torch.where(m.gather(1, order), grow.gather(1, order), 0).to(torch.int32)
            lens = ((m.sum(1) - 1) * bs + off + 1).to(torch.int32)
            outs.append(paged_decode_attention(q[:, h * g:(h + 1) * g], self.k_pool[:, :, h:h + 1],
                                               self.v_pool[:, :, h:h + 1], tables, lens, scale, force_triton=force))
        return torch.cat(outs, 1)

    def _select(self, q: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, score_cols: int) -> Selection:
        """Blocks each sequence attends to this step `[B, width]`, ascending (current last):
        every block below `min_context` or with at most `topk` candidates; else the sink,
        the `topk` best-scoring candidates and the recent blocks."""
        c, bs = self.config, self.block
        nb = positions // bs + 1
        ar = torch.arange(self.width, device=self.device)[None, :]
        every_valid = ar < nb[:, None]
        every = torch.where(every_valid, ar, 0)
        if score_cols <= 0:
            return Selection(every, every_valid)
        from kernels.hisparse_select import block_scores, topk_blocks

        lo = nb.clamp(max=c.sink_blocks)
        hi = torch.maximum(lo, nb - c.recent_blocks)
        selecting = (positions + 1 >= c.min_context) & (hi - lo > c.topk)
        hi_cols = torch.minimum(hi, torch.full_like(hi, score_cols))
        if c.per_kv_head:
            g = q.shape[1] // self.num_kv_heads
            tops = [topk_blocks(block_scores(q[:, h * g:(h + 1) * g], self.summaries[:, :, :, h:h + 1], slots, lo,
                                             hi_cols, score_cols, c.summary), c.topk)
                    for h in range(self.num_kv_heads)]
        else:
            tops = [topk_blocks(block_scores(q, self.summaries, slots, lo, hi_cols, score_cols, c.summary), c.topk)]
        B = positions.shape[0]
        big = torch.iinfo(torch.int64).max
        sink = torch.arange(c.sink_blocks, device=self.device)[None, :].expand(B, -1)
        recent = nb[:, None] - c.recent_blocks + torch.arange(c.recent_blocks, device=self.device)[None, :]
        picked = torch.cat([sink, *tops, recent], 1).sort(1).values
        if len(tops) > 1:  # the union: duplicates out, then to the end
            dup = torch.cat([torch.zeros_like(picked[:, :1], dtype=torch.bool), picked[:, 1:] == picked[:, :-1]], 1)
            picked = picked.masked_fill(dup, big).sort(1).values
        pad = self.width - picked.shape[1]
        if pad > 0:
            picked = torch.cat([picked, picked.new_full((B, pad), big)], 1)
        picked_valid = picked != big
        picked = picked.masked_fill(~picked_valid, 0)
        blocks = torch.where(selecting[:, None], picked, every)
        valid = torch.where(selecting[:, None], picked_valid, every_valid)
        heads = None
        if c.per_kv_head:
            pinned = (picked < c.sink_blocks) | (picked >= nb[:, None] - c.recent_blocks)
            own = torch.stack([(picked[:, :, None] == t[:, None, :]).any(-1) for t in tops], 1)  # [B, Hkv, W]
            picked_heads = (own | pinned[:, None]) & picked_valid[:, None]
            heads = torch.where(selecting[:, None, None], picked_heads, every_valid[:, None].expand_as(picked_heads))
        return Selection(blocks, valid, heads)
