"""Which daemon-tier hits are worth loading: the measured read rate of each tier
(`TierReadRates`) and the admission policies over it (`TierAdmission`,
StoreConnectorConfig.tier_admission).

A hit saves computing its positions in context; loading it costs its bytes over the read
rate of the tier that holds it. Where the load is expected to take longer than the
compute it saves (a working set that spilled to a disk slower than the model's prefill:
the break-even read rate of tools/bench_tiered.py), the hit is better treated as a miss.

`TierReadRates` keeps, per tier, an exponential moving average of the GB/s real loads
reached (bytes over the wall time of the Get that served them, their decode and device
copy: engine.connector.loader), seeded with `SEED_GB_PER_S` until the first load of that
tier is measured. The seeds are modest guesses of what each tier reads at (a host DMA
over PCIe, a single NVMe drive), not peaks: a hit is skipped on a seed only when even a
typical drive could not beat the compute. Thread-safe (the loader and hint threads
update it, the loader thread reads it).

`TierAdmission.admit(tier, nbytes, compute_ms) -> bool` is the policy, one sentence each:
- `CostAdmission`: load a hit unless `nbytes` at the tier's read rate takes longer than
  `compute_ms`, the time computing its positions in context takes (GPU-tier hits are
  always loaded: read in place over CUDA IPC or by a peer copy, they move nothing over a
  slow bus, and what their loads measure is fixed cost, the RPCs and a first IPC open,
  not a rate a compute could beat); after `probe_every`
  hits of a tier skipped in a row it loads the next one anyway, so a tier whose estimate
  one slow load pulled down is measured again (NVMe rates are also measured by the
  background promotions of skipped hits: engine.connector.loader).
- `AlwaysAdmit`: load every hit (the behaviour without a cost model).
`compute_ms` None (the planner has no measured compute cost yet, or cannot compute a hit
in context) always admits.
"""
from __future__ import annotations

import abc
import math
import threading
from typing import Optional

#: StoreConnectorConfig.tier_admission values
TIER_ADMISSIONS = ("cost", "always")
#: read rate (GB/s) of each tier before its first measured load (module docstring)
SEED_GB_PER_S = {"gpu": 100.0, "cpu": 10.0, "nvme": 1.0}
#: loads smaller than this are not measured (their fixed costs would dominate the rate)
MIN_MEASURED_BYTES = 256 << 10
#: tiers whose hits CostAdmission always loads (read in place: module docstring)
ALWAYS_LOADED_TIERS = frozenset({"gpu"})
#: CostAdmission loads a tier's hit after this many of its hits were skipped in a row
PROBE_EVERY = 32


class TierReadRates:
    """Per-tier EWMA of measured read rates in GB/s (module docstring)."""

    def __init__(self, smoothing: float = 0.3, seeds: Optional[dict[str, float]] = None) -> None:
        if not 0.0 < smoothing <= 1.0:
            raise ValueError(f"smoothing={smoothing!r} must be in (0, 1]")
        self.smoothing = smoothing
        self._lock = threading.Lock()
        self._rate = dict(SEED_GB_PER_S if seeds is None else seeds)
        self._samples = dict.fromkeys(self._rate, 0)

    def observe(self, tier: str, nbytes: int, ms: float) -> None:
        """A load of `nbytes` from `tier` took `ms` milliseconds (wall time); ignored
        below MIN_MEASURED_BYTES or for a non-positive time."""
        if nbytes < MIN_MEASURED_BYTES or not ms > 0 or tier not in self._rate:
            return
        gbps = nbytes / (ms * 1e-3) / 1e9
        with self._lock:
            old = self._rate[tier] if self._samples[tier] else None
            self._rate[tier] = gbps if old is None else old + self.smoothing * (gbps - old)
            self._samples[tier] += 1

    def set(self, tier: str, gb_per_s: float) -> None:
        """Replace `tier`'s estimate by `gb_per_s` as if measured (operators, tests);
        later loads move it again."""
        if tier not in self._rate:
            raise ValueError(f"tier={tier!r} must be one of {', '.join(self._rate)}")
        if not (isinstance(gb_per_s, (int, float)) and math.isfinite(gb_per_s) and gb_per_s > 0):
            raise ValueError(f"gb_per_s={gb_per_s!r} must be a finite number > 0")
        with self._lock:
            self._rate[tier] = float(gb_per_s)
            self._samples[tier] = max(1, self._samples[tier])

    def gb_per_s(self, tier: str) -> float:
        """The current estimate for `tier` (its seed before any measured load)."""
        with self._lock:
            return self._rate.get(tier, SEED_GB_PER_S["nvme"])

    def load_ms(self, tier: str, nbytes: int) -> float:
        """Expected milliseconds to load `nbytes` from `tier`."""
        return nbytes / (self.gb_per_s(tier) * 1e9) * 1e3

    def snapshot(self) -> dict:
        with self._lock:
            return {"gb_per_s": {t: round(v, 3) for t, v in self._rate.items()}, "measured_loads": dict(self._samples)}


class TierAdmission(abc.ABC):
    """Whether a hit of `nbytes` in `tier` is loaded (module docstring)."""

    @abc.abstractmethod
    def admit(self, tier: str, nbytes: int, compute_ms: Optional[float]) -> bool:
        """True: load the hit; False: treat it as a miss (computed in context)."""


class AlwaysAdmit(TierAdmission):
    """Load every hit."""

    def admit(self, tier: str, nbytes: int, compute_ms: Optional[float]) -> bool:
        return True


class CostAdmission(TierAdmission):
    """Load a hit unless its expected load time exceeds the compute it saves."""

    def __init__(self, rates: TierReadRates, probe_every: int = PROBE_EVERY) -> None:
        if not isinstance(probe_every, int) or probe_every < 1:
            raise ValueError(f"probe_every={probe_every!r} must be an int >= 1")
        self.rates = rates
        self.probe_every = probe_every
        self._lock = threading.Lock()
        self._skipped_in_a_row: dict[str, int] = {}

    def admit(self, tier: str, nbytes: int, compute_ms: Optional[float]) -> bool:
        if compute_ms is None or tier in ALWAYS_LOADED_TIERS or self.rates.load_ms(tier, nbytes) <= compute_ms:
            return True
        with self._lock:
            n = self._skipped_in_a_row.get(tier, 0) + 1
            probe = n > self.probe_every
            self._skipped_in_a_row[tier] = 0 if probe else n
        return probe


def make_admission(name: str, rates: TierReadRates) -> TierAdmission:
    """The policy of StoreConnectorConfig.tier_admission `name`."""
    if name == "cost":
        return CostAdmission(rates)
    if name == "always":
        return AlwaysAdmit()
    raise ValueError(f"tier_admission={name!r} must be one of {', '.join(TIER_ADMISSIONS)}")
