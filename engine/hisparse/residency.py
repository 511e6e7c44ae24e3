"""`HotBufferTable`: which block of each sequence sits in which hot-buffer row, kept on the
device (one HiSparse layer, every slot), and the two decisions a decode step makes with it
without reading anything back to the host: the row of a sequence's new block, and the rows
of the blocks selected this step (the missing ones get evicted rows, else staging rows).

Tensors (flat, each with one trailing *trash* entry that masked updates write to, so every
update has a fixed shape and no data-dependent indexing; constants are written with
`index_fill_`, never `t[index] = scalar`, whose index_put_ copies the scalar from pageable
host memory: a synchronising copy that CUDA-graph capture refuses):
- `row_of[slot * max_blocks + block]`: the block's hot row, or -1;
- `row_block[slot * hot + row]`: the row's block, or -1 (free);
- `last_use[slot * hot + row]`: the step counter when the row was last attended to;
- `clock`: the step counter (a device scalar, advanced by `tick`).

Eviction: a new block takes a free row, else the least recently used row whose block is not
pinned (the first `sink` blocks, the last `recent` ones); a selected block missing from the
hot buffer takes a row whose block is not selected this step, free rows first, then least
recently used; when none is left it gets a staging row (not recorded in the table).
Counters (`counts`, int64 on the device): attended, hot hits, fetched, staged, evicted.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

_BIG = torch.iinfo(torch.int64).max

ATTENDED, HITS, FETCHED, STAGED, EVICTED = range(5)
COUNTER_NAMES = ("blocks_attended", "hot_hits", "blocks_fetched", "blocks_staged", "blocks_evicted")


@dataclass
class Admission:
    """The rows of one step's selected blocks `[B, K]`: `rows` per-slot rows (hot rows
    `< hot`, staging rows after), `missing` the blocks to bring in (into those rows)."""

    rows: torch.Tensor
    missing: torch.Tensor


class HotBufferTable:
    """See the module docstring."""

    def __init__(self, num_slots: int, max_blocks: int, hot: int, rows_per_slot: int, device: torch.device) -> None:
        self.num_slots, self.max_blocks, self.hot, self.rows_per_slot = num_slots, max_blocks, hot, rows_per_slot
        self.device = torch.device(device)
        kw = dict(dtype=torch.int64, device=self.device)
        self.row_of = torch.full((num_slots * max_blocks + 1,), -1, **kw)
        self.row_block = torch.full((num_slots * hot + 1,), -1, **kw)
        self.last_use = torch.zeros(num_slots * hot + 1, **kw)
        self.clock = torch.zeros((), **kw)
        self.counts = torch.zeros(len(COUNTER_NAMES), **kw)
        self._trash_of = num_slots * max_blocks
        self._trash_rb = num_slots * hot

    # ------------------------------------------------------------------ slots
    def reset_slot(self, slot: int) -> None:
        """Forget the slot's rows (device writes only)."""
        self.row_of[slot * self.max_blocks:(slot + 1) * self.max_blocks] = -1
        self.row_block[slot * self.hot:(slot + 1) * self.hot] = -1
        self.last_use[slot * self.hot:(slot + 1) * self.hot] = 0

    def read_slot(self, slot: int) -> tuple[list[int], list[int], int]:
        """The slot's row -> block list, last-use stamps and the clock (one host read: for
        the host-planned prefill, not the decode path)."""
        h = self.hot
        both = torch.cat([self.row_block[slot * h:(slot + 1) * h], self.last_use[slot * h:(slot + 1) * h],
                          self.clock[None]]).tolist()
        return both[:h], both[h:2 * h], both[-1]

    def write_slot(self, slot: int, row_block: list[int], last_use: list[int]) -> None:
        """Replace the slot's rows with a host plan (`row_block[row]`: block or -1)."""
        h, mb = self.hot, self.max_blocks
        rb = torch.tensor(row_block, dtype=torch.int64)
        lu = torch.tensor(last_use, dtype=torch.int64)
        self.row_block[slot * h:(slot + 1) * h] = rb.to(self.device)
        self.last_use[slot * h:(slot + 1) * h] = lu.to(self.device)
        self.row_of[slot * mb:(slot + 1) * mb] = -1
        used = rb >= 0
        if bool(used.any()):
            self.row_of[(slot * mb + rb[used]).to(self.device)] = torch.arange(h)[used].to(self.device)

    def tick(self) -> None:
        self.clock += 1

    def rows_of(self, slots: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """Hot rows (-1: not resident) of `blocks` (any shape, broadcast with `slots`)."""
        return self.row_of[slots * self.max_blocks + blocks]

    def resident(self, slot: int) -> list[int]:
        """Blocks of `slot` in the hot buffer, ascending (a host read: tests, diagnostics)."""
        rb = self.row_block[slot * self.hot:(slot + 1) * self.hot].tolist()
        return sorted(b for b in rb if b >= 0)

    def counters(self) -> dict[str, int]:
        return dict(zip(COUNTER_NAMES, self.counts.tolist()))

    # ------------------------------------------------------------------ placing a new block
    def place(self, slots: torch.Tensor, blocks: torch.Tensor, need: torch.Tensor, sink: int,
              recent: int, live: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The hot row of block `blocks[b]` of sequence `slots[b]` `[B]`: its row if resident;
        where `need[b]` and it is not, a free row or the least recently used row holding no
        pinned block (the first `sink` blocks and the `recent` last up to `blocks[b]`),
        recorded in the table. Rows stay -1 where neither. The caller guarantees a row exists
        (hot >= sink + recent). `live [B]` (default all): the entries the counters count."""
        h, mb = self.hot, self.max_blocks
        base = slots * mb
        cur = self.row_of[base + blocks]
        rb = self.row_block[:-1].view(self.num_slots, h)[slots]  # [B, H]
        lu = self.last_use[:-1].view(self.num_slots, h)[slots]
        pinned = (rb >= 0) & ((rb < sink) | (rb > blocks[:, None] - recent))
        key = torch.where(rb < 0, torch.full_like(lu, -1), lu).masked_fill(pinned, _BIG)
        victim = key.argmin(1)
        take = need & (cur < 0)
        old = rb.gather(1, victim[:, None])[:, 0]
        evict = take & (old >= 0)
        self.row_of.index_fill_(0, torch.where(evict, base + old.clamp(min=0), self._trash_of).flatten(), -1)
        self.row_of[torch.where(take, base + blocks, self._trash_of)] = victim
        flat_row = torch.where(take, slots * h + victim, self._trash_rb)
        self.row_block[flat_row] = blocks
        self.last_use[flat_row] = self.clock.expand(flat_row.shape)
        self.counts[EVICTED] += (evict if live is None else evict & live).sum()
        return torch.where(take, victim, cur)

    # ------------------------------------------------------------------ admitting a selection
    def admit(self, slots: torch.Tensor, sel: torch.Tensor, valid: torch.Tensor,
              live: Optional[torch.Tensor] = None) -> Admission:
        """Rows for the selected blocks `sel [B, K]` (entries where `valid`): resident ones keep
        their rows; missing ones evict rows holding no selected block (free first, then least
        recently used), else take staging rows `hot, hot+1, ...`. The table and last-use stamps
        are updated; nothing is copied (the caller fetches `missing` into `rows`). `live [B]`
        (default all): the sequences the counters count (a graph's padding rows are not)."""
        h, mb = self.hot, self.max_blocks
        base = (slots * mb)[:, None]
        selc = sel.clamp(min=0)
        cur = torch.where(valid, self.row_of[base + selc], torch.full_like(sel, -1))
        resident = cur >= 0
        missing = valid & ~resident
        rb = self.row_block[:-1].view(self.num_slots, h)[slots]  # [B, H]
        lu = self.last_use[:-1].view(self.num_slots, h)[slots]
        protected = torch.zeros(sel.shape[0], h + 1, dtype=torch.bool, device=sel.device)
        protected.scatter_(1, torch.where(resident, cur, h), True)
        protected = protected[:, :h]
        key = torch.where(rb < 0, torch.full_like(lu, -1), lu).masked_fill(protected, _BIG)
        order = key.argsort(dim=1, stable=True)
        n_free = (~protected).sum(1, keepdim=True)
        rank = missing.long().cumsum(1) - 1
        use_hot = missing & (rank < n_free)
        victim = order.gather(1, rank.clamp(0, h - 1))
        rows = torch.where(resident, cur, torch.where(use_hot, victim, h + rank - n_free))
        old = rb.gather(1, victim)
        evict = use_hot & (old >= 0)
        self.row_of.index_fill_(0, torch.where(evict, base + old.clamp(min=0), self._trash_of).flatten(), -1)
        self.row_of[torch.where(use_hot, base + selc, self._trash_of)] = victim
        self.row_block[torch.where(use_hot, (slots * h)[:, None] + victim, self._trash_rb)] = sel
        in_hot = valid & (rows < h)
        stamp = torch.where(in_hot, (slots * h)[:, None] + rows, self._trash_rb)
        self.last_use[stamp] = self.clock.expand(stamp.shape)
        staged = missing & ~use_hot
        n = [valid, resident, missing, staged, evict]
        if live is not None:
            n = [m & live[:, None] for m in n]
        self.counts += torch.stack([m.sum() for m in n])
        return Admission(rows, missing)
