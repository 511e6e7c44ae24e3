"""Signatures of missing segments taken from the request's own fused pass (context
signatures), instead of an alone pass of their own.

With `PicConfig.miss_path="context"` a request computes each missing segment where it
lies, in context, inside its one fused pass (engine.pic.fused). By default the segment is
then queued for an idle-time alone pass (`help_idle`) that computes its signature: a
second pass over the segment's tokens through every layer, which on the H200 cost
1.6-3x a full prefill per token (docs/BENCHMARKS.md, sessions 7-8) and, on a cold stream,
competes with the next requests for the device. `PicConfig.miss_signatures="context"`
takes the signature from the pass the request runs anyway (`ContextCapture`):

| layer | part | taken from |
|---|---|---|
| full attention | K/V of the tail rows (later placement) or of every row (first) | the pass's own K/V, K re-rotated to its alone position (RoPE composes) |
| sliding window | K/V of the segment's last min(n, w) positions | the same |
| linear | E_tail, T_tail over the tail tokens | the tail's recurrence inputs in context, run from zero (`compute.tails_from_zero`: on fla, the delta rule's E_tail and T in ONE varlen call per layer for every capture of the request; scalar/diagonal decay's E_tail as one decay-weighted sum each, `DIRECT_TAILS`); T as the alone pass derives it |
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

from engine.models.layers.linear_ops import RecurrenceInputs
from engine.pic.compute import _tail_transitions, settle_transitions, tails_from_zero
from engine.pic.errors import SplicePlacementError
from engine.pic.signature import AttentionPart, LinearPart, SegmentSignature

#: what a context signature's meta says of where it came from
ORIGIN = "context"
#: on fla, scalar/diagonal-decay tails' E_tail as one decay-weighted sum each
#: (linear_ops.end_state_from_zero: a few small ops) rather than an fla varlen call per
#: layer (~1 ms of host time each on the H200): the capture runs on the request's path
DIRECT_TAILS = True


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
            out.append(sig)
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


def capture_attention(captures: CaptureSet, index: LocalIndex, mixer, k: torch.Tensor, v: torch.Tensor) -> None:
    """A full or sliding-window layer's part of every capture, from the pass's own K
    (rotated at its absolute position) and V `[C, Hkv, D]` (module docstring)."""
    for cap in captures.captures:
        if mixer.window is None:
            lo, first_pos = cap.rows_start, (0 if cap.first else cap.anchor_len + cap.split)
            kind = "full"
        else:
            m = min(cap.end if cap.first else cap.num_tokens, mixer.window)
            lo, kind = cap.end - m, "swa"
            first_pos = lo + cap.delta
        a, b = index.span(lo, cap.end)
        rows_k = k[a:b]
        if cap.delta and mixer.inv_freq.numel():
            rows_k = mixer.rope_shift(rows_k, cap.delta)
        cap.parts.append(AttentionPart(kind, rows_k.clone(), v[a:b].clone(), first_pos))


def capture_linear(captures: CaptureSet, index: LocalIndex, mixer, inp: RecurrenceInputs, conv_in: torch.Tensor,
                   backend: str) -> None:
    """A linear layer's part of every capture (module docstring), from the layer's
    recurrence inputs over C (`inp`, `[1, C, ...]`) and its pre-conv inputs `conv_in`
    `[1, C, ch]`: E_tail of every capture's tail from zero in one call
    (`compute.tails_from_zero`), T_tail as the alone pass derives it, E of a first
    placement from the in-context run from position 0."""
    caps = sorted(captures.captures, key=lambda c: c.tail_start)
    if not caps:
        return
    dtype = captures.state_dtype
    tailed = [c for c in caps if c.tail_start < c.end]  # a first placement may have no tail
    spans = [index.span(c.tail_start, c.end) for c in tailed]
    e_tails, dense = tails_from_zero(mixer, inp, spans, backend, direct=DIRECT_TAILS)
    e_of = {id(c): e for c, e in zip(tailed, e_tails)}
    parts = []
    for cap in caps:
        e = e_of.get(id(cap))
        state, same = None, False
        if cap.first:
            if cap.split == 0 and cap.anchor_len == 0:  # the tail is the whole pass
                state, same = e, True
            else:
                a, b = index.span(0, cap.end)
                zero = torch.zeros(1, *mixer.state_shape, dtype=torch.float32, device=inp.q.device)
                state = mixer.run_recurrence(inp.slice_time(a, b), zero, backend)[1]
        conv_tail = None
        if mixer.conv is not None:
            r = min(cap.end if cap.first else cap.num_tokens, mixer.conv.width - 1)
            a, b = index.span(cap.end - r, cap.end)
            conv_tail = conv_in[0, a:b].transpose(0, 1).contiguous()
        part = LinearPart(family=mixer.family, state=None if state is None else state[0].to(dtype),
                          tail_state=None if e is None else e[0].to(dtype), tail_transition=None, live_heads=None,
                          conv_tail=conv_tail, tail_state_is_state=same)
        if same:
            part.state = part.tail_state
        if e is not None:
            parts.append(part)
        cap.parts.append(part)
    transitions = _tail_transitions(mixer, [inp.slice_time(a, b) for a, b in spans], backend, dtype, dense)
    if transitions is not None:
        transitions.attach(parts, captures.pending)
