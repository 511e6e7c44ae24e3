"""Model benchmark of the real-shape presets (engine/models/presets.py): how long one
loads and what GPU memory it leaves for KV, prefill tokens/s and model FLOP utilisation
(MFU) at 4k/16k/64k, decode tokens/s at batch 1 and 32, and the time from `kvengine
serve --preset P` start to ready (first /v1/models answer; and to /health saying the
prefill-stage graphs are captured, which `--prefill-graphs idle`, serve's default and
this tool's, does after ready) as a subprocess, kernel compilation included: once with an empty kernel cache (a fresh machine) and once again
with the cache that run filled (`--kernel-cache`, engine/kernel_cache.py).

    python tools/bench_models.py                 # GPU: both real-shape presets, <= 9 min wall
    python tools/bench_models.py --quick         # CPU, scaled-down variants, seconds

Writes docs/results/models-<date>.json (or `--out`), rewritten after every phase, so a
run cut short still leaves what it measured. Every phase runs under its own timeout (a
SIGALRM in this process; the serve subprocess is killed at its limit) and within the
whole run's `--time-budget-s`, shared by the presets left; a phase that would not fit is
skipped with its reason in the JSON (64k prefill is skipped when the 16k time, scaled,
does not fit what is left), never guessed.

Order, per preset (the budget shared evenly by the presets left): `kvengine serve` to
ready with an empty kernel cache (a fresh directory: a fresh machine), while this process
holds no model; then in this process, compiling into that same directory, load, memory,
prefill per length, decode per batch; then, the model freed (two copies of a 35B model
would not fit one GPU), `kvengine serve` to ready again with the cache the runs filled.

FLOPs (forward pass, counted from the model's own modules on the meta device, so they
follow the preset exactly):
- dense: 2 x in x out per token for every projection (nn.Linear) of every mixer and
  dense MLP; in a MoE layer the router, the `top_k` routed experts' three projections
  (the active experts only) and the shared expert and its gate; the short convolutions
  (2 x channels x width); the LM head for the rows whose logits are computed (the last
  token of a prefill, every row of a decode step). The embedding lookup counts 0.
- attention: causal softmax attention over T tokens from position 0 is 2 x heads x
  head_dim x T^2 per full layer (QK^T and PV, half of the T x T products each), sliding
  window layers 4 x heads x head_dim x T x min(T, w).
- linear: per token and value head, 4 x dk x dv for the state update and the read-out
  (6 x for the delta rule, which also reads k S), plus chunk x (dk + dv) for the
  intra-chunk products of the chunked form. An estimate of the kernels' matmul work.
MFU = counted FLOPs / seconds / peak, against the H200's bf16 dense spec (989.4 TFLOP/s)
and against the matmul peak measured on the same GPU (`--matmul-peak-tflops`, 790 by
default, also measured in this run: the best of 8192^3 bf16 matmuls); `mfu_dense_*`
counts the dense FLOPs only (the target "50% MFU at 16k on the dense parts").
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import gc
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engine.kernel_cache import kernel_cache_dir, use_kernel_cache  # noqa: E402
from tools.model_flops import flop_model  # noqa: E402
from tools.results import write_json  # noqa: E402

H200_BF16_DENSE_TFLOPS = 989.4
H200_MEASURED_MATMUL_TFLOPS = 790.0
REAL_PRESETS = ("qwen3.5-35b-a3b-real", "ring-mini-linear-2.0-real")
QUICK_SERVE = {"qwen3.5-35b-a3b-real": "qwen3next-tiny", "ring-mini-linear-2.0-real": "ring-tiny"}
FULL_LENGTHS = (4096, 16384, 65536)
FULL_BATCHES = (1, 32)
QUICK_LENGTHS = (32, 64)
QUICK_BATCHES = (1, 2)

#: of one preset's share of the budget: the most the cold serve run may take, then the
#: part of what is left the in-process phases may take (the warm serve run has the rest)
COLD_READY_SHARE = 0.55
IN_PROCESS_SHARE = 0.8
#: per-phase time limits (seconds), GPU mode
PHASE_LIMITS = {"ready_cold": 240.0, "ready_warm": 120.0, "load": 90.0, "memory": 30.0, "prefill": 90.0,
                "decode": 60.0, "matmul_peak": 30.0}


class PhaseTimeout(Exception):
    """A phase ran past its limit."""


@contextlib.contextmanager
def phase_limit(seconds: float) -> Iterator[None]:
    """Raise PhaseTimeout in this (main) thread after `seconds` (SIGALRM; a GPU kernel in
    flight finishes first, the next Python step raises)."""
    def fire(_sig, _frm):
        raise PhaseTimeout(f"over its {seconds:.0f} s limit")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


# ----------------------------------------------------------------------- the run
class Report:
    """The JSON document, rewritten after every phase."""

    def __init__(self, path: Path, head: dict[str, Any]) -> None:
        self.path = path
        self.doc: dict[str, Any] = {**head, "presets": {}}
        self.t0 = time.perf_counter()

    def preset(self, name: str) -> dict[str, Any]:
        return self.doc["presets"].setdefault(name, {})

    def write(self) -> None:
        self.doc["elapsed_s"] = round(time.perf_counter() - self.t0, 2)
        write_json(self.path, self.doc, indent=2)


class Budget:
    """The whole run's deadline; a phase gets min(its limit, what is left)."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.perf_counter() + seconds

    def left(self) -> float:
        return self.deadline - time.perf_counter()


def run_phase(report: Report, where: dict, key: str, limit: float, budget: Budget, fn: Callable[[], dict],
              min_s: float = 1.0) -> Optional[dict]:
    """Run one phase under min(limit, budget left); record its result (or why it was
    skipped / failed) under where[key] and rewrite the JSON."""
    allowed = min(limit, budget.left())
    if budget.left() < min_s:
        where[key] = {"skipped": f"time budget spent ({budget.left():.0f} s left)"}
        report.write()
        return None
    t0 = time.perf_counter()
    try:
        with phase_limit(allowed):
            out = fn()
    except PhaseTimeout as exc:
        where[key] = {"skipped": f"timed out: {exc}", "limit_s": round(allowed, 1)}
    except Exception as exc:  # noqa: BLE001  (a failed phase is reported; the run goes on)
        where[key] = {"failed": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"}
    else:
        out.setdefault("phase_s", round(time.perf_counter() - t0, 3))
        where[key] = out
        report.write()
        return out
    report.write()
    _free_memory()
    return None


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _free_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def measure_matmul_peak() -> dict:
    """The best of a few 8192^3 bf16 matmuls, TFLOP/s."""
    import torch

    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    best = 0.0
    for _ in range(10):
        _sync()
        t0 = time.perf_counter()
        for _ in range(5):
            a @ b
        _sync()
        best = max(best, 5 * 2 * n ** 3 / (time.perf_counter() - t0) / 1e12)
    return {"tflops": round(best, 1), "shape": [n, n, n]}


def ready_time(serve_preset: str, cache_dir: Path, quick: bool, limit: float, prefill_graphs: str = "idle") -> dict:
    """Seconds from starting `kvengine serve --preset P --port 0 --prefill-graphs MODE` to
    its first /v1/models answer (HTTP 200, `ready_s`), and to /health saying its
    prefill-stage graphs are captured (`graphs_ready_s`: later than ready in idle mode;
    None in lazy mode, or when the limit came first)."""
    cmd = [sys.executable, "-m", "engine.cli", "serve", "--preset", serve_preset, "--port", "0", "--log-level",
           "info", "--kernel-cache", str(cache_dir), "--prefill-graphs", prefill_graphs]
    if quick:
        cmd += ["--device", "cpu", "--dtype", "float32", "--max-batch", "2"]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("TRITON_CACHE_DIR", None)  # the subprocess takes --kernel-cache
    log = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe: a chatty server never blocks on it
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        m, seen = None, []
        while m is None:  # up to the "kvengine serving ... on http://..." line, or the exit
            line = proc.stdout.readline()
            if not line:
                break
            seen.append(line)
            m = re.search(r"kvengine serving .* on (http://\S+)", line)
        if m is None:
            line = "".join(seen)[-300:]
            proc.kill()
            proc.wait(timeout=30)
            log.seek(0)
            raise RuntimeError(f"serve printed {line!r}, exit {proc.returncode}: {log.read().strip()[-300:]}")
        url = m.group(1) + "/v1/models"
        listening_s = time.perf_counter() - t0
        while True:
            try:
                with urllib.request.urlopen(url, timeout=max(1.0, limit)) as resp:
                    body = json.loads(resp.read())
                    if resp.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.05)
        ready_s = time.perf_counter() - t0
        graphs = {"graphs_ready_s": None} if prefill_graphs == "lazy" else graphs_ready(m.group(1) + "/health", t0, limit)
        files = sum(1 for p in cache_dir.rglob("*") if p.is_file())
        log.seek(0)
        return {"ready_s": round(ready_s, 3), "listening_s": round(listening_s, 3), "serve_preset": serve_preset,
                "prefill_graphs_mode": prefill_graphs, **graphs,
                "models": [d.get("id") for d in body.get("data", [])], "kernel_cache_files": files,
                "breakdown": serve_log_timings(log.read()), "command": " ".join(cmd[1:])}
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        proc.stdout.close()
        log.close()


def graphs_ready(health_url: str, t0: float, limit: float) -> dict:
    """Poll /health until it reports the prefill-stage graphs ready: `graphs_ready_s`,
    seconds from t0 (None: not within `limit` seconds of t0, or the capture failed), and
    /health's `prefill_graphs` at the first poll (`graphs_at_ready`) and the last."""
    first = last = None
    while time.perf_counter() - t0 < limit:
        with urllib.request.urlopen(health_url, timeout=max(1.0, limit)) as resp:
            last = json.loads(resp.read()).get("prefill_graphs")
        first = last if first is None else first
        if last is None or last["ready"]:
            return {"graphs_ready_s": round(time.perf_counter() - t0, 3), "graphs_at_ready": first,
                    "graphs_final": last}
        if last.get("failed"):
            break
        time.sleep(0.1)
    return {"graphs_ready_s": None, "graphs_at_ready": first, "graphs_final": last}


def serve_log_timings(text: str) -> dict[str, float]:
    """The start-up steps engine/builder.py logs with their durations: model load and
    prefill-stage graph capture (which compiles and autotunes the kernels at each bucket;
    before ready with --prefill-graphs upfront, after it with idle)."""
    out: dict[str, float] = {}
    m = re.search(r"loaded model .* in ([0-9.]+) s", text)
    if m:
        out["model_load_s"] = float(m.group(1))
    m = re.search(r"prefill-stage graphs ready \(\w+\): (\d+) graphs .* captured in ([0-9.]+) s", text)
    if m:
        out["prefill_graphs"] = int(m.group(1))
        out["prefill_graph_capture_s"] = float(m.group(2))
    return out


def scaled_down(name: str):
    """The --quick variant of a real-shape preset: its layer pattern cut to one group (one
    full-attention layer), widths divided by 8 (head counts and rotary dims by 4), 8
    experts (4 per group when routing is group-limited: the real group counts kept), a
    1024 vocabulary, float32: the same code path at CPU size."""
    from dataclasses import replace

    from engine.models.presets import get_preset

    cfg = get_preset(name)
    n = cfg.layers.index("full") + 1
    a, lin, moe = cfg.attention, cfg.linear, cfg.moe
    return cfg.replace(
        name=f"{name}:scaled-down", layers=cfg.layers[:n], mlp_layers=cfg.mlp_layers[:n], vocab_size=1024,
        hidden_size=cfg.hidden_size // 8, intermediate_size=max(1, cfg.intermediate_size // 8), dtype="float32",
        attention=replace(a, num_heads=a.num_heads // 4, num_kv_heads=max(1, a.num_kv_heads // 4),
                          head_dim=a.head_dim // 4, rotary_dim=a.rotary_dim // 4),
        linear=replace(lin, num_heads=lin.num_heads // 4, num_v_heads=lin.num_v_heads // 4,
                       key_dim=lin.key_dim // 4, value_dim=lin.value_dim // 4, rotary_dim=lin.rotary_dim // 4),
        moe=replace(moe, num_experts=8 if moe.num_groups == 1 else 4 * moe.num_groups,
                    intermediate_size=moe.intermediate_size // 8,
                    shared_intermediate_size=moe.shared_intermediate_size // 8))


def bench_preset(name: str, args, report: Report, budget: Budget, peaks: dict[str, float]) -> None:
    import torch

    from engine.cache.manager import CacheConfig, CacheManager, cache_specs
    from engine.models.presets import count_parameters, get_preset
    from engine.models.weights import build_model
    from engine.runtime.runner import ModelRunner
    from engine.runtime.sequence import Sequence

    quick = args.quick
    cfg = scaled_down(name) if quick else get_preset(name)
    device = torch.device("cpu" if quick else "cuda")
    dtype = torch.float32 if quick else torch.bfloat16
    out = report.preset(name)
    flops = flop_model(cfg)
    out.update({"config": cfg.name, "family": cfg.family, "parameters": count_parameters(cfg),
                "dense_flops_per_token": flops.dense_per_token,
                "active_parameters_per_token": flops.dense_per_token // 2})
    limits = {k: (v if not quick else 60.0) for k, v in PHASE_LIMITS.items()}

    # load
    holder: dict[str, Any] = {}

    def load() -> dict:
        _sync()
        t0 = time.perf_counter()
        holder["model"] = build_model(cfg, device, dtype)
        _sync()
        secs = time.perf_counter() - t0
        weights = sum(p.numel() * p.element_size() for p in holder["model"].parameters())
        return {"load_s": round(secs, 3), "weights_gib": round(weights / 2**30, 2), "dtype": str(dtype),
                "device": str(device), "how": "meta-device modules, storage made in dtype on the device, seeded "
                "in place (engine.models.weights.build_model)"}

    if run_phase(report, out, "load", limits["load"], budget, load) is None:
        return
    model = holder.pop("model")

    def memory() -> dict:
        probe = CacheManager(cache_specs(model), CacheConfig(block_size=16, num_blocks=0, num_slots=1), device, dtype)
        per_token = probe.bytes_per_block() / 16
        per_seq = probe.bytes_per_slot()
        res = {"kv_bytes_per_token": per_token, "state_bytes_per_sequence": per_seq}
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            res.update({"gpu_total_gib": round(total / 2**30, 2), "gpu_free_after_load_gib": round(free / 2**30, 2),
                        "kv_tokens_in_free_memory": int(free // per_token) if per_token else None,
                        "note": "free memory after the weights, before any cache; kvengine serve keeps "
                                "(1 - gpu_memory_utilization) of it and a 4 GiB activation reserve"})
        return res

    run_phase(report, out, "memory", limits["memory"], budget, memory)

    # prefill
    gen = torch.Generator().manual_seed(0)
    prefill = out.setdefault("prefill", {})
    last: Optional[tuple[int, float]] = None
    for length in args.lengths:
        if last is not None:
            scale = (length / last[0]) ** 2  # attention grows quadratically: a safe projection
            projected = 2 * last[1] * scale  # an untimed warm-up run, then the timed run
            if projected > min(limits["prefill"], budget.left()):
                prefill[str(length)] = {"skipped": f"projected {projected:.0f} s (from {last[0]} tokens in "
                                                   f"{last[1]:.2f} s) does not fit "
                                                   f"{min(limits['prefill'], budget.left()):.0f} s"}
                report.write()
                continue

        def one(length=length) -> dict:
            mgr = CacheManager.for_model(model, CacheConfig.for_tokens(length + 16, num_slots=1, block_size=16))
            runner = ModelRunner(model, mgr)
            ids = torch.randint(0, cfg.vocab_size, (length,), generator=gen)
            times = []
            for r in range(1 + args.repeats):  # the first run compiles / autotunes: untimed
                seq = mgr.allocate(Sequence(f"p{length}-{r}"))
                _sync()
                t0 = time.perf_counter()
                runner.prefill(seq, ids, 0)
                _sync()
                times.append(time.perf_counter() - t0)
                mgr.free(seq)
            secs = statistics.median(times[1:])
            f = flops.prefill(length)
            res = {"seconds": round(secs, 4), "tokens_per_s": round(length / secs, 1), "warmup_s": round(times[0], 3),
                   "flops": f}
            for peak_name, peak in peaks.items():
                res[f"mfu_{peak_name}"] = float(f"{f['total'] / secs / (peak * 1e12):.4g}")
                res[f"mfu_dense_{peak_name}"] = float(f"{f['dense'] / secs / (peak * 1e12):.4g}")
            del runner, mgr
            return res

        got = run_phase(report, prefill, str(length), limits["prefill"], budget, one)
        last = (length, got["seconds"]) if got else last
        _free_memory()

    # decode
    decode = out.setdefault("decode", {})
    for batch in args.batches:
        def one_decode(batch=batch) -> dict:
            ctx = args.decode_context
            mgr = CacheManager.for_model(
                model, CacheConfig.for_tokens((ctx + args.decode_steps + 8) * batch, num_slots=batch, block_size=16))
            runner = ModelRunner(model, mgr)
            seqs = [mgr.allocate(Sequence(f"d{batch}-{i}")) for i in range(batch)]
            for s in seqs:
                runner.prefill(s, torch.randint(0, cfg.vocab_size, (ctx,), generator=gen), 0)
            tok = torch.randint(0, cfg.vocab_size, (batch,), generator=gen).to(device)
            tok = runner.decode(seqs, tok).argmax(-1)  # warm-up: graph capture, autotuning
            _sync()
            t0 = time.perf_counter()
            for _ in range(args.decode_steps):
                tok = runner.decode(seqs, tok).argmax(-1)
            _sync()
            secs = time.perf_counter() - t0
            res = {"tokens_per_s": round(batch * args.decode_steps / secs, 1), "steps": args.decode_steps,
                   "context": ctx, "ms_per_step": round(secs / args.decode_steps * 1e3, 3),
                   "cuda_graphs": runner.graphs is not None}
            for s in seqs:
                mgr.free(s)
            del runner, mgr
            return res

        run_phase(report, decode, str(batch), limits["decode"], budget, one_decode)
        _free_memory()
    del model
    _free_memory()


def bench_ready(name: str, args, report: Report, budget: Budget, run: str, cache: Path,
                limit_share: float = 1.0) -> None:
    """One `kvengine serve` start-to-ready run of `name`'s preset with kernel cache `cache`
    (`run`: "cold" for an empty cache, "warm" for the one the cold run filled). Runs while
    this process holds no model; at most `limit_share` of the budget left."""
    quick = args.quick
    if args.skip_ready or (quick and name != args.presets[0]):  # --quick: one serve run in all
        return
    ready = report.preset(name).setdefault("ready", {})
    serve_preset = QUICK_SERVE[name] if quick else name
    lim = min(PHASE_LIMITS[f"ready_{run}"] if not quick else 60.0, max(budget.left() * limit_share, 1.0))
    run_phase(report, ready, run, lim, budget,
              lambda: ready_time(serve_preset, cache, quick, lim, args.prefill_graphs))


def _versions() -> dict[str, Optional[str]]:
    from importlib import metadata

    import torch

    out: dict[str, Optional[str]] = {"torch": torch.__version__, "python": platform.python_version()}
    for pkg in ("triton", "fla-core"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="CPU, scaled-down variants, short prompts (seconds)")
    ap.add_argument("--presets", default=",".join(REAL_PRESETS), help="comma-separated real-shape presets")
    ap.add_argument("--lengths", default=None, help="prefill lengths, comma-separated (default 4096,16384,65536)")
    ap.add_argument("--batches", default=None, help="decode batch sizes, comma-separated (default 1,32)")
    ap.add_argument("--decode-context", type=int, default=None, help="tokens per sequence before decoding")
    ap.add_argument("--decode-steps", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=None, help="timed prefill runs per length (median)")
    ap.add_argument("--time-budget-s", type=float, default=None, help="whole run (default 510; --quick 50)")
    ap.add_argument("--matmul-peak-tflops", type=float, default=H200_MEASURED_MATMUL_TFLOPS)
    ap.add_argument("--skip-ready", action="store_true", help="no `kvengine serve` start-to-ready runs")
    ap.add_argument("--prefill-graphs", default="idle", choices=("upfront", "idle", "lazy"),
                    help="serve's --prefill-graphs in the start-to-ready runs (default idle, serve's own)")
    ap.add_argument("--out", default=None, help="JSON path (default docs/results/models-<date>.json)")
    args = ap.parse_args(argv)

    q = args.quick
    args.presets = [p for p in args.presets.split(",") if p]
    unknown = [p for p in args.presets if p not in REAL_PRESETS]
    if unknown:
        ap.error(f"--presets: {', '.join(unknown)} not among the real-shape presets {', '.join(REAL_PRESETS)}")
    lengths, batches = (QUICK_LENGTHS, QUICK_BATCHES) if q else (FULL_LENGTHS, FULL_BATCHES)
    args.lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else list(lengths)
    args.batches = [int(x) for x in args.batches.split(",")] if args.batches else list(batches)
    args.decode_context = args.decode_context or (16 if q else 1024)
    args.decode_steps = args.decode_steps or (2 if q else 64)
    args.repeats = args.repeats or (1 if q else 2)
    budget_s = args.time_budget_s or (50.0 if q else 510.0)
    date = _dt.date.today().isoformat()
    out = Path(args.out) if args.out else ROOT / "docs" / "results" / (f"models-quick-{date}.json" if q else
                                                                         f"models-{date}.json")

    # this process compiles through each preset's fresh cache, filled first by its cold serve run
    cache_dir = use_kernel_cache(kernel_cache_dir(None))
    import torch

    if not q and not torch.cuda.is_available():
        ap.error("no CUDA device: run with --quick on the CPU")
    device_name = torch.cuda.get_device_name() if not q else f"cpu-{platform.machine()}"
    peaks = {"spec": H200_BF16_DENSE_TFLOPS, "matmul": args.matmul_peak_tflops}
    report = Report(out, {
        "tool": "tools/bench_models.py", "date": date, "device": device_name, "quick": q, "versions": _versions(),
        "command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
        "budget_s": budget_s,
        "kernel_cache": "a fresh directory per preset: its cold serve run fills it, this process and the warm serve "
                        "run reuse it",
        "peak_tflops": {"spec": H200_BF16_DENSE_TFLOPS, "matmul": args.matmul_peak_tflops,
                        "note": "mfu_spec: vs the H200 bf16 dense spec; mfu_matmul: vs the measured matmul peak"},
        "flop_counting": "see tools/bench_models.py docstring: dense = projections + active experts + convs + "
                         "LM head rows; attention = 2*H*hd*T^2 per full layer; linear = (4|6)*dk*dv + chunk*(dk+dv) "
                         "per token and value head",
        "lengths": args.lengths, "batches": args.batches, "decode_context": args.decode_context, "complete": False,
    })
    budget = Budget(budget_s)
    if not q:
        run_phase(report, report.doc, "matmul_peak_measured", PHASE_LIMITS["matmul_peak"], budget,
                  measure_matmul_peak)
    for i, name in enumerate(args.presets):
        share = Budget(budget.left() / (len(args.presets) - i))
        cache = Path(tempfile.mkdtemp(prefix="kvengine-kernels-"))
        try:
            bench_ready(name, args, report, share, "cold", cache, COLD_READY_SHARE)
            os.environ["TRITON_CACHE_DIR"] = str(cache)  # read at each compile: the serve run's kernels
            bench_preset(name, args, report, Budget(share.left() * IN_PROCESS_SHARE), peaks)
            bench_ready(name, args, report, share, "warm", cache)
        finally:
            os.environ["TRITON_CACHE_DIR"] = str(cache_dir)
            shutil.rmtree(cache, ignore_errors=True)
    report.doc["complete"] = True
    report.write()
    print(json.dumps({k: v for k, v in report.doc.items() if k != "presets"}, indent=1)[:2000])
    for name, res in report.doc["presets"].items():
        pre = {k: v.get("tokens_per_s", v.get("skipped") or v.get("failed")) for k, v in res.get("prefill", {}).items()}
        dec = {k: v.get("tokens_per_s", v.get("skipped") or v.get("failed")) for k, v in res.get("decode", {}).items()}
        ready = {k: v.get("ready_s", v.get("skipped") or v.get("failed")) for k, v in res.get("ready", {}).items()}
        print(f"{name}: load {res.get('load', {}).get('load_s')} s, prefill tok/s {pre}, decode tok/s {dec}, "
              f"ready s {ready}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
