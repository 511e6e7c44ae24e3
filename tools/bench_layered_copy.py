"""CPU tier -> GPU copies of signature blobs while another thread keeps the host and the
device busy, one way of issuing the copies against another, in one process (CUDA only).

The loader (engine.connector.loader) copies a CPU-tier hit from the daemon's pinned arena
into device memory in groups of layers (engine.connector.layer_loads), on its own thread,
while the engine's thread launches the fused pass. In the tiered benchmark those copies
reach 0.92 of pinned PCIe with the engine idle but 0.66-0.85 while it computes. This
bench isolates that: blobs laid out like a qwen3next-bench signature of `--tokens` tokens
(stacked parts per the codec: state, tail state, tail transition, conv tail per delta
layer; K and V per attention layer), `--segments` of them per load, copied by a loader
thread the way the loader does (wait for the compute stream, an event before, one after,
the copy stream's device time between them counted), under these engine loads:

- `idle`: no engine thread;
- `host`: a thread launching small kernels from a Python loop (the fused pass's host-bound
  launches: GIL traffic and a busy device queue);
- `gemm`: a thread queueing large matmuls (the device busy, the host mostly waiting);
- `python`: a thread running pure Python (the engine's scheduling and planning code),
  which gives up the GIL only when the interpreter forces it (every switch interval);
- `mixed`: a thread alternating ~1 ms of pure Python with 64 small kernel launches.

Variants: `banded` (the codec's layout: each band of layers laid out together, so the
loader's issue_layered copies a group in one copy, an event after each), `unbanded` (the
layout before bands: parts stacked across all layers, a copy per stacked part and group,
~22 a blob), `whole` (one copy per blob, no layer events: the reference).

    PYTHONPATH=. python tools/bench_layered_copy.py [--segments 10] [--repeats 5] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

LOADS = ("idle", "host", "gemm", "python", "mixed")
VARIANTS = ("banded", "unbanded", "whole")


def blob_layout(tokens: int, layers: int = 24, every: int = 4, heads: int = 32, dk: int = 128, dv: int = 128,
                kv_heads: int = 2, head_dim: int = 256, conv_channels: int = 8192, conv_rows: int = 3,
                esize: int = 2, banded: bool = True) -> tuple[list, dict, int, list]:
    """(parts, stacked, total bytes, bands) of a blob shaped like a qwen3next-bench
    signature: delta layers but every `every`-th (full attention), stacked parts in the
    codec's order: per band of layers (engine.connector.codec.layer_bands) when `banded`,
    else across all layers (the layout before bands), each part 4 KiB-aligned."""
    from engine.connector.layer_loads import COPY_GROUP_GROWTH, MAX_COPY_GROUP_BYTES, MIN_COPY_BYTES, group_bounds

    rows = tokens + 1
    per_row = {"state": heads * dk * dv * esize, "tail_state": heads * dk * dv * esize,
               "tail_transition": heads * dk * dk * esize, "conv_tail": conv_channels * conv_rows * esize,
               "k": rows * kv_heads * head_dim * esize, "v": rows * kv_heads * head_dim * esize}
    kinds = {i: ("k", "v") if not (i + 1) % every else ("state", "tail_state", "tail_transition", "conv_tail")
             for i in range(layers)}
    sizes = [sum(per_row[p] for p in kinds[i]) for i in range(layers)]
    bounds = (group_bounds(sizes, MIN_COPY_BYTES, COPY_GROUP_GROWTH, MAX_COPY_GROUP_BYTES) if banded
              else [(0, layers)])
    parts, stacked, off = [], {}, 0
    for lo, hi in bounds:
        for part in ("state", "tail_state", "tail_transition", "conv_tail", "k", "v"):
            lays = [i for i in range(lo, hi) if part in kinds[i]]
            if not lays:
                continue
            name = f"S{len(parts)}.{part}"
            off = -(-off // 4096) * 4096
            n = per_row[part] * len(lays)
            parts.append(SimpleNamespace(name=name, layer=lays[0], offset=off, length=n))
            stacked[name] = [f"L{j}.{part}" for j in lays]
            off += n
    return parts, stacked, off, [lo for lo, _ in bounds]


def _engine_thread(kind: str, stop: threading.Event, device) -> threading.Thread:
    import torch

    def host() -> None:
        x = torch.zeros(1024, device=device)
        n = 0
        while not stop.is_set():
            for _ in range(64):
                x.add_(1.0)
                x.mul_(0.5)
            n += 1
            if n % 64 == 0:  # keep the queue bounded, as a prefill's layer syncs do
                torch.cuda.current_stream(device).synchronize()

    def gemm() -> None:
        a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
        while not stop.is_set():
            for _ in range(4):
                a @ a
            torch.cuda.current_stream(device).synchronize()

    def python() -> None:
        x = 0
        while not stop.is_set():
            for i in range(20000):
                x += i * i

    def mixed() -> None:
        x = torch.zeros(1024, device=device)
        n = 0
        while not stop.is_set():
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < 1e-3:
                n += 1
            for _ in range(32):
                x.add_(1.0)
                x.mul_(0.5)
            torch.cuda.current_stream(device).synchronize()

    t = threading.Thread(target={"host": host, "gemm": gemm, "python": python, "mixed": mixed}[kind], daemon=True)
    t.start()
    return t


def run_load(plan, src, total: int, segments: int, device) -> dict:
    """One load of `segments` blobs from `src` (pinned, one blob after another), issued by
    this thread as `plan`'s groups (None: one copy a blob); device ms (sum over blobs of
    start -> ready) and host ms issuing."""
    import torch

    from engine.connector.layer_loads import CudaCopyQueue, issue_layered

    stream = torch.cuda.Stream(device)
    pairs, issue_ms = [], 0.0
    keep = []
    for j in range(segments):
        buf = src[j * total:(j + 1) * total]
        stream.wait_stream(torch.cuda.current_stream(device))
        start = torch.cuda.Event(enable_timing=True)
        start.record(stream)
        dev = torch.empty(total, dtype=torch.uint8, device=device)
        t0 = time.perf_counter()
        with torch.cuda.stream(stream):
            if plan is not None:
                issue_layered(buf, dev, plan, CudaCopyQueue(stream))
            else:
                dev.copy_(buf, non_blocking=True)
        issue_ms += (time.perf_counter() - t0) * 1e3
        ready = torch.cuda.Event(enable_timing=True)
        ready.record(stream)
        dev.record_stream(stream)
        pairs.append((start, ready))
        keep.append(dev)
    stream.synchronize()
    ms = sum(a.elapsed_time(b) for a, b in pairs)
    return {"device_ms": ms, "issue_ms": issue_ms, "gb_per_s": segments * total / ms / 1e6}


def variant_plan(variant: str, tokens: int) -> tuple[Optional[list], int]:
    """(the loader's copy plan of the variant's blob layout, None for `whole`; blob bytes)."""
    from engine.connector.layer_loads import (COPY_GROUP_GROWTH, MAX_COPY_GROUP_BYTES, MIN_COPY_BYTES, group_layers,
                                              groups_at, layer_plan)

    if variant not in VARIANTS:
        raise SystemExit(f"bench_layered_copy: unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")
    parts, stacked, total, bands = blob_layout(tokens, banded=variant != "unbanded")
    per_layer = layer_plan(parts, stacked)
    if variant == "whole":
        return None, total
    if variant == "banded":
        return groups_at(per_layer, bands), total
    return group_layers(per_layer, MIN_COPY_BYTES, COPY_GROUP_GROWTH, MAX_COPY_GROUP_BYTES), total


def pinned_h2d(src, total: int, device) -> float:
    """GB/s of one plain copy of `total` bytes (the bench's PCIe reference)."""
    import torch

    dev = torch.empty(total, dtype=torch.uint8, device=device)
    best = 0.0
    for _ in range(5):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        dev.copy_(src[:total], non_blocking=True)
        e.record()
        e.synchronize()
        best = max(best, total / s.elapsed_time(e) / 1e6)
    return best


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--segments", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=1400)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--loads", default=",".join(LOADS))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench_layered_copy: needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    layouts = {v: variant_plan(v, args.tokens) for v in args.variants.split(",") if v}
    total = max(t for _, t in layouts.values())  # the layouts differ by their padding
    src = torch.randint(0, 255, (total * args.segments,), dtype=torch.uint8).pin_memory()
    ref = pinned_h2d(src, total * args.segments, device)
    rows = []
    for load in [x for x in args.loads.split(",") if x]:
        for variant, (plan, size) in layouts.items():
            stop = threading.Event()
            eng = _engine_thread(load, stop, device) if load != "idle" else None
            time.sleep(0.2)
            runs = [run_load(plan, src, size, args.segments, device) for _ in range(args.repeats + 1)][1:]
            stop.set()
            if eng is not None:
                eng.join()
            gbs = [r["gb_per_s"] for r in runs]
            row = {"load": load, "variant": variant, "gb_per_s": statistics.median(gbs),
                   "gb_per_s_runs": [round(x, 2) for x in gbs], "fraction_of_pcie": statistics.median(gbs) / ref,
                   "copies_per_blob": sum(len(g.spans) for g in plan) if plan else 1,
                   "issue_ms": statistics.median(r["issue_ms"] for r in runs),
                   "device_ms": statistics.median(r["device_ms"] for r in runs)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    out = {"command": "python tools/bench_layered_copy.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "blob_bytes": total,
           "segments": args.segments, "pinned_h2d_gb_per_s": ref, "torch": torch.__version__,
           "gpu": torch.cuda.get_device_name(), "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    print(f"blob {total / 2**20:.1f} MiB; pinned H2D {ref:.1f} GB/s")
    for r in rows:
        print(f"  {r['load']:6s} {r['variant']:9s} {r['copies_per_blob']:3d} copies {r['gb_per_s']:6.1f} GB/s "
              f"({r['fraction_of_pcie']:.3f}) "
              f"issue {r['issue_ms']:.2f} ms, device {r['device_ms']:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
