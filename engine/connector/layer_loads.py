"""Layer-by-layer loads of a signature blob into device memory, overlapped with compute.

A signature's blob (engine.connector.codec) holds each layer's parts: as a part of its
own (`L<i>.<part>`, the part's `layer`), or as row r of a stacked part `S<n>.<part>`
`[layers, ...]` whose header meta `stacked` names the rows (`L<i>.<part>`). `layer_plan`
turns a blob header into the byte spans of each layer, in layer order (adjacent spans
merged). `group_layers` merges consecutive layers into groups of at least `min_bytes`
(MIN_COPY_BYTES in the loader, each later group twice the one before up to
MAX_COPY_GROUP_BYTES; `group_bounds` over the layers' byte counts). Per layer, a
qwen3next-bench signature is 4 parts per delta-rule layer (state, tail state, tail
transition, conv tail) and 2 per full-attention layer (K, V): ~80 copies of a few KiB to
a few MiB for a segment of ~70 MB, too short for the copy engine to stay busy. The codec
bands a blob by the same groups (engine.connector.codec: each band's parts stacked and
laid out together, meta `bands`), so `groups_at` groups a banded blob at its bands and
`coalesced` joins a group's spans across the padding between parts: one copy per group,
~4 a segment. The loader's thread issues them next to the engine's, which holds the GIL
between its launches; ~22 copies a segment (one per stacked part and group, blobs
without bands) fell behind the copy engine there (tools/bench_layered_copy.py). Groups
stay several per segment, so the pass still computes early layers while later ones
arrive. `issue_layered` copies the groups
in order on one copy stream and records an event after each group's last copy (keyed by
the group's first layer); since the copies run in order on that stream, the event of
layer i's group completes once every layer <= i has landed. The returned
`LayerEvents` lets the consumer make its compute stream wait for layer i just before it
first reads layer i (`wait_layer`), so layer i computes while layer i+1's bytes arrive
(the fused pass's `before_layer` hook, engine.pic.fused; the store planner installs it).

The streams and events are behind a small interface (`CopyQueue`): `CudaCopyQueue` on a
CUDA device (non_blocking copies from pinned host memory: the daemon's shm arena, mapped
in place and registered as pinned once per mapping by kvstore.client.regions), and any
object with the same two methods elsewhere (the tests use a recording fake). On the
CPU there is nothing to overlap: the loader keeps its zero-copy views.
"""
from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass
from typing import Any, Optional, Protocol, Sequence

from engine.connector.errors import ConnectorError


class LayerPlanError(ConnectorError):
    """A blob header whose parts cannot be split by layer."""


#: the smallest group of layers copied together by the loader (`group_layers`): large
#: enough that a copy's fixed cost is a few percent of its transfer at PCIe speed
MIN_COPY_BYTES = 8 << 20
#: the loader's groups after the first grow by this factor up to MAX_COPY_GROUP_BYTES
#: (`group_layers`: the first layers early, the rest in fewer copies)
COPY_GROUP_GROWTH = 2.0
MAX_COPY_GROUP_BYTES = 64 << 20


@dataclass(frozen=True)
class LayerSpans:
    """The bytes of one layer's parts in a blob (or, after `group_layers`, of the
    consecutive layers `layer`..`last`): (offset, length) pairs, ascending."""

    layer: int
    spans: tuple[tuple[int, int], ...]
    last: Optional[int] = None  # the group's last layer (None: `layer` alone)

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.spans)


def _layer_of(row_name: str) -> int:
    head = row_name.split(".", 1)[0]
    if not head.startswith("L") or not head[1:].isdigit():
        raise LayerPlanError(f"stacked row {row_name!r} does not name a layer (expected L<layer>.<part>)")
    return int(head[1:])


def _merged(spans: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    out: list[list[int]] = []
    for off, n in sorted(spans):
        if out and out[-1][0] + out[-1][1] == off:
            out[-1][1] += n
        else:
            out.append([off, n])
    return tuple((a, b) for a, b in out)


def layer_plan(parts: Sequence[Any], stacked: Optional[dict] = None) -> list[LayerSpans]:
    """Each layer's byte spans (module docstring), in layer order. `parts`: the blob
    header's parts (`name`, `layer`, `offset`, `length`); `stacked`: the header meta's
    `stacked` (part name -> row names)."""
    stacked = stacked or {}
    by_layer: dict[int, list[tuple[int, int]]] = {}
    for p in parts:
        if not p.length:
            continue
        rows = stacked.get(p.name)
        if rows:
            if p.length % len(rows):
                raise LayerPlanError(f"stacked part {p.name!r}: {p.length} bytes do not split into {len(rows)} rows")
            row = p.length // len(rows)
            for r, name in enumerate(rows):
                by_layer.setdefault(_layer_of(name), []).append((p.offset + r * row, row))
        else:
            if p.layer is None or p.layer < 0:
                raise LayerPlanError(f"blob part {p.name!r} has no layer")
            by_layer.setdefault(int(p.layer), []).append((p.offset, p.length))
    return [LayerSpans(layer, _merged(spans)) for layer, spans in sorted(by_layer.items())]


def group_bounds(sizes: Sequence[int], min_bytes: int, growth: float = 1.0,
                 max_bytes: Optional[int] = None) -> list[tuple[int, int]]:
    """[start, end) index ranges over consecutive `sizes` (bytes per layer, in layer
    order) that `group_layers` makes groups of: each at least `min_bytes` (the last may be
    smaller), each floor `growth` times the one before up to `max_bytes`; one range per
    size when `min_bytes` <= 0. The codec bands a blob's parts by the same ranges."""
    if min_bytes <= 0:
        return [(i, i + 1) for i in range(len(sizes))]
    if not growth >= 1.0:
        raise ValueError(f"growth={growth!r} must be >= 1")
    out: list[tuple[int, int]] = []
    start, size = 0, 0
    floor = float(min_bytes)
    for i, n in enumerate(sizes):
        size += n
        if size >= floor:
            out.append((start, i + 1))
            start, size = i + 1, 0
            floor = floor * growth if max_bytes is None else min(floor * growth, float(max(max_bytes, min_bytes)))
    if start < len(sizes):
        out.append((start, len(sizes)))
    return out


def group_layers(plan: Sequence[LayerSpans], min_bytes: int, growth: float = 1.0,
                 max_bytes: Optional[int] = None) -> list[LayerSpans]:
    """Consecutive layers of `plan` merged into groups of at least `min_bytes` (the last
    group may be smaller), in order, each group's spans merged where they touch or where
    only padding lies between them (`coalesced`; module docstring). `min_bytes` <= 0
    keeps one group per layer. With `growth` > 1 each group's floor is `growth` times the
    one before (at most `max_bytes`): the first layers still arrive in a small group, so
    the pass starts early, and the rest in fewer, larger copies (each copy's fixed cost is
    paid fewer times per byte)."""
    if min_bytes <= 0:
        return list(plan)
    bounds = group_bounds([ls.nbytes for ls in plan], min_bytes, growth, max_bytes)
    return coalesced([_group(list(plan[a:b])) for a, b in bounds])


def groups_at(plan: Sequence[LayerSpans], firsts: Sequence[int]) -> list[LayerSpans]:
    """`plan`'s layers grouped at the given first layers (a banded blob's meta `bands`:
    the codec wrote each band's parts together, so a group is one span), spans
    `coalesced`. Layers before the first band start join the first group."""
    if not isinstance(firsts, (list, tuple)) or not all(isinstance(f, int) and f >= 0 for f in firsts):
        raise LayerPlanError(f"blob meta bands={firsts!r} is not a list of first layers")
    starts = sorted(set(firsts))

    def band(ls: LayerSpans) -> int:  # layers before the first start join the first band
        return max(bisect.bisect_right(starts, ls.layer), 1)

    return coalesced([_group(list(g)) for _, g in itertools.groupby(plan, key=band)])


def coalesced(groups: Sequence[LayerSpans]) -> list[LayerSpans]:
    """`groups` with each group's spans joined where no other group's span lies between
    them: the bytes between are the blob's alignment padding (kvstore.format pads each
    part to 4 KiB), copied along so a group laid out together is one copy. The copies
    still write only the destination blob's own bytes, and no byte of another group."""
    flat = sorted((off, n, g) for g, ls in enumerate(groups) for off, n in ls.spans)
    joined: list[list[tuple[int, int]]] = [[] for _ in groups]
    prev = None
    for off, n, g in flat:
        if prev == g:
            a = joined[g][-1][0]
            joined[g][-1] = (a, off + n - a)
        else:
            joined[g].append((off, n))
        prev = g
    return [LayerSpans(ls.layer, tuple(sp), ls.last) for ls, sp in zip(groups, joined)]


def _group(layers: list[LayerSpans]) -> LayerSpans:
    spans = [s for ls in layers for s in ls.spans]
    last = layers[-1].last if layers[-1].last is not None else layers[-1].layer
    return LayerSpans(layers[0].layer, _merged(spans), last if last != layers[0].layer else None)


class CopyQueue(Protocol):
    """Where the copies go: one ordered queue (a CUDA stream)."""

    def copy(self, dst: Any, src: Any) -> None:
        """Queue dst <- src (same byte count)."""

    def record(self) -> Any:
        """An event that completes once every copy queued so far has."""


class LayerEvents:
    """Per-layer completion events of one blob's copies (module docstring)."""

    def __init__(self, events: list[tuple[int, Any]]) -> None:
        self._events = events  # (layer, event), ascending layers
        self.waited: set[int] = set()
        self._last_waited: Optional[Any] = None

    @property
    def layers(self) -> list[int]:
        return [layer for layer, _ in self._events]

    @property
    def last(self) -> Optional[Any]:
        return self._events[-1][1] if self._events else None

    def event_for(self, layer: int) -> Optional[Any]:
        """The event after which `layer`'s bytes are in place: its own (its group's),
        else the last one of a lower layer (it has no parts of its own; earlier layers'
        still count as read by the caller's layer loop), None when no layer <= `layer`
        was copied."""
        found = None
        for lay, ev in self._events:
            if lay > layer:
                break
            found = ev
        return found

    def wait_layer(self, layer: int, wait) -> None:
        """`wait(event)` (e.g. the compute stream's wait_event) for `layer`'s event, once
        per layer, and not again for the next layers of the same group."""
        if layer in self.waited:
            return
        self.waited.add(layer)
        ev = self.event_for(layer)
        if ev is not None and ev is not self._last_waited:
            self._last_waited = ev
            wait(ev)


def issue_layered(src: Any, dst: Any, plan: Sequence[LayerSpans], queue: CopyQueue) -> LayerEvents:
    """Queue the copies of `plan` from `src` to `dst` (sliceable byte buffers of the
    blob's size), layer by layer (group by group after `group_layers`), with an event
    after each layer (group), keyed by its first layer."""
    events = []
    for ls in plan:
        for off, n in ls.spans:
            queue.copy(dst[off:off + n], src[off:off + n])
        events.append((ls.layer, queue.record()))
    return LayerEvents(events)


class CudaCopyQueue:  # pragma: no cover - GPU only
    """`CopyQueue` on a CUDA stream: non_blocking copies (pinned sources DMA asynchronously).
    Use it inside `torch.cuda.stream(stream)`: the copies go to the current stream (no
    stream switch per copy), the events are recorded on `stream`."""

    def __init__(self, stream) -> None:
        self.stream = stream

    def copy(self, dst, src) -> None:
        dst.copy_(src, non_blocking=True)

    def record(self):
        import torch

        ev = torch.cuda.Event()
        ev.record(self.stream)
        return ev
