"""Training of the tiny hybrid models on the synthetic workloads (see docs/training.md).

- `data`: training sequences from `tools.workloads` (fresh random content, a task mixture,
  a size curriculum, extra questions per prompt), byte tokens with a loss class per token,
  length-bucketed batches built ahead by worker processes;
- `questions`: the extra questions asked over a training prompt;
- `evaluate`: greedy answers under full recomputation, scored by `tools.workloads.score`;
- `trainer`: the loop (AdamW, bf16 autocast, warmup + cosine over progress, clipping,
  time limit), checkpoint and train_log.json;
- `train`: the CLI (`python -m tools.train`).

Names are imported lazily, so the data worker processes (which import `tools.train.data`)
never load torch.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "DEFAULT_MIX": "data", "Batch": "data", "BatchStream": "data", "DataConfig": "data", "Example": "data",
    "encode_request": "data", "make_example": "data",
    "DataError": "errors", "TrainConfigError": "errors", "TrainError": "errors",
    "evaluate": "evaluate", "eval_requests": "evaluate", "greedy_generate": "evaluate",
    "TrainConfig": "trainer", "TrainResult": "trainer", "train": "trainer",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
