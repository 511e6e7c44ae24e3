"""Workload `aggregate`: aggregation over all documents (MultiNews/GovReport-like).

Documents hold facts `key: <category>` with category words (red, blue, ...). The
question "Q: which keys are <category>?\\nA: " asks for every key in the prompt with that
category, in prompt order, separated by single spaces. The category is one that occurs
in the prompt, so the answer is never empty. Metric: ROUGE-L (order-aware partial credit).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, replace

from .common import Request, Segment, WordAllocator, ZipfSampler, question_segment
from .config import CATEGORY_WORDS, WorkloadConfig
from .kvdocs import KvDoc, build_plain_docs

NAME = "aggregate"
METRIC = "rougeL"
QUESTION_TEMPLATE = "which keys are {category}?"


@dataclass(frozen=True)
class AggregatePool:
    docs: tuple[KvDoc, ...]
    sampler: ZipfSampler
    categories: tuple[str, ...]


def build_pool(cfg: WorkloadConfig, rng: random.Random, id_base: int = 0) -> AggregatePool:
    categories = CATEGORY_WORDS[:cfg.categories]
    alloc = WordAllocator(cfg.word_len, reserved=CATEGORY_WORDS)
    docs = build_plain_docs(cfg, rng, alloc, cfg.pool_size, id_base, values=categories)
    return AggregatePool(tuple(docs), ZipfSampler(len(docs), cfg.zipf), categories)


def make_request(pool: AggregatePool, cfg: WorkloadConfig, rng: random.Random, request_id: str) -> Request:
    k = rng.randrange(cfg.docs_min, cfg.docs_max + 1)
    chosen = pool.sampler.draw_distinct(rng, k)
    rng.shuffle(chosen)
    facts = [fact for i in chosen for fact in pool.docs[i].facts]
    present = [c for c in pool.categories if any(v == c for _, v in facts)]
    category = rng.choice(present)
    answer = " ".join(key for key, value in facts if value == category)
    segments = [Segment(pool.docs[i].text, cache=True) for i in chosen]
    segments.append(question_segment(QUESTION_TEMPLATE.format(category=category)))
    return Request(request_id, NAME, tuple(segments), answer, METRIC)


def fresh_request(cfg: WorkloadConfig, rng: random.Random, request_id: str) -> Request:
    """A request over freshly generated documents (training data, not the pool)."""
    small = replace(cfg, pool_size=cfg.docs_max, zipf=0.0)
    return make_request(build_pool(small, rng, id_base=rng.randrange(1000)), small, rng, request_id)
