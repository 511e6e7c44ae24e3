"""GPU check of whole-model HiSparse decode through the runner's decode CUDA graphs
(engine/runtime/cuda_graphs.py over engine/hisparse/ layer caches), against eager HiSparse
decode and dense decode with graphs, at one context length and batch (default:
qwen3next-bench, 32k, batch 8, block 64, top-32, auto hot buffer).

1. `build`: `build_engine(preset, EngineConfig(hisparse=..., cuda_graphs=True))` with
   2 x batch sequence slots: the runner must hold decode graphs over the HiSparse layers.
2. `fill`: two sets of `batch` sequences (G and E) get the same contexts: random K/V
   appended through the layer caches (seeded; blocks sealed into the mirror as in a
   prefill), linear-layer states left zero.
3. `equal`: `--steps` decode steps; each step decodes set G through the runner (graphs:
   captured on the first step, replayed after) and set E eagerly (the runner's graphs
   detached for that call), both fed the same tokens (E's argmax, so one near-tie cannot
   fork the runs). Per step: tokens equal, max |logit difference|. With the graphs'
   record (`graph_steps`, captured keys, eager fallbacks, failed captures with frames)
   and the HiSparse metrics of the engine.
4. `timing`: tokens/s of `ModelRunner.decode` at the batch: HiSparse from the graphs (set
   G), HiSparse eager (set E), then dense with graphs (a second engine, no HiSparse, its
   paged pool sized for the batch, contexts filled with random K/V the same way).

Every failure is recorded with the last frames of its traceback (`*_frames`); the JSON is
rewritten after each phase, so a timeout leaves what was measured.

    PYTHONPATH=. python tools/check_hisparse_engine_gpu.py --json /root/out/check_hisparse_engine.json  # H200, < 3 min
    PYTHONPATH=. python tools/check_hisparse_engine_gpu.py --quick   # CPU: qwen3next-tiny, static-buffer steps (CI)

On the CPU (`--quick`) the graphs' static-buffer step runs eagerly (nothing is captured),
so `equal` compares that step, the one a graph would replay, with the eager one. Exit
status 0 when every check passes, 1 if one fails, 2 without CUDA (unless --quick).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engine.builder import EngineConfig, build_engine  # noqa: E402
from engine.hisparse import HiSparseConfig  # noqa: E402
from engine.runtime.runner import ModelRunner  # noqa: E402
from engine.runtime.sequence import Sequence  # noqa: E402
from tools.bench_hisparse import decode_rate, fill_dense_context, fill_hisparse_context  # noqa: E402


def _frames(exc: BaseException, n: int = 8) -> list[str]:
    """The last `n` frames of `exc`'s traceback outside torch, then the innermost one."""
    tb = traceback.extract_tb(exc.__traceback__)
    own = [f for f in tb if "/torch/" not in f.filename.replace("\\", "/")][-n:]
    if tb and (not own or own[-1] is not tb[-1]):
        own.append(tb[-1])
    return [f"{f.filename}:{f.lineno} in {f.name}" for f in own]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _guarded(doc: dict[str, Any], name: str, fn: Callable[[], dict[str, Any]]) -> bool:
    """Run one phase into doc[name]; an exception is recorded with its frames."""
    t0 = time.perf_counter()
    try:
        doc[name] = fn()
        ok = True
    except Exception as exc:  # noqa: BLE001 - every failure goes to the JSON
        doc[name] = {"error": f"{type(exc).__name__}: {exc}"[:500], "error_frames": _frames(exc), "pass": False}
        ok = False
    doc[name]["seconds"] = time.perf_counter() - t0
    return ok


def _engine_config(p: dict[str, Any], hisparse: bool) -> EngineConfig:
    hs = HiSparseConfig(enabled=True, block_size=p["block"], topk=p["topk"], hot_blocks=p["hot"],
                        min_context=p["min_context"]) if hisparse else HiSparseConfig()
    slots = 2 * p["batch"] if hisparse else p["batch"]
    max_len = p["context"] + p["steps"] + p["timing_steps"] + 8
    return EngineConfig(device=p["device"], dtype=p["dtype"], max_num_seqs=slots, max_model_len=max_len,
                        kv_cache_tokens=None if hisparse else p["batch"] * (max_len + 16),
                        cuda_graphs=True, hisparse=hs, prefill_graphs="lazy")


def _runner(engine, device: torch.device) -> ModelRunner:
    runner = engine.runner
    if runner.graphs is None and device.type != "cuda":
        runner.set_cuda_graphs(True)  # CPU: the static-buffer step the graphs would capture, run eagerly
    return runner


def _rate(runner: ModelRunner, seqs: list[Sequence], steps: int, eager: bool) -> float:
    """bench_hisparse.decode_rate, with the runner's decode graphs set aside when `eager`."""
    graphs = runner.graphs
    if eager:
        runner.graphs = None
    try:
        return decode_rate(runner, seqs, steps)
    finally:
        runner.graphs = graphs


class Check:
    """The phases over one HiSparse engine (module docstring)."""

    def __init__(self, p: dict[str, Any]) -> None:
        self.p = p
        self.device = torch.device(p["device"])
        self.engine = None
        self.sets: dict[str, list[Sequence]] = {}

    def build(self) -> dict[str, Any]:
        self.engine = build_engine(self.p["preset"], _engine_config(self.p, True))
        runner = _runner(self.engine, self.device)
        off = self.engine.kv_offload
        ok = runner.graphs is not None and runner.graphs.external == off.layers and bool(off.layers)
        return {"pass": ok, "graphs_on": runner.graphs is not None, "capture": runner.graphs.capture if ok else None,
                "hisparse_layers": len(off.layers), "hot_blocks": off.hot_blocks,
                "device_bytes_per_seq": off.device_bytes_per_slot()}

    def fill(self) -> dict[str, Any]:
        runner = self.engine.runner
        for name in ("G", "E"):
            seqs = [runner.cache.allocate(Sequence(f"{name}{i}")) for i in range(self.p["batch"])]
            fill_hisparse_context(runner, seqs, self.p["context"], torch.Generator().manual_seed(20))
            self.sets[name] = seqs
        _sync(self.device)
        return {"pass": True, "sequences": 2 * self.p["batch"], "context": self.p["context"]}

    def equal(self) -> dict[str, Any]:
        runner = self.engine.runner
        graphs = runner.graphs
        tokens = [1] * self.p["batch"]
        rows, diffs, scale = [], [], 0.0
        for _ in range(self.p["steps"]):
            got = runner.decode(self.sets["G"], tokens)
            runner.graphs = None
            try:
                want = runner.decode(self.sets["E"], tokens)
            finally:
                runner.graphs = graphs
            g_tok, w_tok = got.argmax(-1).tolist(), want.argmax(-1).tolist()
            diffs.append(float((got.float() - want.float()).abs().max()))
            scale = max(scale, float(want.float().abs().max()))
            rows.append({"graph": g_tok, "eager": w_tok})
            tokens = w_tok
        tol = self.p["logit_atol"] * max(1.0, scale)
        same = all(r["graph"] == r["eager"] for r in rows)
        rec = graphs.report()
        used = rec["used"] if graphs.capture else rec["static_steps"] > 0
        ok = same and max(diffs) <= tol and used and not rec["fallbacks"] and not rec["capture_errors"]
        return {"pass": ok, "tokens_equal": same, "max_abs_logit_diff": max(diffs), "logit_tolerance": tol,
                "max_abs_logit": scale, "per_step_max_abs_diff": diffs, "tokens": rows, "graphs": rec,
                "hisparse": self.engine.kv_offload.snapshot()}

    def timing(self) -> dict[str, Any]:
        runner, steps = self.engine.runner, self.p["timing_steps"]
        out: dict[str, Any] = {"batch": self.p["batch"], "context": self.p["context"], "steps": steps}
        out["hisparse_graph_tokens_per_s"] = _rate(runner, self.sets["G"], steps, eager=False)
        out["hisparse_eager_tokens_per_s"] = _rate(runner, self.sets["E"], steps, eager=True)
        out["hisparse_graphs"] = runner.graphs.report()
        for seqs in self.sets.values():
            for seq in seqs:
                runner.cache.free(seq)
        self.engine.kv_offload.close()
        self.engine = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        dense = build_engine(self.p["preset"], _engine_config(self.p, False))
        drunner = _runner(dense, self.device)
        seqs = [drunner.cache.allocate(Sequence(f"D{i}")) for i in range(self.p["batch"])]
        fill_dense_context(drunner, seqs, self.p["context"], torch.Generator().manual_seed(20))
        out["dense_graph_tokens_per_s"] = _rate(drunner, seqs, steps, eager=False)
        out["dense_graphs"] = drunner.graphs.report()
        out["hisparse_graph_over_dense"] = out["hisparse_graph_tokens_per_s"] / out["dense_graph_tokens_per_s"]
        out["hisparse_eager_over_dense"] = out["hisparse_eager_tokens_per_s"] / out["dense_graph_tokens_per_s"]
        out["graph_speedup"] = out["hisparse_graph_tokens_per_s"] / out["hisparse_eager_tokens_per_s"]
        out["pass"] = all(out[k] > 0 for k in ("hisparse_graph_tokens_per_s", "hisparse_eager_tokens_per_s",
                                                "dense_graph_tokens_per_s"))
        return out


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="CPU, qwen3next-tiny, a short context (CI)")
    ap.add_argument("--json", help="output file (default: print only)")
    ap.add_argument("--preset", help="model preset (default qwen3next-bench; quick qwen3next-tiny)")
    ap.add_argument("--context", type=int, help="tokens in each sequence's context (default 32768; quick 200)")
    ap.add_argument("--batch", type=int, help="sequences decoded together (default 8; quick 2)")
    ap.add_argument("--steps", type=int, help="compared decode steps (default 12; quick 3)")
    ap.add_argument("--timing-steps", type=int, help="timed decode steps per kind (default 30; quick 2)")
    args = ap.parse_args(argv)
    q = args.quick
    if not q and not torch.cuda.is_available():
        print("check_hisparse_engine_gpu: no CUDA device (use --quick on the CPU)", file=sys.stderr)
        return 2
    p: dict[str, Any] = {
        "preset": args.preset or ("qwen3next-tiny" if q else "qwen3next-bench"),
        "device": "cpu" if q else "cuda", "dtype": "float32" if q else "bfloat16",
        "context": args.context or (200 if q else 32768), "batch": args.batch or (2 if q else 8),
        "steps": args.steps or (3 if q else 12), "timing_steps": args.timing_steps or (2 if q else 30),
        "block": 16 if q else 64, "topk": 3 if q else 32, "hot": 0, "min_context": 64 if q else 4096,
        "logit_atol": 1e-4 if q else 2e-2,
    }
    doc: dict[str, Any] = {"tool": "tools/check_hisparse_engine_gpu.py", "params": p,
                           "gpu": torch.cuda.get_device_name() if p["device"] == "cuda" else None}

    def save() -> None:
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(args.json + ".tmp")
            tmp.write_text(json.dumps(doc, indent=1))
            tmp.replace(args.json)

    t0 = time.perf_counter()
    check = Check(p)
    ready = True  # equal and timing need the engine built and filled; timing runs after a failed equal
    for name in ("build", "fill", "equal", "timing"):
        if not ready:
            doc[name] = {"skipped": "build or fill failed", "pass": False}
            continue
        ok = _guarded(doc, name, getattr(check, name))
        ready = ready and (ok or name == "equal")
        save()
    doc["seconds"] = time.perf_counter() - t0
    doc["pass"] = all(doc[k].get("pass") for k in ("build", "fill", "equal", "timing"))
    save()
    print(json.dumps({k: doc[k] for k in ("pass", "seconds")} | {
        "equal": {k: doc["equal"].get(k) for k in ("pass", "tokens_equal", "max_abs_logit_diff", "error")},
        "timing": {k: v for k, v in doc["timing"].items() if not isinstance(v, dict)}}, indent=1))
    return 0 if doc["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
