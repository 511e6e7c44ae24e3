"""A PIC request's layout: which positions of the prompt are computed in context and
which are spliced from a cached segment's signature, as small records (`ComputeTo`,
`Splice` of a `SpliceUnit`), and how a layout becomes the fused step's items.

`layout()` walks the prompt's segments (engine.runtime.request.PromptSegment) from a
start position (0, or the end of a restored exact prefix):
- positions no segment covers (the BOS the engine puts before the first segment) are
  computed, except the anchor in front of a first placement, which its splice covers;
- the first cached segment right behind the anchor is spliced whole (`first`) when
  signatures keep their end states;
- every later cached segment computes its first `split = min(n, seam)` tokens in
  context (the seam) and splices the rest;
- uncached segments and the prompt's last segment are computed ("suffix").

`fused_spec()` turns a layout into the fused step's ranges (`ComputeRange` and `Splice`
in prompt order); `fused_items()` turns those, with the request's signatures, into
engine.pic.fused's `FusedItem`s; `seal_tails()` picks the captured units whose tails keep
their own range.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence, Union

from engine.pic.fused import FusedItem
from engine.pic.signature import SegmentSignature
from engine.pic.splice import SplicePiece
from engine.runtime.request import PromptSegment


@dataclass(frozen=True)
class SpliceUnit:
    """A cached segment to splice: content tokens at [offset, end) of the prompt."""

    offset: int
    end: int
    split: int
    first: bool
    key: bytes

    @property
    def num_tokens(self) -> int:
        return self.end - self.offset

    @property
    def splice_start(self) -> int:
        """First position its splice writes: 0 (anchor included) when placed first, else
        after its seam (SplicePiece.start, without the signature)."""
        return 0 if self.first else self.offset + self.split


@dataclass(frozen=True)
class ComputeTo:
    """Layout item: compute in context from the previous item's end up to `end`; `kind`
    is "seam" or "suffix" (accounting)."""

    end: int
    kind: str


@dataclass(frozen=True)
class Splice:
    """Layout item (and fused-spec item): splice `unit`."""

    unit: SpliceUnit

    @property
    def end(self) -> int:
        return self.unit.end


@dataclass(frozen=True)
class ComputeRange:
    """Fused-spec item: positions [start, end) computed in context."""

    start: int
    end: int


LayoutItem = Union[ComputeTo, Splice]
SpecItem = Union[ComputeRange, Splice]


def splice_units(items: Sequence[LayoutItem]) -> list[SpliceUnit]:
    return [it.unit for it in items if isinstance(it, Splice)]


def layout(ids: Sequence[int], segments: Sequence[PromptSegment], anchor_ids: Sequence[int], seam: int,
           key: Callable[[Sequence[int], int], bytes], keep_end_state: bool, start: int = 0) -> list[LayoutItem]:
    """The request's layout from position `start` (module docstring); `key(content, split)`
    is the planner's segment key."""
    a = len(anchor_ids)
    anchored = list(ids[:a]) == list(anchor_ids) and start == 0
    segments = [s for s in segments if s.num_tokens > 0]
    items: list[LayoutItem] = []
    pos = start  # end of the items so far

    def compute(end: int, kind: str) -> None:
        nonlocal pos
        if end > pos:
            items.append(ComputeTo(end, kind))
            pos = end

    for i, s in enumerate(segments):
        if s.token_end <= start:  # inside the restored prefix
            continue
        # a segment that starts the prompt and holds the anchor itself: content after it
        offset = a if (s.token_start == 0 and anchored) else s.token_start
        n = s.token_end - offset
        if not s.cache or i == len(segments) - 1 or n <= 0:
            compute(s.token_end, "suffix")
            continue
        split = min(n, seam)
        k = key(ids[offset:s.token_end], split)
        if keep_end_state and anchored and offset == a and i == 0:
            items.append(Splice(SpliceUnit(offset, s.token_end, split, True, k)))
            pos = s.token_end
            continue
        compute(offset, "suffix")  # positions before the content (BOS, uncovered gaps)
        if split >= n:
            compute(s.token_end, "seam")
            continue
        compute(offset + split, "seam")
        items.append(Splice(SpliceUnit(offset, s.token_end, split, False, k)))
        pos = s.token_end
    compute(len(ids), "suffix")
    return items


def cached_after(segments: Sequence[PromptSegment], start: int) -> bool:
    """Whether a cached segment other than the prompt's last (non-empty) one ends after
    position `start`. When none does, `layout(..., start)` is one computed range from
    `start` to the prompt's end (no splice, no seam), e.g. after an exact prefix that
    covers every cacheable segment."""
    last = None
    for s in reversed(segments):
        if s.token_end > s.token_start:
            last = s
            break
    for s in segments:
        if s.cache and s.token_end > start and s.token_end > s.token_start and s is not last:
            return True
    return False


def fused_spec(items: Sequence[LayoutItem], start: int) -> tuple[list[SpecItem], dict[str, int], int]:
    """The fused step's ranges from `start`, the positions it computes by kind, and its end."""
    spec: list[SpecItem] = []
    kinds = {"seam": 0, "suffix": 0}
    pos = start
    for it in items:
        if isinstance(it, Splice):
            spec.append(it)
        else:
            spec.append(ComputeRange(pos, it.end))
            kinds[it.kind] += it.end - pos
        pos = it.end
    return spec, kinds, pos


def add_compute(items: list[FusedItem], start: int, end: int, sealed: bool = False) -> None:
    """Append in-context positions [start, end) to fused items, merged with a computed
    item right before them (one range instead of two) unless either is `sealed` (a
    captured tail kept its own range)."""
    if end <= start:
        return
    if sealed:
        items.append(FusedItem(start, end, sealed=True))
        return
    if items and items[-1].computes and not items[-1].sealed and items[-1].end == start:
        items[-1] = FusedItem(items[-1].start, end)
    else:
        items.append(FusedItem(start, end))


def fused_items(spec: Sequence[SpecItem], signatures: dict[bytes, SegmentSignature], in_context: set[bytes],
                sealed: set, linear_mode: str) -> list[FusedItem]:
    """The fused step's items: computed ranges merged, misses computed in context
    (`in_context`: their splice positions, `sealed` ones as ranges of their own), every
    other unit spliced from its signature (a context signature placed first, which cannot
    be, computes its anchor and seam instead)."""
    items: list[FusedItem] = []
    for s in spec:
        if isinstance(s, ComputeRange):
            add_compute(items, s.start, s.end)
            continue
        u = s.unit
        if u.key in in_context:  # a miss computed in context (miss_path="context")
            add_compute(items, u.splice_start, u.end, sealed=u in sealed)
            continue
        sig = signatures[u.key]
        first = u.first and sig.placeable_first
        if u.first and not first:  # a context signature placed first: anchor and seam computed
            add_compute(items, 0, u.offset + u.split)
        piece = SplicePiece(sig, u.offset, first, linear_mode)
        items.append(FusedItem(piece.start, piece.end, piece))
    return items


def seal_tails(spec: Sequence[SpecItem], to_capture: Sequence[SpliceUnit], in_context: set[bytes]) -> set:
    """The captured later placements whose tails the fused step keeps as ranges of their
    own (so a delta-rule layer's shared varlen call for long ranges, engine.pic.long_ranges,
    also gives the capture its (T, E)): all of them when each one's seam follows a spliced
    hit, none otherwise (a run of misses stays one range). The caller checks the backend."""
    later = [u for u in to_capture if not u.first]
    if not later:
        return set()
    at = {id(s.unit): j for j, s in enumerate(spec) if isinstance(s, Splice)}
    for u in later:
        j = at.get(id(u))
        if j is None or j < 2:
            return set()
        seam, before = spec[j - 1], spec[j - 2]
        if not isinstance(seam, ComputeRange) or seam.start != u.offset or not isinstance(before, Splice) \
                or before.unit.key in in_context:
            return set()
    return set(later)


def first_placements(units: Sequence[SpliceUnit]) -> list[SpliceUnit]:
    """One unit per key: its first placement in the prompt."""
    seen: dict[bytes, SpliceUnit] = {}
    for u in units:
        seen.setdefault(u.key, u)
    return sorted(seen.values(), key=lambda u: u.offset)

