"""Workload `fact`: single-fact retrieval (TriviaQA-like).

Prompt: 3-7 key-value documents drawn from the pool by Zipf popularity, in random order,
then the question "Q: value of <key>?\\nA: ". Answer: the key's value (one word).
Metric: exact match.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, replace

from .common import Request, Segment, WordAllocator, ZipfSampler, question_segment
from .config import CATEGORY_WORDS, WorkloadConfig
from .kvdocs import KvDoc, build_plain_docs

NAME = "fact"
METRIC = "em"
QUESTION_TEMPLATE = "value of {key}?"


@dataclass(frozen=True)
class FactPool:
    docs: tuple[KvDoc, ...]
    sampler: ZipfSampler


def build_pool(cfg: WorkloadConfig, rng: random.Random, id_base: int = 0) -> FactPool:
    alloc = WordAllocator(cfg.word_len, reserved=CATEGORY_WORDS)
    docs = build_plain_docs(cfg, rng, alloc, cfg.pool_size, id_base)
    return FactPool(tuple(docs), ZipfSampler(len(docs), cfg.zipf))


def make_request(pool: FactPool, cfg: WorkloadConfig, rng: random.Random, request_id: str) -> Request:
    k = rng.randrange(cfg.docs_min, cfg.docs_max + 1)
    chosen = pool.sampler.draw_distinct(rng, k)
    rng.shuffle(chosen)
    doc = pool.docs[rng.choice(chosen)]
    key, value = rng.choice(doc.facts)
    segments = [Segment(pool.docs[i].text, cache=True) for i in chosen]
    segments.append(question_segment(QUESTION_TEMPLATE.format(key=key)))
    return Request(request_id, NAME, tuple(segments), value, METRIC)


def fresh_request(cfg: WorkloadConfig, rng: random.Random, request_id: str) -> Request:
    """A request over freshly generated documents (training data, not the pool)."""
    small = replace(cfg, pool_size=cfg.docs_max, zipf=0.0)
    return make_request(build_pool(small, rng, id_base=rng.randrange(1000)), small, rng, request_id)
