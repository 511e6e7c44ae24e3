"""Task accuracy of a model under FULL recomputation: greedy answers to held-out requests
of the fixed evaluation pools (`tools.workloads.iter_requests`), scored by the workloads'
own `score` (points 0-100).

Generation re-runs the whole sequence through `HybridDecoder.forward` for every new token
(no cache of any kind), so it is the reference the cached methods are compared against.
A batch of prompts of different lengths is right-padded in one buffer: causal layers never
look right, so each row's logits at its own last position are exact, and the token chosen
for row i is written at position `len_i + step`. Generation stops at the first newline
(the answer delimiter) or special token, or after `max_new_tokens(metric)` tokens.

Prompts are encoded as the engine encodes a request: BOS, then the prompt's UTF-8 bytes.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch

from engine.models.decoder import HybridDecoder
from engine.tokenizer import ByteTokenizer
from tools.workloads import TASKS, Request, iter_requests, score

from .errors import TrainConfigError

NEWLINE = ord("\n")
#: generation bound per metric: exact-match answers are at most 12 bytes (fewshot "double"
#: of a 6-letter word); aggregate lists of keys are longer.
MAX_NEW = {"em": 16, "f1": 64, "rougeL": 128}


def max_new_tokens(metric: str) -> int:
    return MAX_NEW.get(metric, 64)


def encode_prompt(prompt: str, bos: bool = True) -> list[int]:
    ids = list(prompt.encode("utf-8"))
    return [ByteTokenizer.BOS] + ids if bos else ids


def autocast_context(device: torch.device, dtype: torch.dtype | None):
    """bf16/fp16 autocast on CUDA when `dtype` is given, else a no-op context."""
    if dtype is None or device.type != "cuda":
        return contextlib.nullcontext()
    return torch.autocast("cuda", dtype=dtype)


@torch.no_grad()
def greedy_generate(model: HybridDecoder, prompts: Sequence[Sequence[int]], max_new: int,
                    backend: str = "torch", autocast_dtype: torch.dtype | None = None,
                    batch_size: int = 64, pad_multiple: int = 64) -> list[list[int]]:
    """Greedy continuation of each prompt (full recomputation every token). Returns the
    generated ids of each prompt, ending with the newline / special token that stopped it
    (not included when `max_new` ran out first)."""
    if max_new < 1:
        raise TrainConfigError(f"max_new={max_new} must be >= 1")
    if any(len(p) == 0 for p in prompts):
        raise TrainConfigError("greedy_generate got an empty prompt")
    device = model.device
    was_training = model.training
    model.eval()
    out: list[list[int]] = []
    try:
        for start in range(0, len(prompts), batch_size):
            out.extend(_generate_batch(model, prompts[start:start + batch_size], max_new, backend,
                                       autocast_dtype, pad_multiple, device))
    finally:
        model.train(was_training)
    return out


def _generate_batch(model, prompts, max_new, backend, autocast_dtype, pad_multiple, device):
    b = len(prompts)
    lens = torch.tensor([len(p) for p in prompts], device=device)
    width = int(lens.max()) + max_new
    buf = torch.full((b, width), ByteTokenizer.PAD, dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        buf[i, :len(p)] = torch.tensor(list(p), dtype=torch.long)
    done = torch.zeros(b, dtype=torch.bool, device=device)
    generated: list[list[int]] = [[] for _ in range(b)]
    rows = torch.arange(b, device=device)
    for step in range(max_new):
        cur = int(lens.max()) + step
        t = min(width, -(-cur // pad_multiple) * pad_multiple)
        with autocast_context(device, autocast_dtype):
            logits = model(buf[:, :t], backend=backend)
        nxt = logits[rows, lens + step - 1].float().argmax(-1)
        nxt = torch.where(done, torch.full_like(nxt, ByteTokenizer.PAD), nxt)
        buf[rows, lens + step] = nxt
        for i, (tok, finished) in enumerate(zip(nxt.tolist(), done.tolist())):
            if not finished:
                generated[i].append(tok)
        done |= (nxt == NEWLINE) | (nxt >= 256)
        if bool(done.all()):
            break
    return generated


def decode_answer(ids: Iterable[int]) -> str:
    """Generated ids -> text (special tokens dropped); the scorer cuts at the first newline."""
    return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


@dataclass
class TaskEval:
    """Score of one task: mean points over `n` requests, and a few (answer, prediction) pairs."""

    task: str
    n: int
    score: float
    seconds: float
    samples: list[tuple[str, str]] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"task": self.task, "n": self.n, "score": round(self.score, 2), "seconds": round(self.seconds, 2),
                "samples": [list(s) for s in self.samples]}


def eval_requests(tasks: Sequence[str], n: int, seed: int = 0, scale: str = "tiny",
                  **overrides) -> dict[str, list[Request]]:
    """The first n requests of each task's evaluation stream (fixed pools, `seed`);
    `overrides` are `make_config` parameters (e.g. docs="2-3" for short CPU checks)."""
    for task in tasks:
        if task not in TASKS:
            raise TrainConfigError(f"unknown evaluation task {task!r}; known: {', '.join(TASKS)}")
    if n < 1:
        raise TrainConfigError(f"evaluation size n={n} must be >= 1")
    return {task: list(iter_requests(task, n, seed, scale=scale, **overrides)) for task in tasks}


def evaluate(model: HybridDecoder, requests: dict[str, list[Request]], backend: str = "torch",
             autocast_dtype: torch.dtype | None = None, batch_size: int = 64, bos: bool = True,
             keep_samples: int = 3, max_new: int | None = None) -> dict[str, TaskEval]:
    """Greedy full-recompute answers to every request, scored per task. `max_new` bounds
    the answer length (default: per metric, MAX_NEW)."""
    results = {}
    for task, reqs in requests.items():
        t0 = time.perf_counter()
        by_metric: dict[str, list[int]] = {}
        for i, r in enumerate(reqs):
            by_metric.setdefault(r.metric, []).append(i)
        preds: list[str] = [""] * len(reqs)
        for metric, idx in by_metric.items():
            gens = greedy_generate(model, [encode_prompt(reqs[i].prompt, bos) for i in idx],
                                   max_new or max_new_tokens(metric), backend, autocast_dtype, batch_size)
            for i, g in zip(idx, gens):
                preds[i] = decode_answer(g)
        points = [score(r, p) for r, p in zip(reqs, preds)]
        samples = [(r.answer, p.split("\n", 1)[0]) for r, p in zip(reqs[:keep_samples], preds)]
        results[task] = TaskEval(task, len(reqs), sum(points) / len(points), time.perf_counter() - t0, samples)
    return results
