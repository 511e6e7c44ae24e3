"""GPU check of the engine's compute paths: fla kernels + SDPA against the torch path.

For each preset (default: every "tiny" preset), with identical weights:
  1. GPU, backend "fla" vs backend "torch": single-shot prefill logits (every token),
     chunked prefill (chunks straddling fla's 64-token chunks and the KV blocks), token
     decode, and a batched decode of three sequences of different lengths;
  2. GPU torch path vs the CPU torch path (fp32 only): single-shot prefill logits.
Prints the max abs difference and the max abs logit of each comparison, and PASS/FAIL
against a tolerance relative to the logit scale: fla vs torch 1e-2 in fp32 (fla's Triton
kernels use TF32 dots) and 8e-2 in bf16; GPU torch vs CPU torch 1e-4 (TF32 disabled). `--bench` adds each "bench" preset (bf16, random weights) at a 2048-token
prefill + 8 decode steps, fla vs torch.

Run on a CUDA machine from the repository root (fla-core and einops installed; README.md,
"Running on a GPU"):
    PYTHONPATH=. python tools/check_engine_gpu.py [--bench] [--json]
Exit status 0 when every check passes, 1 when one fails, 2 when CUDA or fla is missing.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from engine.cache.manager import CacheConfig, CacheManager
from engine.models.layers.fla_backend import fla_importable
from engine.models.presets import get_preset, list_presets
from engine.models.weights import build_model
from engine.runtime.runner import ModelRunner
from engine.runtime.sequence import Sequence

TOL = {torch.float32: 1e-2, torch.bfloat16: 8e-2}
TOL_GPU_VS_CPU = 1e-4


def make_runner(model, backend: str, max_tokens: int) -> ModelRunner:
    cache = CacheManager.for_model(model, CacheConfig.for_tokens(max_tokens, num_slots=4, block_size=16))
    return ModelRunner(model, cache, backend=backend)


def run_paths(model, backend: str, ids: torch.Tensor, chunks: list[int], decode_steps: int) -> dict:
    n = ids.numel()
    out = {}
    r = make_runner(model, backend, 4 * (n + decode_steps) + 64)
    s = r.cache.allocate(Sequence("single"))
    out["prefill"] = r.prefill(s, ids, all_logits=True).float().cpu()
    dec = []
    for t in range(decode_steps):
        dec.append(r.decode([s], ids[t:t + 1])[0].float().cpu())
    out["decode"] = torch.stack(dec)
    c = r.cache.allocate(Sequence("chunked"))
    parts, start = [], 0
    for m in chunks:
        parts.append(r.prefill(c, ids[start:start + m], all_logits=True).float().cpu())
        start += m
    out["chunked"] = torch.cat(parts)
    r.cache.free(c)
    lens = [max(1, n // 7), n // 2, n - 1]
    seqs = [r.cache.allocate(Sequence(f"b{i}")) for i in range(3)]
    r.cache.free(s)
    for q, m in zip(seqs, lens):
        r.prefill(q, ids[:m])
    steps = []
    for t in range(4):
        toks = torch.stack([ids[(m + t) % n] for m in lens])
        steps.append(r.decode(seqs, toks).float().cpu())
    out["batch_decode"] = torch.stack(steps)
    return out


def compare(name: str, check: str, a: torch.Tensor, b: torch.Tensor, tol: float) -> dict:
    diff = float((a - b).abs().max())
    scale = float(b.abs().max())
    ok = bool(torch.isfinite(a).all()) and diff <= tol * max(1.0, scale)
    return {"preset": name, "check": check, "max_abs_diff": diff, "max_abs_logit": scale, "pass": ok}


def check_preset(name: str, dtype: torch.dtype, n_tokens: int, decode_steps: int, with_cpu: bool) -> list[dict]:
    cfg = get_preset(name)
    model = build_model(cfg, "cuda", dtype)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, min(cfg.vocab_size, 256), (n_tokens,), generator=gen)
    third = n_tokens // 3
    chunks = [third + 5, 37, n_tokens - third - 5 - 37]
    results = []
    torch_out = run_paths(model, "torch", ids.cuda(), chunks, decode_steps)
    fla_out = run_paths(model, "fla", ids.cuda(), chunks, decode_steps)
    tol = TOL[dtype]
    tag = str(dtype).removeprefix("torch.")
    for key in ("prefill", "chunked", "decode", "batch_decode"):
        results.append(compare(name, f"{tag} fla-vs-torch {key}", fla_out[key], torch_out[key], tol))
    results.append(compare(name, f"{tag} torch chunked-vs-single", torch_out["chunked"], torch_out["prefill"], tol))
    if with_cpu and dtype == torch.float32:
        cpu_model = build_model(cfg, "cpu", torch.float32)
        cpu_model.load_state_dict({k: v.cpu() for k, v in model.state_dict().items()})
        r = make_runner(cpu_model, "torch", n_tokens + 64)
        s = r.cache.allocate(Sequence("cpu"))
        cpu_logits = r.prefill(s, ids, all_logits=True)
        results.append(compare(name, "float32 gpu-torch-vs-cpu-torch prefill", torch_out["prefill"], cpu_logits,
                               TOL_GPU_VS_CPU))
    del model
    torch.cuda.empty_cache()
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", nargs="*", default=None, help="preset names (default: every tiny preset)")
    ap.add_argument("--tokens", type=int, default=300, help="prompt length of the tiny checks")
    ap.add_argument("--bench", action="store_true", help="also run every bench preset (bf16, 2048 tokens)")
    ap.add_argument("--json", action="store_true", help="print one JSON object per check")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("CUDA is not available: nothing to check", file=sys.stderr)
        return 2
    if not fla_importable():
        print("fla-core does not import (install the fla-core and einops wheels): cannot compare paths",
              file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False  # the torch path in fp32 stays fp32
    torch.backends.cudnn.allow_tf32 = False
    import fla

    print(f"# torch {torch.__version__}, fla-core {getattr(fla, '__version__', '?')}, "
          f"device {torch.cuda.get_device_name()}", file=sys.stderr)
    names = args.presets or [c.name for c in list_presets("tiny")]
    jobs = [(n, torch.float32, args.tokens, 16, True) for n in names]
    jobs += [(n, torch.bfloat16, args.tokens, 16, False) for n in names]
    if args.bench:
        jobs += [(c.name, torch.bfloat16, 2048, 8, False) for c in list_presets("bench")]
    all_ok = True
    for job in jobs:
        t0 = time.perf_counter()
        try:
            results = check_preset(*job)
        except Exception as e:  # report and continue with the next preset
            results = [{"preset": job[0], "check": f"{job[1]} run", "error": f"{type(e).__name__}: {e}",
                        "pass": False}]
        for r in results:
            all_ok &= r["pass"]
            if args.json:
                print(json.dumps(r))
            elif "error" in r:
                print(f"FAIL {r['preset']:<18} {r['check']:<44} {r['error']}")
            else:
                print(f"{'PASS' if r['pass'] else 'FAIL'} {r['preset']:<18} {r['check']:<44} "
                      f"max|diff|={r['max_abs_diff']:.3e}  max|logit|={r['max_abs_logit']:.3e}")
        print(f"# {job[0]} {job[1]} done in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
