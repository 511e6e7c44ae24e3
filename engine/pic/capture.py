"""Signatures of missing segments taken from the request's own fused pass (context
signatures), instead of an alone pass of their own.

With `PicConfig.miss_path="context"` a request computes each missing segment where it
lies, in context, inside its one fused pass (engine.pic.fused). By default the segment is
then queued for an idle-time alone pass (`help_idle`) that computes its signature: a
second pass over the segment's tokens through every layer, which on the H200 cost
1.6-3x a full prefill per token (docs/BENCHMARKS.md) and, on a cold stream,
competes with the next requests for the device. `PicConfig.miss_signatures="context"`
takes the signature from the pass the request runs anyway (`ContextCapture`):

| layer | part | taken from |
|---|---|---|
| full attention | K/V of the tail rows (later placement) or of every row (first) | the pass's own K/V, K re-rotated to its alone position (RoPE composes) |
| sliding window | K/V of the segment's last min(n, w) positions | the same |
| linear | E_tail, T_tail over the tail tokens | the tail's recurrence inputs in context, run from zero: scalar/diagonal decay as one padded decay-weighted sum for every tail of the layer (linear_ops.end_states_and_log_sums: a fixed handful of ops, no fla call), the delta rule from a run started at [0 I] with values [v 0] (on fla ONE varlen call per layer for every capture of the request); the live heads as the alone pass finds them |
| linear | E (first placement only) | the in-context run from position 0, which *is* the alone pass there |
| linear with a conv | the last conv-1 pre-conv inputs | the pass's own |

A segment placed first (right behind the anchor, from position 0 and zero state) is
computed in context exactly as its alone pass computes it, so its context signature is
its alone signature (up to kernel rounding). A later segment's is not: its tokens' layer
inputs carry the context it was computed in (the segments before it in that request),
where an alone signature's carry none. It keeps no end state E (E would be the state
after the anchor and the segment alone, which this pass never holds), so it is never
placed first: a first placement of it computes the anchor and seam and splices the tail
(engine.pic.planner). Whether context-computed tails splice as well as alone-computed ones
is the quality harness's question (tools/quality.py --miss-signatures).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from engine.models.layers.linear_ops import (DENSE_FAMILIES, RecurrenceInputs, end_states_and_log_sums, head_log_sums,
                                             padded_ranges)
from engine.pic import long_ranges
from engine.pic.compute import LOG_FLOAT32_TINY, PendingTransitions, ScalarTransitions, settle_transitions
from engine.pic.errors import SplicePlacementError
from engine.pic.signature import AttentionPart, LinearPart, SegmentSignature

#: what a context signature's meta says of where it came from
ORIGIN = "context"


@dataclass
class ContextCapture:
    """One missing segment of a fused prefill whose signature the pass takes: content
    tokens at absolute positions [offset, end), seam `split`; `first`: placed right behind
    the anchor (`offset == anchor_len`, computed from position 0). `parts` fills layer by
    layer; `signature()` once the pass is done."""

    key: bytes
    offset: int
    end: int
    split: int
    first: bool
    anchor_len: int
    parts: list = field(default_factory=list)

    def __post_init__(self) -> None:
        n = self.end - self.offset
        if n < 1 or self.split < 0 or self.split > n or (self.split == n and not self.first):
            raise SplicePlacementError(f"capture [{self.offset}, {self.end}) with split {self.split} has no tail "
                                       "(only a first placement may have none)")
        if self.first and self.offset != self.anchor_len:
            raise SplicePlacementError(f"a first capture starts right behind the anchor ({self.anchor_len}), "
                                       f"not at {self.offset}")

    @property
    def num_tokens(self) -> int:
        return self.end - self.offset

    @property
    def tail_start(self) -> int:
        """Absolute position of the tail's first token."""
        return self.offset + self.split

    @property
    def rows_start(self) -> int:
        """First absolute position whose K/V rows a full-attention layer keeps."""
        return 0 if self.first else self.tail_start

    @property
    def delta(self) -> int:
        """Alone position minus absolute position of every row."""
        return self.anchor_len - self.offset



class CaptureSet:
    """The captures of one fused pass (`engine.pic.fused.fused_prefill(captures=...)`),
    their linear parts in `state_dtype`. The delta rule's live heads are read from the
    device once for all of them, in `signatures()`, after the pass."""

    def __init__(self, captures: Sequence[ContextCapture], state_dtype: torch.dtype = torch.float32) -> None:
        self.captures = list(captures)
        self.state_dtype = state_dtype
        self.pending: list = []
        self.num_layers: Optional[int] = None
        self.layout: Optional["_Layout"] = None

    def prepare(self, index: "LocalIndex", device: torch.device) -> None:
        """Lay the captures out over the pass's computed tokens (fused_prefill, once)."""
        self.layout = _Layout(self, index, torch.device(device))

    def __len__(self) -> int:
        return len(self.captures)

    def check(self, computed: Sequence[tuple[int, int]], num_layers: int) -> None:
        """Every capture's positions (from position 0 when first, else from its offset)
        must be computed by the pass (`computed`: its computed ranges, absolute, sorted),
        and nothing captured yet."""
        runs = _merged(computed)
        for cap in self.captures:
            lo = 0 if cap.first else cap.offset
            if not any(a <= lo and cap.end <= b for a, b in runs):
                raise SplicePlacementError(f"capture [{lo}, {cap.end}) is not computed by the fused pass")
            if cap.parts:
                raise SplicePlacementError(f"capture [{cap.offset}, {cap.end}) was filled already")
        self.num_layers = num_layers

    def signatures(self, meta: Optional[dict] = None) -> list[SegmentSignature]:
        """Each capture's signature (meta: `meta` plus `origin`), once the pass is done."""
        settle_transitions(self.pending)
        out = []
        for cap in self.captures:
            if self.num_layers is None or len(cap.parts) != self.num_layers:
                raise SplicePlacementError(f"capture [{cap.offset}, {cap.end}) holds {len(cap.parts)} layers, "
                                           f"the pass ran {self.num_layers}")
            sig = SegmentSignature(cap.num_tokens, cap.anchor_len, cap.split, tuple(cap.parts), dict(meta or {}))
            sig.meta["origin"] = ORIGIN
            if not cap.first:  # its rows start at the tail: never spliced whole at the start
                sig.meta["placeable_first"] = False
            out.append(sig.compacted())  # its own bytes, not views of the request's batches
        return out


def _merged(ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for a, b in ranges:
        if out and out[-1][1] == a:
            out[-1][1] = b
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


class LocalIndex:
    """Absolute prompt position -> row of the pass's computed tokens C (prompt order)."""

    def __init__(self, computed: Sequence[tuple[int, int]]) -> None:
        self.ranges = []
        at = 0
        for a, b in computed:
            self.ranges.append((a, b, at))
            at += b - a

    def __call__(self, p: int) -> int:
        for a, b, at in self.ranges:
            if a <= p <= b:
                return at + p - a
        raise SplicePlacementError(f"position {p} is not computed by the fused pass")

    def span(self, lo: int, hi: int) -> tuple[int, int]:
        """Rows of absolute [lo, hi), which lie in one run of computed positions."""
        return self(lo), self(lo) + hi - lo


@dataclass
class _Rows:
    """Where one kind of layer's captured rows lie in C, for every capture at once: `idx`
    (device, the rows of all captures one after another), per-row position deltas (device;
    None when all are 0), each capture's [a, b) in the batch and its `first_pos`."""

    idx: torch.Tensor
    delta: Optional[torch.Tensor]
    bounds: list[tuple[int, int]]
    first_pos: list[int]


class _Layout:
    """A request's capture layout in C, worked out on the host once and copied to the
    device once per kind, shared by every layer of that kind (one gather per layer, not
    one per capture)."""

    def __init__(self, captures: "CaptureSet", index: LocalIndex, device: torch.device) -> None:
        self.captures, self.index, self.device = captures, index, device
        self._rows: dict = {}
        caps = captures.captures
        self.tailed = sorted((c for c in caps if c.tail_start < c.end), key=lambda c: c.tail_start)
        self.spans = [index.span(c.tail_start, c.end) for c in self.tailed]
        self._padded = None

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda":  # pragma: no cover - GPU only
            host = host.pin_memory()
        return host.to(self.device, non_blocking=True)

    def rows(self, key, spec) -> _Rows:
        """`spec(cap)` -> (absolute lo, first_pos) of the rows [lo, cap.end) a layer keeps."""
        got = self._rows.get(key)
        if got is None:
            idx, delta, bounds, first_pos = [], [], [], []
            for cap in self.captures.captures:
                lo, fp = spec(cap)
                a, b = self.index.span(lo, cap.end)
                bounds.append((len(idx), len(idx) + b - a))
                idx.extend(range(a, b))
                delta.extend([cap.delta] * (b - a))
                first_pos.append(fp)
            host = torch.tensor([idx, delta], dtype=torch.long)
            dev = self._to_device(host)
            got = _Rows(dev[0], dev[1] if any(delta) else None, bounds, first_pos)
            self._rows[key] = got
        return got

    def padded_tails(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._padded is None:
            self._padded = padded_ranges(self.spans, self.device)
        return self._padded


def _full_spec(cap: ContextCapture) -> tuple[int, int]:
    return cap.rows_start, (0 if cap.first else cap.anchor_len + cap.split)


def capture_attention(captures: CaptureSet, mixer, k: torch.Tensor, v: torch.Tensor) -> None:
    """A full or sliding-window layer's part of every capture, from the pass's own K
    (rotated at its absolute position) and V `[C, Hkv, D]` (module docstring): one gather
    and one re-rotation for all captures."""
    lay = captures.layout
    if mixer.window is None:
        rows, kind = lay.rows("full", _full_spec), "full"
    else:
        w = mixer.window

        def swa_spec(cap: ContextCapture) -> tuple[int, int]:
            m = min(cap.end if cap.first else cap.num_tokens, w)
            return cap.end - m, cap.end - m + cap.delta

        rows, kind = lay.rows(("swa", w), swa_spec), "swa"
    rk, rv = k.index_select(0, rows.idx), v.index_select(0, rows.idx)
    if rows.delta is not None and mixer.inv_freq.numel():
        rk = mixer.rope_shift(rk, rows.delta)
    for cap, (a, b), fp in zip(captures.captures, rows.bounds, rows.first_pos):
        cap.parts.append(AttentionPart(kind, rk[a:b], rv[a:b], fp))


def capture_linear(captures: CaptureSet, mixer, inp: RecurrenceInputs, conv_in: torch.Tensor, backend: str,
                   ops: Optional[dict] = None) -> None:
    """A linear layer's part of every capture (module docstring), from the layer's
    recurrence inputs over C (`inp`, `[1, C, ...]`) and its pre-conv inputs `conv_in`
    `[1, C, ch]`: E_tail and T_tail of every capture's tail from zero (scalar and diagonal
    decay as one batched sum for all tails; the delta rule from one run
    per tail started at [0 | I], on fla one varlen call for all), E of a first placement
    from the in-context run from position 0, the conv tails in one gather. `ops`: (T, E) from
    zero of ranges the layer already ran (engine.pic.seam_chain_layer, keyed by local
    (start, end)): when every tail is among them (the planner kept each captured tail its own
    range, `_seal_tails`), the delta rule's tails take no call of their own."""
    lay = captures.layout
    dtype = captures.state_dtype
    family = mixer.family
    e_of: dict[int, torch.Tensor] = {}
    transitions = None
    if lay.tailed:
        if family not in DENSE_FAMILIES:
            idx, valid = lay.padded_tails()
            E, log_sums = end_states_and_log_sums(family, inp, idx, valid)
            if getattr(mixer, "uses_positions", False):  # tails ran at their absolute positions: back to alone ones
                E = mixer.rotate_state(E, torch.tensor([c.delta for c in lay.tailed], device=E.device))
            E = E.to(dtype)
            e_of = {id(c): E[i] for i, c in enumerate(lay.tailed)}
            transitions = ScalarTransitions(list(log_sums.unbind(0)))
        else:  # the delta rule: E_tail and T of every tail from one run: [0 | I] start, values [v | 0]
            if ops and all(tuple(sp) in ops for sp in lay.spans):  # the layer's own varlen call ran them
                dense = torch.stack([ops[tuple(sp)][0] for sp in lay.spans])
                E = torch.stack([ops[tuple(sp)][1] for sp in lay.spans])
            else:  # on fla ONE varlen call for every tail
                dense, E = long_ranges.delta_operators(inp, lay.spans, backend, mixer.chunk_size, family)
            E = E.to(dtype).contiguous()  # the varlen call's [E | T] halves are strided: one copy for all
            e_of = {id(c): E[i] for i, c in enumerate(lay.tailed)}
            idx, valid = lay.padded_tails()
            g = inp.log_decay[0].to(torch.float32)[idx]  # [n, L, H] or [n, L, H, K]
            mask = valid.reshape(*valid.shape, *([1] * (g.dim() - 2)))
            log_sums = head_log_sums(family, (g * mask).sum(dim=1))  # [n, H]
            live = (log_sums >= LOG_FLOAT32_TINY) & (dense.abs().amax(dim=(2, 3)) > 0)
            transitions = PendingTransitions(dense.to(dtype).contiguous(), live)
    conv = None
    if mixer.conv is not None:
        width1 = mixer.conv.width - 1

        def conv_spec(cap: ContextCapture) -> tuple[int, int]:
            return cap.end - min(cap.end if cap.first else cap.num_tokens, width1), 0

        rows = lay.rows(("conv", width1), conv_spec)
        got = conv_in[0].index_select(0, rows.idx)  # [rows, C]
        sizes = {b - a for a, b in rows.bounds}
        if len(sizes) == 1:  # every capture keeps r rows: one transposing copy for all
            r = sizes.pop()
            tails = got.view(len(rows.bounds), r, got.shape[-1]).transpose(1, 2).contiguous()  # [n, C, r]
            conv = [tails[j] for j in range(len(rows.bounds))]
        else:
            conv = [got[a:b].transpose(0, 1).contiguous() for a, b in rows.bounds]
    tail_parts = []
    for j, cap in enumerate(captures.captures):
        e = e_of.get(id(cap))
        state, same = None, False
        if cap.first:
            if cap.split == 0 and cap.anchor_len == 0:  # the tail is the whole pass
                state, same = e, True
            else:
                a, b = lay.index.span(0, cap.end)
                zero = torch.zeros(1, *mixer.state_shape, dtype=torch.float32, device=inp.q.device)
                state = mixer.run_recurrence(inp.slice_time(a, b), zero, backend)[1][0].to(dtype)
        conv_tail = None if conv is None else conv[j]  # [C, r]
        part = LinearPart(family=family, state=state, tail_state=e, tail_transition=None, live_heads=None,
                          conv_tail=conv_tail, tail_state_is_state=same)
        cap.parts.append(part)
        if e is not None:
            tail_parts.append((cap, part))
    if transitions is not None:
        order = {id(c): i for i, c in enumerate(lay.tailed)}
        transitions.attach([p for _, p in sorted(tail_parts, key=lambda cp: order[id(cp[0])])], captures.pending)
