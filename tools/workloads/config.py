"""Generator parameters: the `WorkloadConfig` record and its defaults per task and scale.

Two scales:
- `tiny`: prompts of a few hundred bytes (= tokens of the byte-level tokenizer) up to
  1000 tokens with the answer (`max_tokens`, so a 1024-token context always fits), in
  3-8 segments; what the tiny models are trained and evaluated on.
- `bench`: long documents for the serving benchmark (TTFT/QPS); `rag` averages ~12k
  tokens per prompt.

`make_config(task, scale, **overrides)` is the one way to build a config; it validates
every field and names the bad one. `doc_tokens=` is accepted as an override and turned
into items per document (facts, or examples for `fewshot`).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from .common import check_task
from .errors import WorkloadConfigError

SCALES: tuple[str, ...] = ("tiny", "bench")
#: Tiny-scale bound on prompt + answer + newline, so a 1024-token context (with a few
#: special tokens) always holds a whole example.
TINY_MAX_TOKENS = 1000

#: Category words of the `aggregate` task (values of its facts); never used as keys.
CATEGORY_WORDS: tuple[str, ...] = (
    "red", "blue", "green", "gold", "gray", "pink", "teal", "navy",
    "lime", "rose", "sand", "plum", "jade", "ruby", "mint", "rust",
)
#: Average bytes of one item line per task at word length 4 (used to turn a document
#: length in tokens into items per document); a document also has a ~11-byte header.
_DOC_HEADER_BYTES = 11
_FEWSHOT_LINE_BYTES = 15.8


@dataclass(frozen=True)
class WorkloadConfig:
    """Parameters of one task's generator. Items are facts (`key: value` lines) for
    fact/twohop/aggregate/rag and input -> output examples for fewshot."""

    task: str
    scale: str = "tiny"
    pool_size: int = 64          # documents (example blocks for fewshot) in the shared pool
    zipf: float = 1.0            # popularity exponent over the pool
    docs_min: int = 3            # cacheable documents per request (rag: besides the system prompt)
    docs_max: int = 7
    facts_per_doc: int = 12      # mean items per document
    doc_len_spread: float = 0.0  # item count varies uniformly within +-spread * mean
    word_len: int = 4            # bytes per key / value
    categories: int = 6          # aggregate: distinct category values
    num_rules: int = 8           # fewshot: hidden rules in the pool
    system_prompts: int = 3      # rag: system prompts in the pool
    fact_share: float = 0.5      # rag: share of single-fact questions (the rest two-hop)
    max_tokens: int = 0          # bound on prompt + answer + newline tokens (0: none);
                                 # requests over it are redrawn

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_DEFAULTS: dict[tuple[str, str], dict[str, Any]] = {
    ("fact", "tiny"): dict(pool_size=64, docs_min=3, docs_max=7, facts_per_doc=11),
    ("twohop", "tiny"): dict(pool_size=64, docs_min=3, docs_max=7, facts_per_doc=11),
    ("aggregate", "tiny"): dict(pool_size=48, docs_min=3, docs_max=6, facts_per_doc=9, categories=8),
    ("fewshot", "tiny"): dict(pool_size=64, docs_min=3, docs_max=7, facts_per_doc=7, num_rules=8),
    ("rag", "tiny"): dict(pool_size=64, docs_min=3, docs_max=6, facts_per_doc=10, doc_len_spread=0.5),
    ("fact", "bench"): dict(pool_size=256, docs_min=4, docs_max=8, facts_per_doc=90),
    ("twohop", "bench"): dict(pool_size=256, docs_min=4, docs_max=8, facts_per_doc=90),
    ("aggregate", "bench"): dict(pool_size=256, docs_min=4, docs_max=8, facts_per_doc=90, categories=16),
    ("fewshot", "bench"): dict(pool_size=128, docs_min=4, docs_max=8, facts_per_doc=64, num_rules=16),
    ("rag", "bench"): dict(pool_size=512, docs_min=3, docs_max=10, facts_per_doc=155, doc_len_spread=0.5),
}


def item_bytes(task: str, word_len: int = 4, categories: int = 6) -> float:
    """Mean bytes of one item line of `task` (a fact line, or a fewshot example line)."""
    if task == "fewshot":
        return _FEWSHOT_LINE_BYTES
    if task == "aggregate":
        cats = CATEGORY_WORDS[:categories]
        return word_len + 2 + sum(map(len, cats)) / len(cats) + 1
    return 2 * word_len + 3


def facts_for_doc_tokens(task: str, doc_tokens: int, word_len: int = 4, categories: int = 6) -> int:
    """Items per document that give documents of about `doc_tokens` tokens."""
    if doc_tokens < 20:
        raise WorkloadConfigError(f"doc_tokens must be >= 20, got {doc_tokens}")
    body = doc_tokens - (0 if task == "fewshot" else _DOC_HEADER_BYTES)
    return max(1, round(body / item_bytes(task, word_len, categories)))


def make_config(task: str, scale: str = "tiny", **overrides: Any) -> WorkloadConfig:
    """The default config of (task, scale) with `overrides` applied and validated.

    Overrides are WorkloadConfig fields, plus `doc_tokens` (mean document length in
    tokens; sets facts_per_doc) and `docs` (an int, a (min, max) pair, or "MIN-MAX").
    Overrides whose value is None are ignored, so CLI options can be passed through."""
    check_task(task)
    if scale not in SCALES:
        raise WorkloadConfigError(f"unknown scale {scale!r}; expected one of {', '.join(SCALES)}")
    overrides = {k: v for k, v in overrides.items() if v is not None}
    doc_tokens = overrides.pop("doc_tokens", None)
    docs = overrides.pop("docs", None)
    fields = set(WorkloadConfig.__dataclass_fields__) - {"task", "scale"}
    unknown = set(overrides) - fields
    if unknown:
        raise WorkloadConfigError(f"unknown workload parameter(s) {sorted(unknown)}; known: {sorted(fields)}")
    cfg = replace(WorkloadConfig(task=task, scale=scale), **_DEFAULTS[(task, scale)])
    if scale == "tiny":
        cfg = replace(cfg, max_tokens=TINY_MAX_TOKENS)
    if docs is not None:
        lo, hi = parse_docs_range(docs)
        cfg = replace(cfg, docs_min=lo, docs_max=hi)
    cfg = replace(cfg, **overrides)
    if doc_tokens is not None:
        cfg = replace(cfg, facts_per_doc=facts_for_doc_tokens(task, int(doc_tokens), cfg.word_len, cfg.categories))
    validate(cfg)
    return cfg


def parse_docs_range(value: Any) -> tuple[int, int]:
    """Documents per request from 5, (3, 10) or "3-10"."""
    try:
        if isinstance(value, str):
            parts = value.split("-")
            if len(parts) == 1:
                lo = hi = int(parts[0])
            elif len(parts) == 2:
                lo, hi = int(parts[0]), int(parts[1])
            else:
                raise ValueError(value)
        elif isinstance(value, int):
            lo = hi = value
        else:
            lo, hi = (int(v) for v in value)
    except (ValueError, TypeError) as exc:
        raise WorkloadConfigError(f"docs per request must be N or MIN-MAX, got {value!r}") from exc
    if lo < 1 or hi < lo:
        raise WorkloadConfigError(f"docs per request range must satisfy 1 <= min <= max, got {value!r}")
    return lo, hi


def validate(cfg: WorkloadConfig) -> None:
    """Raise WorkloadConfigError naming the first field out of range."""
    def bad(field: str, why: str) -> WorkloadConfigError:
        return WorkloadConfigError(f"{cfg.task}: {field}={getattr(cfg, field)!r} {why}")

    if cfg.zipf < 0:
        raise bad("zipf", "must be >= 0")
    if cfg.docs_min < 1 or cfg.docs_max < cfg.docs_min:
        raise bad("docs_max", f"must be >= docs_min={cfg.docs_min} >= 1")
    if cfg.task == "twohop" and cfg.docs_min < 2:
        raise bad("docs_min", "must be >= 2: a two-hop question needs two documents")
    if cfg.facts_per_doc < 1:
        raise bad("facts_per_doc", "must be >= 1")
    if cfg.task in ("twohop", "rag") and cfg.facts_per_doc < 2:
        raise bad("facts_per_doc", "must be >= 2 for linked documents")
    if not 0 <= cfg.doc_len_spread < 1:
        raise bad("doc_len_spread", "must be in [0, 1)")
    if not 3 <= cfg.word_len <= 12:
        raise bad("word_len", "must be in [3, 12]")
    if not 2 <= cfg.categories <= len(CATEGORY_WORDS):
        raise bad("categories", f"must be in [2, {len(CATEGORY_WORDS)}]")
    if cfg.system_prompts < 1:
        raise bad("system_prompts", "must be >= 1")
    if not 0 <= cfg.fact_share <= 1:
        raise bad("fact_share", "must be in [0, 1]")
    if cfg.max_tokens < 0:
        raise bad("max_tokens", "must be >= 0 (0: no bound)")
    if cfg.task == "fewshot":
        if cfg.num_rules < 1:
            raise bad("num_rules", "must be >= 1")
        if cfg.pool_size < cfg.num_rules * cfg.docs_max:
            raise bad("pool_size", f"must be >= num_rules * docs_max = {cfg.num_rules * cfg.docs_max} "
                                   "(every rule needs docs_max example blocks)")
    elif cfg.task in ("twohop", "rag"):
        if cfg.pool_size < 2 * cfg.docs_max:
            raise bad("pool_size", f"must be >= 2 * docs_max = {2 * cfg.docs_max}")
    elif cfg.pool_size < cfg.docs_max:
        raise bad("pool_size", f"must be >= docs_max = {cfg.docs_max}")
