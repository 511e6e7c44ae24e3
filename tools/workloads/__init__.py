"""Synthetic segmented-prompt workloads: `fact`, `twohop`, `aggregate`, `fewshot`, `rag`.

No data sets can be downloaded, so these deterministic generators are the project's
data: they train the tiny models (`sample_training_example`, fresh content), feed the
quality harness and the serving benchmark (`iter_requests`, fixed Zipf-popular pools of
reusable segments), and score outputs (`score`). See docs/workloads.md.
"""
from .common import (ANSWER_END, ANSWER_PREFIX, METRICS, QUESTION_PREFIX, TASKS, Request, Segment,
                     read_requests, token_count, write_requests)
from .config import SCALES, WorkloadConfig, make_config
from .errors import (GenerationError, RecordFormatError, UnknownTaskError, WorkloadConfigError,
                     WorkloadError)
from .generate import (TRAINING_MIX, generate, iter_requests, sample_training_example,
                       sample_training_request)
from .scoring import exact_match, first_line, rouge_l, score, token_f1
from .stats import WorkloadStats, format_table, workload_stats

__all__ = [
    "ANSWER_END", "ANSWER_PREFIX", "METRICS", "QUESTION_PREFIX", "SCALES", "TASKS", "TRAINING_MIX",
    "GenerationError", "RecordFormatError", "Request", "Segment", "UnknownTaskError",
    "WorkloadConfig", "WorkloadConfigError", "WorkloadError", "WorkloadStats",
    "exact_match", "first_line", "format_table", "generate", "iter_requests", "make_config",
    "read_requests", "rouge_l", "sample_training_example", "sample_training_request", "score", "token_count",
    "token_f1", "workload_stats", "write_requests",
]
