"""Which committed objects the daemon writes to the remote tier.

Owns: `RemotePolicy` (one method: `should_write`) and its three forms, chosen by the
`remote_policy` setting: `all` (every committed object), `none` (read the remote tier,
never write it) and `cost:SECONDS` (objects whose recorded recompute cost, `meta.cost`,
is at least SECONDS: cheap segments are recomputed rather than shipped).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

from kvstore.records import ObjectMeta
from kvstore.remote.base import RemoteConfigError

POLICY_FORMS = "all | none | cost:SECONDS"


class RemotePolicy(ABC):
    """Decides, per committed object, whether it is written to the remote tier."""

    name: str

    @abstractmethod
    def should_write(self, size: int, meta: ObjectMeta) -> bool:
        """True when the object of `size` bytes with `meta` goes to the remote tier."""


@dataclass(frozen=True)
class WriteAll(RemotePolicy):
    """Every committed object is written to the remote tier."""

    name: str = "all"

    def should_write(self, size: int, meta: ObjectMeta) -> bool:
        return True


@dataclass(frozen=True)
class WriteNone(RemotePolicy):
    """Nothing is written: the daemon only reads what other hosts wrote."""

    name: str = "none"

    def should_write(self, size: int, meta: ObjectMeta) -> bool:
        return False


@dataclass(frozen=True)
class CostThreshold(RemotePolicy):
    """Objects whose recompute cost (`meta.cost`, seconds) is at least `min_cost_s`."""

    min_cost_s: float = 0.0
    name: str = "cost"

    def should_write(self, size: int, meta: ObjectMeta) -> bool:
        return meta.cost >= self.min_cost_s


def parse_policy(text: str) -> RemotePolicy:
    """A policy from its setting (`all`, `none`, `cost:SECONDS`); RemoteConfigError naming it."""
    t = str(text).strip().lower()
    if t == "all":
        return WriteAll()
    if t == "none":
        return WriteNone()
    if t.startswith("cost:"):
        try:
            v = float(t[5:])
        except ValueError:
            v = math.nan
        if not math.isfinite(v) or v < 0:
            raise RemoteConfigError(f"remote_policy {text!r}: cost:SECONDS needs a number >= 0, e.g. cost:0.05")
        return CostThreshold(v)
    raise RemoteConfigError(f"remote_policy {text!r} is not one of {POLICY_FORMS}")
