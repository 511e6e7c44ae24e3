"""GPU check of engine.pic.long_ranges: a request whose missing segments are computed in
context (PicConfig.miss_path="context") has one long computed range per miss in each
linear layer; on fla a delta-rule layer's long ranges share two varlen calls
(engine.pic.long_ranges) instead of one call each. Side by side in one process, two
planners sharing one signature cache, PicConfig.batch_long_ranges on and off:

1. correctness (tiny presets, float32, their trained weights): last-position logits and
   every linear layer's final state of the same request, batched vs one call per range
   (max abs logit difference, largest relative state difference);
2. time (bench presets, bf16): the prefill of one rag-like request (`--docs` documents
   of `--doc-tokens` tokens, every other one cached, the rest missing) with device
   synchronisation around each run, median of `--repeats`, batched vs one call per
   range, and full recompute of the same prompt for scale; and the largest last-position
   logit difference between the two paths in bf16 (`max_abs_logit_diff`, with the logits'
   largest magnitude `logit_abs_max` for scale).

    PYTHONPATH=. python tools/check_long_ranges_gpu.py [--json PATH]

Needs CUDA and fla-core (the batched path is fla-only). Prints the table last.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", default="qwen3next-tiny",
                    help="presets of the correctness part (their delta-rule layers take the batched path)")
    ap.add_argument("--bench", default="qwen3next-bench", help="presets of the timing part")
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--doc-tokens", type=int, default=1400)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--seam", type=int, default=16)
    ap.add_argument("--device", default="cuda", help="cuda; cpu only dry-runs the script (no fla, nothing batched)")
    ap.add_argument("--json", default=None, metavar="PATH")
    return ap.parse_args(argv)


def _texts(n: int, length: int, seed: int) -> list[str]:
    import torch

    g = torch.Generator().manual_seed(seed)
    letters = "abcdefghijklmnopqrstuvwxyz0123456789 "
    return [f"## doc {seed}-{i}\n" + "".join(letters[j] for j in torch.randint(0, len(letters), (length,),
                                                                                  generator=g).tolist())
            for i in range(n)]


class Setup:
    """A model, its runner and two PIC planners (misses in context; `planners[True]` with
    long ranges batched, `planners[False]` one call per range) over one signature cache
    that holds every other document of `docs`."""

    def __init__(self, preset: str, dtype, docs: list[str], seam: int, device: str = "cuda") -> None:
        import torch

        from engine.cache.manager import CacheConfig, CacheManager
        from engine.models.weights import load_model
        from engine.pic.config import PicConfig
        from engine.pic.offline import build_request, prefill_with_plan, release
        from engine.pic.planner import make_planner
        from engine.pic.signature_cache import InMemorySignatureCache
        from engine.runtime.runner import ModelRunner
        from engine.tokenizer import load_tokenizer

        self.torch, self.build, self.prefill, self.release = torch, build_request, prefill_with_plan, release
        self.tok = load_tokenizer("byte")
        self.device = torch.device(device)
        loaded = load_model(preset, device=self.device, dtype=dtype)
        self.model, self.fp = loaded.model, loaded.fingerprint
        total = sum(len(d) for d in docs) + 256
        self.mgr = CacheManager.for_model(self.model, CacheConfig(block_size=16, num_blocks=total // 16 + 64,
                                                                  num_slots=4))
        self.runner = ModelRunner(self.model, self.mgr)
        cache = InMemorySignatureCache(PicConfig().signature_cache_bytes)
        self.planners = {batch: make_planner(PicConfig(seam=seam, miss_path="context", batch_long_ranges=batch),
                                             self.model, self.fp, self.tok, signature_cache=cache)
                         for batch in (True, False)}
        self.planner = self.planners[True]
        self.full = make_planner(PicConfig(method="full"), self.model, self.fp, self.tok)
        q = {"text": "Q: which documents mention the letter q?\nA: ", "cache": False}
        self.segments = [{"text": d, "cache": True} for d in docs] + [q]
        warm = self.build(self.tok, [{"text": d, "cache": True} for d in docs[::2]] + [q])
        self.run(self.planner, warm)
        while self.planner.help_idle(self.runner):  # cache every other document
            pass

    def run(self, planner, request=None, keep: bool = False):
        req = request if request is not None else self.build(self.tok, self.segments)
        got = self.prefill(planner, self.runner, req)
        out = (got.logits[-1].float().clone(), got.report)
        if keep:
            return out, got
        self.release(planner, self.runner, req)
        return out

    def states(self, got) -> list:
        from engine.cache.layer_caches import StateSlotCache

        return [c.state[got.seq.slot].float().clone() for c in self.mgr.layers if isinstance(c, StateSlotCache)]

    def timed(self, planner, repeats: int) -> list[float]:
        sync = self.torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        self.run(planner)  # warm-up at this shape
        out = []
        for _ in range(repeats):
            sync()
            t0 = time.perf_counter()
            self.run(planner)
            sync()
            out.append((time.perf_counter() - t0) * 1e3)
        return out


def correctness(preset: str, args) -> dict:
    import torch

    s = Setup(preset, torch.float32, _texts(6, 400, 1), args.seam, args.device)
    got = {}
    for batch in (True, False):
        (logits, rep), res = s.run(s.planners[batch], keep=True)
        got[batch] = (logits, s.states(res), rep.miss_segments)
        s.release(s.planners[batch], s.runner, res.request)
    rel = max(float((a - b).norm() / b.norm().clamp_min(1e-30)) for a, b in zip(got[True][1], got[False][1]))
    return {"preset": preset, "miss_segments": got[True][2],
            "max_abs_logit_diff": float((got[True][0] - got[False][0]).abs().max()), "max_state_rel_diff": rel}


def timing(preset: str, args) -> dict:
    import torch

    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    s = Setup(preset, dtype, _texts(args.docs, args.doc_tokens, 2), args.seam, args.device)
    row = {"preset": preset, "docs": args.docs, "doc_tokens": args.doc_tokens}
    (_, rep) = s.run(s.planner)
    row["miss_segments"], row["hit_segments"] = rep.miss_segments, rep.hit_segments
    for name, batch in (("batched", True), ("per_range", False), ("batched_again", True)):
        runs = s.timed(s.planners[batch], args.repeats)
        row[f"{name}_ms"] = statistics.median(runs)
        row[f"{name}_runs_ms"] = [round(x, 3) for x in runs]
    logits = {batch: s.run(s.planners[batch])[0] for batch in (True, False)}
    row["max_abs_logit_diff"] = float((logits[True] - logits[False]).abs().max())
    row["logit_abs_max"] = float(logits[False].abs().max())
    row["full_ms"] = statistics.median(s.timed(s.full, args.repeats))
    row["speedup"] = row["per_range_ms"] / min(row["batched_ms"], row["batched_again_ms"])
    del s
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("needs CUDA (the batched path runs on fla); --device cpu dry-runs the script", file=sys.stderr)
        return 2
    checks = [correctness(p, args) for p in args.tiny.split(",") if p]
    for c in checks:
        print(json.dumps(c), flush=True)
    rows = []
    for p in [p for p in args.bench.split(",") if p]:
        rows.append(timing(p, args))
        print(json.dumps(rows[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"command": "python tools/check_long_ranges_gpu.py "
                                               + " ".join(sys.argv[1:] if argv is None else argv),
                                               "gpu": torch.cuda.get_device_name() if torch.cuda.is_available()
                                               else None, "correctness": checks,
                                               "timing": rows}, indent=1) + "\n")
    print("| preset | misses | batched ms | one call per range ms | speedup | full recompute ms | max logit diff |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['preset']} | {r['miss_segments']}/{r['miss_segments'] + r['hit_segments']} | "
              f"{min(r['batched_ms'], r['batched_again_ms']):.1f} | {r['per_range_ms']:.1f} | {r['speedup']:.2f}x | "
              f"{r['full_ms']:.1f} | {r['max_abs_logit_diff']:.2e} (of {r['logit_abs_max']:.1f}) |")
    for c in checks:
        print(f"| {c['preset']} correctness | {c['miss_segments']} | max |logit diff| {c['max_abs_logit_diff']:.2e} "
              f"| max state rel diff {c['max_state_rel_diff']:.2e} | | | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
