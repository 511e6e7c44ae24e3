"""GPU check of the fused prefill's CUDA-graph stages (engine.runtime.prefill_graphs).

For each preset: a PIC planner (fused pass) on a runner with the graph stages, a cold
request (signatures computed), then the same warm request `--repeats` times with the
stages (the first warm pass captures, the rest replay) and as many times without
(`runner.prefill_stages = None`, the plain eager pass). Reported per preset: the largest
absolute difference of the warm last-token logits (graphs vs plain), whether their argmax
agrees, the computed tokens and bucket, captures / replays, and the median warm prefill
time both ways (device-synchronised) with their ratio. Tiny presets run in float32 (the
logits must agree to float rounding), bench presets in bfloat16 (timing).

    PYTHONPATH=. python tools/check_prefill_graphs_gpu.py [--presets qwen3next-tiny,...]
        [--docs 8] [--doc-chars 600] [--repeats 7] [--json-path out.json]

Prints one JSON line per preset, then the table.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Optional

import torch

from engine.cache.manager import CacheConfig, CacheManager
from engine.models.weights import load_model
from engine.pic.config import PicConfig
from engine.pic.offline import build_request, prefill_with_plan, release
from engine.pic.planner import make_planner
from engine.runtime.prefill_graphs import PrefillStages
from engine.runtime.runner import ModelRunner
from engine.tokenizer import load_tokenizer

DEFAULT_PRESETS = "qwen3next-tiny,ring-tiny,gemma3-tiny,nemotronh-tiny,gla-tiny,qwen3next-bench,ring-bench"


def _segments(n_docs: int, chars: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    letters = "abcdefghijklmnopqrstuvwxyz0123456789 "
    segs = []
    for i in range(n_docs):
        idx = torch.randint(0, len(letters), (chars,), generator=g).tolist()
        segs.append({"text": f"## doc {i}\n" + "".join(letters[j] for j in idx), "cache": True})
    segs.append({"text": "Q: which documents mention the most digits?\nA: ", "cache": False})
    return segs


def _warm(planner, runner, tok, segs, repeats: int):
    times, logits, report = [], None, None
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        got = prefill_with_plan(planner, runner, build_request(tok, segs))
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
        logits, report = got.logits[-1].float().clone(), got.report
        release(planner, runner, got.request)
    return times, logits, report


def check(preset: str, n_docs: int, chars: int, repeats: int, seed: int) -> dict:
    dtype = torch.float32 if preset.endswith("-tiny") else torch.bfloat16
    loaded = load_model(preset, device=torch.device("cuda"), dtype=dtype)
    model = loaded.model
    mgr = CacheManager.for_model(model, CacheConfig(block_size=16, num_blocks=2048, num_slots=4))
    runner = ModelRunner(model, mgr)
    stages = runner.prefill_stages or PrefillStages(model.device)
    tok = load_tokenizer("byte")
    planner = make_planner(PicConfig(seam=16, miss_path="alone"), model, loaded.fingerprint, tok)
    segs = _segments(n_docs, chars, seed)
    cold = prefill_with_plan(planner, runner, build_request(tok, segs))
    release(planner, runner, cold.request)
    runner.prefill_stages = stages
    t_graph, l_graph, rep = _warm(planner, runner, tok, segs, repeats)
    runner.prefill_stages = None
    t_plain, l_plain, _ = _warm(planner, runner, tok, segs, repeats)
    computed = rep.seam_tokens + rep.suffix_tokens if rep is not None else None
    graph_ms, plain_ms = statistics.median(t_graph[1:]), statistics.median(t_plain[1:])
    row = {
        "preset": preset, "dtype": str(dtype).replace("torch.", ""), "backend": runner.backend,
        "computed_tokens": computed, "bucket": None if computed is None else stages.bucket(computed),
        "max_abs_logit_diff": (l_graph - l_plain).abs().max().item(),
        "argmax_agrees": bool(l_graph.argmax() == l_plain.argmax()),
        "captures": stages.captures, "replays": stages.replays, "eager_runs": stages.eager_runs,
        "first_graph_ms": round(t_graph[0], 2), "graph_ms_p50": round(graph_ms, 2),
        "plain_ms_p50": round(plain_ms, 2), "speedup": round(plain_ms / graph_ms, 2),
    }
    del model, mgr, runner, stages
    torch.cuda.empty_cache()
    return row


def table(rows: list[dict]) -> str:
    cols = ("preset", "dtype", "computed_tokens", "bucket", "max_abs_logit_diff", "argmax_agrees", "captures",
            "replays", "first_graph_ms", "graph_ms_p50", "plain_ms_p50", "speedup")
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        out.append("| " + " | ".join(f"{r[c]:.3g}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |")
    return "\n".join(out)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--presets", default=DEFAULT_PRESETS)
    p.add_argument("--docs", type=int, default=8)
    p.add_argument("--doc-chars", type=int, default=600)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-path", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("check_prefill_graphs_gpu: needs CUDA", file=sys.stderr)
        return 2
    rows = []
    for preset in [s for s in args.presets.split(",") if s]:
        row = check(preset, args.docs, args.doc_chars, max(2, args.repeats), args.seed)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    print(table(rows))
    ok = all(r["argmax_agrees"] and (r["dtype"] != "float32" or r["max_abs_logit_diff"] < 1e-3) for r in rows)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
