"""Prefix caching for hybrid models, the `prefix` baseline: a radix tree over segment
boundaries whose nodes hold state checkpoints (Marconi / SGLang style).

A node is one segment appended to its parent's prefix; its `BoundaryCheckpoint` holds
what a request needs to continue from the end of that prefix: the full-attention K/V of
the node's own positions (a path's nodes together hold the whole prefix's K/V), and at
the boundary itself the sliding-window rows of the last `window` positions, every linear
layer's state and conv tail. Linear states cannot be rolled back, so a prefix is reusable
only up to a boundary that has a checkpoint; this is why boundaries sit at segment ends.

Which boundaries keep linear states is `PicConfig.prefix_checkpoints`: `"every"` keeps
them at every boundary; `"branch"` (default, as Marconi and SGLang's hybrid radix cache
do) keeps K/V at every boundary but states only at the end of a request's cacheable
prefix and at the boundary where the request leaves a path another request cached
before (a branch point: a shared prefix, likely shared again; that node gets its states
from this request's pass). A match is usable up to its deepest node with states.

`PrefixPlanner` matches the request's leading cached segments (never its last segment,
whose last token must be computed), restores the deepest usable checkpoint, computes
the rest, and snapshots a checkpoint after each further leading cached segment. With
`PicConfig.fused` (default) the rest is ONE pass through the layers (engine.pic.fused)
that splits only the linear recurrences at the boundaries and takes the snapshots inside
the pass, so prefix caching costs what full recomputation of the rest costs; without it,
one compute step per segment and a zero-width apply step at each boundary. Checkpointed positions are reused verbatim, so a
matched prefix gives the same outputs as full recomputation.

Eviction: least recently used leaves first, until the bytes held fit `capacity_bytes`;
nodes in use by a live request are pinned and never evicted.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from engine.cache.layer_caches import PagedKVCache, StateSlotCache, WindowRingCache
from engine.pic.config import PicConfig
from engine.pic.errors import SplicePlacementError
from engine.pic.report import STATE_KEY, ReportingPlanner
from engine.pic.report import PlanBuilder
from engine.runtime.planner import PrefillPlan
from engine.runtime.request import Request


@dataclass
class BoundaryCheckpoint:
    """Cache contents for positions [start, end) (full K/V) and at `end` (the rest; not
    kept when `with_state` is False: such a node holds K/V only and a match cannot end
    there)."""

    start: int
    end: int
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    ring: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = field(default_factory=dict)  # k, v, first position
    states: dict[int, tuple[torch.Tensor, Optional[torch.Tensor]]] = field(default_factory=dict)
    with_state: bool = True

    def nbytes(self) -> int:
        tensors = [t for pair in self.kv.values() for t in pair]
        tensors += [t for k, v, _ in self.ring.values() for t in (k, v)]
        tensors += [t for pair in self.states.values() for t in pair if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)


def capture_checkpoint(manager, seq, start: int, end: int, with_state: bool = True) -> BoundaryCheckpoint:
    """Copy what `seq`'s caches hold for [start, end) and, `with_state`, at `end`."""
    if seq.num_computed_tokens != end:
        raise SplicePlacementError(f"checkpoint at {end} but the caches hold {seq.num_computed_tokens} positions")
    cp = BoundaryCheckpoint(start, end, with_state=with_state)
    slots = manager.flat_slots(seq, start, end)  # the same for every layer: computed once
    for i, cache in enumerate(manager.layers):
        if isinstance(cache, PagedKVCache):
            k, v = cache.gather(slots)
            cp.kv[i] = (k.clone(), v.clone())
        elif not with_state:
            continue
        elif isinstance(cache, WindowRingCache):
            first = max(0, end - cache.window)
            k, v = cache.read(seq.slot, torch.arange(first, end, device=cache.k.device))
            cp.ring[i] = (k.clone(), v.clone(), first)
        elif isinstance(cache, StateSlotCache):
            tail = cache.get_conv_tail(seq.slot)
            cp.states[i] = (cache.get_state(seq.slot).clone(), None if tail is None else tail.clone())
    return cp


def restore_checkpoints(manager, seq, path: list[BoundaryCheckpoint]) -> None:
    """Write a path of checkpoints (root side first, the last one with states) into
    `seq`, which holds nothing yet. Each checkpoint's flat slots are computed once (on
    the device, without a host sync) and serve every full-attention layer."""
    if seq.num_computed_tokens != 0:
        raise SplicePlacementError(f"restore into caches that hold {seq.num_computed_tokens} positions")
    if not path[-1].with_state:
        raise SplicePlacementError(f"checkpoint [{path[-1].start}, {path[-1].end}) holds no states to restore from")
    end = path[-1].end
    manager.ensure_capacity(seq, end)
    last = path[-1]
    slots = [manager.flat_slots(seq, cp.start, cp.end) for cp in path]
    for i, cache in enumerate(manager.layers):
        if isinstance(cache, PagedKVCache):
            for cp, at in zip(path, slots):
                k, v = cp.kv[i]
                cache.write(at, k, v)
        elif isinstance(cache, WindowRingCache):
            k, v, first = last.ring[i]
            cache.write(seq.slot, torch.arange(first, end, device=cache.k.device), k, v)
        elif isinstance(cache, StateSlotCache):
            state, tail = last.states[i]
            cache.set_state(seq.slot, state)
            if tail is not None:
                cache.set_conv_tail(seq.slot, tail)
    seq.num_computed_tokens = end


def merge_path(path: list[BoundaryCheckpoint]) -> BoundaryCheckpoint:
    """One checkpoint for positions [0, end) out of a path of checkpoints (root side first,
    the last one with states): the whole prefix's K/V and the last one's states (what a
    store object of the prefix holds)."""
    if not path or path[0].start != 0 or not path[-1].with_state:
        raise SplicePlacementError("a merged checkpoint needs a path from position 0 ending with states")
    last = path[-1]
    cp = BoundaryCheckpoint(0, last.end, ring=dict(last.ring), states=dict(last.states))
    for i in path[0].kv:
        cp.kv[i] = (torch.cat([c.kv[i][0] for c in path]), torch.cat([c.kv[i][1] for c in path]))
    return cp


def split_checkpoint(cp: BoundaryCheckpoint, bounds: list[tuple[int, int]]) -> list[BoundaryCheckpoint]:
    """A merged checkpoint [0, end) cut at `bounds` (consecutive (lo, hi) from 0 to end)
    into a path of tree checkpoints: K/V of each bound, the states on the last one only."""
    if not bounds or bounds[0][0] != 0 or bounds[-1][1] != cp.end:
        raise SplicePlacementError(f"bounds {bounds[:1]}..{bounds[-1:]} do not tile the checkpoint [0, {cp.end})")
    out = []
    for j, (lo, hi) in enumerate(bounds):
        last = j == len(bounds) - 1
        part = BoundaryCheckpoint(lo, hi, with_state=last)
        part.kv = {i: (k[lo:hi], v[lo:hi]) for i, (k, v) in cp.kv.items()}
        if last:
            part.ring, part.states = dict(cp.ring), dict(cp.states)
        out.append(part)
    return out


def prefix_bounds(segments) -> list[tuple[int, int]]:
    """The prefix boundaries of a prompt: (start, end) after each leading cached segment
    (never the last segment, whose last token must be computed); an edge is everything
    since the previous boundary (so the BOS before the first segment belongs to the
    first edge). `segments`: the request's PromptSegments."""
    segments = [s for s in segments if s.num_tokens > 0]
    bounds: list[tuple[int, int]] = []
    for s in segments[:-1]:
        if not s.cache:
            break
        bounds.append((bounds[-1][1] if bounds else 0, s.token_end))
    return bounds


def stateful_ends(policy: str, todo: list[tuple[int, int]], matched: list["PrefixNode"],
                  path: list["PrefixNode"]) -> set[int]:
    """The boundaries (ends) among `todo` whose checkpoints keep states
    (PicConfig.prefix_checkpoints `policy`; module docstring)."""
    if not todo:
        return set()
    if policy == "every":
        return {hi for _, hi in todo}
    ends = {todo[-1][1]}  # the end of the cacheable prefix
    if len(matched) > len(path):  # the request leaves a cached path there: a branch point
        ends.add(matched[-1].checkpoint.end)
    return ends


def fill_with_checkpoints(runner, seq, ids, todo, stateful, end: int, config: PicConfig,
                          all_logits: bool = False, before_layer=None):
    """Compute positions [seq.num_computed_tokens, end) of `ids` in context as one fused
    pass (engine.pic.fused), split inside the linear recurrences only at the boundaries in
    `stateful`, with a checkpoint of every boundary of `todo` inside the fill taken on the
    way; returns (logits, checkpoints in order). `before_layer(i)`: fused_prefill's (an
    idle pass raises there to give way)."""
    from engine.pic.fused import FusedItem, fused_prefill

    start = seq.num_computed_tokens
    cuts = [hi for _, hi in todo if start < hi < end and hi in stateful]
    edges = [start, *cuts, end]
    items = [FusedItem(a, b) for a, b in zip(edges, edges[1:])]
    cps = [BoundaryCheckpoint(lo, hi, with_state=hi in stateful) for lo, hi in todo if start < hi <= end
           and (hi < end or hi in stateful)]
    logits = fused_prefill(runner.model, runner.cache, seq, ids, items, backend=runner.backend,
                           kernel=config.kernel, chain=config.seam_chain, checkpoints=cps,
                           all_logits=all_logits, stages=getattr(runner, "prefill_stages", None),
                           batch_long_ranges=config.batch_long_ranges, before_layer=before_layer)
    return logits, cps


def insert_chain(tree: "PrefixTree", tip: Optional["PrefixNode"], ids, cps: list[BoundaryCheckpoint],
                 pinned: Optional[list] = None) -> Optional["PrefixNode"]:
    """Insert checkpoints one after the other below `tip` (each the child of the one
    before); the new tip (None once one did not fit). Each node inserted is pinned and
    appended to `pinned` when given."""
    for cp in cps:
        if tip is None:  # an earlier checkpoint did not fit
            break
        tip = tree.insert(tip, tuple(ids[cp.start:cp.end]), cp)
        if tip is not None and pinned is not None:
            tip.pins += 1
            pinned.append(tip)
    return tip


class PrefixNode:
    """One segment edge of the radix tree."""

    __slots__ = ("edge", "parent", "children", "checkpoint", "last_used", "pins", "nbytes", "stored")

    def __init__(self, edge: tuple[int, ...], parent: Optional["PrefixNode"],
                 checkpoint: Optional[BoundaryCheckpoint]) -> None:
        self.edge = edge
        self.parent = parent
        self.children: dict[tuple[int, ...], PrefixNode] = {}
        self.checkpoint = checkpoint
        self.last_used = 0
        self.pins = 0
        self.nbytes = 0 if checkpoint is None else checkpoint.nbytes()
        #: the store holds the exact prefix ending here (engine.pic.exact_prefix `offer`)
        self.stored = False


class PrefixTree:
    """Radix tree of segment-boundary checkpoints, LRU-evicted by bytes (module docstring)."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.root = PrefixNode((), None, None)
        self.bytes = 0
        self.num_nodes = 0
        self._clock = itertools.count(1)
        self.lookups = self.hit_segments = self.hit_tokens = self.inserts = self.evictions = 0

    def match(self, edges: list[tuple[int, ...]]) -> list[PrefixNode]:
        """The longest chain of nodes whose edges equal `edges[0], edges[1], ...`, whether
        or not they hold states (`usable_path` cuts it to what can be restored); the
        hit counters count the usable part."""
        self.lookups += 1
        path = self.walk(edges)
        for child in path:
            child.last_used = next(self._clock)
        usable = usable_path(path)
        self.hit_segments += len(usable)
        self.hit_tokens += usable[-1].checkpoint.end if usable else 0
        return path

    def walk(self, edges: list[tuple[int, ...]]) -> list[PrefixNode]:
        """The chain of nodes along `edges` (as `match`), counting and touching nothing."""
        node, path = self.root, []
        for edge in edges:
            child = node.children.get(edge)
            if child is None:
                break
            path.append(child)
            node = child
        return path

    def insert(self, parent: PrefixNode, edge: tuple[int, ...], checkpoint: BoundaryCheckpoint) -> Optional[PrefixNode]:
        """Add (or refresh) the child `edge` of `parent`; None if it cannot fit. A node
        that holds K/V only takes a checkpoint with states in its place (a branch point),
        if it fits."""
        existing = parent.children.get(edge)
        if existing is not None:
            existing.last_used = next(self._clock)
            if checkpoint.with_state and not existing.checkpoint.with_state:
                self._upgrade(existing, checkpoint)
            return existing
        node = PrefixNode(edge, parent, checkpoint)
        if node.nbytes > self.capacity_bytes:
            return None
        parent.pins += 1  # the parent must survive the eviction that makes room for its child
        try:
            self._evict(self.capacity_bytes - node.nbytes)
        finally:
            parent.pins -= 1
        if self.bytes + node.nbytes > self.capacity_bytes:
            return None
        node.last_used = next(self._clock)
        parent.children[edge] = node
        self.bytes += node.nbytes
        self.num_nodes += 1
        self.inserts += 1
        return node

    def _upgrade(self, node: PrefixNode, checkpoint: BoundaryCheckpoint) -> None:
        grown = checkpoint.nbytes() - node.nbytes
        if node.nbytes + grown > self.capacity_bytes:
            return
        node.pins += 1  # it and its path stay while room is made
        try:
            self._evict(self.capacity_bytes - grown)
        finally:
            node.pins -= 1
        if self.bytes + grown > self.capacity_bytes:
            return
        node.checkpoint = checkpoint
        node.nbytes += grown
        self.bytes += grown

    def strip(self, node: PrefixNode) -> None:
        """Drop `node`'s states and window rows, keeping its K/V: a path passes through
        it but can no longer resume there."""
        cp = node.checkpoint
        if not cp.with_state:
            return
        node.checkpoint = BoundaryCheckpoint(cp.start, cp.end, kv=cp.kv, with_state=False)
        freed = node.nbytes - node.checkpoint.nbytes()
        node.nbytes -= freed
        self.bytes -= freed

    def remove(self, node: PrefixNode) -> int:
        """Drop `node` and everything below it unless one of them is pinned; how many
        nodes went."""
        below = [node]
        stack = list(node.children.values())
        while stack:
            n = stack.pop()
            below.append(n)
            stack.extend(n.children.values())
        if any(n.pins for n in below) or node.parent is None:
            return 0
        del node.parent.children[node.edge]
        self.bytes -= sum(n.nbytes for n in below)
        self.num_nodes -= len(below)
        return len(below)

    def clear(self) -> int:
        """Drop every node no request has pinned (with what lies below it); how many
        nodes went. The counters stay."""
        return sum(self.remove(child) for child in list(self.root.children.values()))

    def _evict(self, limit: int) -> None:
        while self.bytes > limit:
            leaves = [n for n in self._nodes() if not n.children and n.pins == 0]
            if not leaves:
                return
            victim = min(leaves, key=lambda n: n.last_used)
            del victim.parent.children[victim.edge]
            self.bytes -= victim.nbytes
            self.num_nodes -= 1
            self.evictions += 1

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def stats(self) -> dict:
        return {"nodes": self.num_nodes, "bytes": self.bytes, "capacity_bytes": self.capacity_bytes,
                "lookups": self.lookups, "hit_segments": self.hit_segments, "hit_tokens": self.hit_tokens,
                "inserts": self.inserts, "evictions": self.evictions}


def usable_path(path: list[PrefixNode]) -> list[PrefixNode]:
    """`path` cut after its deepest node whose checkpoint holds states (a prefix can be
    restored only up to a linear state)."""
    for i in range(len(path) - 1, -1, -1):
        if path[i].checkpoint.with_state:
            return path[: i + 1]
    return []


def path_to(node: Optional[PrefixNode]) -> list[PrefixNode]:
    """The nodes from the root's child down to `node` (root side first; [] for the root
    or None)."""
    out: list[PrefixNode] = []
    while node is not None and node.parent is not None:
        out.append(node)
        node = node.parent
    return out[::-1]


@dataclass
class _PrefixState:
    builder: PlanBuilder
    pinned: list[PrefixNode] = field(default_factory=list)
    tip: Optional[PrefixNode] = None  # deepest node of this request's prefix so far
    store_report: Optional[object] = None  # the store-backed planner's report of this request


class PrefixPlanner(ReportingPlanner):
    """`prefix` (module docstring)."""

    name = "prefix"

    def __init__(self, config: PicConfig, tree: PrefixTree, device: torch.device) -> None:
        super().__init__(config, device)
        self.tree = tree

    def plan(self, request: Request) -> PrefillPlan:
        ids = list(request.prefill_token_ids())
        bounds = prefix_bounds(request.prefill_segments())
        b = self._new_builder(request)
        t0 = time.perf_counter()
        matched, path = self._match(ids, bounds)
        b.report.lookup_ms += (time.perf_counter() - t0) * 1e3
        state = _PrefixState(b, list(path), path[-1] if path else self.tree.root)
        for node in path:
            node.pins += 1
        request.planner_state[STATE_KEY] = state
        if path:
            checkpoints = [n.checkpoint for n in path]
            b.apply(checkpoints[-1].end, lambda runner, req, _c=checkpoints: restore_checkpoints(
                runner.cache, req.seq, _c), "load")
            for cp in checkpoints:
                b.report.add_hit(cp.end - cp.start)
        todo = bounds[len(path):]
        b.report.miss_segments += len(todo)
        stateful = self._stateful_ends(todo, matched, path)
        if self.config.fused:
            start = b.position
            b.fused(len(ids), lambda runner, req, _t=tuple(todo), _s=frozenset(stateful), **kw: self._run_fused(
                runner, req, _t, _s, **kw), {"suffix": len(ids) - start})
            return b.build()
        for lo, hi in todo:
            b.compute(hi, "suffix")
            b.apply(hi, lambda runner, req, _lo=lo, _hi=hi, _w=hi in stateful: self._checkpoint(
                runner, req, _lo, _hi, _w), "checkpoint")
        b.compute(len(ids), "suffix")
        return b.build()

    def _match(self, ids: list[int], bounds: list[tuple[int, int]]) -> tuple[list[PrefixNode], list[PrefixNode]]:
        """The tree's nodes along the request's boundaries and their usable part (the
        store-backed planner also asks the daemon)."""
        matched = self.tree.match([tuple(ids[lo:hi]) for lo, hi in bounds])
        return matched, usable_path(matched)

    def _stateful_ends(self, todo: list[tuple[int, int]], matched: list[PrefixNode],
                       path: list[PrefixNode]) -> set[int]:
        """The boundaries (ends) among `todo` whose checkpoints keep states
        (PicConfig.prefix_checkpoints)."""
        return stateful_ends(self.config.prefix_checkpoints, todo, matched, path)

    def _inserted(self, ids: list[int], state: "_PrefixState") -> None:
        """Hook: the request's checkpoints are in the tree (the store-backed planner
        stores the deepest one with states through the daemon)."""
        return None

    def _run_fused(self, runner, request: Request, todo: tuple[tuple[int, int], ...], stateful: frozenset,
                   all_logits: bool = False):
        """Everything after the restored prefix in one pass (engine.pic.fused), split inside
        the linear recurrences only at the boundaries that keep states, with each
        boundary's checkpoint taken inside the pass; then inserted into the tree in order."""
        ids = request.prefill_token_ids()
        logits, cps = fill_with_checkpoints(runner, request.seq, ids, list(todo), stateful, len(ids), self.config,
                                            all_logits)
        state: _PrefixState = request.planner_state[STATE_KEY]
        state.tip = insert_chain(self.tree, state.tip, ids, cps, state.pinned)
        self._inserted(list(ids), state)
        return logits

    def _checkpoint(self, runner, request: Request, start: int, end: int, with_state: bool = True) -> None:
        state: _PrefixState = request.planner_state[STATE_KEY]
        if state.tip is None:  # an earlier checkpoint of this request did not fit
            return
        cp = capture_checkpoint(runner.cache, request.seq, start, end, with_state)
        node = self.tree.insert(state.tip, tuple(request.prefill_token_ids()[start:end]), cp)
        state.tip = node
        if node is not None:
            node.pins += 1
            state.pinned.append(node)
            if with_state:
                self._inserted(list(request.prefill_token_ids()), state)

    def _release(self, state: _PrefixState) -> None:
        for node in state.pinned:
            node.pins -= 1
        state.pinned.clear()
