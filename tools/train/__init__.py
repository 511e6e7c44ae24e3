"""Training of the tiny hybrid models on the synthetic workloads (see docs/training.md).

- `data`: training sequences from `tools.workloads` (fresh random content, a task mixture,
  a size curriculum, extra questions per prompt), byte tokens with a loss class per token,
  length-bucketed batches built ahead by worker processes;
- `questions`: the extra questions asked over a training prompt;
- `evaluate`: greedy answers under full recomputation, scored by `tools.workloads.score`;
- `trainer`: the loop (AdamW, bf16 autocast, warmup + cosine over progress, clipping,
  time limit), checkpoint and train_log.json;
- `train`: the CLI (`python -m tools.train`).
"""
from .data import DEFAULT_MIX, Batch, BatchStream, DataConfig, Example, encode_request, make_example
from .errors import DataError, TrainConfigError, TrainError
from .evaluate import evaluate, eval_requests, greedy_generate
from .trainer import TrainConfig, TrainResult, train

__all__ = [
    "DEFAULT_MIX", "Batch", "BatchStream", "DataConfig", "DataError", "Example", "TrainConfig",
    "TrainConfigError", "TrainError", "TrainResult", "encode_request", "eval_requests", "evaluate",
    "greedy_generate", "make_example", "train",
]
