"""The training loop of one model: AdamW on fp32 master weights, bf16 autocast on CUDA,
warmup + cosine learning rate over the run's progress, gradient clipping, periodic and
final full-recompute evaluation, checkpoint (safetensors + config.json) and train_log.json.

Progress p in [0, 1] drives the cosine schedule and the data curriculum:
`p = max(step / steps, seconds since the first step ended / time left after it)`; the
first step (which compiles and autotunes the GPU kernels) is not counted against the time
limit's schedule, so the schedule covers the seconds that actually train. The run stops
when p reaches 1.

Robustness for a one-shot GPU run: if the first step fails on the `fla` linear-attention
backend, the run switches to the torch backend and says so in the log; a step with a
non-finite gradient norm is skipped (counted); an exception later in training ends the
loop early and the model trained so far is still evaluated and saved (the log says
`"aborted"` with the error).
"""
from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import platform
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F

from engine.models.config import ModelConfig
from engine.models.layers.fla_backend import resolve_backend
from engine.models.presets import get_preset
from engine.models.weights import CONFIG_FILE, WEIGHTS_FILE, build_model, load_weights, save_model
from tools.workloads import TASKS

from .data import ANSWER_KIND, KIND_NAMES, Batch, BatchStream, DataConfig, derive_seed
from .curriculum import CurriculumGate, GateConfig
from .errors import TrainConfigError
from .fla_check import check_backend_grads, failed_check, has_linear_layers, hopper_guard_active, set_hopper_guard
from .evaluate import TaskEval, autocast_context, eval_requests, evaluate

LOG_FILE = "train_log.json"
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}
#: final_loss is the mean total loss over this many last steps
RECENT_STEPS = 50
#: steps between feeding the curriculum gate a batch's per-task answer loss (a host sync)
GATE_EVERY = 5
#: checkpoints stay under this size (the committed models/ files and the bundles a remote run returns)
MAX_CHECKPOINT_BYTES = 16 * 2**20


@dataclass(frozen=True)
class TrainConfig:
    """Every option of one training run (the CLI maps onto it one to one)."""

    preset: str
    out_dir: str
    steps: int = 1_000_000
    batch_size: int = 64
    lr: float = 3e-3
    min_lr_frac: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    #: weights of the mean loss of the other token classes next to the mean answer-token
    #: loss (weight 1): document text, question text, fewshot demonstration outputs
    prompt_loss_weight: float = 0.05
    question_loss_weight: float = 0.5
    demo_loss_weight: float = 0.5
    seed: int = 0
    device: str = "auto"
    dtype: str = "bf16"
    backend: str = "auto"
    time_limit_s: float | None = None
    eval_every: int = 0
    eval_n: int = 32
    eval_tasks: tuple[str, ...] = ("fact", "twohop", "fewshot")
    final_eval_n: int = 200
    final_eval_tasks: tuple[str, ...] = TASKS
    eval_seed: int = 0
    #: make_config overrides of the evaluation pools (empty: the scale's defaults, as the
    #: quality harness uses; set only for short CPU checks)
    eval_overrides: tuple[tuple[str, Any], ...] = ()
    eval_batch: int = 64
    log_every: int = 50
    compile: bool = False
    workers: int = 0
    threads: int = 0
    #: top-level ModelConfig fields changed from the preset (CPU experiments, tests)
    model_overrides: tuple[tuple[str, Any], ...] = ()
    #: start from the weights saved in this directory (same config) instead of the init
    init_from: str | None = None
    #: before training on fla, compare its gradients with the torch path's (fla_check.py);
    #: fla is used only when that passes (and then even where fla's Hopper guard would refuse)
    fla_check: bool = True
    fla_check_tol: float = 0.05
    #: rows and longest row of the check's batch
    fla_check_rows: int = 4
    fla_check_len: int = 512
    #: loss-gated curriculum (curriculum.py; threshold 0: the time-gated one)
    gate: GateConfig = field(default_factory=GateConfig)
    data: DataConfig = field(default_factory=DataConfig)

    def validate(self) -> None:
        positive = dict(steps=self.steps, batch_size=self.batch_size, eval_n=self.eval_n,
                        final_eval_n=self.final_eval_n, eval_batch=self.eval_batch, log_every=self.log_every)
        for name, value in positive.items():
            if value < 1:
                raise TrainConfigError(f"{name}={value} must be >= 1")
        if not self.lr > 0:
            raise TrainConfigError(f"lr={self.lr} must be > 0")
        if not 0 <= self.min_lr_frac <= 1:
            raise TrainConfigError(f"min_lr_frac={self.min_lr_frac} must be in [0, 1]")
        for name in ("warmup_steps", "eval_every", "workers", "threads"):
            if getattr(self, name) < 0:
                raise TrainConfigError(f"{name}={getattr(self, name)} must be >= 0")
        if self.fla_check_rows < 1 or self.fla_check_len < 64:
            raise TrainConfigError(f"fla_check_rows={self.fla_check_rows} must be >= 1 and "
                                   f"fla_check_len={self.fla_check_len} >= 64")
        for name in ("weight_decay", "grad_clip", "prompt_loss_weight", "question_loss_weight",
                     "demo_loss_weight", "fla_check_tol"):
            if getattr(self, name) < 0:
                raise TrainConfigError(f"{name}={getattr(self, name)} must be >= 0")
        if self.dtype not in AUTOCAST_DTYPES:
            raise TrainConfigError(f"dtype={self.dtype!r} must be one of {sorted(AUTOCAST_DTYPES)}")
        if self.time_limit_s is not None and self.time_limit_s <= 0:
            raise TrainConfigError(f"time_limit_s={self.time_limit_s} must be > 0")
        for task in (*self.eval_tasks, *self.final_eval_tasks):
            if task not in TASKS:
                raise TrainConfigError(f"unknown evaluation task {task!r}; known: {', '.join(TASKS)}")
        self.data.validate()
        self.gate.validate(self.data.curriculum_frac)
        for task in self.gate.tasks:
            if task not in TASKS:
                raise TrainConfigError(f"unknown curriculum gate task {task!r}; known: {', '.join(TASKS)}")

    @property
    def loss_weights(self) -> dict[str, float]:
        return {"answer": 1.0, "prompt": self.prompt_loss_weight, "question": self.question_loss_weight,
                "demo": self.demo_loss_weight}

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["data"]["mix"] = dict(self.data.mix)
        d["model_overrides"] = dict(self.model_overrides)
        d["eval_overrides"] = dict(self.eval_overrides)
        return d


def model_config(cfg: TrainConfig) -> ModelConfig:
    """The preset's ModelConfig, with `model_overrides` applied (then named `<preset>-custom`)."""
    base = get_preset(cfg.preset)
    if not cfg.model_overrides:
        return base
    return base.replace(**dict(cfg.model_overrides), name=f"{base.name}-custom", scale="custom")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise TrainConfigError(f"device={name!r} but CUDA is not available")
    return device


def lr_at(cfg: TrainConfig, step: int, progress: float) -> float:
    """Linear warmup over `warmup_steps`, times a cosine from 1 to `min_lr_frac` over progress."""
    warm = min(1.0, (step + 1) / cfg.warmup_steps) if cfg.warmup_steps else 1.0
    p = min(max(progress, 0.0), 1.0)
    cosine = cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * p))
    return cfg.lr * warm * cosine


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices except the (tied) embedding, none on norms, biases,
    decay and step parameters."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.dim() >= 2 and not name.startswith("embed") else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    kwargs = {"fused": True} if device.type == "cuda" else {}
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), **kwargs)


@dataclass
class LossParts:
    total: torch.Tensor
    by_kind: dict[str, torch.Tensor]  # mean CE of each loss class ("answer", "prompt", ...)
    answer_correct: torch.Tensor  # answer tokens predicted right (argmax), summed
    answer_count: torch.Tensor
    row_answer_ce: torch.Tensor   # [B] summed answer CE per row
    row_answer_n: torch.Tensor    # [B]

    @property
    def answer(self) -> torch.Tensor:
        return self.by_kind["answer"]


def compute_loss(logits: torch.Tensor, ids: torch.Tensor, kinds: torch.Tensor,
                 weights: dict[str, float]) -> LossParts:
    """sum over loss classes of weight * mean CE over that class's target tokens (targets are
    ids shifted by one; a target's kind decides its class; padding and BOS never count).
    `weights` maps class names (data.KIND_NAMES) to weights; "answer" defaults to 1, the
    others to 0."""
    logits = logits[:, :-1].float()
    target = ids[:, 1:]
    kind = kinds[:, 1:]
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                         reduction="none").view_as(target)
    by_kind: dict[str, torch.Tensor] = {}
    total = torch.zeros((), device=ce.device)
    for k, name in KIND_NAMES.items():
        mask = (kind == k).float()
        by_kind[name] = (ce * mask).sum() / mask.sum().clamp(min=1)
        w = weights.get(name, 1.0 if name == "answer" else 0.0)
        if w:
            total = total + w * by_kind[name]
    ans = (kind == ANSWER_KIND).float()
    with torch.no_grad():
        correct = ((logits.argmax(-1) == target).float() * ans).sum()
        row_ce = (ce.detach() * ans).sum(1)
        row_n = ans.sum(1)
    return LossParts(total, by_kind, correct, ans.sum(), row_ce, row_n)


@dataclass
class TrainResult:
    preset: str
    out_dir: str
    ok: bool
    steps: int
    wall_s: float
    final_loss: float | None
    scores: dict[str, float]
    fingerprint: str | None
    error: str | None = None


class _Clock:
    """Training progress by steps and by seconds after the first step."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.t0 = time.perf_counter()
        self.t_first: float | None = None

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def first_step_done(self) -> None:
        if self.t_first is None:
            self.t_first = time.perf_counter()

    def progress(self, step: int) -> float:
        p = step / self.cfg.steps
        if self.cfg.time_limit_s is not None and self.t_first is not None:
            budget = self.cfg.time_limit_s - (self.t_first - self.t0)
            if budget <= 0:
                return 1.0
            p = max(p, (time.perf_counter() - self.t_first) / budget)
        return min(p, 1.0)


def _say(cfg: TrainConfig, msg: str) -> None:
    print(f"[{cfg.preset}] {msg}", flush=True)


def _scores_line(evals: dict[str, TaskEval]) -> str:
    return " ".join(f"{t}={e.score:.1f}" for t, e in evals.items())


def _environment(device: torch.device, backend: str) -> dict[str, Any]:
    env = {"python": platform.python_version(), "torch": torch.__version__, "device": str(device),
           "backend": backend, "host_cpus": os.cpu_count()}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    try:
        import fla  # noqa: F401
        env["fla"] = getattr(fla, "__version__", "unknown")
    except Exception:
        env["fla"] = None
    return env


def train(cfg: TrainConfig, command: str | None = None,
          on_log: Callable[[dict], None] | None = None) -> TrainResult:
    """Train one model as `cfg` says, evaluate it, save it under cfg.out_dir with its log."""
    cfg.validate()
    command = command if command is not None else " ".join(sys.argv)
    wall0 = time.perf_counter()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = resolve_device(cfg.device)
    torch.manual_seed(cfg.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    mcfg = model_config(cfg)
    model = build_model(mcfg, device, torch.float32, seed=derive_seed(cfg.seed, "init") % 2**31).train()
    init_missing = bool(cfg.init_from) and not (Path(cfg.init_from) / WEIGHTS_FILE).is_file()
    init_fp = _init_from(model, cfg.init_from) if cfg.init_from and not init_missing else None
    backend = resolve_backend(cfg.backend, device)
    amp = AUTOCAST_DTYPES[cfg.dtype] if device.type == "cuda" else None
    opt = make_optimizer(model, cfg, device)
    fwd = torch.compile(model) if cfg.compile else model
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    log: dict[str, Any] = {
        "preset": cfg.preset, "model": mcfg.name, "command": command, "config": cfg.to_dict(),
        "environment": _environment(device, backend), "parameters": sum(p.numel() for p in model.parameters()),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "history": [], "evals": [], "notes": [],
        "init_from": None if cfg.init_from is None else {"dir": cfg.init_from, "fingerprint": init_fp},
    }
    if init_missing:  # e.g. --init-root over presets of which only some were trained before
        log["notes"].append(f"no {WEIGHTS_FILE} in {cfg.init_from}: training from the seeded init")
        _say(cfg, log["notes"][-1])

    def write_log() -> None:
        tmp = out_dir / (LOG_FILE + ".tmp")
        tmp.write_text(json.dumps(log, indent=1) + "\n")
        tmp.replace(out_dir / LOG_FILE)

    _say(cfg, f"{mcfg.name}: {log['parameters']} parameters on {device} ({backend} linear backend, "
              f"autocast {cfg.dtype if amp else 'off'}), batch {cfg.batch_size}, lr {cfg.lr}, "
              f"time limit {cfg.time_limit_s}s")
    eval_set = eval_requests(cfg.eval_tasks, cfg.eval_n, cfg.eval_seed, **dict(cfg.eval_overrides)) \
        if cfg.eval_every else None
    stream = BatchStream(cfg.data, cfg.batch_size, derive_seed(cfg.seed, "data"), cfg.workers)
    clock = _Clock(cfg)
    gate = CurriculumGate(cfg.gate, cfg.data.curriculum_frac)
    log["curriculum_gate"] = gate.to_dict()
    step, skipped, tokens, examples = 0, 0, 0, 0
    data_wait = 0.0
    last: LossParts | None = None
    recent = collections.deque(maxlen=RECENT_STEPS)  # losses of the last steps, for final_loss
    correct_sum = torch.zeros((), device=device)
    count_sum = torch.zeros((), device=device)
    error: str | None = None
    if backend == "fla":
        backend = _check_fla(cfg, model, stream, amp, device, log)
    try:
        while step < cfg.steps:
            progress = clock.progress(step)
            if progress >= 1.0:
                break
            t_wait = time.perf_counter()
            batch: Batch = stream.next(gate.data_progress(progress))
            data_wait += time.perf_counter() - t_wait
            ids = torch.from_numpy(batch.ids.astype(np.int64)).to(device, non_blocking=True)
            kinds = torch.from_numpy(batch.kinds).to(device, non_blocking=True)
            lr = lr_at(cfg, step, gate.lr_progress(progress))
            for group in opt.param_groups:
                group["lr"] = lr
            try:
                with autocast_context(device, amp):
                    logits = fwd(ids, backend=backend)
                parts = compute_loss(logits, ids, kinds, cfg.loss_weights)
                opt.zero_grad(set_to_none=True)
                parts.total.backward()
                gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip or float("inf"))
                gn = float(gnorm)
            except Exception as exc:
                if backend == "fla":
                    note = f"fla backend failed at step {step} ({type(exc).__name__}: {exc}); using torch"
                    _say(cfg, note)
                    log["notes"].append(note)
                    backend = log["environment"]["backend"] = "torch"
                    opt.zero_grad(set_to_none=True)
                    continue
                raise
            if not math.isfinite(gn):
                skipped += 1
                opt.zero_grad(set_to_none=True)
                if skipped > 50 and skipped > step // 4:
                    raise FloatingPointError(f"{skipped} of {step + 1} steps had a non-finite gradient norm")
            else:
                opt.step()
            step += 1
            recent.append(float(parts.total.detach()))
            clock.first_step_done()
            tokens += batch.real_tokens
            examples += len(batch.tasks)
            last = parts
            correct_sum += parts.answer_correct
            count_sum += parts.answer_count
            if not gate.is_open and step % GATE_EVERY == 0 and gate.observe(step, progress, _per_task(batch, parts)):
                log["curriculum_gate"] = gate.to_dict()
                _say(cfg, f"curriculum gate open at step {step} (p={progress:.2f}): {gate.reason}")
            if step % cfg.log_every == 0 or step == 1:
                loss = parts.total.item()
                by_kind = {name: round(v.item(), 4) for name, v in parts.by_kind.items()}
                ans = by_kind["answer"]
                per_task = _per_task(batch, parts)
                entry = {"step": step, "elapsed_s": round(clock.elapsed(), 2), "progress": round(progress, 4),
                         "data_progress": round(gate.data_progress(progress), 4),
                         "lr": lr, "loss": round(loss, 4), "answer_loss": ans,
                         "loss_by_class": by_kind, "grad_norm": round(gn, 3),
                         "answer_token_acc": round((correct_sum / count_sum.clamp(min=1)).item(), 4),
                         "answer_loss_by_task": per_task, "seq_len": int(batch.ids.shape[1]),
                         "tokens": tokens, "examples": examples, "data_wait_s": round(data_wait, 2),
                         "skipped_steps": skipped}
                correct_sum.zero_()
                count_sum.zero_()
                log["history"].append(entry)
                if on_log is not None:
                    on_log(entry)
                if step == 1 or step % (cfg.log_every * 10) == 0:
                    _say(cfg, f"step {step} t={entry['elapsed_s']:.0f}s p={progress:.2f} lr={lr:.2e} "
                              f"loss={loss:.3f} ans={ans:.3f} acc={entry['answer_token_acc']:.3f} "
                              f"T={entry['seq_len']} wait={data_wait:.1f}s")
            if cfg.eval_every and step % cfg.eval_every == 0:
                evals, backend = _evaluate_safely(cfg, model, eval_set, backend, amp, log, keep_samples=0)
                log["evals"].append({"step": step, "elapsed_s": round(clock.elapsed(), 2),
                                     "n": cfg.eval_n, "scores": {t: round(e.score, 2) for t, e in evals.items()}})
                _say(cfg, f"eval step {step} t={clock.elapsed():.0f}s: {_scores_line(evals)}")
                log["curriculum_gate"] = gate.to_dict()
                write_log()
    except Exception as exc:  # keep what was trained: evaluate and save it, report the error
        error = f"{type(exc).__name__}: {exc}"
        log["notes"].append("aborted: " + error)
        log["traceback"] = traceback.format_exc()
        _say(cfg, "training aborted: " + error)
    finally:
        stream.close()
    train_s = clock.elapsed()
    _say(cfg, f"trained {step} steps in {train_s:.0f}s ({examples} examples, {tokens} tokens); saving")
    final_loss = round(sum(recent) / len(recent), 4) if recent else None
    log.update({
        "steps": step, "skipped_steps": skipped, "examples": examples, "tokens": tokens,
        "train_wall_s": round(train_s, 2), "data_wait_s": round(data_wait, 2),
        "final_loss": final_loss, "final_loss_steps": len(recent),
        "final_answer_loss": None if last is None else round(last.answer.item(), 4),
        "aborted": error is not None, "curriculum_gate": gate.to_dict(),
    })
    fp = _save(model, out_dir, log)  # before the final eval: a failure there keeps the weights
    log["fingerprint"] = fp
    write_log()
    final_set = eval_requests(cfg.final_eval_tasks, cfg.final_eval_n, cfg.eval_seed, **dict(cfg.eval_overrides))
    final, backend = _evaluate_safely(cfg, model, final_set, backend, amp, log)
    _say(cfg, f"final eval (n={cfg.final_eval_n}): {_scores_line(final)}")
    log.update({
        "wall_s": round(time.perf_counter() - wall0, 2),
        "final_eval": {"n": cfg.final_eval_n, "seed": cfg.eval_seed, "overrides": dict(cfg.eval_overrides),
                       "backend": backend, "scores": {t: round(e.score, 2) for t, e in final.items()},
                       "details": {t: e.to_dict() for t, e in final.items()}},
    })
    write_log()
    return TrainResult(cfg.preset, str(out_dir), error is None, step, log["wall_s"], final_loss,
                       {t: e.score for t, e in final.items()}, fp, error)


def _check_fla(cfg: TrainConfig, model: torch.nn.Module, stream: BatchStream, amp, device: torch.device,
               log: dict) -> str:
    """The backend to train on: 'fla' when the model has linear layers and fla's gradients
    match the torch path's on a small batch of this run's data (fla's Hopper guard lifted for
    the check and kept lifted if it passes), else 'torch'. Records `log["fla_check"]`."""
    if not has_linear_layers(model):
        log["fla_check"] = {"skipped": "no linear-attention layers"}
        return "fla"
    guard = hopper_guard_active()
    if not cfg.fla_check:
        log["fla_check"] = {"skipped": "--no-fla-check", "hopper_guard": guard}
        if guard:
            note = "fla's Hopper guard is active and --no-fla-check was given: training on torch"
            _say(cfg, note)
            log["notes"].append(note)
            return "torch"
        return "fla"
    batch = stream.peek(0.0)
    rows, length = min(cfg.fla_check_rows, batch.ids.shape[0]), min(cfg.fla_check_len, batch.ids.shape[1])
    ids = torch.from_numpy(batch.ids[:rows, :length].astype(np.int64)).to(device)
    kinds = torch.from_numpy(batch.kinds[:rows, :length]).to(device)
    weights = cfg.loss_weights
    loss_fn = lambda logits, i, k: compute_loss(logits, i, k, weights).total  # noqa: E731
    if guard:
        set_hopper_guard(False)
    t0 = time.perf_counter()
    try:
        check = check_backend_grads(model, ids, kinds, loss_fn, amp, "fla", "torch", tol=cfg.fla_check_tol)
    except Exception as exc:
        check = failed_check("fla", "torch", ids, cfg.fla_check_tol, f"{type(exc).__name__}: {exc}",
                             time.perf_counter() - t0)
    check.guard_lifted = guard
    log["fla_check"] = check.to_dict()
    log["fla_check"]["hopper_guard"] = guard
    _say(cfg, check.summary())
    if check.ok:
        return "fla"
    if guard:
        set_hopper_guard(True)
    note = f"fla gradient check did not pass ({check.summary()}); training on torch"
    log["notes"].append(note)
    log["environment"]["backend"] = "torch"
    return "torch"


def _init_from(model: torch.nn.Module, directory: str) -> str:
    """Copy the weights saved in `directory` into `model` (configs must be equal); returns
    their fingerprint."""
    src, fp = load_weights(directory, "cpu", torch.float32)
    if src.config.to_json() != model.config.to_json():
        raise TrainConfigError(f"--init-from {directory}: its config ({src.config.name}) differs from the "
                               f"model being trained ({model.config.name})")
    model.load_state_dict({k: v.to(model.device) for k, v in src.state_dict().items()})
    return fp


def _evaluate_safely(cfg: TrainConfig, model, requests, backend: str, amp, log: dict,
                     keep_samples: int = 3) -> tuple[dict[str, TaskEval], str]:
    """evaluate(); if the fla backend raises, note it and evaluate on the torch path."""
    try:
        return evaluate(model, requests, backend, amp, cfg.eval_batch, cfg.data.bos, keep_samples), backend
    except Exception as exc:
        if backend != "fla":
            raise
        note = f"fla backend failed in evaluation ({type(exc).__name__}: {exc}); using torch"
        _say(cfg, note)
        log["notes"].append(note)
        return evaluate(model, requests, "torch", amp, cfg.eval_batch, cfg.data.bos, keep_samples), "torch"


def _per_task(batch: Batch, parts: LossParts) -> dict[str, float]:
    ce = parts.row_answer_ce.tolist()
    n = parts.row_answer_n.tolist()
    sums: dict[str, list[float]] = {}
    for task, c, k in zip(batch.tasks, ce, n):
        s = sums.setdefault(task, [0.0, 0.0])
        s[0] += c
        s[1] += k
    return {t: round(c / k, 4) for t, (c, k) in sorted(sums.items()) if k}


def _save(model: torch.nn.Module, out_dir: Path, log: dict) -> str:
    """Save fp32 weights + config on the CPU, reload them and check the fingerprint."""
    cpu_model = build_model(model.config, "cpu", torch.float32)
    cpu_model.load_state_dict({k: v.detach().to("cpu", torch.float32) for k, v in model.state_dict().items()})
    fp = save_model(cpu_model, out_dir)
    _, fp_loaded = load_weights(out_dir, "cpu")
    if fp_loaded != fp:
        raise RuntimeError(f"checkpoint in {out_dir} reloads with fingerprint {fp_loaded} != saved {fp}")
    size = (out_dir / WEIGHTS_FILE).stat().st_size
    log["checkpoint"] = {"dir": str(out_dir), "files": [WEIGHTS_FILE, CONFIG_FILE], "bytes": size,
                         "dtype": "float32"}
    if size >= MAX_CHECKPOINT_BYTES:
        log["notes"].append(f"checkpoint is {size} bytes, over the {MAX_CHECKPOINT_BYTES}-byte limit")
    return fp
