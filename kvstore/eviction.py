"""Eviction policies: which unpinned objects leave a tier when it needs room.

A policy is one method, `choose_victims`, and holds no state of its own: the Store hands
it the tier's evictable objects (never leased, reserved or busy ones) and how many bytes
it must free, and gets back keys in the order to evict them. What eviction means (demote
to the next tier down, or drop from the bottom tier) is the Store's business.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Sequence

from kvstore.errors import InvalidRequest


@dataclass(frozen=True)
class Candidate:
    """What a policy may weigh about one evictable object."""

    key: bytes
    size: int
    cost: float  # seconds of recompute a hit on it saves (putter's estimate; 0 = unknown)
    last_access: float  # time of the last get or put (any monotone clock)
    hits: int = 0


class EvictionPolicy(ABC):
    """Chooses victims in a tier that must free bytes."""

    name: str = ""

    @abstractmethod
    def choose_victims(self, candidates: Sequence[Candidate], bytes_needed: int) -> list[bytes]:
        """Keys of candidates to evict, in order, whose sizes add up to at least
        `bytes_needed` (all candidates, in order, when they do not add up to that)."""


def _take(ordered: list[tuple[float, int, Candidate]], bytes_needed: int) -> list[bytes]:
    heapq.heapify(ordered)
    out, freed = [], 0
    while ordered and freed < bytes_needed:
        _, _, c = heapq.heappop(ordered)
        out.append(c.key)
        freed += c.size
    return out


class LruPolicy(EvictionPolicy):
    """Evict the least recently used object first."""

    name = "lru"

    def choose_victims(self, candidates: Sequence[Candidate], bytes_needed: int) -> list[bytes]:
        return _take([(c.last_access, i, c) for i, c in enumerate(candidates)], bytes_needed)


class CostAwarePolicy(EvictionPolicy):
    """Evict the object with the lowest recency + alpha * (recompute cost saved per byte)
    first, both terms scaled to [0, 1] over the candidates (Marconi-style utility)."""

    name = "cost"

    def __init__(self, alpha: float = 1.0) -> None:
        if alpha < 0:
            raise InvalidRequest(f"cost-aware alpha must be >= 0, got {alpha}")
        self.alpha = alpha

    def choose_victims(self, candidates: Sequence[Candidate], bytes_needed: int) -> list[bytes]:
        if not candidates:
            return []
        t_min = min(c.last_access for c in candidates)
        t_span = max(c.last_access for c in candidates) - t_min
        densities = [max(c.cost, 0.0) / max(c.size, 1) for c in candidates]
        d_max = max(densities)
        scored = []
        for i, (c, d) in enumerate(zip(candidates, densities)):
            recency = (c.last_access - t_min) / t_span if t_span > 0 else 1.0
            value = d / d_max if d_max > 0 else 0.0
            scored.append((recency + self.alpha * value, i, c))
        return _take(scored, bytes_needed)


POLICIES = {"lru": LruPolicy, "cost": CostAwarePolicy}


def make_policy(name: str) -> EvictionPolicy:
    """The policy registered under `name` ("lru" or "cost")."""
    try:
        return POLICIES[name]()
    except KeyError:
        raise InvalidRequest(f"unknown eviction policy {name!r}; choose from {sorted(POLICIES)}") from None
