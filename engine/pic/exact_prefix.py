"""Exact-prefix reuse inside PIC (`PicConfig.exact_prefix`): PIC subsumes prefix caching.

When a request's leading cached segments match an earlier sequence exactly (the same
segments in the same order from position 0), the PIC planner restores the exact state
at the deepest such boundary (full-attention K/V of every position before it, the
sliding-window rows, every linear layer's state and conv tail: engine.pic.prefix's
`BoundaryCheckpoint`s in a `PrefixTree`), with no seam and no composition, and plans
only the rest of the prompt as PIC does (spliced later segments, computed suffix). An
exact repeat therefore computes only its last segment, as prefix caching does.

Only exact states enter the tree. PIC's own prefill of a prompt is exact up to the end
of its first segment only (later segments are spliced: seams and compositions), so the
checkpoints come from passes in context:
- a request the cold fallback serves by full recompute takes them inside its own pass
  (engine.pic.prefix.fill_with_checkpoints: the same pass, split at the boundaries that
  keep states);
- any other request's cacheable prefix is queued (`ExactPrefixes.queue`, at most
  MAX_PREFIX_JOBS, the newest kept) and computed while the engine is idle
  (`help_idle`), on a scratch sequence, from the deepest exact checkpoint the tree
  already holds: a multi-turn chat's next turn computes only what its last turn added.
  With `PicConfig.exact_prefix_passes="repeated"` only a prefix seen before is queued
  (`wants_pass`: a record of the last MAX_PREFIXES_SEEN prefixes' hashes).

Which boundaries keep states follows `PicConfig.prefix_checkpoints` (as prefix
caching); the tree's capacity is `PicConfig.prefix_cache_bytes`. The store-backed
planner also keeps prefixes in the kvstore daemon (engine.connector.prefix_store), so
other engines and the CPU/NVMe tiers serve them too: by default a prefix once a request
of this engine restored it from the tree (`PicConfig.exact_prefix_store="reused"`:
`to_store`, put while idle), or each as soon as it is computed ("always": `offer`).
Idle passes give way to an arriving request between layers (`help`).
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional, Sequence

from engine.errors import CacheError
from engine.pic.config import PicConfig
from engine.pic.prefix import (PrefixNode, PrefixTree, fill_with_checkpoints, insert_chain, path_to,
                               restore_checkpoints, split_checkpoint, stateful_ends, usable_path)
from engine.pic.seen import SeenKeys
from engine.runtime.sequence import Sequence as CacheSequence

log = logging.getLogger("engine.pic")

#: most cacheable prefixes queued for idle-time exact passes; the oldest are dropped
MAX_PREFIX_JOBS = 64
#: cacheable prefixes remembered for exact_prefix_passes="repeated" (hashes; the oldest forgotten)
MAX_PREFIXES_SEEN = 4096


@dataclass(frozen=True)
class PrefixJob:
    """A cacheable prefix to compute exactly while idle: token ids [0, end) and its
    segment boundaries (engine.pic.prefix.prefix_bounds; the last one ends at end)."""

    ids: tuple[int, ...]
    bounds: tuple[tuple[int, int], ...]

    @property
    def end(self) -> int:
        return self.bounds[-1][1]


@dataclass
class PrefixMatch:
    """What a request found: the tree nodes along its boundaries (`matched`) and the part
    it restores (`path`: root side first, the last one with states; pinned until the
    request releases it). `source`: "engine" (this engine's tree) or "store" (loaded from
    the daemon into the tree)."""

    matched: list[PrefixNode] = field(default_factory=list)
    path: list[PrefixNode] = field(default_factory=list)
    source: str = "engine"
    tier: Optional[str] = None  # the daemon tier that held it (source "store")

    @property
    def tree_tip(self) -> Optional[PrefixNode]:
        """The tree node at the restored boundary, under which the request's further
        checkpoints go (the root when nothing was restored; None when the boundary has no
        node in the tree, e.g. a daemon checkpoint that did not fit)."""
        if not self.path:
            return None
        end = self.end
        return next((n for n in self.matched if n.checkpoint.end == end), None)

    @property
    def end(self) -> int:
        return self.path[-1].checkpoint.end if self.path else 0


class ExactPrefixes:
    """The exact-prefix side of a PIC planner (module docstring)."""

    def __init__(self, tree: PrefixTree, config: PicConfig) -> None:
        self.tree = tree
        self.config = config
        self.jobs: OrderedDict[tuple[int, ...], PrefixJob] = OrderedDict()
        #: idle jobs computed, and restores served (counters)
        self.computed = 0
        self.restored = 0
        #: idle passes that gave way to a request half-way (requeued)
        self.stopped = 0
        #: restored prefixes the store does not hold yet (exact_prefix_store="reused"),
        #: by prefix ids: put while idle, oldest first
        self.to_store: OrderedDict[tuple[int, ...], PrefixNode] = OrderedDict()
        #: hashes of the cacheable prefixes seen (exact_prefix_passes="repeated")
        self.seen = SeenKeys(MAX_PREFIXES_SEEN)
        #: prefixes `wants_pass` declined (seen once so far)
        self.declined = 0

    # ------------------------------------------------------------------ requests
    def match(self, ids: Sequence[int], bounds: Sequence[tuple[int, int]]) -> PrefixMatch:
        """The request's match in the tree, its usable path pinned."""
        matched = self.tree.match([tuple(ids[lo:hi]) for lo, hi in bounds])
        m = PrefixMatch(matched, usable_path(matched))
        pin(m.path)
        return m

    def find(self, ids: Sequence[int], bounds: Sequence[tuple[int, int]], store) -> Optional[PrefixMatch]:
        """The exact prefix a request restores, its path pinned; None when none is usable.
        This tree first; when it does not reach the request's deepest boundary, the
        `store`'s `find_prefix` (engine.pic.segment_store): a deeper checkpoint found there
        is restored (and kept in the tree for the next request)."""
        matched = self.tree.match([tuple(ids[lo:hi]) for lo, hi in bounds])  # `match`, inlined: per request
        path = usable_path(matched)
        local, have = None, 0
        if path:
            for n in path:
                n.pins += 1
            local, have = PrefixMatch(matched, path), path[-1].checkpoint.end
        if have >= bounds[-1][1]:  # this tree reaches the deepest boundary: nothing to ask the store
            return self._reused(store, ids, local)
        found = store.find_prefix(ids, [hi for _, hi in bounds if hi > have])
        if found is None:
            return self._reused(store, ids, local)
        cp, tier = found
        if local is not None:  # the store's is deeper: release this tree's
            unpin(local.path)
        cut = [b for b in bounds if b[1] <= cp.end]
        tip = insert_chain(self.tree, self.tree.root, ids, split_checkpoint(cp, cut))
        if tip is not None and tip.checkpoint.end == cp.end:  # the store holds this one
            tip.stored = True
        node = PrefixNode((), None, cp)  # restored from the merged object itself, whatever fit in the tree
        node.pins += 1
        return PrefixMatch(self.tree.walk([tuple(ids[lo:hi]) for lo, hi in bounds]), [node], "store", tier)

    def offer(self, store, ids: Sequence[int], tip: Optional[PrefixNode]) -> None:
        """A computed exact prefix ending at `tip` (None: none fitted in the tree): given to
        the store's `put_prefix` now (`exact_prefix_store="always"`), or kept in this tree
        only until a request restores it ("reused": `find` queues it in `to_store`)."""
        if tip is not None and not tip.stored and self.config.exact_prefix_store == "always" and store.keeps_prefixes:
            store.put_prefix(ids, tip)
            tip.stored = True

    def _reused(self, store, ids: Sequence[int], m: Optional[PrefixMatch]) -> Optional[PrefixMatch]:
        """`m` restored from this tree: its deepest node goes to `to_store` unless the store
        holds it (exact_prefix_store="reused", a store that keeps prefixes); `m` back."""
        if m is None or self.config.exact_prefix_store != "reused" or not store.keeps_prefixes:
            return m
        tip = m.path[-1]
        if not tip.stored:
            key = tuple(ids[:tip.checkpoint.end])
            self.to_store[key] = tip
            self.to_store.move_to_end(key)
            while len(self.to_store) > MAX_PREFIX_JOBS:
                self.to_store.popitem(last=False)
        return m

    def wants_pass(self, ids: Sequence[int], bounds: Sequence[tuple[int, int]]) -> bool:
        """Whether a request whose cacheable prefix (ending at `bounds[-1]`) is not exact
        yet should queue its idle pass (PicConfig.exact_prefix_passes): always under
        "all"; under "repeated" only when the same prefix was seen before (two prefixes
        sharing a hash count as one: at worst a pass too many). Records the prefix."""
        if self.config.exact_prefix_passes == "all" or not bounds:
            return True
        if self.seen.saw(hash(tuple(ids[:bounds[-1][1]]))):
            return True
        self.declined += 1
        return False

    def clear(self) -> int:
        """Forget everything but the counters (benchmarks: a cold start): the tree's
        unpinned nodes, queued jobs, prefixes waiting for the store and prefixes seen;
        how many tree nodes went."""
        self.jobs.clear()
        self.to_store.clear()
        self.seen.clear()
        return self.tree.clear()

    def queue(self, ids: Sequence[int], bounds: Sequence[tuple[int, int]]) -> bool:
        """Queue the prefix ending at `bounds[-1]` for an idle-time exact pass, unless the
        tree holds it already; True when queued."""
        if not bounds:
            return False
        end = bounds[-1][1]
        key = tuple(ids[:end])
        path = usable_path(self.tree.walk([key[lo:hi] for lo, hi in bounds]))
        if path and path[-1].checkpoint.end == end:
            return False
        self.jobs[key] = PrefixJob(key, tuple(bounds))
        self.jobs.move_to_end(key)
        while len(self.jobs) > MAX_PREFIX_JOBS:
            self.jobs.popitem(last=False)
        return True

    @property
    def pending(self) -> bool:
        return bool(self.jobs) or bool(self.to_store)

    def next_job(self) -> Optional[PrefixJob]:
        """The newest queued prefix (the one most likely asked for next), off the queue."""
        if not self.jobs:
            return None
        return self.jobs.popitem(last=True)[1]

    def forget(self, ids: Sequence[int], bounds: Sequence[tuple[int, int]]) -> int:
        """Make the prefixes of `ids` cold (benchmarks): along its path in the tree, the
        nodes no other prefix continues from go, the shared ones keep their K/V but lose
        their states (other prompts' deeper checkpoints stay usable; this one resumes
        nowhere), and its queued job goes. Nothing changes while a live request pins a
        node of the path. How many nodes went."""
        edges = [tuple(ids[lo:hi]) for lo, hi in bounds]
        self.jobs.pop(tuple(ids[:bounds[-1][1]]) if bounds else (), None)
        path = self.tree.walk(edges)
        if any(n.pins for n in path):
            return 0
        removed = 0
        for node in reversed(path):
            if node.children:
                self.tree.strip(node)
            else:
                removed += self.tree.remove(node)
        return removed

    # ------------------------------------------------------------------ passes
    def help(self, runner, store, should_stop=None) -> int:
        """Idle work: first a restored prefix the store lacks (`to_store`), put; else the
        newest queued prefix, skipped when the `store` holds it already (another engine
        computed it), else computed and offered to the store (`offer`); 1 when one was
        taken. When `should_stop()` says a request waits, nothing is started, and a pass
        under way gives way between two layers (a whole prefix's pass is a full prefill's
        length: an arriving request must not wait for it): what it computed is dropped,
        the job goes back to the queue's newest end (the next idle call starts it again)
        and 0 is returned (`stopped` counts them)."""
        if should_stop is not None and should_stop():
            return 0
        if self.to_store:  # a restored prefix the store lacks: one put (a copy on the put thread)
            ids, tip = self.to_store.popitem(last=False)
            if not tip.stored:
                store.put_prefix(ids, tip)
                tip.stored = True
            return 1
        job = self.next_job()
        if job is None:
            return 0
        if store.has_prefix(job.ids):
            return 1
        try:
            path = self.compute(runner, job, should_stop)
        except PrefixPassStopped:
            self.stopped += 1
            self.jobs[job.ids] = job
            self.jobs.move_to_end(job.ids)
            return 0
        if path:
            self.offer(store, job.ids, path[-1])
        return 1

    def fill_request(self, runner, seq, ids: Sequence[int], bounds: Sequence[tuple[int, int]], m: PrefixMatch,
                     pinned: list, all_logits: bool = False):
        """A request's cold-fallback pass: positions [seq.num_computed_tokens, len(ids))
        in context with the checkpoints of its boundaries taken inside the pass and put
        in the tree (pinned into `pinned`); the pass's logits and the new deepest node."""
        start = seq.num_computed_tokens
        todo = [b for b in bounds if b[1] > start]
        stateful = stateful_ends(self.config.prefix_checkpoints, todo, m.matched, m.path)
        logits, cps = fill_with_checkpoints(runner, seq, list(ids), todo, stateful, len(ids), self.config,
                                            all_logits)
        tip = insert_chain(self.tree, m.tree_tip if m.path else self.tree.root, ids, cps, pinned)
        return logits, tip

    def compute(self, runner, job: PrefixJob, should_stop=None) -> list[PrefixNode]:
        """Compute `job` exactly on a scratch sequence, from the deepest exact checkpoint
        the tree holds, and insert its checkpoints; the path to its deepest node with
        states ([] when it did not fit or the cache had no room for the pass).
        `should_stop()`: asked before each layer; True raises PrefixPassStopped (nothing
        inserted, the scratch sequence freed)."""
        matched = self.tree.walk([tuple(job.ids[lo:hi]) for lo, hi in job.bounds])
        path = usable_path(matched)
        if path and path[-1].checkpoint.end == job.end:
            return path
        pin(path)
        pinned: list[PrefixNode] = []
        try:
            seq = runner.cache.allocate(CacheSequence(f"exact-prefix-{self.computed}"))
        except CacheError as exc:
            unpin(path)
            log.debug("no cache slot for an exact prefix pass: %s", exc)
            return []
        try:
            if path:
                restore_checkpoints(runner.cache, seq, [n.checkpoint for n in path])
            todo = list(job.bounds[len(path):])
            stateful = stateful_ends(self.config.prefix_checkpoints, todo, matched, path)
            _, cps = fill_with_checkpoints(runner, seq, list(job.ids), todo, stateful, job.end, self.config,
                                           before_layer=None if should_stop is None else _giving_way(should_stop))
            tip = insert_chain(self.tree, path[-1] if path else self.tree.root, job.ids, cps, pinned)
        except CacheError as exc:
            log.debug("exact prefix pass of %d tokens found no room: %s", job.end, exc)
            return []
        finally:
            runner.cache.free(seq)
            unpin(path)
            unpin(pinned)
        self.computed += 1
        return usable_path(path_to(tip))


class PrefixPassStopped(Exception):
    """An idle exact-prefix pass gave way to a request between two layers."""


def _giving_way(should_stop):
    def before_layer(i: int) -> None:
        if should_stop():
            raise PrefixPassStopped(f"exact prefix pass stopped before layer {i}")
    return before_layer


def pin(nodes: Sequence[PrefixNode]) -> None:
    for n in nodes:
        n.pins += 1


def unpin(nodes: Sequence[PrefixNode]) -> None:
    for n in nodes:
        n.pins -= 1
