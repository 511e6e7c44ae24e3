"""The tier registry: which storage tiers exist, in which order, what each can do, and
how each is built from the Store's settings.

Tier names ("gpu", "cpu", "nvme") are data here: the CLI flags, JSON fields, proto enums
and metrics labels spell them, and this table is the one place that lists them. The
Store, Placement and WriteBack never test a tier's name; they ask for a *role* of the
enabled tiers (`TierRoles`):

- order: fastest first; making room demotes an object to the next enabled tier down and
  drops it from the bottom one.
- `memory`: the fastest enabled host-mapped tier (the CPU shared-memory arena). Durable
  hits are promoted into it, remote hits land in it, write-back gives its objects
  durable backing copies.
- `durable`: the enabled tier whose sealed slots survive a restart (NVMe files). The
  index records its objects and backing copies; open rebuilds it from the index.

Capabilities: `host_mapped` (clients map the bytes in host memory), `device` (the bytes
live on an accelerator; clients reach them through CUDA IPC), `durable` (sealed slots
survive a restart). Each spec names the StoreSettings field that gives its capacity
(0: tier off) and a builder; builders import their tier class when called, so reading
the registry (the client, the CLI, the config registry) does not import torch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional

from kvstore.errors import InvalidRequest

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TierSpec:
    """One kind of tier: its name, capabilities, and how settings build it."""

    name: str
    capacity_setting: str  # the StoreSettings field giving its bytes (0: not enabled)
    host_mapped: bool
    device: bool
    durable: bool
    # (settings, cache directory) -> an unopened tier, or None when the machine cannot
    # have it (a warning says why)
    build: Callable[[Any, Path], Any]

    def capacity(self, settings: Any) -> int:
        return int(getattr(settings, self.capacity_setting))


@dataclass(frozen=True)
class TierRoles:
    """What the enabled tiers are for (module docstring); None: no such tier enabled."""

    order: tuple[str, ...]  # enabled tiers, fastest first
    memory: Optional[str]
    durable: Optional[str]

    def below(self, name: str) -> Optional[str]:
        """The next enabled tier down from `name` (None at the bottom)."""
        i = self.order.index(name)
        return self.order[i + 1] if i + 1 < len(self.order) else None

    @property
    def can_write_back(self) -> bool:
        """A memory tier and a durable tier: write-back and promotions have both ends."""
        return self.memory is not None and self.durable is not None


class TierRegistry:
    """An ordered table of TierSpecs (fastest first)."""

    def __init__(self, specs: Iterable[TierSpec]) -> None:
        self._specs = tuple(specs)
        self.names: tuple[str, ...] = tuple(s.name for s in self._specs)
        self._by_name = {s.name: s for s in self._specs}

    def __iter__(self) -> Iterator[TierSpec]:
        return iter(self._specs)

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def spec(self, name: str) -> TierSpec:
        return self._by_name[self.check(name)]

    def check(self, name: str, what: str = "tier") -> str:
        """`name` when it is a known tier, else InvalidRequest naming the choices."""
        if name not in self._by_name:
            raise InvalidRequest(f"unknown {what} {name!r}; choose from {', '.join(self.names)}")
        return name

    def rank(self, name: str) -> int:
        """0 for the fastest tier, counting down the order."""
        return self.names.index(self.check(name))

    def capacities(self, settings: Any) -> list[tuple[str, int]]:
        """(name, configured bytes) of every tier, fastest first."""
        return [(s.name, s.capacity(settings)) for s in self._specs]

    def enabled(self, settings: Any) -> tuple[str, ...]:
        """Names of the tiers `settings` gives a capacity, fastest first."""
        return tuple(name for name, cap in self.capacities(settings) if cap > 0)

    def build(self, settings: Any, root: Path) -> list[Any]:
        """Unopened tiers for every tier `settings` gives a capacity and the machine can
        have, fastest first."""
        out = []
        for s in self._specs:
            if s.capacity(settings) > 0:
                tier = s.build(settings, root)
                if tier is not None:
                    out.append(tier)
        return out

    def roles(self, enabled: Iterable[str]) -> TierRoles:
        """The roles of the enabled tiers `enabled` (any order; unknown names refused)."""
        have = set(enabled)
        for name in have:
            self.check(name)
        order = tuple(n for n in self.names if n in have)
        memory = next((n for n in order if self._by_name[n].host_mapped), None)
        durable = next((n for n in order if self._by_name[n].durable), None)
        return TierRoles(order, memory, durable)


def _build_gpu(settings: Any, root: Path) -> Any:
    import torch

    if not torch.cuda.is_available():
        log.warning("gpu capacity %d requested but CUDA is not available: no gpu tier", settings.gpu_capacity)
        return None
    from kvstore.tiers.gpu_arena import GpuArena

    return GpuArena(settings.gpu_capacity)


def _build_cpu(settings: Any, root: Path) -> Any:
    from kvstore.tiers.cpu_arena import CpuArena

    return CpuArena(settings.cpu_capacity, settings.shm_name, mode=settings.arena_mode)


def _build_nvme(settings: Any, root: Path) -> Any:
    from kvstore.tiers.nvme import NvmeTier

    return NvmeTier(root / "objects", settings.nvme_capacity)


TIERS = TierRegistry((
    TierSpec("gpu", "gpu_capacity", host_mapped=False, device=True, durable=False, build=_build_gpu),
    TierSpec("cpu", "cpu_capacity", host_mapped=True, device=False, durable=False, build=_build_cpu),
    TierSpec("nvme", "nvme_capacity", host_mapped=False, device=False, durable=True, build=_build_nvme),
))
