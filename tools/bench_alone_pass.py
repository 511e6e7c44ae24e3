"""What a cold segment costs: packed alone passes (engine.pic.compute.compute_signatures,
what PIC runs for misses and for the cold fallback's idle work) against a full prefill of
the same tokens in context, side by side in one process.

For each preset and each batch shape (segments x tokens per segment) it builds the
segments from random token ids, runs both paths `--repeats` times after a warm-up (the
device synchronised around each run) and reports per token: the alone pass, the full
prefill of all the segments' tokens as one prompt, and their ratio, which is the
break-even share of a prompt in misses above which full recompute serves a request
sooner (engine.pic.costs; PicConfig.cold_full_policy="cost"). `--profile` adds the torch
profiler's op table of one alone pass (host syncs counted).

    PYTHONPATH=. python tools/bench_alone_pass.py [--presets qwen3next-bench,ring-bench]
        [--shapes 1x1400,2x1400,8x500] [--repeats 5] [--json docs/results/alone-pass-<date>.json]
    PYTHONPATH=. python tools/bench_alone_pass.py --presets qwen3next-tiny --device cpu --shapes 2x64

On the CPU only the ratios mean anything. Prints the table last.
"""
from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import sys
import time
from datetime import date
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", default="qwen3next-bench,ring-bench")
    ap.add_argument("--shapes", default="1x1400,2x1400,8x500",
                    help="comma-separated SEGMENTSxTOKENS batches (2x1400: two segments of 1400 tokens)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--seam", type=int, default=16, help="each segment's split (its seam)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", action="store_true", help="op table of one alone pass per preset and shape")
    ap.add_argument("--sync-sites", action="store_true",
                    help="run one alone pass and one full prefill per shape under torch's CUDA sync debug mode and "
                         "record where each host sync comes from (file:line of the Python frame, with counts)")
    ap.add_argument("--check", action="store_true",
                    help="also compare each shape's signatures with the torch backend's (largest relative error "
                         "per part field; on CUDA the runner's backend is fla)")
    ap.add_argument("--tail-states", default="fla", choices=("fla", "direct", "both"),
                    help="PicConfig.tail_states for scalar/diagonal-decay tails on fla: fla (a second "
                         "varlen call: the engine's default), direct (one sum per tail), or both: the pass timed "
                         "each way in this process (alone_direct_tails_ms next to alone_ms)")
    ap.add_argument("--json", nargs="?", const="", default=None, metavar="PATH",
                    help="write the run as JSON (default docs/results/alone-pass-<date>.json)")
    args = ap.parse_args(argv)
    try:
        args.shapes = [tuple(int(x) for x in s.lower().split("x")) for s in args.shapes.split(",") if s]
    except ValueError:
        ap.error(f"--shapes {args.shapes!r}: each shape is SEGMENTSxTOKENS, e.g. 2x1400")
    if not args.shapes or any(len(s) != 2 or min(s) < 1 for s in args.shapes):
        ap.error("--shapes: each shape is SEGMENTSxTOKENS with both >= 1")
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    return args


def _timed(fn, sync, repeats: int) -> list[float]:
    fn()  # warm-up: compiles kernels at these shapes
    sync()
    out = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def bench_preset(preset: str, args) -> list[dict]:
    import torch

    from engine.builder import resolve_device, resolve_dtype
    from engine.cache.manager import CacheConfig, CacheManager
    from engine.models.weights import load_model
    from engine.pic.compute import compute_signatures
    from engine.pic.compute import resolve_state_dtype
    from engine.runtime.runner import ModelRunner
    from engine.runtime.sequence import Sequence

    device = resolve_device(args.device)
    dtype = resolve_dtype("auto", device)
    loaded = load_model(preset, device=device, dtype=dtype)
    model = loaded.model
    vocab = model.config.vocab_size
    longest = max(m * n for m, n in args.shapes) + 1
    mgr = CacheManager.for_model(model, CacheConfig(block_size=16, num_blocks=longest // 16 + 8, num_slots=2))
    runner = ModelRunner(model, mgr, cuda_graphs=False)
    state_dtype = resolve_state_dtype("auto", dtype)
    sync = (lambda: torch.cuda.synchronize()) if device.type == "cuda" else (lambda: None)
    g = torch.Generator().manual_seed(args.seed)
    rows = []
    for m, n in args.shapes:
        segs = [(torch.randint(3, vocab, (n,), generator=g).tolist(), min(args.seam, n - 1)) for _ in range(m)]
        prompt = [1] + [t for s, _ in segs for t in s]

        def alone(tail_states: str = "fla"):
            compute_signatures(model, segs, [1], backend=runner.backend, state_dtype=state_dtype,
                               tail_states=tail_states)

        def full():
            seq = mgr.allocate(Sequence("full"))
            try:
                runner.prefill(seq, prompt)
            finally:
                mgr.free(seq)

        mode = "direct" if args.tail_states == "direct" else "fla"
        a = _timed(functools.partial(alone, mode), sync, args.repeats)
        f = _timed(full, sync, args.repeats)
        other = None
        if args.tail_states == "both":
            other = _timed(functools.partial(alone, "direct"), sync, args.repeats)
        a_ms, f_ms = statistics.median(a), statistics.median(f)
        tokens = m * (n + 1)
        row = {"preset": preset, "segments": m, "tokens_per_segment": n, "alone_ms": round(a_ms, 3),
               "full_ms": round(f_ms, 3), "alone_ms_per_token": a_ms / tokens, "full_ms_per_token": f_ms / len(prompt),
               "break_even": (f_ms / len(prompt)) / (a_ms / tokens), "backend": runner.backend,
               "alone_runs_ms": [round(x, 3) for x in a], "full_runs_ms": [round(x, 3) for x in f],
               "tail_states": "fla" if args.tail_states == "both" else args.tail_states}
        if other is not None:
            row["alone_direct_tails_ms"] = round(statistics.median(other), 3)
            row["alone_direct_tails_runs_ms"] = [round(x, 3) for x in other]
        if args.sync_sites and device.type == "cuda":
            row["sync_sites"] = {"alone": sync_sites(alone, sync), "full": sync_sites(full, sync)}
            print(f"--- {preset} {m}x{n} host syncs: {json.dumps(row['sync_sites'])}", flush=True)
        if args.check:
            row["check"] = check_against_torch(model, segs, runner.backend, state_dtype)
            print(f"--- {preset} {m}x{n} vs torch backend: {row['check']}", flush=True)
        if args.profile:
            from tools.profile_engine import torch_tables
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
            with profile(activities=acts) as prof:
                alone()
                sync()
            row["profile"] = torch_tables(prof, 25)
            print(f"--- {preset} {m}x{n} alone pass\n{row['profile']}", flush=True)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "profile"}), flush=True)
    return rows


def sync_sites(fn, sync) -> dict[str, int]:
    """Run `fn` once under torch.cuda's sync debug mode ("warn"): how many host syncs
    each call site caused, most first. A site is the innermost Python frame, and after
    " <- " the innermost frame of this repository's engine/ or kernels/ (where ours
    called into torch or fla)."""
    import traceback
    import warnings

    import torch

    counts: dict[str, int] = {}

    def record(message, category, filename, lineno, file=None, line=None) -> None:
        if "synchroniz" not in str(message).lower():
            return
        frames = traceback.extract_stack()[:-1]
        ours = [f for f in frames if "/engine/" in f.filename or "/kernels/" in f.filename]
        site = f"{Path(filename).name}:{lineno}"
        if ours:
            site += f" <- {Path(ours[-1].filename).parent.name}/{Path(ours[-1].filename).name}:{ours[-1].lineno}"
        counts[site] = counts.get(site, 0) + 1

    sync()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    sync()
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def check_against_torch(model, segs, backend: str, state_dtype) -> dict:
    """Largest relative error (max |a - b| / max |b|) per part field of the signatures the
    runner's backend computes against the torch backend's, over every layer and segment."""
    import torch

    from engine.pic.compute import compute_signatures

    got = compute_signatures(model, segs, [1], backend=backend, state_dtype=state_dtype)
    want = compute_signatures(model, segs, [1], backend="torch", state_dtype=state_dtype)
    worst: dict[str, float] = {}
    for g, w in zip(got, want):
        for pg, pw in zip(g.layers, w.layers):
            for name, b in vars(pw).items():
                a = getattr(pg, name)
                if isinstance(b, torch.Tensor) and isinstance(a, torch.Tensor) and a.shape == b.shape:
                    b32, a32 = b.float(), a.float()
                    err = float((a32 - b32).abs().max() / b32.abs().max().clamp_min(1e-30))
                    worst[name] = max(worst.get(name, 0.0), err)
                elif name == "live_heads" and a != b:
                    worst["live_heads_differ"] = worst.get("live_heads_differ", 0) + 1
    return {k: round(v, 6) for k, v in worst.items()}


def table(rows: list[dict]) -> str:
    head = ("preset", "batch", "alone ms", "full ms", "alone ms/tok", "full ms/tok", "alone/full", "break-even",
            "alone ms, direct tails")
    out = ["| " + " | ".join(head) + " |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        ratio = r["alone_ms_per_token"] / r["full_ms_per_token"]
        direct = f"{r['alone_direct_tails_ms']:.1f}" if "alone_direct_tails_ms" in r else "-"
        out.append(f"| {r['preset']} | {r['segments']}x{r['tokens_per_segment']} | {r['alone_ms']:.1f} | "
                   f"{r['full_ms']:.1f} | {r['alone_ms_per_token']:.4f} | {r['full_ms_per_token']:.4f} | "
                   f"{ratio:.1f}x | {r['break_even']:.3f} | {direct} |")
    return "\n".join(out)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    import torch

    rows = []
    for preset in [p for p in args.presets.split(",") if p]:
        rows += bench_preset(preset, args)  # its model and caches are freed on return
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if args.json is not None:
        path = Path(args.json) if args.json else REPO / "docs" / "results" / f"alone-pass-{date.today()}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        machine = {"python": platform.python_version(), "torch": torch.__version__,
                   "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                   "cpus": __import__("os").cpu_count()}
        path.write_text(json.dumps({"date": str(date.today()), "command": "python tools/bench_alone_pass.py "
                                    + " ".join(sys.argv[1:] if argv is None else argv), "machine": machine,
                                    "rows": rows}, indent=1) + "\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
