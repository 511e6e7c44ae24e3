"""Full-recompute baseline of the engine: prefill time vs prompt length and decode tokens/s,
each "bench" preset (random weights, bf16), with the linear layers through fla's kernels
(backend "fla") next to the same shapes through the torch forms (backend "torch");
attention is torch SDPA in both.

Prefill: one sequence, one chunk of L tokens from position 0, timed from the call to the
logits (CUDA synchronised), median of `--repeat` runs after `--warmup` runs.
Decode: B sequences, each prefilled to `--decode-context` tokens (not timed), then
`--decode-steps` batched decode steps timed; tokens/s = B * steps / seconds.

    PYTHONPATH=. python tools/bench_engine.py [--presets qwen3next-bench ...] [--json OUT.json]

Prints one line per measurement; `--json` also writes every record (with the command line,
torch/fla versions and device name) for docs/results/.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from engine.cache.manager import CacheConfig, CacheManager
from engine.models.layers.fla_backend import fla_importable
from engine.models.presets import get_preset, list_presets
from engine.models.weights import build_model
from engine.runtime.runner import ModelRunner
from engine.runtime.sequence import Sequence


def timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def bench_prefill(runner: ModelRunner, ids: torch.Tensor, warmup: int, repeat: int) -> list[float]:
    times = []
    for i in range(warmup + repeat):
        seq = runner.cache.allocate(Sequence(f"p{i}"))
        t = timed(lambda: runner.prefill(seq, ids))
        runner.cache.free(seq)
        if i >= warmup:
            times.append(t)
    return times


def bench_decode(runner: ModelRunner, batch: int, context: int, steps: int, vocab: int) -> float:
    gen = torch.Generator().manual_seed(1)
    seqs = [runner.cache.allocate(Sequence(f"d{i}")) for i in range(batch)]
    for s in seqs:
        runner.prefill(s, torch.randint(0, vocab, (context,), generator=gen))
    toks = torch.randint(0, vocab, (batch,), generator=gen).cuda()
    runner.decode(seqs, toks)  # warm-up step

    def run():
        nonlocal toks
        for _ in range(steps):
            toks = runner.decode(seqs, toks).argmax(-1)

    t = timed(run)
    for s in seqs:
        runner.cache.free(s)
    return batch * steps / t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", nargs="*", default=[c.name for c in list_presets("bench")])
    ap.add_argument("--backends", nargs="*", default=["fla", "torch"], choices=["fla", "torch"])
    ap.add_argument("--prefill-lengths", nargs="*", type=int, default=[4096, 8192, 16384, 32768, 65536])
    ap.add_argument("--decode-batches", nargs="*", type=int, default=[1, 32])
    ap.add_argument("--decode-context", type=int, default=4096)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", default=None, help="write all records to this file")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_engine needs a CUDA device", file=sys.stderr)
        return 2
    if "fla" in args.backends and not fla_importable():
        print("fla-core does not import; install its wheel or pass --backends torch", file=sys.stderr)
        return 2
    meta = {"argv": sys.argv, "torch": torch.__version__, "device": torch.cuda.get_device_name()}
    if fla_importable():
        import fla
        meta["fla"] = getattr(fla, "__version__", "?")
    records = []
    max_len = max(args.prefill_lengths + [args.decode_context + args.decode_steps + 2])
    for name in args.presets:
        cfg = get_preset(name)
        model = build_model(cfg, "cuda", cfg.dtype)
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, cfg.vocab_size, (max(args.prefill_lengths),), generator=gen)
        slots = max(args.decode_batches + [args.warmup + args.repeat])
        tokens = max(max_len, max(args.decode_batches) * (args.decode_context + args.decode_steps + 2))
        for backend in args.backends:
            cache = CacheManager.for_model(model, CacheConfig.for_tokens(tokens, num_slots=slots))
            runner = ModelRunner(model, cache, backend=backend)
            for length in args.prefill_lengths:
                ts = bench_prefill(runner, ids[:length].cuda(), args.warmup, args.repeat)
                rec = {"preset": name, "backend": backend, "phase": "prefill", "tokens": length,
                       "median_ms": 1e3 * statistics.median(ts), "all_ms": [1e3 * t for t in ts],
                       "tokens_per_s": length / statistics.median(ts)}
                records.append(rec)
                print(f"{name:<16} {backend:<5} prefill {length:>6} tok  {rec['median_ms']:10.1f} ms  "
                      f"{rec['tokens_per_s']:10.0f} tok/s", flush=True)
            for batch in args.decode_batches:
                tps = bench_decode(runner, batch, args.decode_context, args.decode_steps, cfg.vocab_size)
                rec = {"preset": name, "backend": backend, "phase": "decode", "batch": batch,
                       "context": args.decode_context, "steps": args.decode_steps, "tokens_per_s": tps}
                records.append(rec)
                print(f"{name:<16} {backend:<5} decode  batch {batch:>3} ctx {args.decode_context}  "
                      f"{tps:10.1f} tok/s", flush=True)
            del runner, cache
            torch.cuda.empty_cache()
        del model
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "records": records}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
