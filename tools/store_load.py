"""Mixed-operation load on a running kvstore daemon, verifying every byte it reads.

N client processes share one key space whose bytes are a pure function of the key (so
any reader can check any object), for a bounded time, each running a random mix of put,
get, get_many, lookup, delete, prefetch, evict, wait_for and stats. Sized so the key
space does not fit the tiers: puts keep evicting. Counted: operations (per kind),
objects read and verified, wrong bytes (an object whose bytes are not its key's), and
errors (any kvstore error other than a tier refusing room under pressure).

    python -m tools.store_load --socket S [--processes 8] [--seconds 10] [--keys 400]

prints one JSON object (LoadResult). tests/kvstore/test_load.py runs a short version.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

KEY_PREFIX = b"load-"
MAX_ERRORS_KEPT = 5

# (operation, weight)
MIX = (("get", 30), ("put", 25), ("get_many", 10), ("lookup", 10), ("delete", 5), ("prefetch", 5),
       ("wait_for", 4), ("stats", 5), ("evict", 1))


def key_of(i: int) -> bytes:
    return KEY_PREFIX + b"%06d" % i


def size_of(i: int) -> int:
    return 1024 * (1 + (i * 7919) % 96)  # 1..96 KiB


def content(i: int) -> bytes:
    """The bytes of key i: blake2b in counter mode (every byte depends on the key)."""
    n = size_of(i)
    out = bytearray()
    block = 0
    while len(out) < n:
        out += hashlib.blake2b(b"%d:%d" % (i, block), digest_size=64).digest()
        block += 1
    return bytes(out[:n])


@dataclass
class LoadResult:
    processes: int
    seconds: float
    keys: int
    operations: int = 0
    by_op: dict[str, int] = field(default_factory=dict)
    objects_verified: int = 0
    wrong_bytes: int = 0
    errors: int = 0
    refused: int = 0  # CapacityExhausted: a tier could not make room (every object pinned)
    error_samples: list[str] = field(default_factory=list)

    def add(self, other: dict[str, Any]) -> None:
        self.operations += other["operations"]
        self.by_op = dict(Counter(self.by_op) + Counter(other["by_op"]))
        self.objects_verified += other["objects_verified"]
        self.wrong_bytes += other["wrong_bytes"]
        self.errors += other["errors"]
        self.refused += other["refused"]
        self.error_samples = (self.error_samples + other["error_samples"])[:MAX_ERRORS_KEPT]


def _check(view: Any, i: int, tally: dict[str, Any]) -> None:
    with view:
        if view.tobytes() == content(i):
            tally["objects_verified"] += 1
        else:
            tally["wrong_bytes"] += 1
            tally["error_samples"].append(f"wrong bytes for {key_of(i)!r}")


def worker(socket: str, seed: int, seconds: float, keys: int, out: Any) -> None:
    """One client process: random operations for `seconds`; puts its tally on `out`."""
    from kvstore.client import KVStoreClient
    from kvstore.errors import CapacityExhausted, KVStoreError

    rng = random.Random(seed)
    ops, weights = zip(*MIX)
    tally: dict[str, Any] = {"operations": 0, "by_op": Counter(), "objects_verified": 0, "wrong_bytes": 0,
                             "errors": 0, "refused": 0, "error_samples": []}
    with KVStoreClient(socket=socket, client_id=f"load-{seed}") as kv:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            op = rng.choices(ops, weights)[0]
            i = rng.randrange(keys)
            try:
                if op == "get":
                    view = kv.get_many([key_of(i)], promote=rng.random() < 0.7)[0]
                    if view is not None:
                        _check(view, i, tally)
                elif op == "get_many":
                    idx = rng.sample(range(keys), 4)
                    for j, view in zip(idx, kv.get_many([key_of(j) for j in idx])):
                        if view is not None:
                            _check(view, j, tally)
                elif op == "put":
                    kv.put(key_of(i), content(i), tier=rng.choice(("cpu", "cpu", "nvme")), cost=rng.random())
                elif op == "lookup":
                    for j, e in zip(range(i, i + 8), kv.lookup([key_of(j % keys) for j in range(i, i + 8)])):
                        if e.hit and e.size != size_of(j % keys):
                            tally["wrong_bytes"] += 1
                            tally["error_samples"].append(f"lookup size {e.size} for {key_of(j % keys)!r}")
                elif op == "delete":
                    kv.delete([key_of(i)])
                elif op == "prefetch":
                    kv.prefetch([key_of(i)], "cpu")
                elif op == "wait_for":
                    kv.wait_for(key_of(i), 0.05)
                elif op == "stats":
                    kv.stats()
                elif op == "evict":
                    kv.evict("cpu")
                tally["operations"] += 1
                tally["by_op"][op] += 1
            except CapacityExhausted:
                tally["refused"] += 1
                tally["operations"] += 1
                tally["by_op"][op] += 1
            except KVStoreError as exc:
                tally["errors"] += 1
                tally["error_samples"].append(f"{op}: {type(exc).__name__}: {exc}"[:300])
    tally["by_op"] = dict(tally["by_op"])
    tally["error_samples"] = tally["error_samples"][:MAX_ERRORS_KEPT]
    out.put(tally)


def run_load(socket: str, processes: int = 8, seconds: float = 10.0, keys: int = 400, seed: int = 0) -> LoadResult:
    """Run `processes` workers against the daemon at `socket`; their summed tally."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(str(socket), seed * 1000 + n, seconds, keys, out), daemon=True)
             for n in range(processes)]
    for p in procs:
        p.start()
    result = LoadResult(processes=processes, seconds=seconds, keys=keys)
    deadline = time.monotonic() + seconds + 120
    for _ in procs:
        result.add(out.get(timeout=max(1.0, deadline - time.monotonic())))
    for p in procs:
        p.join(30)
        if p.exitcode != 0:
            result.errors += 1
            result.error_samples.append(f"worker {p.pid} exited with {p.exitcode}")
    return result


def verify_all(socket: str, keys: int) -> tuple[int, int]:
    """(objects present and verified, wrong) over the whole key space, after a load."""
    from kvstore.client import KVStoreClient

    ok = wrong = 0
    with KVStoreClient(socket=socket) as kv:
        for start in range(0, keys, 32):
            idx = list(range(start, min(keys, start + 32)))
            for i, view in zip(idx, kv.get_many([key_of(i) for i in idx], promote=False)):
                if view is None:
                    continue
                with view:
                    if view.tobytes() == content(i):
                        ok += 1
                    else:
                        wrong += 1
    return ok, wrong


def main(argv: Any = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--socket", required=True)
    ap.add_argument("--processes", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--keys", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    res = run_load(a.socket, a.processes, a.seconds, a.keys, a.seed)
    ok, wrong = verify_all(a.socket, a.keys)
    print(json.dumps({**asdict(res), "final_verified": ok, "final_wrong": wrong}, indent=2, sort_keys=True))
    return 0 if res.errors == 0 and res.wrong_bytes == 0 and wrong == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
