"""Where a prefill's device time goes, by kernel family: one warm prefill profiled.

    python tools/profile_prefill.py --presets qwen3.5-35b-a3b-real,ring-mini-linear-2.0-real \
        --length 16384 --out docs/results/prefill-profile-<date>.json          # H200, ~2 min
    python tools/profile_prefill.py --quick                                      # CPU, seconds

For each preset: the model is built as tools/bench_models.py builds it (meta-device init,
bf16 on the GPU), one untimed prefill of `--length` random tokens warms the kernels, one
timed prefill gives the wall time, and one prefill under torch.profiler gives every
device kernel's time. Kernels are grouped by family (dense GEMM, grouped expert GEMM,
linear attention, softmax attention, norms, routing/permutation, elementwise, other;
the regexes are `FAMILIES` below) and reported with their share of the profiled prefill,
next to the analytic FLOPs of tools/model_flops.py split the same way where it can be
(`matmul` FLOPs vs the GEMM families' time gives their own utilisation). `device_idle`
is the wall time the GPU spent with no kernel running (launch-bound host code shows up
there). `--decode-batch B` adds decode at batch B over 1024-token contexts: ms per step
replayed from the runner's CUDA graphs and eager, and an eager step's kernels by family.
The JSON is rewritten after each preset.
"""
from __future__ import annotations

import argparse
import re
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools.bench_models import H200_BF16_DENSE_TFLOPS  # noqa: E402
from tools.results import write_json  # noqa: E402

#: kernel family -> regex over the kernel's name (first match wins, in this order).
#: Attention comes before the GEMMs (flash kernels' names carry cutlass types), and
#: cutlass's grouped problem shapes (torch's grouped_mm) before the dense GEMMs.
FAMILIES: list[tuple[str, str]] = [
    ("grouped_gemm", r"grouped|group_gemm|GroupedGemm|grouped_mm|GroupProblemShape"),
    ("softmax_attention", r"flash|fmha|attn_fwd|_attn|attention|sdpa|paged"),
    ("dense_gemm", r"gemm|cutlass|nvjet|xmma|cublas|sm90_|sm100_|matmul|Gemm"),
    ("linear_attention", r"chunk|recurrent|delta|kda|gla|lightning|simple_gla|solve_tril|wy|cumsum|l2norm"),
    ("conv", r"conv"),
    ("norm", r"norm"),
    ("routing", r"sort|topk|scatter|gather|index|bincount|histogram|radix|cumsum|offsets"),
    ("copy", r"copy|Memcpy|memcpy|Memset|cat_|CatArray"),
    ("elementwise", r"elementwise|vectorized|unrolled|reduce|silu|sigmoid|softplus|exp|mul|add"),
]


def family(name: str) -> str:
    for fam, pattern in FAMILIES:
        if re.search(pattern, name, flags=re.IGNORECASE):
            return fam
    return "other"


def _kernel_rows(prof) -> list[tuple[str, float, int]]:
    """(kernel name, device microseconds, calls) for every device kernel the profile saw."""
    import torch

    rows = []
    for evt in prof.key_averages():
        dev_us = getattr(evt, "self_device_time_total", None)
        if dev_us is None:
            dev_us = getattr(evt, "self_cuda_time_total", 0.0)
        is_kernel = getattr(evt, "device_type", None) == torch.autograd.DeviceType.CUDA
        if dev_us and (is_kernel or evt.key.startswith("Memcpy") or evt.key.startswith("Memset")):
            rows.append((evt.key, float(dev_us), int(evt.count)))
    return rows


def _cpu_rows(prof, top: int) -> list[dict[str, Any]]:
    """Host ops by self CPU time (the quick path's only time, and launch costs on a GPU)."""
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return [{"op": e.key, "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 3), "calls": int(e.count)} for e in ops]


def _families(kernels: list[tuple[str, float, int]], steps: int = 1) -> dict[str, dict[str, Any]]:
    """Kernels (name, device us, calls) over `steps` runs -> per family and per run: ms, share
    of the busy time, distinct kernels, calls."""
    busy = sum(us for _, us, _ in kernels) / 1e3 / steps
    fams: dict[str, dict[str, float]] = defaultdict(lambda: {"ms": 0.0, "kernels": 0, "calls": 0})
    for kname, us, calls in kernels:
        f = fams[family(kname)]
        f["ms"] += us / 1e3 / steps
        f["kernels"] += 1
        f["calls"] += calls // steps
    return {k: {"ms": round(v["ms"], 3), "share": round(v["ms"] / busy, 4) if busy else None,
                "kernels": v["kernels"], "calls": v["calls"]}
            for k, v in sorted(fams.items(), key=lambda kv: -kv[1]["ms"])}


def utilisation(flops: dict[str, float], by_family: dict[str, dict[str, Any]], prefill_s: float,
                peak_tflops: float = H200_BF16_DENSE_TFLOPS) -> dict[str, Any]:
    """Achieved TFLOP/s and MFU (vs `peak_tflops`) of the whole prefill (counted FLOPs over the
    timed wall time) and of its dense parts from their own kernel time: `gemm` (the matmul
    FLOPs over the dense + grouped GEMM kernels), `attention` (softmax attention FLOPs over
    its kernels) and `dense_parts` (both together). A part whose kernels did not run reads None."""
    def row(f: float, ms: float) -> dict[str, Optional[float]]:
        if not ms or not f:
            return {"tflops": None, "mfu": None, "ms": round(ms, 3)}
        tf = f / (ms / 1e3) / 1e12
        return {"tflops": round(tf, 1), "mfu": round(tf / peak_tflops, 4), "ms": round(ms, 3)}

    def ms_of(*fams: str) -> float:
        return sum(by_family.get(f, {}).get("ms", 0.0) for f in fams)

    gemm_ms, attn_ms = ms_of("dense_gemm", "grouped_gemm"), ms_of("softmax_attention")
    return {"peak_tflops": peak_tflops,
            "whole": row(flops["total"], prefill_s * 1e3),
            "gemm": row(flops["dense"], gemm_ms),
            "attention": row(flops["attention"], attn_ms),
            "dense_parts": row(flops["dense"] + flops["attention"], gemm_ms + attn_ms)}


def profile_decode(model, cfg, batch: int, cuda: bool, top: int, context: int = 1024,
                   steps: int = 4) -> dict[str, Any]:
    """Decode at `batch` over `context` tokens each: ms per step replayed from CUDA graphs
    (as bench_models measures) and eager, and one eager step's kernels by family (per step)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from engine.cache.manager import CacheConfig, CacheManager
    from engine.runtime.runner import ModelRunner
    from engine.runtime.sequence import Sequence

    gen = torch.Generator().manual_seed(1)
    res: dict[str, Any] = {"batch": batch, "context": context}
    for mode in ("graphs", "eager"):
        mgr = CacheManager.for_model(model, CacheConfig.for_tokens((context + 4 * steps + 8) * batch,
                                                                    num_slots=batch, block_size=16))
        runner = ModelRunner(model, mgr, cuda_graphs=(None if mode == "graphs" else False))
        seqs = [mgr.allocate(Sequence(f"{mode}{i}")) for i in range(batch)]
        for seq in seqs:
            runner.prefill(seq, torch.randint(0, cfg.vocab_size, (context,), generator=gen), 0)
        tok = torch.randint(0, cfg.vocab_size, (batch,), generator=gen).to(model_device(model))
        for _ in range(2):
            tok = runner.decode(seqs, tok).argmax(-1)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            tok = runner.decode(seqs, tok).argmax(-1)
        if cuda:
            torch.cuda.synchronize()
        res[f"{mode}_ms_per_step"] = round((time.perf_counter() - t0) / steps * 1e3, 3)
        if mode == "eager" and cuda:
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(steps):
                    tok = runner.decode(seqs, tok).argmax(-1)
                torch.cuda.synchronize()
            kernels = _kernel_rows(prof)
            res["eager_kernel_busy_ms_per_step"] = round(sum(us for _, us, _ in kernels) / 1e3 / steps, 3)
            res["eager_by_family_per_step"] = _families(kernels, steps)
            res["eager_top_kernels_per_step"] = [
                {"kernel": k[:160], "family": family(k), "ms": round(us / 1e3 / steps, 4), "calls": c // steps}
                for k, us, c in sorted(kernels, key=lambda r: -r[1])[:top]]
        for seq in seqs:
            mgr.free(seq)
        del runner, mgr
    return res


def model_device(model):
    return next(model.parameters()).device


def profile_preset(name: str, length: int, quick: bool, top: int, decode_batch: int = 0) -> dict[str, Any]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from engine.cache.manager import CacheConfig, CacheManager
    from engine.models.presets import get_preset
    from engine.models.weights import build_model
    from engine.runtime.runner import ModelRunner
    from engine.runtime.sequence import Sequence
    from tools.bench_models import scaled_down
    from tools.model_flops import flop_model

    cuda = torch.cuda.is_available() and not quick
    cfg = scaled_down(name) if quick else get_preset(name)
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    model = build_model(cfg, device, dtype)
    mgr = CacheManager.for_model(model, CacheConfig.for_tokens(length + 16, num_slots=1, block_size=16))
    runner = ModelRunner(model, mgr)
    ids = torch.randint(0, cfg.vocab_size, (length,), generator=torch.Generator().manual_seed(0))

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def once(tag: str) -> float:
        seq = mgr.allocate(Sequence(tag))
        sync()
        t0 = time.perf_counter()
        runner.prefill(seq, ids, 0)
        sync()
        secs = time.perf_counter() - t0
        mgr.free(seq)
        return secs

    warm = once("warm")
    timed = once("timed")
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        profiled = once("profiled")
    kernels = _kernel_rows(prof) if cuda else []
    busy_ms = sum(us for _, us, _ in kernels) / 1e3
    flops = flop_model(cfg).prefill(length)
    out: dict[str, Any] = {
        "length": length, "device": str(device), "dtype": str(dtype),
        "warmup_s": round(warm, 4), "prefill_s": round(timed, 4), "tokens_per_s": round(length / timed, 1),
        "profiled_prefill_s": round(profiled, 4), "flops": flops,
        "kernel_busy_ms": round(busy_ms, 3),
        "device_idle_ms": round(max(0.0, profiled * 1e3 - busy_ms), 3) if cuda else None,
        "by_family": _families(kernels),
        "top_kernels": [{"kernel": k[:160], "family": family(k), "ms": round(us / 1e3, 3), "calls": c}
                        for k, us, c in sorted(kernels, key=lambda r: -r[1])[:top]],
        "top_host_ops": _cpu_rows(prof, top),
    }
    if decode_batch:
        out["decode"] = profile_decode(model, cfg, decode_batch, cuda, top)
    if cuda:
        out["utilisation"] = utilisation(flops, out["by_family"], timed)
        out["gemm_tflops_achieved"] = out["utilisation"]["gemm"]["tflops"]
    del runner, mgr, model
    if cuda:
        torch.cuda.empty_cache()
    return out


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", default="qwen3.5-35b-a3b-real,ring-mini-linear-2.0-real")
    ap.add_argument("--length", type=int, default=None, help="prompt tokens (default 16384; --quick 256)")
    ap.add_argument("--top", type=int, default=25, help="rows of the top-kernel and host-op tables")
    ap.add_argument("--quick", action="store_true", help="CPU, scaled-down presets")
    ap.add_argument("--decode-batch", type=int, default=0,
                    help="also decode at this batch: graph vs eager ms per step, eager kernels by family")
    ap.add_argument("--out", default=None, help="JSON path (default: print only)")
    args = ap.parse_args(argv)
    length = args.length or (256 if args.quick else 16384)
    report: dict[str, Any] = {"tool": "tools/profile_prefill.py", "argv": sys.argv[1:], "presets": {}}
    status = 0
    for name in [p for p in args.presets.split(",") if p]:
        try:
            res = profile_preset(name, length, args.quick, args.top, args.decode_batch)
        except Exception as exc:  # one preset failing must not lose the others
            res = {"failed": f"{type(exc).__name__}: {exc}"}
            status = 1
        report["presets"][name] = res
        if args.out:
            write_json(Path(args.out), report)
        fams = {k: v["ms"] for k, v in res.get("by_family", {}).items()}
        print(f"{name}: prefill {res.get('prefill_s')} s, idle {res.get('device_idle_ms')} ms, families {fams}"
              if "failed" not in res else f"{name}: {res['failed']}", flush=True)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
