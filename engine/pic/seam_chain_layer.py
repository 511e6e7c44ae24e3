"""A linear layer of the fused prefill (engine.pic.fused) as kernels.seam_chain calls:
every computed range's recurrence and every piece's composition, in prompt order, in one
launch per run of events (long computed ranges on fla between them: one fla chunk call
each, or with two or more, one or two varlen calls for all of them: engine.pic.long_ranges).

`chain_on` says which layers take this path, `chain_tables` builds every layer's event
table with one host-to-device copy per request, `linear_layer_chain` runs one layer over
its computed inputs (the caller runs the short convs: engine.pic.conv_ranges).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

from engine.cache.layer_caches import StateSlotCache
from engine.cache.manager import CacheManager
from engine.models.decoder import HybridDecoder
from engine.models.layers.linear_ops import DENSE_FAMILIES, RecurrenceInputs
from engine.pic import long_ranges
from engine.pic.errors import SplicePlacementError
from engine.pic.fused_events import Computed
from engine.pic.splice import linear_part
from kernels.backend import HAS_TRITON
from kernels.seam_chain import (ADD, CHAIN_FAMILIES, COMPOSE, COMPUTE, MAX_DIM_TRITON, SET, ChainEvents,
                                seam_chain)

#: with the seam chain on fla, computed ranges longer than this run fla's chunk kernel
#: between chain launches (the chain's per-token loop is serial in time)
CHAIN_MAX_TOKENS = 256

#: families `auto` runs through the seam chain on CUDA: every one the kernel has (not kda) (H200,
#: tools/check_seam_chain.py, 10 pieces, seam 16, bf16: delta 0.24 ms per layer call against 2.56 ms for the per-event path, which
#: is host-bound; scalar 0.10-0.11, diag 0.16 against 1.9-2.2 ms). The per-event path stays
#: for the CPU, `chain="off"`, kda, dims over MAX_DIM_TRITON and prefix checkpoints.
CHAIN_AUTO_FAMILIES = ("scalar", "diag", "delta")


def chain_on(chain: str, mixer, device: torch.device) -> bool:
    """Whether this linear layer runs its events as one kernels.seam_chain call (never for
    a family the kernel lacks, `kda`, even with `chain="on"`: the per-event path)."""
    if chain == "off" or mixer.family not in CHAIN_FAMILIES:
        return False
    if chain == "on":
        return True
    return (device.type == "cuda" and HAS_TRITON and mixer.family in CHAIN_AUTO_FAMILIES
            and mixer.key_dim <= MAX_DIM_TRITON and mixer.value_dim <= MAX_DIM_TRITON)


@dataclass
class ChainLayer:
    """One linear layer's seam-chain events: the device table, and the pieces' E and T
    tensors (stacked at the layer, one torch.cat each)."""

    table: torch.Tensor  # int32 [n, 3] on the device
    t_row: torch.Tensor  # int32 [n, H] on the device
    E: list[torch.Tensor]
    T: list[torch.Tensor]


def _chain_layer_rows(events, layer: int, family: str, num_heads: int, mixer=None):
    """(table rows, t_row rows, E list, T list) of one layer, in the semantics of
    `_linear_layer` (first placement: S = E; naive addition: S + E_tail; a delta part
    whose heads all forgot: S = E_tail; else S = T_tail S + E_tail, forgotten delta heads
    with T row -1). A `mixer` with RoPE inside its recurrence (`uses_positions`) gets each
    E_tail rotated by its piece's delta here, so the kernel composes it unchanged."""
    rotate = getattr(mixer, "uses_positions", False)
    table, rows, E, T = [], [], [], []
    n_t = 0
    none = [-1] * num_heads
    for ev in events:
        if isinstance(ev, Computed):
            table.append((COMPUTE, ev.lo, ev.hi))
            rows.append(none)
            continue
        piece = ev.piece
        part = linear_part(piece, layer)
        r = none
        if piece.first:
            kind, e = SET, part.state
        elif piece.linear == "add":
            kind, e = ADD, part.tail_state
        elif family in DENSE_FAMILIES and (part.tail_transition is None or not part.live_heads):
            kind, e = SET, part.tail_state
        else:
            kind, e = COMPOSE, part.tail_state
            heads = part.live_heads if family in DENSE_FAMILIES else range(num_heads)
            r = list(none)
            for j, hd in enumerate(heads):
                r[hd] = n_t + j
            n_t += len(heads)
            T.append(part.tail_transition)
        if e is None:
            raise SplicePlacementError(f"layer {layer}: signature has no {'end' if piece.first else 'tail'} state")
        if rotate and not piece.first:
            e = mixer.rotate_state(e.float(), piece.delta).to(e.dtype)
        table.append((kind, len(E), 0))
        rows.append(r)
        E.append(e)
    return table, rows, E, T


def chain_tables(model: HybridDecoder, manager: CacheManager, events, device) -> dict[int, ChainLayer]:
    """Every linear layer's event table, with ONE host-to-device copy per request."""
    flat: list[int] = []
    spans = {}
    lists = {}
    for i, cache in enumerate(manager.layers):
        if not isinstance(cache, StateSlotCache):
            continue
        mixer = model.blocks[i].mixer
        h = mixer.state_shape[0]
        table, rows, E, T = _chain_layer_rows(events, i, mixer.family, h, mixer)
        a = len(flat)
        for t in table:
            flat.extend(t)
        b = len(flat)
        for r in rows:
            flat.extend(r)
        spans[i] = (a, b, len(flat), len(table), h)
        lists[i] = (E, T)
    host = torch.tensor(flat, dtype=torch.int32)
    if device.type == "cuda":
        host = host.pin_memory()
    dev = host.to(device, non_blocking=True)
    out = {}
    for i, (a, b, c, n, h) in spans.items():
        out[i] = ChainLayer(dev[a:b].view(n, 3), dev[b:c].view(n, h), *lists[i])
    return out


def _chain_groups(events, long_at: Optional[int]) -> list[tuple[int, int]]:
    """Event index runs [a, b) for seam_chain calls, and single long computed ranges
    (b - a == 1, a compute event longer than `long_at` tokens) between them."""
    groups, a = [], 0
    for j, ev in enumerate(events):
        if long_at is not None and isinstance(ev, Computed) and ev.num_tokens > long_at:
            if j > a:
                groups.append((a, j))
            groups.append((j, j + 1))
            a = j + 1
    if a < len(events):
        groups.append((a, len(events)))
    return groups


def _long(events, a: int, b: int, backend: str) -> bool:
    """Group [a, b) is one computed range that fla's chunk kernel runs between chain calls."""
    ev = events[a]
    return b - a == 1 and isinstance(ev, Computed) and backend == "fla" and ev.num_tokens > CHAIN_MAX_TOKENS


def _joined(join, ts: list, device) -> torch.Tensor:
    """`join(ts)` on `device`: joined where the tensors lie when they all lie on one
    device, then moved in one copy (not one copy per piece)."""
    if all(t.device == ts[0].device for t in ts):
        return join(ts).to(device)
    return join([t.to(device) for t in ts])


def linear_layer_chain(seq, cache: StateSlotCache, mixer, layer, events, inp: RecurrenceInputs, cl: ChainLayer,
                       force, backend, ops_out: Optional[dict] = None, batch_long_ranges: bool = True):
    """`_linear_layer` with the recurrences and compositions as one kernels.seam_chain call
    (a computed range longer than CHAIN_MAX_TOKENS runs fla's chunk kernel between chain
    calls when the backend is fla: token by token it would be slower). `ops_out` (optional)
    gets the (T, E) from zero of every long range the shared varlen path ran, keyed by its
    local (start, end) (engine.pic.capture takes captured tails from there).
    `batch_long_ranges`: PicConfig.batch_long_ranges (engine.pic.long_ranges)."""
    state = cache.state[seq.slot]
    device = state.device
    if inp.v.stride(-1) != 1:  # channel-first conv outputs: copied once for every chain call below
        inp = replace(inp, v=inp.v.contiguous())
    E = _joined(torch.stack, cl.E, device) if cl.E else state.new_zeros(0, *state.shape)
    T = _joined(torch.cat, cl.T, device) if cl.T else None
    o = torch.empty(inp.v.shape, dtype=inp.v.dtype, device=inp.v.device)
    groups = _chain_groups(events, CHAIN_MAX_TOKENS if backend == "fla" else None)
    longs = [(events[a].lo, events[a].hi) for a, b in groups if _long(events, a, b, backend)]
    batched = long_ranges.batches(mixer.family, len(longs), batch_long_ranges)
    run = long_ranges.run_from_zero(mixer.family, inp, longs) if batched else None
    if run is not None and ops_out is not None:
        ops_out.update(zip(longs, run.ops))
    starts: list[torch.Tensor] = []
    for a, b in groups:
        ev = events[a]
        if _long(events, a, b, backend):
            if run is not None:  # its outputs come with every long range's, below
                starts.append(state.clone())
                state = long_ranges.step_over(mixer.family, run.ops[len(starts) - 1], state)
                continue
            o_r, st = mixer.run_recurrence(inp.slice_time(ev.lo, ev.hi), state.float()[None], backend)
            o[:, ev.lo:ev.hi] = o_r
            state = st[0]
            continue
        sub = ChainEvents(cl.table[a:b], cl.t_row[a:b], E, T)
        _, state = seam_chain(inp, state, sub, mixer.family, force_triton=force, out=o)
    if run is not None:
        o_long = long_ranges.outputs(mixer.family, inp, longs, starts)
        for lo, hi in longs:
            o[:, lo:hi] = o_long[:, lo:hi]
    cache.state[seq.slot] = state
    return o
