"""What else ran on the host while one timed request was in flight (tools.servebench.
harness `run_alone`): evidence for a TTFT that is slower as a whole, not in one step.

A request alone on an idle engine is host-bound on a GPU at a prefix hit (a few dozen
tokens computed: the time is kernel launches and Python). When every part of such a
request (the pure-Python lookup as much as the restore and the forward) is slower by
the same factor in one method's runs, the cause is not that method's work but the
host it ran on: another thread of this process holding the GIL, another process on the
request thread's core, a garbage collection. `HostUsage` records, around one request:

- `main_cpu_ms`: CPU time of the calling (request) thread (`time.thread_time`), beside
  `wall_ms`: a request thread that was runnable but not running (GIL, a busy core)
  shows as CPU time below its host-bound wall time;
- `other_threads_cpu_ms`: CPU time of every other thread of this process that used
  any, by thread name (/proc/self/task; Linux only, else empty; a thread that ended
  before the request did is not seen): a put, loader or keepalive thread busy during
  the request;
- `processes_cpu_ms`: CPU time of the processes named in `pids` (e.g. the kvstore
  daemon), by name;
- `gc_collections` / `gc_ms`: Python garbage collections during the request and their
  time (gc.callbacks).

The readings are taken before the request is added and after its first token (outside
its TTFT), except the gc callback, which runs inside it (a few microseconds a
collection). /proc counts in clock ticks (10 ms on most kernels): a thread's figure is
exact over many requests, coarse for one. Not thread-safe: one `HostUsage` per request,
started and stopped on the request thread.
"""
from __future__ import annotations

import gc
import os
import threading
import time
from typing import Mapping, Optional

_TICK_MS = 1e3 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 10.0


def _cpu_ticks(stat_path: str) -> Optional[int]:
    """utime + stime of a /proc stat file, None when it cannot be read."""
    try:
        with open(stat_path) as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[11]) + int(fields[12])


def thread_ticks() -> dict[tuple[int, str], int]:
    """CPU ticks of each thread of this process, by (kernel thread id, name): the Python
    thread's name where it is one, else the kernel's (threads of native libraries); {}
    off Linux."""
    out: dict[tuple[int, str], int] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    for tid in tids:
        ticks = _cpu_ticks(f"/proc/self/task/{tid}/stat")
        if ticks is None:
            continue
        name = names.get(int(tid))
        if name is None:
            try:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    name = f.read().strip()
            except OSError:
                name = "?"
        out[(int(tid), name)] = ticks
    return out


class HostUsage:
    """Host usage around one request (module docstring): `start()`, run it, `stop()`
    (returns the figures, also kept in `result`). `pids`: other processes to account, by
    name."""

    def __init__(self, pids: Optional[Mapping[str, int]] = None) -> None:
        self.pids = dict(pids or {})
        self.result: dict = {}
        self._gc_ms = 0.0
        self._gc_n = 0
        self._gc_t0 = 0.0

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        else:
            self._gc_n += 1
            self._gc_ms += (time.perf_counter() - self._gc_t0) * 1e3

    def start(self) -> "HostUsage":
        self._main = threading.get_native_id()
        self._threads0 = thread_ticks()
        self._procs0 = {n: _cpu_ticks(f"/proc/{p}/stat") for n, p in self.pids.items()}
        gc.callbacks.append(self._on_gc)
        self._cpu0 = time.thread_time()
        self._wall0 = time.perf_counter()
        return self

    def stop(self) -> dict:
        wall = (time.perf_counter() - self._wall0) * 1e3
        cpu = (time.thread_time() - self._cpu0) * 1e3
        gc.callbacks.remove(self._on_gc)
        threads1 = thread_ticks()
        others: dict[str, float] = {}
        for key, ticks in threads1.items():
            if key[0] == self._main:
                continue
            used = ticks - self._threads0.get(key, 0)
            if used > 0:
                others[key[1]] = others.get(key[1], 0.0) + used * _TICK_MS
        procs = {}
        for name, pid in self.pids.items():
            t0, t1 = self._procs0.get(name), _cpu_ticks(f"/proc/{pid}/stat")
            if t0 is not None and t1 is not None:
                procs[name] = (t1 - t0) * _TICK_MS
        self.result = {"wall_ms": round(wall, 3), "main_cpu_ms": round(cpu, 3),
                       "other_threads_cpu_ms": {k: round(v, 3) for k, v in sorted(others.items())},
                       "processes_cpu_ms": {k: round(v, 3) for k, v in procs.items()},
                       "gc_collections": self._gc_n, "gc_ms": round(self._gc_ms, 3)}
        return self.result


def mean_host(rows: list[dict]) -> dict:
    """Means over requests' `HostUsage` results: main_cpu_ms, wall_ms, gc_ms, gc
    collections, and each other thread's / process's CPU ms (0 where a request had none)."""
    rows = [r for r in rows if r]
    if not rows:
        return {}
    n = len(rows)
    out = {k: round(sum(r.get(k, 0.0) for r in rows) / n, 3) for k in ("wall_ms", "main_cpu_ms", "gc_ms",
                                                                       "gc_collections")}
    for field in ("other_threads_cpu_ms", "processes_cpu_ms"):
        names = sorted({name for r in rows for name in r.get(field, {})})
        out[field] = {name: round(sum(r.get(field, {}).get(name, 0.0) for r in rows) / n, 3) for name in names}
    return out
