"""The short conv of a linear layer in the fused prefill (engine.pic.fused): every computed
range convolved behind the conv tail left by what precedes it (the previous range's,
extended by the pieces spliced in between), in one conv call per layer.

Each range's left context is made of pre-conv inputs that are all known before any conv
runs (the slot's tail, the pieces' conv tails, C's own inputs), so which column of which
tensor lands where in the packed conv input depends only on the request's layout, not on
the layer: `ConvLayout` works it out once per request on the host (one host-to-device copy
of its index tensors), and every conv layer then does one concatenation of its sources,
one gather, one conv and one gather of the output columns, whatever the number of seams
and pieces. The per-event walk (`conv_ranges` with `tails_at`) stays for prefix
checkpoints, which need the tail after each range.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from engine.cache.layer_caches import StateSlotCache
from engine.pic.errors import SplicePlacementError
from engine.pic.fused_events import Placed
from engine.pic.splice import SplicePiece, linear_part
from engine.runtime.decode_batch import to_device


def conv_tail_after(part, piece: SplicePiece, cur: torch.Tensor, width1: int, layer: int) -> torch.Tensor:
    """The conv tail `[C, width1]` after `piece` (its linear `part` at `layer`) is placed
    behind tail `cur`."""
    tail = part.conv_tail
    if tail is None:
        raise SplicePlacementError(f"layer {layer}: signature has no conv tail, the model's layer has a conv")
    tail = tail.to(device=cur.device, dtype=cur.dtype)
    take = tail.shape[1] if piece.first else min(tail.shape[1], piece.signature.tail_len)
    if take >= width1:  # the piece alone fills the window: its own tail, whatever came before
        return tail[:, tail.shape[1] - width1:]
    if piece.first:
        return torch.cat([torch.zeros_like(cur), tail], dim=1)[:, -width1:]
    return torch.cat([cur, tail[:, tail.shape[1] - take:]], dim=1)[:, -width1:]


@dataclass(frozen=True)
class ConvLayout:
    """Where each column of one request's packed conv input comes from, for every conv
    layer whose pieces' tails have `widths` columns. Sources, concatenated along time in
    this order: [zeros `[C, width1]` when `zeros`], the slot's tail `[C, width1]`, each
    placed piece's conv tail (prompt order), C's pre-conv inputs `[C, T]`.

    `gather`: device index `[packed + width1]` into the sources: the packed conv input
    (each range behind its left context), then the tail the layer leaves; `take`: device
    index of the conv output columns to keep, in C's order (None: one range, all of them)."""

    width1: int
    widths: tuple
    zeros: bool
    packed: int
    gather: torch.Tensor
    take: Optional[torch.Tensor]


def conv_layout(events, width1: int, widths: tuple, num_tokens: int, device: torch.device) -> ConvLayout:
    """The layout (class docstring) of `events` (engine.pic.fused_events, prompt order) for
    tails of `width1` columns, pieces' conv tails of `widths` columns (one per placed
    event) and `num_tokens` computed tokens: the same columns `conv_tail_after` and the
    per-event walk pick, as indices."""
    pieces = [ev.piece for ev in events if isinstance(ev, Placed)]
    zeros = any(p.first and w < width1 for p, w in zip(pieces, widths))
    base = width1 if zeros else 0  # the slot's tail starts here
    at = base + width1
    starts = []
    for w in widths:
        starts.append(at)
        at += w
    x0 = at  # C's first column
    cur = list(range(base, base + width1))
    packed: list[int] = []
    j = 0
    for ev in events:
        if isinstance(ev, Placed):
            p, w, s = ev.piece, widths[j], starts[j]
            j += 1
            n = w if p.first else min(w, p.signature.tail_len)
            own = list(range(s + w - n, s + w))
            if n >= width1:
                cur = own[n - width1:]
            else:
                cur = ((list(range(width1)) if p.first else cur) + own)[-width1:]
            continue
        seg = list(range(x0 + ev.lo, x0 + ev.hi))
        packed += cur + seg
        cur = (cur + seg)[-width1:]
    ranges = sum(1 for ev in events if not isinstance(ev, Placed))
    # output column i of the packed conv comes from inputs [i, i + width1]: the range
    # starting at packed column a (its left context) gives outputs a .. a + n - 1
    out_take = []
    a = 0
    for ev in events:
        if isinstance(ev, Placed):
            continue
        n = ev.hi - ev.lo
        out_take.extend(range(a, a + n))
        a += width1 + n
    if len(out_take) != num_tokens:
        raise SplicePlacementError(f"computed ranges cover {len(out_take)} tokens, C holds {num_tokens}")
    gather = to_device(torch.tensor(packed + cur, dtype=torch.long), device)
    take = to_device(torch.tensor(out_take, dtype=torch.long), device) if ranges > 1 else None
    return ConvLayout(width1, widths, zeros, len(packed), gather, take)


def conv_ranges(seq, cache: StateSlotCache, mixer, layer, events, conv_in, tails_at: Optional[dict] = None,
                shared: Optional[dict] = None):
    """The short conv of every computed range (module docstring): C's conv outputs
    `[1, T, C]`, and the tail left in the cache slot. `tails_at` (optional) gets the tail
    after each computed range, keyed by the range's absolute end (the per-event walk).
    `shared`: the request's per-layout dict (the `ConvLayout`s are kept there, so every
    conv layer after the first reuses their device index tensors)."""
    tail = None if cache.conv_tail is None else cache.conv_tail[seq.slot]
    if tail is None or mixer.conv is None:
        if tails_at is not None:
            for ev in events:
                if not isinstance(ev, Placed):
                    tails_at[ev.end] = None
        return conv_in  # no conv: C's ranges tile conv_in in prompt order
    xin = conv_in[0].transpose(0, 1)  # [C, T] pre-conv inputs of C, prompt order
    if tails_at is not None or tail.dtype != xin.dtype:
        return _conv_walk(seq, cache, mixer, layer, events, xin, tail, tails_at, shared)
    width1 = tail.shape[-1]
    parts = [linear_part(ev.piece, layer).conv_tail for ev in events if isinstance(ev, Placed)]
    for t in parts:
        if t is None:
            raise SplicePlacementError(f"layer {layer}: signature has no conv tail, the model's layer has a conv")
    widths = tuple(t.shape[1] for t in parts)
    key = ("conv_layout", width1, widths)
    lay = None if shared is None else shared.get(key)
    if lay is None:
        lay = conv_layout(events, width1, widths, xin.shape[1], xin.device)
        if shared is not None:
            shared[key] = lay
    srcs = [tail] + [t if t.device == xin.device and t.dtype == xin.dtype else t.to(device=xin.device, dtype=xin.dtype)
                     for t in parts] + [xin]
    if lay.zeros:
        srcs.insert(0, torch.zeros_like(tail))
    buf = torch.cat(srcs, dim=1).index_select(1, lay.gather)  # [C, packed + width1]
    y = mixer.conv.valid(buf[:, :lay.packed])
    cache.conv_tail[seq.slot] = buf[:, lay.packed:]
    if lay.take is None:
        return y.transpose(0, 1)[None]
    return y.index_select(1, lay.take).transpose(0, 1)[None]


def _conv_walk(seq, cache: StateSlotCache, mixer, layer, events, xin, tail, tails_at, shared):
    """`conv_ranges` event by event (the tails after each range are kept in `tails_at`)."""
    width1 = tail.shape[-1]
    parts: list[torch.Tensor] = []
    take: list[torch.Tensor] = []  # per range: the output columns of the packed conv
    at = 0
    cur = tail
    for ev in events:
        if isinstance(ev, Placed):
            cur = conv_tail_after(linear_part(ev.piece, layer), ev.piece, cur, width1, layer)
            continue
        lo, hi = ev.lo, ev.hi
        seg = xin[:, lo:hi]
        parts += [cur.to(xin.dtype), seg]
        take.append(torch.arange(at, at + hi - lo))
        at += width1 + hi - lo
        both = seg if hi - lo >= width1 else torch.cat([cur.to(xin.dtype), seg], dim=1)
        cur = both[:, both.shape[1] - width1:].to(cache.conv_tail.dtype)
        if tails_at is not None:
            tails_at[ev.end] = cur
    y = mixer.conv.valid(torch.cat(parts, dim=1))  # [C, at - width1]
    cache.conv_tail[seq.slot] = cur  # after the conv: the first part may be a view of this slot
    if len(take) == 1:
        return y.transpose(0, 1)[None]
    key = ("conv_take", width1)
    idx = None if shared is None else shared.get(key)
    if idx is None:
        idx = to_device(torch.cat(take), y.device)
        if shared is not None:
            shared[key] = idx
    return y.index_select(1, idx).transpose(0, 1)[None]
