"""One decode step's index inputs, built on the host and moved to the device in one copy.

A decode step of B sequences needs, per sequence: the token id, its position, its state /
ring slot, the flat paged-KV slot its K/V go to, and its block table. They are packed into
one int64 host tensor `[rows, TABLE_COL + width]` (columns below; the block table padded
with 0 to `width` blocks) and copied to the device once, from pinned memory without a
host sync. Rows past B (padding up to a CUDA-graph bucket) repeat row 0: they recompute
sequence 0's step and write the same values to the same places, so they change nothing.

| column        | holds                                                  |
|---------------|--------------------------------------------------------|
| `COL_TOKEN`   | token id (0 when the ids are given as a device tensor) |
| `COL_POS`     | position of the new token (`num_computed_tokens`)      |
| `COL_SLOT`    | state / window-ring slot                               |
| `COL_WRITE`   | flat paged-KV slot of the new token (0 without full layers) |
| `TABLE_COL..` | block ids of positions 0..pos (0-padded)               |
"""
from __future__ import annotations

from typing import Sequence as Seq

import torch

from engine.errors import CacheError
from engine.models.layers.base import DecodeContext
from engine.runtime.sequence import Sequence

COL_TOKEN, COL_POS, COL_SLOT, COL_WRITE, TABLE_COL = 0, 1, 2, 3, 4


def decode_context(rows: torch.Tensor, has_paged: bool, backend: str, paged_attention: bool) -> DecodeContext:
    """The `DecodeContext` over a packed device tensor of decode rows (the module docstring's columns)."""
    return DecodeContext(
        positions=rows[:, COL_POS],
        slots=rows[:, COL_SLOT],
        write_slots=rows[:, COL_WRITE] if has_paged else None,
        backend=backend,
        block_tables=rows[:, TABLE_COL:] if has_paged else None,
        paged_attention=paged_attention,
    )


def blocks_for(positions: Seq[int], block_size: int) -> int:
    """Block-table columns that cover the new token of every sequence."""
    return max(p // block_size + 1 for p in positions)


def pack_decode_rows(seqs: Seq[Sequence], positions: Seq[int], tokens: Seq[int] | None,
                     block_size: int, has_paged: bool, rows: int | None = None,
                     width: int | None = None) -> torch.Tensor:
    """The host tensor `[rows, TABLE_COL + width]` int64 described in the module docstring.
    `rows` defaults to len(seqs), `width` to the blocks the batch needs (0 without full
    layers)."""
    b = len(seqs)
    rows = b if rows is None else rows
    need = blocks_for(positions, block_size) if has_paged else 0
    width = need if width is None else width
    if rows < b or width < need:
        raise ValueError(f"pack_decode_rows: rows={rows} < batch {b} or width={width} < {need} blocks needed")
    cols = TABLE_COL + width
    flat: list[int] = []
    for i, (seq, p) in enumerate(zip(seqs, positions)):
        tok = 0 if tokens is None else tokens[i]
        if has_paged:
            nb = p // block_size + 1
            if nb > len(seq.block_table):
                raise CacheError(f"sequence {seq.seq_id!r} has {len(seq.block_table)} blocks, "
                                 f"not enough for position {p}")
            table = seq.block_table[:nb]
            write = table[-1] * block_size + p % block_size
            flat += (tok, p, seq.slot, write, *table)
            flat += [0] * (width - nb)
        else:
            flat += (tok, p, seq.slot, 0)
            flat += [0] * width
    out = torch.tensor(flat, dtype=torch.long).view(b, cols)
    if rows > b:
        out = torch.cat([out, out[:1].expand(rows - b, cols)])
    return out


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a packed host tensor to `device` without a host sync (through pinned memory)."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def check_token_ids(ids: torch.Tensor, vocab_size: int) -> None:
    """Range-check host token ids (a device tensor is left to the embedding's own check:
    reading it here would sync)."""
    if ids.device.type == "cpu" and ids.numel():
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"token ids must lie in [0, {vocab_size}); got min {lo}, max {hi}")
