"""An in-process remote store: a `BlockingAdapter` over a dict, for tests and for
reasoning about the remote tier without a Mooncake cluster.

Owns: `MemoryAdapter` and its shared backing `MemoryRemote` (several adapters over one
`MemoryRemote` act as several hosts on one cluster). It keeps the adapter contract: an
object appears whole once its put returned, never half-written.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Sequence

from kvstore.remote.base import NOT_FOUND, BlockingAdapter, GetItem, PutItem


class MemoryRemote:
    """The objects of one in-memory cluster (name -> bytes), shared by its adapters."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.lock = threading.Lock()


def _read(ranges: Sequence[tuple[int, int]]) -> bytes:
    return b"".join(ctypes.string_at(addr, n) for addr, n in ranges)


class MemoryAdapter(BlockingAdapter):
    """A remote tier held in this process's memory (module docstring)."""

    kind = "memory"

    def __init__(self, remote: MemoryRemote | None = None, workers: int = 2, probe_interval_s: float = 0.05) -> None:
        super().__init__(workers=workers, probe_interval_s=probe_interval_s)
        self.remote = remote if remote is not None else MemoryRemote()

    def stat_now(self, names: Sequence[str]) -> list[int]:
        with self.remote.lock:
            return [len(self.remote.objects[n]) if n in self.remote.objects else NOT_FOUND for n in names]

    def get_now(self, items: Sequence[GetItem]) -> list[int]:
        out: list[int] = []
        for it in items:
            with self.remote.lock:
                data = self.remote.objects.get(it.name)
            if data is None:
                out.append(NOT_FOUND)
                continue
            if len(data) != it.size:
                out.append(-600)  # Mooncake answers a size mismatch with an error, not a partial read
                continue
            pos = 0
            for addr, n in it.ranges:
                ctypes.memmove(addr, data[pos:pos + n], n)
                pos += n
            out.append(len(data))
        return out

    def put_now(self, items: Sequence[PutItem]) -> list[int]:
        out: list[int] = []
        for it in items:
            data = _read(it.ranges)  # copied whole first: the object appears complete or not at all
            with self.remote.lock:
                self.remote.objects[it.name] = data
            out.append(len(data))
        return out

    def remove_now(self, names: Sequence[str]) -> list[int]:
        with self.remote.lock:
            return [0 if self.remote.objects.pop(n, None) is not None else NOT_FOUND for n in names]

    def probe_now(self) -> bool:
        return True
