"""`StorePrefixPlanner`: the `prefix` baseline (engine.pic.prefix) with its checkpoints in
the kvstore daemon too, the same objects PIC's exact prefixes use
(engine.connector.prefix_store), so prefix caching gets the CPU/NVMe tiers and
cross-engine sharing.

- matching: the engine's radix tree first; when it does not reach the request's deepest
  cacheable boundary, the daemon is asked (one Lookup over the deeper boundaries) and a
  deeper checkpoint is loaded, cut at the segment boundaries and put in the tree, from
  which the request restores it as from its own;
- storing: after the request's pass, the deepest checkpoint with states on its path (if
  the pass made it) is queued for the daemon as one merged object.

`take_store_report(request_id)` says where a request's prefix came from
(`PrefixStoreReport`). Called from the engine loop's thread only, like every planner.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

import torch

from engine.connector.prefix_store import PrefixCheckpointStore
from engine.connector.store_cache import StoreSignatureCache
from engine.pic.config import PicConfig
from engine.pic.prefix import (PrefixNode, PrefixPlanner, PrefixTree, insert_chain, merge_path, path_to,
                               split_checkpoint, usable_path)
from engine.pic.report import STATE_KEY
from engine.runtime.planner import PrefillPlan
from engine.runtime.request import Request


@dataclass
class PrefixStoreReport:
    """Where one request's restored prefix came from."""

    request_id: str
    prefix_source: Optional[str] = None  # "engine" (its tree) or "store" (loaded from the daemon)
    prefix_tier: Optional[str] = None
    prefix_tokens: int = 0
    stored: bool = False  # its pass made a checkpoint queued for the daemon

    def as_dict(self) -> dict:
        return {"store_prefix_source": self.prefix_source, "store_prefix_tier": self.prefix_tier,
                "store_prefix_tokens": self.prefix_tokens, "store_prefix_stored": self.stored}


class StorePrefixPlanner(PrefixPlanner):
    """`prefix` through the kvstore daemon (module docstring)."""

    def __init__(self, config: PicConfig, tree: PrefixTree, device: torch.device, store: StoreSignatureCache,
                 checkpoints: PrefixCheckpointStore) -> None:
        super().__init__(config, tree, device)
        self.store = store
        self.checkpoints = checkpoints
        self._reports: OrderedDict[str, PrefixStoreReport] = OrderedDict()
        self._current: Optional[PrefixStoreReport] = None

    def plan(self, request: Request) -> PrefillPlan:
        self._current = PrefixStoreReport(request.request_id)
        try:
            plan = super().plan(request)
        finally:
            report, self._current = self._current, None
        state = request.planner_state[STATE_KEY]
        report.prefix_tokens = state.tip.checkpoint.end if state.tip is not None and state.tip.parent is not None \
            else 0
        if report.prefix_tokens and report.prefix_source is None:
            report.prefix_source = "engine"
        state.store_report = report
        return plan

    def _match(self, ids: list[int], bounds: list[tuple[int, int]]) -> tuple[list[PrefixNode], list[PrefixNode]]:
        matched, path = super()._match(ids, bounds)
        have = path[-1].checkpoint.end if path else 0
        deeper = [hi for _, hi in bounds if hi > have]
        found = self.checkpoints.find(ids, deeper) if deeper else None
        if found is None:
            return matched, path
        cp, tier = found
        cut = [b for b in bounds if b[1] <= cp.end]
        if insert_chain(self.tree, self.tree.root, ids, split_checkpoint(cp, cut)) is None:
            return matched, path  # it does not fit the tree: computed as a miss
        matched = self.tree.walk([tuple(ids[lo:hi]) for lo, hi in bounds])
        if self._current is not None:
            self._current.prefix_source, self._current.prefix_tier = "store", tier
        return matched, usable_path(matched)

    def _inserted(self, ids: list[int], state) -> None:
        path = usable_path(path_to(state.tip))
        report: Optional[PrefixStoreReport] = state.store_report
        restored = 0 if report is None else report.prefix_tokens
        if path and path[-1].checkpoint.end > restored:
            end = path[-1].checkpoint.end
            queued = self.checkpoints.put(list(ids[:end]), merge_path([n.checkpoint for n in path]))
            if report is not None:
                report.stored = queued

    def on_prefill_done(self, request: Request) -> None:
        state = request.planner_state.get(STATE_KEY)
        report = None if state is None else state.store_report
        super().on_prefill_done(request)
        if report is not None:
            self._reports[request.request_id] = report
            while len(self._reports) > 4096:
                self._reports.popitem(last=False)

    def take_store_report(self, request_id: str) -> Optional[PrefixStoreReport]:
        """The store report of a request whose prefill completed (returned once)."""
        return self._reports.pop(request_id, None)
