"""Engine benchmark: the full-recompute baseline every cache win is measured against.

For each "bench" preset (or the presets named): prefill time vs prompt length and decode
tokens/s at batch 1 and 32, through the engine's fast path (linear layers through
flash-linear-attention's Triton kernels where installed, attention through SDPA for
prefill and the paged decode kernel for decode, decode steps replayed as CUDA graphs on
CUDA; the same path without graphs is timed too, "no graphs" rows) and through the
model's plain torch path (the same model object and caches, backend "torch", no graphs),
in one process. Prints one table at the end; `--json` also writes
docs/results/engine-<machine>-<date>.json.

    python tools/bench_engine.py                       # on a GPU, every bench preset
    python tools/bench_engine.py --lengths 4096,16384 --presets qwen3next-bench
    python tools/bench_engine.py --quick               # tiny presets on the CPU, seconds

A measurement whose projected time (linear extrapolation from the previous length)
exceeds `--max-seconds-per-point`, or that would start after its share of
`--time-budget-s` is spent (shared evenly by the presets left, then by the paths; warm-up
compile time credited back up to WARMUP_CREDIT_S; nothing starts after 1.5x the budget), is skipped and shown as "skip" with the reason in the JSON,
never guessed. Prefill is timed as one single-shot `ModelRunner.prefill` call of the
whole prompt (median of `--repeats`; the fast path gets an untimed run at each length
first, so Triton autotuning is not timed); decode as `--decode-steps` batched steps over
sequences holding `--decode-context` tokens each (contexts are filled through the fast
path for both paths: the caches have one layout, only the timed decode differs).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import gc
import math
import platform
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engine.cache.manager import CacheConfig, CacheManager  # noqa: E402
from engine.models.presets import list_presets  # noqa: E402
from engine.models.weights import load_model  # noqa: E402
from engine.runtime.runner import ModelRunner  # noqa: E402
from engine.runtime.sequence import Sequence  # noqa: E402
from tools.results import write_json  # noqa: E402

FULL_LENGTHS = (4096, 8192, 16384, 32768, 65536)
FULL_BATCHES = (1, 32)
QUICK_LENGTHS = (64, 256)
QUICK_BATCHES = (1, 4)


@dataclass
class PathResult:
    """One preset through one path ("engine" or "torch")."""

    backend: str
    prefill_s: dict[int, Optional[float]] = field(default_factory=dict)  # length -> seconds (None: skipped)
    prefill_skip_reason: dict[int, str] = field(default_factory=dict)
    decode_tokens_per_s: dict[int, Optional[float]] = field(default_factory=dict)  # batch -> tokens/s
    #: the engine path without CUDA graphs (only where it used them: CUDA)
    decode_eager_tokens_per_s: dict[int, Optional[float]] = field(default_factory=dict)
    cuda_graphs: bool = False
    decode_skip_reason: dict[int, str] = field(default_factory=dict)


@dataclass
class PresetResult:
    preset: str
    family: str
    layers: list[str]
    num_params: int
    load_s: float
    paths: dict[str, PathResult] = field(default_factory=dict)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], None], device: torch.device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def _manager(model, tokens_per_seq: int, num_seqs: int) -> CacheManager:
    cfg = CacheConfig.for_tokens(tokens_per_seq * num_seqs, num_slots=num_seqs, block_size=16)
    return CacheManager.for_model(model, cfg)


def _free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


WARMUP_CREDIT_S = 90.0  # first-call compile/autotune time forgiven per path, at most


class Budget:
    """Wall-clock share of one path's measurements. Untimed warm-ups (Triton compiling
    and autotuning fla's kernels on first use) are credited back up to WARMUP_CREDIT_S,
    never past `hard_deadline` (the whole run's limit)."""

    def __init__(self, seconds: float, hard_deadline: float = math.inf, parent: Optional["Budget"] = None) -> None:
        self.deadline = time.perf_counter() + seconds
        self.hard_deadline = hard_deadline
        self.parent = parent  # a preset's budget: credit given to one path is not taken from the next
        self._credit = WARMUP_CREDIT_S

    def left(self) -> float:
        return min(self.deadline, self.hard_deadline) - time.perf_counter()

    def credit(self, seconds: float) -> None:
        granted = min(seconds, self._credit)
        self._credit -= granted
        self.deadline += granted
        if self.parent is not None:
            self.parent.deadline += granted


def bench_prefill(model, backend: str, lengths: list[int], repeats: int, max_s: float, out: PathResult,
                  device: torch.device, vocab: int, budget: Budget) -> None:
    gen = torch.Generator().manual_seed(0)
    # warm-up: kernels compile / autotune on a short prompt first
    mgr = _manager(model, 512, 1)
    runner = ModelRunner(model, mgr, backend=backend)
    seq = mgr.allocate(Sequence("warmup"))
    budget.credit(_timed(lambda: runner.prefill(seq, torch.randint(0, vocab, (256,), generator=gen), 0), device))
    mgr.free(seq)
    del runner, mgr
    last: Optional[tuple[int, float]] = None
    for length in lengths:
        if budget.left() <= 0:
            out.prefill_s[length] = None
            out.prefill_skip_reason[length] = "time budget spent"
            continue
        if last is not None:
            projected = last[1] * length / last[0]
            if projected > max_s:
                out.prefill_s[length] = None
                out.prefill_skip_reason[length] = f"projected {projected:.0f}s > {max_s:.0f}s"
                continue
        mgr = _manager(model, length, 1)
        runner = ModelRunner(model, mgr, backend=backend)
        ids = torch.randint(0, vocab, (length,), generator=gen)
        times = []
        try:
            if backend != "torch":  # untimed run: Triton kernels autotune per shape
                seq = mgr.allocate(Sequence(f"w{length}"))
                warm = _timed(lambda: runner.prefill(seq, ids, 0), device)
                mgr.free(seq)
                budget.credit(warm)
            for r in range(repeats):
                seq = mgr.allocate(Sequence(f"p{length}-{r}"))
                times.append(_timed(lambda: runner.prefill(seq, ids, 0), device))
                mgr.free(seq)
                if times[-1] * (repeats - r - 1) > max_s:
                    break
        except torch.OutOfMemoryError as exc:
            out.prefill_s[length] = None
            out.prefill_skip_reason[length] = f"out of memory ({str(exc).splitlines()[0][:60]})"
            last = None
        else:
            out.prefill_s[length] = statistics.median(times)
            last = (length, out.prefill_s[length])
        del runner, mgr
        _free_memory(device)


def _time_decode(runner: ModelRunner, seqs: list, last: torch.Tensor, steps: int, max_s: float,
                 device: torch.device, budget: Budget) -> float:
    """Tokens/s of `steps` greedy batched decode steps (after one untimed warm-up step)."""
    budget.credit(_timed(lambda: runner.decode(seqs, last), device))  # warm-up (graph capture, autotune)
    n = 0
    _sync(device)
    t0 = time.perf_counter()
    while n < steps:
        # greedy tokens feed the next step and stay on the device (no per-step host sync)
        last = runner.decode(seqs, last).argmax(-1)
        n += 1
        if time.perf_counter() - t0 > min(max_s, max(budget.left(), 1.0)):
            break
    _sync(device)
    return len(seqs) * n / (time.perf_counter() - t0)


def bench_decode(model, backend: str, batches: list[int], context: int, steps: int, max_s: float,
                 out: PathResult, device: torch.device, vocab: int, budget: Budget,
                 with_eager: bool = False) -> None:
    """Decode tokens/s per batch. The path's own mode goes to `decode_tokens_per_s` (CUDA
    graphs where the device is CUDA, unless backend is the plain torch path); `with_eager`
    also times the same runner without graphs into `decode_eager_tokens_per_s`, over the
    same filled contexts."""
    gen = torch.Generator().manual_seed(1)
    graphs = None if backend != "torch" else False
    for batch in batches:
        if budget.left() <= 0:
            out.decode_tokens_per_s[batch] = None
            out.decode_skip_reason[batch] = "time budget spent"
            continue
        mgr = _manager(model, context + 2 * steps + 4, batch)
        runner = ModelRunner(model, mgr, backend=backend, cuda_graphs=graphs)
        filler = ModelRunner(model, mgr, backend="auto", cuda_graphs=False)  # same caches, fastest prefill
        try:
            seqs = [mgr.allocate(Sequence(f"d{batch}-{i}")) for i in range(batch)]
            t_fill = 0.0
            for s in seqs:
                t_fill += _timed(lambda: filler.prefill(s, torch.randint(0, vocab, (context,), generator=gen), 0), device)
                if t_fill > max_s:
                    raise TimeoutError(f"filling {batch} contexts took over {max_s:.0f}s")
            last = torch.randint(0, vocab, (batch,), generator=gen).to(device)
            out.decode_tokens_per_s[batch] = _time_decode(runner, seqs, last, steps, max_s, device, budget)
            if with_eager and runner.graphs is not None:
                if budget.left() <= 0:
                    out.decode_eager_tokens_per_s[batch] = None
                    out.decode_skip_reason[batch] = "eager decode: time budget spent"
                else:
                    runner.set_cuda_graphs(False)
                    out.decode_eager_tokens_per_s[batch] = _time_decode(runner, seqs, last, steps, max_s,
                                                                        device, budget)
        except (TimeoutError, torch.OutOfMemoryError) as exc:
            out.decode_tokens_per_s.setdefault(batch, None)
            out.decode_skip_reason[batch] = str(exc).splitlines()[0][:80]
        del runner, filler, mgr
        _free_memory(device)


def machine_name(device: torch.device) -> str:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"cpu-{platform.machine()}"
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def _versions() -> dict[str, Optional[str]]:
    from importlib import metadata

    out: dict[str, Optional[str]] = {"torch": torch.__version__, "python": platform.python_version()}
    for pkg in ("triton", "fla-core"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def _fmt_s(v: Optional[float]) -> str:
    if v is None:
        return "skip"
    return f"{v * 1e3:.1f}ms" if v < 1 else f"{v:.2f}s"


def _fmt_rate(v: Optional[float]) -> str:
    return "skip" if v is None else f"{v:.1f}"


def format_table(results: list[PresetResult], lengths: list[int], batches: list[int]) -> str:
    head = ["preset", "path"] + [f"prefill {n // 1024}k" if n >= 1024 else f"prefill {n}" for n in lengths]
    head += [f"decode b{b} tok/s" for b in batches]
    rows = [head]
    for res in results:
        for name, p in res.paths.items():
            row = [res.preset, f"{name} ({p.backend}{', graphs' if p.cuda_graphs else ''})"]
            row += [_fmt_s(p.prefill_s.get(n)) for n in lengths]
            row += [_fmt_rate(p.decode_tokens_per_s.get(b)) for b in batches]
            rows.append(row)
            if p.decode_eager_tokens_per_s:
                row = [res.preset, f"{name} ({p.backend}, no graphs)"] + ["" for _ in lengths]
                row += [_fmt_rate(p.decode_eager_tokens_per_s.get(b)) for b in batches]
                rows.append(row)
        eng, base = res.paths.get("engine"), res.paths.get("torch")
        if eng and base:
            row = [res.preset, "speedup"]
            for n in lengths:
                a, b = eng.prefill_s.get(n), base.prefill_s.get(n)
                row.append(f"{b / a:.2f}x" if a and b else "-")
            for bt in batches:
                a, b = eng.decode_tokens_per_s.get(bt), base.decode_tokens_per_s.get(bt)
                row.append(f"{a / b:.2f}x" if a and b else "-")
            rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny presets on the CPU, short prompts (seconds)")
    ap.add_argument("--presets", default=None, help="comma-separated preset names (default: every bench preset)")
    ap.add_argument("--lengths", default=None, help="prefill prompt lengths, comma-separated")
    ap.add_argument("--batches", default=None, help="decode batch sizes, comma-separated")
    ap.add_argument("--decode-context", type=int, default=None, help="tokens per sequence before decoding")
    ap.add_argument("--decode-steps", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=None, help="prefill repeats per length (median)")
    ap.add_argument("--max-seconds-per-point", type=float, default=None)
    ap.add_argument("--time-budget-s", type=float, default=None,
                    help="wall-clock budget of the whole run, shared evenly by the presets left")
    ap.add_argument("--paths", default="engine,torch", help="engine (fla/SDPA) and/or torch (plain torch ops)")
    ap.add_argument("--no-eager-decode", action="store_true",
                    help="engine path: skip the decode timing without CUDA graphs")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--json", action="store_true", help="write docs/results/engine-<machine>-<date>.json")
    ap.add_argument("--json-path", default=None, help="write the JSON here instead")
    args = ap.parse_args(argv)

    quick = args.quick
    device = torch.device(args.device or ("cpu" if quick or not torch.cuda.is_available() else "cuda"))
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
        args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    ]
    lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else list(QUICK_LENGTHS if quick else FULL_LENGTHS)
    batches = [int(x) for x in args.batches.split(",")] if args.batches else list(QUICK_BATCHES if quick else FULL_BATCHES)
    context = args.decode_context or (64 if quick else 2048)
    steps = args.decode_steps or (4 if quick else 32)
    repeats = args.repeats or (1 if quick else 2)
    max_s = args.max_seconds_per_point or (30.0 if quick else 15.0)
    total_budget = args.time_budget_s or (300.0 if quick else 330.0)
    scale = "tiny" if quick else "bench"
    presets = [p for p in list_presets() if p.scale == scale]
    if args.presets:
        wanted = args.presets.split(",")
        presets = [p for p in list_presets() if p.name in wanted]
        missing = set(wanted) - {p.name for p in presets}
        if missing:
            ap.error(f"--presets: unknown preset(s) {sorted(missing)}")
    paths = {"engine": "auto", "torch": "torch"}
    chosen = [p for p in args.paths.split(",") if p]
    for p in chosen:
        if p not in paths:
            ap.error(f"--paths: {p!r} is not engine or torch")

    started = time.perf_counter()
    hard_deadline = started + 1.5 * total_budget  # nothing new starts after this, warm-up credit or not
    machine = machine_name(device)

    def save(rows: list[PresetResult], complete: bool) -> Optional[Path]:
        """Write the run JSON (atomically) with the rows so far; None without --json."""
        if not (args.json or args.json_path):
            return None
        date = _dt.date.today().isoformat()
        path = Path(args.json_path) if args.json_path else ROOT / "docs" / "results" / f"engine-{machine}-{date}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        doc = {
            "benchmark": "engine",
            "date": date,
            "machine": machine,
            "device": str(device),
            "dtype": str(dtype).removeprefix("torch."),
            "command": " ".join(["python", "tools/bench_engine.py", *(argv if argv is not None else sys.argv[1:])]),
            "versions": _versions(),
            "settings": {"lengths": lengths, "batches": batches, "decode_context": context, "decode_steps": steps,
                         "repeats": repeats, "max_seconds_per_point": max_s, "time_budget_s": total_budget},
            "complete": complete,
            "results": [asdict(r) for r in rows],
            "wall_s": time.perf_counter() - started,
        }
        return write_json(path, doc, indent=2)
    results: list[PresetResult] = []
    for i, cfg in enumerate(presets):
        preset_budget = Budget((total_budget - (time.perf_counter() - started)) / (len(presets) - i), hard_deadline)
        t0 = time.perf_counter()
        loaded = load_model(cfg.name, device=device, dtype=dtype)
        model = loaded.model
        _sync(device)
        res = PresetResult(cfg.name, cfg.family, list(cfg.layers), sum(p.numel() for p in model.parameters()),
                           time.perf_counter() - t0)
        vocab = cfg.vocab_size
        for j, name in enumerate(chosen):
            budget = Budget(preset_budget.left() / (len(chosen) - j), hard_deadline, preset_budget)  # its share
            probe = ModelRunner(model, _manager(model, 16, 1), backend=paths[name],
                                cuda_graphs=None if name == "engine" else False)
            pr = PathResult(backend=probe.backend, cuda_graphs=probe.graphs is not None)
            del probe
            print(f"[{time.perf_counter() - started:6.1f}s] {cfg.name}: {name} path ({pr.backend}) prefill", flush=True)
            bench_prefill(model, paths[name], lengths, repeats, max_s, pr, device, vocab, budget)
            print(f"[{time.perf_counter() - started:6.1f}s] {cfg.name}: {name} path decode", flush=True)
            bench_decode(model, paths[name], batches, context, steps, max_s, pr, device, vocab, budget,
                         with_eager=name == "engine" and not args.no_eager_decode)
            res.paths[name] = pr
            save(results + [res], complete=False)  # a run stopped by a time limit keeps its finished rows
        results.append(res)
        del model, loaded
        _free_memory(device)

    table = format_table(results, lengths, batches)
    path = save(results, complete=True)
    if path is not None:
        print(f"wrote {path}", flush=True)
    print(f"\nengine benchmark on {machine} ({device}, {str(dtype).removeprefix('torch.')}), "
          f"decode context {context}, {steps} steps; wall {time.perf_counter() - started:.0f}s")
    print(table, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
