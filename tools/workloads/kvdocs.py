"""Key-value documents, the cacheable segments of `fact`, `twohop`, `aggregate` and `rag`.

A document is a header line and one fact per line:

    ## doc 17
    k3x9: m2qa
    p0zt: 7fbe

Owns the document record (`KvDoc`), its rendering, and the builders of document pools:
plain documents (independent facts) and linked documents (hop-1 facts `a: b` whose value
b is the key of a fact `b: c` in a hop-2 document). Every key and value is drawn from one
`WordAllocator`, so within a pool no word is used twice: keys are unique in any prompt,
no value is mistaken for a key, and a two-hop chain is unambiguous.

Linked pools interleave hop-1 and hop-2 documents (pool index 2i: hop-1 doc i, 2i+1:
hop-2 doc i); hop-1 doc i points half its facts into hop-2 doc i and half into hop-2
doc i+1, so pairs of documents that answer a question together are retrieved together,
as in real multi-hop RAG.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from .common import WordAllocator
from .config import WorkloadConfig

HEADER_TEMPLATE = "## doc {doc_id}\n"
FACT_TEMPLATE = "{key}: {value}\n"


@dataclass(frozen=True)
class KvDoc:
    """One document: its pool index, its facts in text order, its text, and (hop-1
    documents only) for each linked key, the pool index of the document holding the
    fact whose key is this fact's value."""

    index: int
    facts: tuple[tuple[str, str], ...]
    text: str
    links: Mapping[str, int] = field(default_factory=dict)
    kind: str = "plain"  # "plain" | "hop1" | "hop2"

    def value_of(self, key: str) -> str:
        for k, v in self.facts:
            if k == key:
                return v
        raise KeyError(key)


def render_doc(doc_id: int, facts: Sequence[tuple[str, str]]) -> str:
    return HEADER_TEMPLATE.format(doc_id=doc_id) + "".join(
        FACT_TEMPLATE.format(key=k, value=v) for k, v in facts)


def doc_fact_counts(cfg: WorkloadConfig, rng: random.Random, n: int, minimum: int = 1) -> list[int]:
    """Facts per document for a pool of n documents: cfg.facts_per_doc, or, when
    cfg.doc_len_spread > 0, lengths varied uniformly by +-spread and then rescaled so that
    their mean weighted by how often each pool rank is drawn (Zipf, cfg.zipf) is
    cfg.facts_per_doc. Without the rescaling the few most popular documents would set
    the mean prompt length by the luck of their draw."""
    if cfg.doc_len_spread == 0:
        return [max(minimum, cfg.facts_per_doc)] * n
    raw = [1.0 + cfg.doc_len_spread * (2.0 * rng.random() - 1.0) for _ in range(n)]
    weights = inclusion_weights(n, cfg.zipf, (cfg.docs_min + cfg.docs_max) / 2)
    norm = sum(weights) / sum(w * r for w, r in zip(weights, raw))
    return [max(minimum, round(cfg.facts_per_doc * r * norm)) for r in raw]


def inclusion_weights(n: int, zipf: float, draws: float) -> list[float]:
    """Approximate probability that pool rank i is among `draws` Zipf draws."""
    raw = [1.0 / (i + 1) ** zipf for i in range(n)]
    total = sum(raw)
    return [1.0 - (1.0 - r / total) ** draws for r in raw]


def build_plain_docs(cfg: WorkloadConfig, rng: random.Random, alloc: WordAllocator,
                     n: int, id_base: int = 0, values: Sequence[str] | None = None) -> list[KvDoc]:
    """n documents of independent facts. Values are fresh words, or drawn from `values`
    (e.g. the category words of `aggregate`) when given."""
    docs = []
    for i, count in enumerate(doc_fact_counts(cfg, rng, n)):
        keys = alloc.words(rng, count)
        vals = [rng.choice(values) for _ in keys] if values else alloc.words(rng, count)
        facts = tuple(zip(keys, vals))
        docs.append(KvDoc(i, facts, render_doc(id_base + i, facts)))
    return docs


def build_linked_docs(cfg: WorkloadConfig, rng: random.Random, alloc: WordAllocator,
                      n: int, id_base: int = 0) -> list[KvDoc]:
    """A pool of n documents, hop-1 at even indices and hop-2 at odd ones (see the
    module docstring). A hop-1 fact whose target pool is exhausted gets a fresh value
    and no link (it is then only a single-fact question)."""
    hop1_idx = list(range(0, n, 2))
    hop2_idx = list(range(1, n, 2))
    counts = doc_fact_counts(cfg, rng, n, minimum=2)
    docs: dict[int, KvDoc] = {}
    unused: dict[int, list[str]] = {}
    for idx in hop2_idx:
        keys = alloc.words(rng, counts[idx])
        facts = tuple(zip(keys, alloc.words(rng, counts[idx])))
        docs[idx] = KvDoc(idx, facts, render_doc(id_base + idx, facts), kind="hop2")
        pending = list(keys)
        rng.shuffle(pending)
        unused[idx] = pending
    n2 = len(hop2_idx)
    for i, idx in enumerate(hop1_idx):
        count = counts[idx]
        keys = alloc.words(rng, count)
        first = (count + 1) // 2
        facts: list[tuple[str, str]] = []
        links: dict[str, int] = {}
        for j, key in enumerate(keys):
            start = i if j < first else i + 1
            target = None
            for step in range(n2):
                cand = hop2_idx[(start + step) % n2]
                if unused[cand]:
                    target = cand
                    break
            if target is None:
                facts.append((key, alloc.word(rng)))
            else:
                facts.append((key, unused[target].pop()))
                links[key] = target
        rng.shuffle(facts)
        docs[idx] = KvDoc(idx, tuple(facts), render_doc(id_base + idx, facts), links, kind="hop1")
    return [docs[i] for i in range(n)]


def chain_answer(docs: Mapping[int, KvDoc], hop1: KvDoc, key: str) -> tuple[str, str, int]:
    """For a linked key a of `hop1`: (b, c, index of the hop-2 document) of a -> b -> c."""
    middle = hop1.value_of(key)
    target = hop1.links[key]
    return middle, docs[target].value_of(middle), target
