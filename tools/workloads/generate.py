"""The public generation API: request streams over the fixed pools (evaluation and
benchmarks) and fresh training examples (training).

- `iter_requests(task, n, seed, scale=..., **overrides)`: n requests of one task over
  that task's pool, built from `seed`. Same arguments -> the same requests, byte for
  byte; the first n requests of a longer stream are the n-request stream.
- `sample_training_example(task, rng, scale)`: (prompt, target) over FRESH random
  documents / rules, so a model learns the skill, not the pool. `task="mix"` draws the
  task from `TRAINING_MIX`.

Each task module (fact, twohop, aggregate, fewshot, rag) exposes `build_pool(cfg, rng)`,
`make_request(pool, cfg, rng, request_id)` and `fresh_request(cfg, rng, request_id)`.
"""
from __future__ import annotations

import functools
import random
from types import ModuleType
from typing import Any, Callable, Iterator, Mapping

from . import aggregate, fact, fewshot, rag, twohop
from .common import ANSWER_END, Request, check_task, derive_rng, token_count
from .config import WorkloadConfig, make_config
from .errors import GenerationError, WorkloadConfigError

_MODULES: dict[str, ModuleType] = {
    "fact": fact, "twohop": twohop, "aggregate": aggregate, "fewshot": fewshot, "rag": rag,
}
#: Default task weights of the training mixture (the harder tasks weigh more).
_MAX_REDRAWS = 1000
TRAINING_MIX: Mapping[str, float] = {"fact": 1.0, "twohop": 1.5, "aggregate": 1.0, "fewshot": 1.5, "rag": 1.0}


def iter_requests(task: str, n: int, seed: int = 0, *, scale: str = "tiny",
                  config: WorkloadConfig | None = None, **overrides: Any) -> Iterator[Request]:
    """Yield n requests of `task` drawn from its pool. The pool depends only on
    (seed, task, config), the stream on (seed, task, config) too; ids are
    "<task>-s<seed>-<index>". `overrides` are `make_config` parameters (pool_size, zipf,
    docs, doc_tokens, facts_per_doc, ...); pass either them or a ready `config`."""
    check_task(task)
    if config is None:
        config = make_config(task, scale, **overrides)
    elif overrides:
        raise WorkloadConfigError(f"pass either config or overrides, not both (got {sorted(overrides)})")
    elif config.task != task:
        raise WorkloadConfigError(f"config is for task {config.task!r}, not {task!r}")
    if not isinstance(n, int) or n < 0:
        raise WorkloadConfigError(f"number of requests must be an int >= 0, got {n!r}")
    module = _MODULES[task]
    pool = module.build_pool(config, derive_rng(seed, task, config.scale, "pool"))
    rng = derive_rng(seed, task, config.scale, "requests")
    for i in range(n):
        yield _bounded(lambda rid: module.make_request(pool, config, rng, rid), config, f"{task}-s{seed}-{i:06d}")


def _bounded(make: Callable[[str], Request], cfg: WorkloadConfig, request_id: str) -> Request:
    """make(request_id), redrawn (from the same rng stream) until prompt + answer + the
    ending newline fit in cfg.max_tokens (0: no bound)."""
    if not cfg.max_tokens:
        return make(request_id)
    for _ in range(_MAX_REDRAWS):
        req = make(request_id)
        if req.prompt_tokens + token_count(req.answer) + len(ANSWER_END) <= cfg.max_tokens:
            return req
    raise GenerationError(
        f"{cfg.task}: no request fits max_tokens={cfg.max_tokens} in {_MAX_REDRAWS} draws "
        f"(docs {cfg.docs_min}-{cfg.docs_max}, facts_per_doc={cfg.facts_per_doc}); "
        "raise max_tokens (0 = no bound) or make documents shorter / fewer")


def generate(task: str, n: int, seed: int = 0, **kwargs: Any) -> list[Request]:
    """`iter_requests` as a list."""
    return list(iter_requests(task, n, seed, **kwargs))


@functools.lru_cache(maxsize=None)
def _default_config(task: str, scale: str) -> WorkloadConfig:
    return make_config(task, scale)


def sample_training_request(task: str, rng: random.Random, scale: str = "tiny",
                            config: WorkloadConfig | None = None) -> Request:
    """One request over fresh random content (not the pool) at the given scale; its
    segments show where the document boundaries are. `task="mix"` draws the task from
    TRAINING_MIX with `rng`."""
    if task == "mix":
        task = rng.choices(list(TRAINING_MIX), weights=list(TRAINING_MIX.values()))[0]
    check_task(task)
    cfg = config if config is not None else _default_config(task, scale)
    if cfg.task != task:
        raise WorkloadConfigError(f"config is for task {cfg.task!r}, not {task!r}")
    return _bounded(lambda rid: _MODULES[task].fresh_request(cfg, rng, rid), cfg, f"{task}-train")


def sample_training_example(task: str, rng: random.Random, scale: str = "tiny",
                            config: WorkloadConfig | None = None) -> tuple[str, str]:
    """(prompt_text, target_text) over fresh random content. The prompt ends with the
    answer delimiter "\\nA: "; the target is the answer followed by ANSWER_END ("\\n"),
    which is what the model must generate (the newline ends the answer)."""
    if not isinstance(rng, random.Random):
        raise WorkloadConfigError(f"rng must be a random.Random, got {type(rng).__name__}")
    request = sample_training_request(task, rng, scale, config)
    return request.prompt, request.answer + ANSWER_END
