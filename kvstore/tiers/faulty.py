"""A fault-injecting tier wrapper for reliability tests.

`FaultyTier(inner)` forwards every call to `inner` and, when armed, makes chosen calls
fail the way a real medium fails: `fail("write_from", times=2)` makes the next two
`write_from` calls raise StorageError (before touching the inner tier, so nothing was
written); `corrupt_next_writes(n)` lets the next n writes through and then flips one byte
of each written slot; `corrupt(slot)` flips a byte of an existing slot; `delay_s` sleeps
before every data operation. Each injected failure is counted in `injected`.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any, Optional

import torch

from kvstore.errors import InvalidRequest, StorageError
from kvstore.objheader import ObjectHeader
from kvstore.records import Region
from kvstore.tiers.base import Slot, Tier

FAULTABLE = ("allocate", "seal", "read_into", "write_from", "checksum")


class FaultyTier(Tier):
    """Wraps a tier and injects failures on demand (see the module docstring)."""

    def __init__(self, inner: Tier, delay_s: float = 0.0) -> None:
        self.inner = inner
        self.name = inner.name
        self.durable = inner.durable
        self.delay_s = delay_s
        self._armed: Counter[str] = Counter()
        self._corrupt_writes = 0
        self.injected: Counter[str] = Counter()
        self._lock = threading.Lock()

    # -- arming ----------------------------------------------------------------------
    def fail(self, op: str, times: int = 1) -> None:
        """Make the next `times` calls of `op` (one of FAULTABLE) raise StorageError."""
        if op not in FAULTABLE:
            raise InvalidRequest(f"cannot inject faults into {op!r}; choose from {FAULTABLE}")
        with self._lock:
            self._armed[op] += times

    def corrupt_next_writes(self, n: int = 1) -> None:
        """Let the next `n` write_from calls succeed, then flip a byte of each slot."""
        with self._lock:
            self._corrupt_writes += n

    def corrupt(self, slot: Slot, at: Optional[int] = None) -> None:
        """Flip one byte of `slot` (at `at`, default the middle) in the inner tier."""
        pos = slot.size // 2 if at is None else at
        buf = torch.empty(slot.size, dtype=torch.uint8)
        self.inner.read_into(slot, buf)
        buf[pos] ^= 0xFF
        self.inner.write_from(slot, buf)

    def disarm(self) -> None:
        with self._lock:
            self._armed.clear()
            self._corrupt_writes = 0

    def _maybe_fail(self, op: str, what: Any) -> None:
        if self.delay_s:
            time.sleep(self.delay_s)
        with self._lock:
            if self._armed[op] <= 0:
                return
            self._armed[op] -= 1
            self.injected[op] += 1
        raise StorageError(f"injected fault: {self.name}.{op} of {what}")

    # -- Tier interface --------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self.inner.capacity

    @property
    def used_bytes(self) -> int:
        return self.inner.used_bytes

    def open(self) -> None:
        self.inner.open()

    def close(self) -> None:
        self.inner.close()

    def allocate(self, size: int, name: str) -> Optional[Slot]:
        self._maybe_fail("allocate", f"{size} bytes")
        return self.inner.allocate(size, name)

    def free(self, slot: Slot) -> None:
        self.inner.free(slot)

    def seal(self, slot: Slot, name: str, header: Optional[ObjectHeader] = None) -> Slot:
        self._maybe_fail("seal", slot)
        return self.inner.seal(slot, name, header)

    def retire(self, slot: Slot) -> None:
        self.inner.retire(slot)

    def free_bytes(self) -> int:
        return self.inner.free_bytes()

    def region(self, slot: Slot) -> Region:
        return self.inner.region(slot)

    def view(self, slot: Slot) -> Optional[torch.Tensor]:
        return self.inner.view(slot)

    def read_into(self, slot: Slot, dst: torch.Tensor) -> None:
        self._maybe_fail("read_into", slot)
        self.inner.read_into(slot, dst)

    def write_from(self, slot: Slot, src: torch.Tensor) -> None:
        self._maybe_fail("write_from", slot)
        self.inner.write_from(slot, src)
        with self._lock:
            corrupt = self._corrupt_writes > 0
            if corrupt:
                self._corrupt_writes -= 1
                self.injected["corrupt_write"] += 1
        if corrupt:
            self.corrupt(slot)

    def read_into_hashed(self, slot: Slot, dst: torch.Tensor) -> int:
        self._maybe_fail("read_into", slot)
        return self.inner.read_into_hashed(slot, dst)

    def checksum(self, slot: Slot) -> int:
        self._maybe_fail("checksum", slot)
        return self.inner.checksum(slot)

    def list_sealed(self) -> list[Slot]:
        return self.inner.list_sealed()

    def adopt(self, slot: Slot) -> None:
        self.inner.adopt(slot)

    def discard_unsealed(self) -> int:
        return self.inner.discard_unsealed()

    def stats(self) -> dict[str, Any]:
        return {**self.inner.stats(), "injected_faults": dict(self.injected)}
