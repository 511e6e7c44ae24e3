"""Workload `rag`: a production-RAG-like trace, for speed/QPS and for quality.

Prompt: a system prompt segment (a small pool, Zipf-popular, so mostly the same one),
then 3-10 (bench) / 3-6 (tiny) retrieved documents of varying length from a linked
key-value pool (Zipf over the pool, random order), then the question. The question is a
single-fact question (share `fact_share`) or a two-hop question, with the same templates
and answers as the `fact` and `twohop` workloads, so rag quality is measured with them.
At bench scale documents average ~1700 tokens and prompts ~12k tokens.
Metric: exact match.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, replace

from . import fact, twohop
from .common import Request, Segment, ZipfSampler, question_segment
from .config import WorkloadConfig

NAME = "rag"
METRIC = "em"

_SYSTEM_BASES: tuple[str, ...] = (
    "You answer questions from the documents below. Each line is key: value.\n",
    "Use only the documents that follow. Reply with the value alone.\n",
    "Documents list facts as key: value. Look the key up and answer.\n",
    "Answer briefly from the retrieved documents. Facts read key: value.\n",
)
_POLICY_LINES: tuple[str, ...] = (
    "Never invent a value that is not written in a document.",
    "A key names exactly one fact; look for the line that starts with it.",
    "For value of value of a key, look the first value up as a key again.",
    "Answer with the value only, on one line, with no other words.",
    "Documents may come in any order; read all of them before answering.",
    "Ignore documents that do not mention the key in the question.",
    "Keys and values are short words of letters and digits.",
    "Do not repeat the question, the key or the document number.",
    "If a value looks like a key, it may be a key in another document.",
    "Keep the answer exactly as written, without changing case.",
)


def system_prompt(index: int, scale: str) -> str:
    """System prompt number `index` (0 is the most popular). Bench prompts append ten
    numbered policy lines (~780 tokens in all), as production system prompts do."""
    text = _SYSTEM_BASES[index % len(_SYSTEM_BASES)]
    if index >= len(_SYSTEM_BASES):
        text = f"[profile {index}] " + text
    if scale == "bench":
        start = index % len(_POLICY_LINES)
        lines = [_POLICY_LINES[(start + i) % len(_POLICY_LINES)] for i in range(len(_POLICY_LINES))]
        text += "".join(f"Rule {i + 1}: {line}\n" for i, line in enumerate(lines))
    return text


@dataclass(frozen=True)
class RagPool:
    docs: twohop.LinkedPool
    system: tuple[str, ...]
    system_sampler: ZipfSampler


def build_pool(cfg: WorkloadConfig, rng: random.Random, id_base: int = 0) -> RagPool:
    system = tuple(system_prompt(i, cfg.scale) for i in range(cfg.system_prompts))
    return RagPool(twohop.build_pool(cfg, rng, id_base), system, ZipfSampler(len(system), cfg.zipf))


def make_request(pool: RagPool, cfg: WorkloadConfig, rng: random.Random, request_id: str) -> Request:
    docs = pool.docs
    system = pool.system[pool.system_sampler.draw(rng)]
    k = rng.randrange(cfg.docs_min, cfg.docs_max + 1)
    if rng.random() < cfg.fact_share:
        chosen = docs.sampler.draw_distinct(rng, k)
        doc = docs.docs[rng.choice(chosen)]
        key, answer = rng.choice(doc.facts)
        question = fact.QUESTION_TEMPLATE.format(key=key)
    else:
        first, second, key, answer = twohop.draw_chain(docs, rng)
        k = max(k, 2)
        chosen = [first, second] + docs.sampler.draw_distinct(rng, k - 2, exclude=(first, second))
        question = twohop.QUESTION_TEMPLATE.format(key=key)
    rng.shuffle(chosen)
    segments = [Segment(system, cache=True)]
    segments += [Segment(docs.docs[i].text, cache=True) for i in chosen]
    segments.append(question_segment(question))
    return Request(request_id, NAME, tuple(segments), answer, METRIC)


def fresh_request(cfg: WorkloadConfig, rng: random.Random, request_id: str) -> Request:
    """A request over freshly generated documents (training data); the system prompts
    are the fixed ones (they carry no answer)."""
    small = replace(cfg, pool_size=max(cfg.docs_max, 2), zipf=0.0)
    return make_request(build_pool(small, rng, id_base=rng.randrange(1000)), small, rng, request_id)
