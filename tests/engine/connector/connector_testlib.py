"""Helpers of the store connector tests: small segmented prompts, engines on tiny presets
(CPU, fp32), running one request to completion, and polling."""
from __future__ import annotations

import time
from typing import Callable

from engine.builder import EngineConfig, build_engine
from engine.runtime.sampling import SamplingParams

GREEDY = SamplingParams(max_new_tokens=4, ignore_eos=True)

DOCS = [
    "## doc 1\nk1aa: v1aa\nk1bb: v1bb\nk1cc: v1cc\nk1dd: v1dd\n",
    "## doc 2\nk2aa: v2aa\nk2bb: v2bb\nk2cc: v2cc\nk2dd: v2dd\n",
    "## doc 3\nk3aa: v3aa\nk3bb: v3bb\nk3cc: v3cc\nk3dd: v3dd\n",
]


def prompt(order: tuple[int, ...], question: str = "Q: value of k2bb?\nA: ") -> list[dict]:
    """Cached documents in `order`, then an uncached question."""
    return [{"text": DOCS[i], "cache": True} for i in order] + [{"text": question, "cache": False}]


def new_engine(preset: str = "qwen3next-tiny", **kw):
    cfg = dict(device="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=2048, prefill_chunk_size=512,
               kv_cache_tokens=4096)
    cfg.update(kw)
    return build_engine(preset, EngineConfig(**cfg))


def run_one(engine, planner, segments, request_id: str, params: SamplingParams = GREEDY):
    """Run one request to completion; (output, pic report, store report or None)."""
    engine.add_request(segments, params, request_id=request_id)
    final = None
    while final is None:
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                final = out
    take = getattr(planner, "take_store_report", None)
    return final, planner.take_report(request_id), (take(request_id) if take else None)


def wait_until(cond: Callable[[], bool], timeout: float = 15.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)
