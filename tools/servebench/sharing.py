"""Two engine processes on one host: sharing one kvstore daemon vs each with a private
in-process signature cache.

The same request trace (drawn from one pool) is dealt alternately to two worker
processes (tools.servebench.worker), which run at the same time. With a shared daemon,
a segment one engine computed is a hit for the other (and a segment both need at once
is computed once: the other waits through the daemon); with private caches each engine
only reuses what it computed itself. Reported per configuration: segment hit rate
(hits / (hits + misses)), TTFT p50/p99 over both engines' requests, and segments
computed in all.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

from tools.servebench.harness import percentile
from tools.servebench.requests import BenchRequest

REPO = Path(__file__).resolve().parents[2]


def run_pair(preset: str, engine_options: dict, requests: Sequence[BenchRequest], socket: Optional[str],
             threads: Optional[int] = None, timeout: float = 900.0) -> dict:
    """Run `requests` on two worker processes (module docstring); socket None: private caches."""
    work = Path(tempfile.mkdtemp(prefix="servebench-"))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    procs, outs = [], []
    for i in range(2):
        spec = {"name": f"w{i}", "preset": preset, "engine": engine_options, "socket": socket,
                "barrier": str(work), "threads": threads,
                "requests": [{"id": r.id, "task": r.task, "segments": list(r.segments)} for r in requests[i::2]]}
        (work / f"w{i}.json").write_text(json.dumps(spec))
        out = work / f"w{i}.out.json"
        outs.append(out)
        log = open(work / f"w{i}.log", "wb")
        procs.append(subprocess.Popen([sys.executable, "-m", "tools.servebench.worker", "--spec",
                                       str(work / f"w{i}.json"), "--out", str(out)],
                                      stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(REPO)))
    deadline = time.monotonic() + timeout
    while not all((work / f"w{i}.ready").exists() for i in range(2)):
        for i, p in enumerate(procs):
            if p.poll() is not None:
                raise RuntimeError(f"worker w{i} exited with {p.returncode}:\n{_tail(work / f'w{i}.log')}")
        if time.monotonic() > deadline:
            raise RuntimeError("workers not ready in time")
        time.sleep(0.05)
    t0 = time.perf_counter()
    (work / "go").write_text("go")
    for i, p in enumerate(procs):
        if p.wait(max(1.0, deadline - time.monotonic())) != 0:
            raise RuntimeError(f"worker w{i} failed:\n{_tail(work / f'w{i}.log')}")
    wall = time.perf_counter() - t0
    results = [json.loads(o.read_text()) for o in outs]
    runs = [r for res in results for r in res["runs"]]
    hits = sum(r["hit_segments"] for r in runs)
    misses = sum(r["miss_segments"] for r in runs)
    ttfts = [r["ttft_ms"] for r in runs]
    return {"shared": socket is not None, "requests": len(runs), "hit_rate": hits / (hits + misses) if hits + misses else 0.0,
            "segments_computed": misses, "segments_waited": sum(r.get("waited", 0) for r in runs),
            "ttft_ms_p50": percentile(ttfts, 50), "ttft_ms_p99": percentile(ttfts, 99),
            "ttft_ms_mean": sum(ttfts) / len(ttfts) if ttfts else None, "wall_s": wall}


def _tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"
