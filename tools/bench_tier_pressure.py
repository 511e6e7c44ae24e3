"""What a full CPU tier costs the daemon's clients, with background write-back
(kvstore.writeback) off and on, side by side in one run.

For each mode it starts a real daemon (subprocess, unix socket) with a small CPU tier and
an NVMe tier in `--dir`, fills the CPU tier with `--size` objects, lets the write-back
thread settle (mode on), then puts `--puts` more objects into the CPU tier, each needing
room, paced at `--rate` objects/s (0: back to back), while a second client looks up a
batch of 64 keys every 5 ms. Reported per mode: put latency p50/p99, lookup latency p99
during the puts (lookups queue behind whatever holds the store's lock), and the daemon's
demotions, evictions and write-backs. Without write-back every put demotes a victim by
writing and fsyncing it (outside the store's lock since issue 23: the put waits for it,
lookups do not); with it, the victims' NVMe copies were made ahead and a demotion writes
nothing until the puts outrun the write-back (`--rate 0`).

    PYTHONPATH=. python tools/bench_tier_pressure.py [--dir /mnt/nvme/kvbench] [--size 32MiB]
        [--objects 16] [--puts 16] [--rate 4] [--json docs/results/tier-pressure-<date>.json]

CPU figures are ratios only. Prints its table last.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import threading
import time
from datetime import date
from pathlib import Path
from typing import Optional

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from kvstore.config import parse_size  # noqa: E402
from kvstore.testing import DaemonProcess  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=None, help="directory for the daemons' NVMe tiers (default: a temp dir)")
    ap.add_argument("--size", default="32MiB", help="bytes per object")
    ap.add_argument("--objects", type=int, default=16, help="objects the CPU tier holds (its capacity)")
    ap.add_argument("--puts", type=int, default=16, help="puts measured once the CPU tier is full")
    ap.add_argument("--rate", type=float, default=4.0, help="puts per second (0: back to back)")
    ap.add_argument("--watermark", type=float, default=0.5, help="writeback_watermark of the 'on' mode")
    ap.add_argument("--json", nargs="?", const="", default=None, metavar="PATH")
    args = ap.parse_args(argv)
    try:
        args.size = parse_size(args.size, "--size")
    except Exception as exc:  # noqa: BLE001 - the parser names the problem
        ap.error(str(exc))
    if args.objects < 2 or args.puts < 1 or args.rate < 0 or not 0 <= args.watermark < 1:
        ap.error("--objects >= 2, --puts >= 1, --rate >= 0, 0 <= --watermark < 1")
    return args


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


def run_mode(root: Path, args, watermark: float) -> dict:
    cap = args.objects * args.size
    payload = np.random.default_rng(0).integers(0, 256, args.size, dtype=np.uint8).tobytes()
    d = DaemonProcess(root, cpu_capacity=str(cap), nvme_capacity=str(8 * cap + args.puts * args.size),
                      extra_args=["--writeback-watermark", str(watermark)])
    with d:
        kv = d.client()
        for i in range(args.objects):
            kv.put(f"fill-{i}".encode(), payload, tier="cpu")
        if watermark < 1:  # let the write-back thread reach its watermark
            deadline = time.monotonic() + 120
            want = args.objects - int(watermark * args.objects)  # objects over the watermark
            while kv.stats().get("writebacks", 0) < want and time.monotonic() < deadline:
                time.sleep(0.05)
        keys = [f"fill-{i}".encode() for i in range(64)]
        lookups: list[float] = []
        stop = threading.Event()

        def poll() -> None:
            with d.client() as c:
                while not stop.is_set():
                    t0 = time.perf_counter()
                    c.lookup(keys)
                    lookups.append((time.perf_counter() - t0) * 1e3)
                    time.sleep(0.005)

        poller = threading.Thread(target=poll)
        poller.start()
        puts: list[float] = []
        start = time.perf_counter()
        for i in range(args.puts):
            if args.rate:
                due = start + i / args.rate
                time.sleep(max(0.0, due - time.perf_counter()))
            t0 = time.perf_counter()
            kv.put(f"new-{i}".encode(), payload, tier="cpu")
            puts.append((time.perf_counter() - t0) * 1e3)
        stop.set()
        poller.join()
        st = kv.stats()
        kv.close()
    return {"watermark": watermark, "put_ms_p50": statistics.median(puts), "put_ms_p99": _pct(puts, 99),
            "lookup_ms_p50": _pct(lookups, 50), "lookup_ms_p99": _pct(lookups, 99), "lookups": len(lookups),
            "demotions": st.get("demotions"), "evictions": st.get("evictions"), "writebacks": st.get("writebacks"),
            "put_ms": [round(x, 3) for x in puts]}


def table(rows: list[dict]) -> str:
    head = "| write-back | put p50 ms | put p99 ms | lookup p50 ms | lookup p99 ms | demotions | write-backs |"
    out = [head, "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        name = "off" if r["watermark"] >= 1 else f"on ({r['watermark']:g})"
        out.append(f"| {name} | {r['put_ms_p50']:.1f} | {r['put_ms_p99']:.1f} | {r['lookup_ms_p50']:.2f} | "
                   f"{r['lookup_ms_p99']:.2f} | {r['demotions']} | {r['writebacks']} |")
    off, on = rows
    out.append(f"\nratios off / on: put p99 {off['put_ms_p99'] / on['put_ms_p99']:.1f}x, "
               f"lookup p99 {off['lookup_ms_p99'] / on['lookup_ms_p99']:.1f}x")
    return "\n".join(out)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="kvpressure-"))
    rows = [run_mode(base / "off", args, 1.0), run_mode(base / "on", args, args.watermark)]
    if args.json is not None:
        path = Path(args.json) if args.json else REPO / "docs" / "results" / f"tier-pressure-{date.today()}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        cmd = "python tools/bench_tier_pressure.py " + " ".join(sys.argv[1:] if argv is None else argv)
        path.write_text(json.dumps({"date": str(date.today()), "command": cmd.strip(),
                                    "machine": {"python": platform.python_version(), "host": platform.node()},
                                    "size": args.size, "rows": rows}, indent=1) + "\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
