"""GPU check of CUDA-graph decode (engine/runtime/cuda_graphs.py) against eager decode.

For each preset (default: every bench preset, bf16, plus every tiny preset in fp32), with
identical weights and identical prompts, three runners over their own caches:
  * `eager`:  plain decode (cuda_graphs=False), the same paged attention and fla kernels;
  * `static`: the graphs' static-buffer step run eagerly (capture=False), bucket-padded;
  * `graph`:  the captured graphs, replayed.
Three sequences of mixed lengths (one past the sliding window where there is one) decode
`--steps` steps together (bucket 4), then the first alone (bucket 1), then all three with
two more (bucket 8). Checks: graph vs static (same kernels, same shapes: expected equal
to rounding, tolerance 1e-3 of the logit scale) and graph vs eager (batch shapes differ:
tolerance 1e-2 fp32 / 8e-2 bf16 of the logit scale), plus greedy-token agreement. Then
the time of one decode step at batch 1 and 32 with and without graphs.

    PYTHONPATH=. python tools/check_decode_graphs_gpu.py [--presets a,b] [--json PATH]
Exit status 0 when every check passes, 1 when one fails, 2 without CUDA.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engine.cache.manager import CacheConfig, CacheManager  # noqa: E402
from engine.models.presets import get_preset, list_presets  # noqa: E402
from engine.models.weights import build_model  # noqa: E402
from engine.runtime.cuda_graphs import DecodeGraphs  # noqa: E402
from engine.runtime.runner import ModelRunner  # noqa: E402
from engine.runtime.sequence import Sequence  # noqa: E402

TOL_EAGER = {torch.float32: 1e-2, torch.bfloat16: 8e-2}
TOL_STATIC = 1e-3


def _runner(model, mode: str, max_tokens: int, slots: int) -> ModelRunner:
    cache = CacheManager.for_model(model, CacheConfig.for_tokens(max_tokens, num_slots=slots, block_size=16))
    runner = ModelRunner(model, cache, cuda_graphs=mode == "graph")
    if mode == "static":
        runner.graphs = DecodeGraphs(model, cache, runner.backend, capture=False)
    return runner


def _compare(name, check, a, b, tol):
    diff = float((a.float() - b.float()).abs().max())
    scale = float(b.float().abs().max())
    agree = float((a.argmax(-1) == b.argmax(-1)).float().mean())
    ok = bool(torch.isfinite(a).all()) and diff <= tol * max(1.0, scale)
    return {"preset": name, "check": check, "max_abs_diff": diff, "max_abs_logit": scale,
            "argmax_agree": agree, "pass": ok}


def decode_script(runner: ModelRunner, prompts: list[torch.Tensor], steps: int) -> dict[str, torch.Tensor]:
    """Prefill the prompts, then decode (all 3 | the first | all + 2 short ones) greedily."""
    seqs = [runner.cache.allocate(Sequence(f"s{i}")) for i in range(len(prompts))]
    last = []
    for s, p in zip(seqs, prompts):
        last.append(int(runner.prefill(s, p.cuda()).argmax()))
    out = {}
    toks = torch.tensor(last[:3])
    logs = []
    for _ in range(steps):  # bucket 4, host token ids
        logits = runner.decode(seqs[:3], toks)
        logs.append(logits.float().cpu())
        toks = logits.argmax(-1).cpu()
    out["b3"] = torch.stack(logs)
    tok = logits.argmax(-1)[:1]  # device token ids from here on
    logs = []
    for _ in range(steps):  # bucket 1
        logits = runner.decode(seqs[:1], tok)
        logs.append(logits.float().cpu())
        tok = logits.argmax(-1)
    out["b1"] = torch.stack(logs)
    toks = torch.cat([tok, torch.zeros(4, dtype=torch.long, device=tok.device)])
    logs = []
    for _ in range(steps):  # bucket 8 (5 sequences)
        logits = runner.decode(seqs, toks)
        logs.append(logits.float().cpu())
        toks = logits.argmax(-1)
    out["b5"] = torch.stack(logs)
    return out


def check_preset(name: str, dtype: torch.dtype, steps: int) -> list[dict]:
    cfg = get_preset(name)
    model = build_model(cfg, "cuda", dtype)
    window = cfg.attention.sliding_window or 0
    gen = torch.Generator().manual_seed(0)
    vocab = min(cfg.vocab_size, 256) if cfg.scale == "tiny" else cfg.vocab_size
    lengths = [max(700, window + 300), 333, 1500, 17, 64] if cfg.scale == "bench" else [150, 33, 90, 5, 12]
    prompts = [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]
    cap = sum(lengths) + 8 * steps * 5 + 256
    outs = {}
    for mode in ("eager", "static", "graph"):
        outs[mode] = decode_script(_runner(model, mode, cap, 5), prompts, steps)
        torch.cuda.empty_cache()
    tag = str(dtype).removeprefix("torch.")
    res = []
    for key in ("b3", "b1", "b5"):
        res.append(_compare(name, f"{tag} graph-vs-static {key}", outs["graph"][key], outs["static"][key], TOL_STATIC))
        res.append(_compare(name, f"{tag} graph-vs-eager {key}", outs["graph"][key], outs["eager"][key],
                            TOL_EAGER[dtype]))
    del model
    torch.cuda.empty_cache()
    return res


def time_steps(name: str, dtype: torch.dtype, context: int, batches: list[int], steps: int) -> list[dict]:
    cfg = get_preset(name)
    model = build_model(cfg, "cuda", dtype)
    rows = []
    for batch in batches:
        for graphs in (False, True):
            runner = _runner(model, "graph" if graphs else "eager", batch * (context + steps + 40), batch)
            seqs = [runner.cache.allocate(Sequence(f"t{i}")) for i in range(batch)]
            for s in seqs:
                runner.prefill(s, torch.randint(0, cfg.vocab_size, (context,)).cuda())
            tok = torch.zeros(batch, dtype=torch.long, device="cuda")
            for _ in range(3):
                tok = runner.decode(seqs, tok).argmax(-1)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(steps):
                tok = runner.decode(seqs, tok).argmax(-1)
            torch.cuda.synchronize()
            ms = (time.perf_counter() - t0) / steps * 1e3
            rows.append({"preset": name, "batch": batch, "context": context, "cuda_graphs": graphs,
                         "ms_per_step": ms, "tokens_per_s": batch * 1e3 / ms})
            del runner, seqs
            torch.cuda.empty_cache()
    del model
    torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default=None, help="comma-separated (default: every bench preset + every tiny)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--context", type=int, default=2048, help="tokens per sequence for the timing")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--json", default=None, help="write every result here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("CUDA is not available: nothing to check", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    names = args.presets.split(",") if args.presets else (
        [c.name for c in list_presets("bench")] + [c.name for c in list_presets("tiny")])
    results, timings, ok = [], [], True
    for name in names:
        dtype = torch.float32 if get_preset(name).scale == "tiny" else torch.bfloat16
        t0 = time.perf_counter()
        try:
            rs = check_preset(name, dtype, args.steps)
        except Exception as exc:  # report and go on with the next preset
            rs = [{"preset": name, "check": "run", "error": f"{type(exc).__name__}: {exc}", "pass": False}]
        for r in rs:
            ok &= r["pass"]
            if "error" in r:
                print(f"FAIL {name:<18} {r['check']:<32} {r['error']}", flush=True)
            else:
                print(f"{'PASS' if r['pass'] else 'FAIL'} {name:<18} {r['check']:<32} "
                      f"max|diff|={r['max_abs_diff']:.3e} max|logit|={r['max_abs_logit']:.3e} "
                      f"argmax agree={r['argmax_agree']:.3f}", flush=True)
        results += rs
        if not args.no_timing and get_preset(name).scale == "bench":
            try:
                ts = time_steps(name, dtype, args.context, [int(b) for b in args.batches.split(",")], 20)
            except Exception as exc:  # noqa: BLE001
                ts = [{"preset": name, "error": f"{type(exc).__name__}: {exc}"}]
            for t in ts:
                print("TIME " + json.dumps(t), flush=True)
            timings += ts
        print(f"# {name} done in {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"checks": results, "timings": timings}, indent=2) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
