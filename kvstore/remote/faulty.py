"""A fault-injecting remote adapter, so every layer above the remote tier can be tested
for failure (the remote counterpart of kvstore.tiers.faulty).

Owns: `RemoteFaults` (the switches a test flips while the adapter runs) and
`FaultyAdapter`, a `BlockingAdapter` that forwards each blocking call to an inner one
(composition) after applying the faults: `down` (every call fails as UNREACHABLE and the
probe fails: a master that is away), `delay_s` (a slow store: each call sleeps first),
`fail_gets` / `fail_puts` (calls fail with FAILED), `corrupt_gets` (a get that succeeded
has one byte flipped a third of the way into the object: in the payload of any object
over twice its envelope trailer, as a damaged replica would; the inner get then reports
no progress through `GetItem.landed`, so the reader hashes the flipped byte),
`truncate_puts` (a put writes its object short by this many bytes: what a broken or
foreign writer might leave).
`injected` counts what was injected.
"""

from __future__ import annotations

import ctypes
import dataclasses
import time
from collections import Counter
from dataclasses import dataclass
from typing import Sequence

from kvstore.remote.base import FAILED, UNREACHABLE, BlockingAdapter, GetItem, PutItem


@dataclass
class RemoteFaults:
    """What to inject (mutable: tests change it while the adapter runs)."""

    down: bool = False
    delay_s: float = 0.0
    fail_gets: bool = False
    fail_puts: bool = False
    corrupt_gets: bool = False
    truncate_puts: int = 0


class FaultyAdapter(BlockingAdapter):
    """`inner`'s blocking calls with `faults` applied (module docstring)."""

    def __init__(self, inner: BlockingAdapter, faults: RemoteFaults | None = None, workers: int = 4,
                 probe_interval_s: float = 0.05) -> None:
        super().__init__(workers=workers, probe_interval_s=probe_interval_s)
        self.inner = inner
        self.namespace = inner.namespace
        self.kind = f"faulty({inner.kind})"
        self.faults = faults if faults is not None else RemoteFaults()
        self.injected: Counter = Counter()

    def _enter(self, n: int) -> list[int] | None:
        f = self.faults
        if f.delay_s > 0:
            self.injected["delays"] += 1
            time.sleep(f.delay_s)
        if f.down:
            self.injected["unreachable"] += 1
            return [UNREACHABLE] * n
        return None

    def stat_now(self, names: Sequence[str]) -> list[int]:
        return self._enter(len(names)) or self.inner.stat_now(names)

    def get_now(self, items: Sequence[GetItem]) -> list[int]:
        down = self._enter(len(items))
        if down:
            return down
        if self.faults.fail_gets:
            self.injected["failed_gets"] += 1
            return [FAILED] * len(items)
        corrupt = self.faults.corrupt_gets
        if corrupt:  # the flip models a damaged replica: the inner get must not report bytes before it
            items = [dataclasses.replace(it, landed=None) for it in items]
        codes = self.inner.get_now(items)
        if corrupt:
            for it, c in zip(items, codes):
                if c > 0:
                    at = c // 3  # the byte to flip, as an offset into the object's ranges
                    for addr, n in it.ranges:
                        if at < n:
                            ctypes.c_uint8.from_address(addr + at).value ^= 0x5A
                            self.injected["corrupted_gets"] += 1
                            break
                        at -= n
        return codes

    def put_now(self, items: Sequence[PutItem]) -> list[int]:
        down = self._enter(len(items))
        if down:
            return down
        if self.faults.fail_puts:
            self.injected["failed_puts"] += 1
            return [FAILED] * len(items)
        cut = self.faults.truncate_puts
        if cut > 0:
            short = []
            for it in items:
                addr, n = it.ranges[-1]
                short.append(PutItem(it.name, (*it.ranges[:-1], (addr, max(0, n - cut)))))
                self.injected["truncated_puts"] += 1
            self.inner.put_now(short)
            return [it.size for it in items]  # the writer believes it wrote everything
        return self.inner.put_now(items)

    def remove_now(self, names: Sequence[str]) -> list[int]:
        return self._enter(len(names)) or self.inner.remove_now(names)

    def probe_now(self) -> bool:
        if self.faults.delay_s > 0:
            time.sleep(self.faults.delay_s)  # a slow store answers its probe slowly too
        return not self.faults.down and self.inner.probe_now()

    def stats(self) -> dict:
        return {**super().stats(), "injected": dict(self.injected)}

    def close(self) -> None:
        super().close()
        self.inner.close()
