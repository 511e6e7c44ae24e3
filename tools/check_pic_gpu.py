"""GPU check and first timing of position-independent caching (run on a CUDA machine).

Part 1, correctness on CUDA (fp32, tiny presets, fla for linear layers, the Triton
rope_scatter / state_compose kernels for splicing): for each tiny preset,
- one cached segment + question: PIC logits vs a plain prefill with the same chunks
  (max abs difference; 0 means bit-identical),
- the state of the first linear layer after a 3-document PIC prefill vs a plain prefill
  of the whole prompt (relative error; its inputs are context-free, so it must be small),
- a seam as wide as every segment vs full recompute (max abs logit difference),
- context signatures (engine.pic.capture): a captured miss spliced back into its own
  context vs the request that captured it (max abs logit difference), and a first
  placement's capture vs its alone signature (worst relative error of any part).

Part 2, time to first token on a bench preset (bf16, random weights) with the `rag`
workload at bench scale (about 12k-token prompts, Zipf-popular documents): every
method (full, prefix, naive, pic with each --seams) runs the same request stream through
the engine one request at a time, with device-synchronised timing marks. Reported per
method: mean TTFT over all requests and over warm ones (requests that reused something),
the mean time split, and tokens reused / recomputed.

    PYTHONPATH=. python tools/check_pic_gpu.py [--preset qwen3next-bench] [--requests 12]
        [--seams 16,32] [--skip-correctness] [--skip-timing] [--json-path out.json]
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
from engine.models.config import LINEAR_KINDS
from engine.models.weights import load_model
from engine.pic.config import PicConfig
from engine.pic.offline import build_request, prefill_with_plan, release
from engine.pic.planner import make_planner
from engine.runtime.runner import ModelRunner
from engine.runtime.sequence import Sequence
from engine.tokenizer import load_tokenizer

TINY = ("qwen3next-tiny", "ring-tiny", "gemma3-tiny", "nemotronh-tiny", "gla-tiny")


def _docs(n: int, seed: int) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    letters = "abcdefghijklmnopqrstuvwxyz0123456789"
    out = []
    for i in range(3):
        idx = torch.randint(0, len(letters), (n,), generator=g).tolist()
        out.append(f"## doc {i}\n" + "".join(letters[j] for j in idx))
    return out


def correctness(device: torch.device, presets=TINY) -> list[dict]:
    tok = load_tokenizer("byte")
    rows = []
    for name in presets:
        loaded = load_model(name, device=device, dtype=torch.float32)
        model = loaded.model
        mgr = CacheManager.for_model(model, CacheConfig(block_size=16, num_blocks=256, num_slots=4))
        runner = ModelRunner(model, mgr)
        docs, q = _docs(300, 0), "Q: what is in doc 1?\nA: "
        row = {"preset": name, "backend": runner.backend}
        # one segment: PIC vs plain prefill with the same chunks
        planner = make_planner(PicConfig(seam=16, miss_path="alone"), model, loaded.fingerprint, tok)
        req = build_request(tok, [{"text": docs[0], "cache": True}, {"text": q, "cache": False}])
        got = prefill_with_plan(planner, runner, req)
        ids = req.prompt_token_ids
        cut = req.segments[0].token_end
        plain = mgr.allocate(Sequence("plain"))
        runner.prefill(plain, ids[:cut])
        ref = runner.prefill(plain, ids[cut:], start_pos=cut, all_logits=True)
        row["one_segment_max_abs_diff"] = (got.logits - ref).abs().max().item()
        mgr.free(plain)
        release(planner, runner, req)
        # three documents: first linear layer state, and a seam as wide as every segment
        segs = [{"text": d, "cache": True} for d in docs] + [{"text": q, "cache": False}]
        full_planner = make_planner(PicConfig(method="full"), model, loaded.fingerprint, tok)
        ref = prefill_with_plan(full_planner, runner, build_request(tok, segs))
        linear = [i for i, k in enumerate(model.config.layers) if k in LINEAR_KINDS]
        ref_state = mgr.layers[linear[0]].state[ref.seq.slot].clone() if linear else None
        ref_logits = ref.logits[-1].clone()
        release(full_planner, runner, ref.request)
        for seam, key in ((16, "first_linear_state_rel_err"), (10_000, "wide_seam_max_abs_logit_diff")):
            p = make_planner(PicConfig(seam=seam, miss_path="alone"), model, loaded.fingerprint, tok)
            got = prefill_with_plan(p, runner, build_request(tok, segs))
            if key.startswith("first"):
                if ref_state is not None:
                    s = mgr.layers[linear[0]].state[got.seq.slot]
                    row[key] = ((s - ref_state).norm() / ref_state.norm()).item()
            else:
                row[key] = (got.logits[-1] - ref_logits).abs().max().item()
            release(p, runner, got.request)
        row.update(_context_signatures(model, loaded.fingerprint, tok, runner, docs, q))
        rows.append(row)
        print(json.dumps(row), flush=True)
        del model, mgr, runner
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _context_signatures(model, fingerprint: str, tok, runner, docs: list[str], q: str) -> dict:
    """Context signatures (PicConfig.miss_signatures, engine.pic.capture) on this device: a
    request whose middle document is a miss captures it; the same request again splices
    it back into the same context, which must give the first request's logits; and the
    first document's capture (placed first) against its alone signature."""
    from engine.pic.compute import compute_signature

    ctx = PicConfig(seam=16, miss_path="context", miss_signatures="context")
    planner = make_planner(ctx, model, fingerprint, tok)
    for d in (docs[0], docs[2]):
        got = prefill_with_plan(planner, runner, build_request(tok, [{"text": d, "cache": True},
                                                                    {"text": q, "cache": False}]))
        release(planner, runner, got.request)
    segs = [{"text": d, "cache": True} for d in docs] + [{"text": q, "cache": False}]
    first = prefill_with_plan(planner, runner, build_request(tok, segs))
    logits = first.logits[-1].clone()
    release(planner, runner, first.request)
    again = prefill_with_plan(planner, runner, build_request(tok, segs))
    out = {"ctx_splice_back_max_abs_logit_diff": (again.logits[-1] - logits).abs().max().item()}
    release(planner, runner, again.request)
    req = build_request(tok, segs)
    ids = req.prompt_token_ids
    seg0 = req.segments[0]
    anchor = ids[:seg0.token_start]
    content = ids[seg0.token_start:seg0.token_end]
    split = min(len(content), planner.seam)
    sig = planner.cache.get(planner.key(content, split))
    ref = compute_signature(model, content, anchor, split=split, backend=runner.backend)
    worst = 0.0
    for a, b in zip(sig.to_tensors()[0].items(), ref.to_tensors()[0].items()):
        x, y = a[1].float(), b[1].float()
        worst = max(worst, ((x - y).norm() / y.norm().clamp_min(1e-30)).item())
    out["ctx_first_capture_vs_alone_rel_err"] = worst
    return out


def timing(preset: str, n: int, seams: list[int], cache_gib: float, seed: int, device: str = "cuda",
           scale: str = "bench") -> dict:
    from engine.builder import EngineConfig, build_engine
    from engine.pic.run import attach_planner, run_requests, RunRequest
    from tools.workloads import iter_requests

    reqs = [RunRequest(r.id, [s.to_dict() for s in r.segments]) for r in iter_requests("rag", n, seed, scale=scale)]
    engine = build_engine(preset, EngineConfig(device=device, max_num_seqs=1, kv_cache_tokens=65536,
                                               prefill_chunk_size=8192, max_num_batched_tokens=8192))
    cap = int(cache_gib * (1 << 30))
    # warm-up: kernels compile/autotune on the first requests
    attach_planner(engine, PicConfig(method="full"))
    list(run_requests(engine, engine.planner, reqs[:1], 1))
    out = {"preset": preset, "weights": engine.loaded_model.source, "requests": n, "methods": []}
    for method, seam in [("full", 0), ("prefix", 0), ("naive", 0)] + [("pic", s) for s in seams]:
        cfg = PicConfig(method=method, seam=seam, sync_timing=True, signature_cache_bytes=cap, prefix_cache_bytes=cap,
                        miss_path="alone")  # no idle time between requests here: misses cached in the request
        planner = attach_planner(engine, cfg)
        t0 = time.perf_counter()
        recs = list(run_requests(engine, planner, reqs, 1))
        wall = time.perf_counter() - t0
        warm = [r for r in recs if r["reused_tokens"] > 0]

        def mean(key, rows=recs):
            vals = [r[key] for r in rows if r.get(key) is not None]
            return statistics.fmean(vals) if vals else None

        row = {"method": method, "seam": getattr(planner, "seam", None), "wall_s": wall,
               "ttft_ms_mean": mean("ttft_ms"), "ttft_ms_warm_mean": mean("ttft_ms", warm), "warm_requests": len(warm),
               "prompt_tokens": sum(r["prompt_tokens"] for r in recs),
               "reused_tokens": sum(r["reused_tokens"] for r in recs),
               "recomputed_tokens": sum(r["recomputed_tokens"] for r in recs)}
        for k in ("lookup_ms", "miss_ms", "load_compose_ms", "seam_ms", "suffix_ms", "checkpoint_ms"):
            row[k + "_mean"] = mean(k)
        out["methods"].append(row)
        print(json.dumps(row), flush=True)
    full = out["methods"][0]["ttft_ms_mean"]
    prefix = out["methods"][1]["ttft_ms_mean"]
    for row in out["methods"]:
        row["ttft_speedup_vs_full"] = full / row["ttft_ms_mean"] if row["ttft_ms_mean"] else None
        row["ttft_speedup_vs_prefix"] = prefix / row["ttft_ms_mean"] if row["ttft_ms_mean"] else None
    return out


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen3next-bench")
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--seams", default="16,32")
    p.add_argument("--cache-gib", type=float, default=40.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scale", default="bench", help="rag workload scale: bench (~12k tokens) or tiny")
    p.add_argument("--skip-correctness", action="store_true")
    p.add_argument("--skip-timing", action="store_true")
    p.add_argument("--json-path", default=None)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("check_pic_gpu: no CUDA device here", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    result = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__}
    if not a.skip_correctness:
        result["correctness"] = correctness(device)
    if not a.skip_timing:
        result["timing"] = timing(a.preset, a.requests, [int(s) for s in a.seams.split(",") if s], a.cache_gib, a.seed,
                                  scale=a.scale)
    if a.json_path:
        with open(a.json_path, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
