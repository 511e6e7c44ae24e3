"""Command line of tools.train: train the tiny presets on the workload mixture, one after
another in this process (`--presets a,b`) or side by side in child processes sharing the
GPU (`--parallel`), then print one table of per-task accuracy.

    python -m tools.train --preset qwen3next-tiny [--steps N --batch B --lr LR --seq-len L
        --seed S --out models/qwen3next-tiny --device cuda --dtype bf16 --eval-every K
        --time-limit-s T ...]
    python -m tools.train --presets qwen3next-tiny,ring-tiny,gemma3-tiny --parallel \\
        --time-limit-s 400 --out-root models --bundle-dir $OUT

Each run writes `<out>/config.json`, `<out>/model.safetensors` (fp32) and
`<out>/train_log.json`; `--out-root R` puts preset P under `R/P` (default `models/`, where
`engine.models.weights.load_model(P)` looks). `--bundle-dir D` also writes `D/<P>.tar`
(the three files under `<P>/`; written as soon as that model is saved, so a run cut short
keeps the models already done) and, at the end, `D/summary.json`: few files, for a
machine that returns at most 8. `--eval-only` scores saved models instead of training (`load_model` paths).

Tiny models are launch-bound on a big GPU, so `--parallel` (one process per preset) uses
the GPU several times better than running them in turn; data workers are split between
the children (`--workers` each, default: the CPUs left over, shared out).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

from engine.models.presets import get_preset, list_presets
from engine.models.weights import CONFIG_FILE, WEIGHTS_FILE, default_models_root
from tools.workloads import TASKS

from .curriculum import GateConfig
from .data import DataConfig, parse_mix
from .errors import TrainConfigError, TrainError
from .trainer import LOG_FILE, TrainConfig, model_config, train

DEFAULT_TINY = "qwen3next-tiny,ring-tiny,gemma3-tiny,nemotronh-tiny"
#: set for --parallel children: the command the user ran (recorded in each train_log.json)
PARENT_COMMAND_ENV = "TOOLS_TRAIN_PARENT_COMMAND"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m tools.train", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--preset", help="one preset to train (e.g. qwen3next-tiny)")
    which.add_argument("--presets", help=f"comma-separated presets, trained in turn (or --parallel); "
                                         f"'tiny' = {DEFAULT_TINY}")
    ap.add_argument("--parallel", action="store_true", help="train the --presets side by side, one child process each")
    ap.add_argument("--gpus", default="auto",
                    help="--parallel: GPUs to spread the children over, e.g. 0,1 (child i gets "
                         "CUDA_VISIBLE_DEVICES=gpus[i %% n]); auto: every visible GPU; none: leave the environment")
    ap.add_argument("--out", help="output directory of a single --preset (default: <out-root>/<preset>)")
    ap.add_argument("--out-root", default=None, help="parent of per-preset output dirs (default: models/)")
    ap.add_argument("--bundle-dir", default=None, help="also write <dir>/<preset>.tar and <dir>/summary.json")
    ap.add_argument("--steps", type=int, default=TrainConfig.steps, help="step limit (default: time limit rules)")
    ap.add_argument("--time-limit-s", type=float, default=None, help="training seconds per preset")
    ap.add_argument("--batch", type=int, default=TrainConfig.batch_size, help="sequences per step")
    ap.add_argument("--lr", type=float, default=TrainConfig.lr)
    ap.add_argument("--min-lr-frac", type=float, default=TrainConfig.min_lr_frac)
    ap.add_argument("--warmup-steps", type=int, default=TrainConfig.warmup_steps)
    ap.add_argument("--weight-decay", type=float, default=TrainConfig.weight_decay)
    ap.add_argument("--grad-clip", type=float, default=TrainConfig.grad_clip)
    ap.add_argument("--prompt-loss-weight", type=float, default=TrainConfig.prompt_loss_weight,
                    help="weight of the document-token loss next to the answer-token loss")
    ap.add_argument("--question-loss-weight", type=float, default=TrainConfig.question_loss_weight,
                    help="weight of the question-token loss (keys there are copied from the documents)")
    ap.add_argument("--demo-loss-weight", type=float, default=TrainConfig.demo_loss_weight,
                    help="weight of the loss on fewshot demonstration outputs")
    ap.add_argument("--seq-len", type=int, default=DataConfig.max_len, help="longest training sequence (tokens)")
    ap.add_argument("--extra-questions", type=int, default=DataConfig.extra_questions,
                    help="questions appended after the first answer of each example")
    ap.add_argument("--curriculum-frac", type=float, default=DataConfig.curriculum_frac,
                    help="curriculum length c: sizes widen until c, mix until 2c, then full size (0: off)")
    ap.add_argument("--gate-loss", type=float, default=GateConfig.threshold,
                    help="loss-gated curriculum: hold short prompts (and peak lr) until the gate tasks' answer "
                         "loss (EMA, nats/token) is below this; 0: time-gated curriculum")
    ap.add_argument("--gate-tasks", default=",".join(GateConfig.tasks), help="tasks whose answer loss opens the gate")
    ap.add_argument("--gate-deadline", type=float, default=GateConfig.deadline,
                    help="progress at which the gate opens anyway")
    ap.add_argument("--gate-hold-level", type=float, default=GateConfig.hold_level,
                    help="while held, size levels are drawn from U(0, this)")
    ap.add_argument("--max-level", type=float, default=DataConfig.max_level,
                    help="cap on the curriculum size level (1: full-size prompts; <1: short only, CPU runs)")
    ap.add_argument("--min-docs", type=int, default=DataConfig.min_docs,
                    help="documents per prompt at curriculum level 0")
    ap.add_argument("--min-items", type=int, default=DataConfig.min_items,
                    help="facts / examples per document at curriculum level 0")
    ap.add_argument("--pad-multiple", type=int, default=DataConfig.pad_multiple,
                    help="batches are padded to a multiple of this many tokens")
    ap.add_argument("--mix", default=None, help="task weights, e.g. fact=1,twohop=2 (default: data.DEFAULT_MIX)")
    ap.add_argument("--no-bos", action="store_true", help="do not prepend BOS (the engine does)")
    ap.add_argument("--seed", type=int, default=TrainConfig.seed)
    ap.add_argument("--device", default=TrainConfig.device, help="auto | cpu | cuda[:i]")
    ap.add_argument("--dtype", default=TrainConfig.dtype, choices=["bf16", "fp16", "fp32"],
                    help="autocast dtype on CUDA (master weights stay fp32)")
    ap.add_argument("--backend", default=TrainConfig.backend, choices=["auto", "torch", "fla"],
                    help="linear-attention kernels (auto: fla on CUDA when importable)")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model (off: compile time)")
    ap.add_argument("--eval-every", type=int, default=TrainConfig.eval_every, help="steps between quick evals (0: none)")
    ap.add_argument("--eval-n", type=int, default=TrainConfig.eval_n, help="requests per task in quick evals")
    ap.add_argument("--eval-tasks", default=",".join(TrainConfig.eval_tasks))
    ap.add_argument("--final-eval-n", type=int, default=TrainConfig.final_eval_n)
    ap.add_argument("--final-eval-tasks", default=",".join(TrainConfig.final_eval_tasks))
    ap.add_argument("--eval-seed", type=int, default=TrainConfig.eval_seed)
    ap.add_argument("--eval-overrides", default=None,
                    help='JSON of workload make_config overrides for evaluation, e.g. \'{"docs": "2-3"}\' '
                         "(default: the tiny pools the quality harness uses)")
    ap.add_argument("--eval-batch", type=int, default=TrainConfig.eval_batch)
    ap.add_argument("--log-every", type=int, default=TrainConfig.log_every)
    ap.add_argument("--workers", type=int, default=None, help="data worker processes per run")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--model-overrides", default=None,
                    help='JSON of top-level ModelConfig fields to change, e.g. \'{"hidden_size": 64}\'')
    ap.add_argument("--init-root", default=None,
                    help="start each model from the weights saved in <init-root>/<name>/ (continue training)")
    ap.add_argument("--no-fla-check", action="store_true",
                    help="skip the start-of-run fla-vs-torch gradient check (fla then only where its guards allow)")
    ap.add_argument("--fla-check-tol", type=float, default=TrainConfig.fla_check_tol,
                    help="per-parameter relative gradient error the fla path may show (on top of bf16 noise)")
    ap.add_argument("--eval-only", action="store_true", help="score saved models (no training)")
    return ap


def _tasks(text: str, option: str) -> tuple[str, ...]:
    names = tuple(t for t in (s.strip() for s in text.split(",")) if t)
    for t in names:
        if t not in TASKS:
            raise TrainConfigError(f"{option} names unknown task {t!r}; known: {', '.join(TASKS)}")
    return names


def _presets(args: argparse.Namespace) -> list[str]:
    if args.preset:
        names = [args.preset]
    else:
        text = args.presets or "tiny"
        names = [p.strip() for p in (DEFAULT_TINY if text == "tiny" else text).split(",") if p.strip()]
    for name in names:
        get_preset(name)  # raises PresetNotFoundError naming it
    if len(set(names)) != len(names):
        raise TrainConfigError(f"--presets repeats a preset: {names}")
    return names


def _out_dir(args: argparse.Namespace, preset: str) -> Path:
    """--out for a single --preset; else <out-root>/<model name> (`<preset>-custom` when
    --model-overrides changes the preset, so it never shadows the preset's weights)."""
    if args.out and args.preset:
        return Path(args.out)
    root = Path(args.out_root) if args.out_root else default_models_root()
    return root / (f"{preset}-custom" if args.model_overrides else preset)


def _default_workers(parallel_runs: int) -> int:
    cpus = os.cpu_count() or 2
    return max(0, min(8, (cpus - parallel_runs) // parallel_runs))


def _json_items(text: str | None, option: str) -> tuple:
    if not text:
        return ()
    try:
        return tuple(sorted(json.loads(text).items()))
    except (json.JSONDecodeError, AttributeError) as exc:
        raise TrainConfigError(f"{option} is not a JSON object: {text!r}") from exc


def train_config(args: argparse.Namespace, preset: str, workers: int) -> TrainConfig:
    overrides = _json_items(args.model_overrides, "--model-overrides")
    data = DataConfig(mix=parse_mix(args.mix) if args.mix else DataConfig().mix,
                      extra_questions=args.extra_questions, bos=not args.no_bos, max_len=args.seq_len,
                      curriculum_frac=args.curriculum_frac, max_level=args.max_level, min_docs=args.min_docs,
                      min_items=args.min_items, pad_multiple=args.pad_multiple)
    cfg = TrainConfig(
        preset=preset, out_dir=str(_out_dir(args, preset)), steps=args.steps, batch_size=args.batch, lr=args.lr,
        min_lr_frac=args.min_lr_frac, warmup_steps=args.warmup_steps, weight_decay=args.weight_decay,
        grad_clip=args.grad_clip, prompt_loss_weight=args.prompt_loss_weight,
        question_loss_weight=args.question_loss_weight, demo_loss_weight=args.demo_loss_weight, seed=args.seed, device=args.device,
        dtype=args.dtype, backend=args.backend, time_limit_s=args.time_limit_s, eval_every=args.eval_every,
        eval_n=args.eval_n, eval_tasks=_tasks(args.eval_tasks, "--eval-tasks"), final_eval_n=args.final_eval_n,
        final_eval_tasks=_tasks(args.final_eval_tasks, "--final-eval-tasks"), eval_seed=args.eval_seed,
        eval_overrides=_json_items(args.eval_overrides, "--eval-overrides"),
        eval_batch=args.eval_batch, log_every=args.log_every, compile=args.compile, workers=workers,
        threads=args.threads, model_overrides=overrides, data=data,
        gate=GateConfig(threshold=args.gate_loss, tasks=_tasks(args.gate_tasks, "--gate-tasks"),
                        deadline=args.gate_deadline, hold_level=args.gate_hold_level),
        fla_check=not args.no_fla_check, fla_check_tol=args.fla_check_tol,
        init_from=str(Path(args.init_root) / _out_dir(args, preset).name) if args.init_root else None)
    cfg.validate()
    model_config(cfg)  # raises ConfigError naming a bad --model-overrides field
    return cfg


# ----------------------------------------------------------------- parallel runs
def _child_argv(argv: list[str], preset: str, workers: int, out: Path) -> list[str]:
    """This command's options for one preset: drop --presets/--parallel/--out*/--workers,
    add --preset, --out and --workers (a child writes its own bundle as soon as it is done)."""
    drop_with_value = {"--presets", "--out-root", "--out", "--workers", "--preset", "--gpus"}
    out_args, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        key = a.split("=", 1)[0]
        if key in drop_with_value:
            skip = "=" not in a
            continue
        if a == "--parallel":
            continue
        out_args.append(a)
    return [sys.executable, "-m", "tools.train", *out_args, "--preset", preset, "--out", str(out),
            "--workers", str(workers)]


def _pump(stream, sink) -> None:
    for line in iter(stream.readline, ""):
        sink.write(line)
        sink.flush()


def _visible_gpus() -> list[str]:
    """The GPUs this process sees, as CUDA_VISIBLE_DEVICES entries for its children."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [g.strip() for g in visible.split(",") if g.strip()]
    try:
        import torch
        return [str(i) for i in range(torch.cuda.device_count())]
    except Exception:  # no torch CUDA runtime: nothing to spread over
        return []


def parse_gpus(text: str) -> list[str] | None:
    """--gpus: 'auto' (every visible GPU; None when there is none), 'none' (leave the
    children's environment alone: None) or a comma-separated list of device ids."""
    text = text.strip()
    if text == "none":
        return None
    if text == "auto":
        return _visible_gpus() or None
    gpus = [g.strip() for g in text.split(",") if g.strip()]
    if not gpus or not all(g.isdigit() or g.startswith(("GPU-", "MIG-")) for g in gpus):
        raise TrainConfigError(f"--gpus must be auto, none or device ids like 0,1; got {text!r}")
    return gpus


def gpu_assignment(presets: list[str], gpus: list[str] | None) -> dict[str, str | None]:
    """Child i (preset order) runs on gpus[i % len(gpus)]; None: no CUDA_VISIBLE_DEVICES set."""
    return {p: (gpus[i % len(gpus)] if gpus else None) for i, p in enumerate(presets)}


def run_parallel(argv: list[str], args: argparse.Namespace, presets: list[str]) -> int:
    workers = args.workers if args.workers is not None else _default_workers(len(presets))
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    env[PARENT_COMMAND_ENV] = shlex.join(["python", "-m", "tools.train", *argv])
    placement = gpu_assignment(presets, parse_gpus(args.gpus))
    procs = []
    for preset in presets:
        cmd = _child_argv(argv, preset, workers, _out_dir(args, preset))
        if not args.threads:  # children share the CPUs with each other and their data workers
            cmd += ["--threads", "2"]
        child_env = dict(env)
        if placement[preset] is not None:
            child_env["CUDA_VISIBLE_DEVICES"] = placement[preset]
        print(f"[parallel] CUDA_VISIBLE_DEVICES={placement[preset]} {shlex.join(cmd)}", flush=True)
        p = subprocess.Popen(cmd, env=child_env, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
        t = threading.Thread(target=_pump, args=(p.stdout, sys.stdout), daemon=True)
        t.start()
        procs.append((preset, p, t))
    status = 0
    for preset, p, t in procs:
        rc = p.wait()
        t.join(timeout=5)
        if rc:
            print(f"[parallel] {preset} exited with status {rc}", flush=True)
            status = 1
    return status


# ------------------------------------------------------------------- reporting
def read_log(out_dir: Path) -> dict | None:
    path = out_dir / LOG_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def summary_rows(args: argparse.Namespace, presets: list[str]) -> list[dict]:
    rows = []
    for preset in presets:
        log = read_log(_out_dir(args, preset))
        if log is None or "final_eval" not in log:
            rows.append({"preset": preset, "ok": False})
            continue
        rows.append({"preset": preset, "ok": not log.get("aborted", False), "steps": log["steps"],
                     "train_wall_s": log["train_wall_s"], "final_loss": log["final_loss"],
                     "backend": log["environment"]["backend"], "scores": log["final_eval"]["scores"],
                     "eval_n": log["final_eval"]["n"], "fingerprint": log.get("fingerprint")})
    return rows


def format_table(rows: list[dict]) -> str:
    tasks = [t for t in TASKS if any(t in r.get("scores", {}) for r in rows)]
    head = f"{'preset':<16} {'steps':>6} {'train_s':>7} {'loss':>6}  " + " ".join(f"{t:>9}" for t in tasks)
    lines = [head, "-" * len(head)]
    for r in rows:
        if "scores" not in r:
            lines.append(f"{r['preset']:<16} {'FAILED (no final eval)':>30}")
            continue
        cells = " ".join(f"{r['scores'].get(t, float('nan')):>9.1f}" for t in tasks)
        flag = "" if r["ok"] else "  (aborted)"
        steps = "-" if r.get("steps") is None else r["steps"]
        wall = "-" if r.get("train_wall_s") is None else f"{r['train_wall_s']:.0f}"
        loss = "-" if r.get("final_loss") is None else f"{r['final_loss']:.3f}"
        lines.append(f"{r['preset']:<16} {steps:>6} {wall:>7} {loss:>6}  {cells}{flag}")
    return "\n".join(lines)


def bundle_one(args: argparse.Namespace, preset: str) -> Path | None:
    """Write <bundle-dir>/<name>.tar holding <name>/{config.json, model.safetensors,
    train_log.json} (name: the output dir's name); None when nothing was saved."""
    src = _out_dir(args, preset)
    files = [f for f in (CONFIG_FILE, WEIGHTS_FILE, LOG_FILE) if (src / f).is_file()]
    if not files:
        return None
    d = Path(args.bundle_dir)
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / f".{src.name}.tar.tmp"
    with tarfile.open(tmp, "w") as tar:
        for f in files:
            tar.add(src / f, arcname=f"{src.name}/{f}")
    tmp.replace(d / f"{src.name}.tar")
    return d / f"{src.name}.tar"


def write_summary(args: argparse.Namespace, rows: list[dict]) -> None:
    d = Path(args.bundle_dir)
    d.mkdir(parents=True, exist_ok=True)
    (d / "summary.json").write_text(json.dumps({"rows": rows, "table": format_table(rows)}, indent=1) + "\n")


def eval_only(args: argparse.Namespace, presets: list[str]) -> int:
    import torch

    from engine.models.weights import load_model

    from .evaluate import eval_requests, evaluate
    from .trainer import AUTOCAST_DTYPES, resolve_device
    from engine.models.layers.fla_backend import resolve_backend

    device = resolve_device(args.device)
    backend = resolve_backend(args.backend, device)
    amp = AUTOCAST_DTYPES[args.dtype] if device.type == "cuda" else None
    reqs = eval_requests(_tasks(args.final_eval_tasks, "--final-eval-tasks"), args.final_eval_n, args.eval_seed,
                         **dict(_json_items(args.eval_overrides, "--eval-overrides")))
    rows = []
    for preset in presets:
        root = Path(args.out_root) if args.out_root else None
        target = args.out if (args.out and args.preset) else preset
        loaded = load_model(target, device, torch.float32, models_root=root)
        t0 = time.perf_counter()
        res = evaluate(loaded.model, reqs, backend, amp, args.eval_batch, not args.no_bos)
        print(f"[{preset}] {loaded.source} fingerprint {loaded.fingerprint[:16]} "
              f"({time.perf_counter() - t0:.0f}s): " + " ".join(f"{t}={e.score:.1f}" for t, e in res.items()),
              flush=True)
        rows.append({"preset": preset, "ok": loaded.trained, "steps": None, "train_wall_s": None,
                     "final_loss": None, "scores": {t: e.score for t, e in res.items()}})
    print(format_table(rows))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        presets = _presets(args)
        if args.eval_only:
            return eval_only(args, presets)
        if args.parallel and len(presets) > 1:
            for p in presets:  # validate options once, before spawning anything
                train_config(args, p, 0)
            parse_gpus(args.gpus)
            status = run_parallel(argv, args, presets)
        else:
            status = 0
            workers = args.workers if args.workers is not None else _default_workers(1)
            command = shlex.join(["python", "-m", "tools.train", *argv])
            if os.environ.get(PARENT_COMMAND_ENV):
                command = f"{os.environ[PARENT_COMMAND_ENV]}  (child: {command})"
            for preset in presets:
                result = train(train_config(args, preset, workers), command)
                status |= 0 if result.ok else 1
                if args.bundle_dir:
                    bundle_one(args, preset)
    except (TrainError, ValueError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if os.environ.get(PARENT_COMMAND_ENV):
        return status  # a --parallel child: the parent prints the table and the summary
    rows = summary_rows(args, presets)
    print("\nfinal full-recompute scores (points, n = final eval requests per task):")
    print(format_table(rows))
    if args.bundle_dir:
        write_summary(args, rows)
    return status
