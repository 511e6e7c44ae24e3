"""Workload `twohop`: two-hop retrieval across documents (HotpotQA-like).

Prompt: a hop-1 document holding `a: b`, the hop-2 document holding `b: c`, and further
Zipf-drawn distractor documents, in random order; then "Q: value of value of <a>?\\nA: ".
Answer: "b: c", the bridge word and then the final value (a short chain of thought, as
HotpotQA systems answer with their supporting fact: each step is one lookup, and the
second lookup's query, b, is only known from the first). The two facts always sit in two
different segments, so the answer needs attention across segments (the case where naive
KV reuse fails). Metric: exact match of the whole chain.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, replace

from .common import Request, Segment, WordAllocator, ZipfSampler, question_segment
from .config import CATEGORY_WORDS, WorkloadConfig
from .errors import GenerationError
from .kvdocs import KvDoc, build_linked_docs, chain_answer

NAME = "twohop"
METRIC = "em"
QUESTION_TEMPLATE = "value of value of {key}?"
ANSWER_TEMPLATE = "{middle}: {value}"


def chain_text(middle: str, value: str) -> str:
    """The expected answer of a two-hop question a -> b -> c: "b: c"."""
    return ANSWER_TEMPLATE.format(middle=middle, value=value)


@dataclass(frozen=True)
class LinkedPool:
    """Linked documents (hop-1 at even pool indices, hop-2 at odd ones)."""

    docs: tuple[KvDoc, ...]
    sampler: ZipfSampler          # over the whole pool (distractors)
    hop1: tuple[int, ...]         # pool indices of hop-1 documents that have links
    hop1_sampler: ZipfSampler     # over `hop1`, by rank


def build_pool(cfg: WorkloadConfig, rng: random.Random, id_base: int = 0) -> LinkedPool:
    alloc = WordAllocator(cfg.word_len, reserved=CATEGORY_WORDS)
    docs = tuple(build_linked_docs(cfg, rng, alloc, cfg.pool_size, id_base))
    hop1 = tuple(d.index for d in docs if d.kind == "hop1" and d.links)
    if not hop1:
        raise GenerationError(f"{cfg.task}: pool of {cfg.pool_size} documents has no linked facts")
    return LinkedPool(docs, ZipfSampler(len(docs), cfg.zipf), hop1, ZipfSampler(len(hop1), cfg.zipf))


def draw_chain(pool: LinkedPool, rng: random.Random) -> tuple[int, int, str, str]:
    """A Zipf-popular hop-1 document and one of its linked keys:
    (hop-1 index, hop-2 index, key a, answer "b: c")."""
    first = pool.docs[pool.hop1[pool.hop1_sampler.draw(rng)]]
    key = rng.choice(sorted(first.links))
    middle, value, second = chain_answer(pool.docs, first, key)
    return first.index, second, key, chain_text(middle, value)


def make_request(pool: LinkedPool, cfg: WorkloadConfig, rng: random.Random, request_id: str) -> Request:
    k = rng.randrange(cfg.docs_min, cfg.docs_max + 1)
    first, second, key, answer = draw_chain(pool, rng)
    chosen = [first, second] + pool.sampler.draw_distinct(rng, k - 2, exclude=(first, second))
    rng.shuffle(chosen)
    segments = [Segment(pool.docs[i].text, cache=True) for i in chosen]
    segments.append(question_segment(QUESTION_TEMPLATE.format(key=key)))
    return Request(request_id, NAME, tuple(segments), answer, METRIC)


def fresh_request(cfg: WorkloadConfig, rng: random.Random, request_id: str) -> Request:
    """A request over freshly generated documents (training data, not the pool)."""
    small = replace(cfg, pool_size=max(cfg.docs_max, 2), zipf=0.0)
    return make_request(build_pool(small, rng, id_base=rng.randrange(1000)), small, rng, request_id)
