"""Workload `fewshot`: in-context rule following.

A hidden rule maps a short lowercase word to another. Each cacheable segment is a block
of examples of one rule, one per line ("abc -> cba\\n"); a prompt holds 3-7 blocks of the
same rule (Zipf-popular in the pool, in random order), then the question
"Q: <new word>\\nA: ". Answer: the rule applied to the new word. Metric: exact match.

Rule families: reverse; shift every letter by k (k in 1..3, cyclic); rotate left by one;
double every letter; map every letter through a small table (6 source letters; inputs of
that rule use only those letters, and the question uses only letters that the prompt's
examples show). The generator checks that every rule consistent with the prompt's
examples gives the same answer, so the question is well posed.

Pool layout: block j belongs to rule j % num_rules, so Zipf popularity over blocks is
also popularity over rules.
"""
from __future__ import annotations

import random
import string
from dataclasses import dataclass
from typing import Sequence

from .common import Request, Segment, ZipfSampler, question_segment
from .config import WorkloadConfig
from .errors import GenerationError
from .kvdocs import doc_fact_counts

NAME = "fewshot"
METRIC = "em"
FAMILIES: tuple[str, ...] = ("reverse", "shift", "rotate", "double", "map")
SHIFTS: tuple[int, ...] = (1, 2, 3)
MAP_LETTERS = 6
WORD_MIN, WORD_MAX = 3, 6
EXAMPLE_TEMPLATE = "{inp} -> {out}\n"
_LETTERS = string.ascii_lowercase


@dataclass(frozen=True)
class Rule:
    """A hidden rule: its family and parameter (shift amount or letter table)."""

    family: str
    shift: int = 0
    table: tuple[tuple[str, str], ...] = ()

    @property
    def alphabet(self) -> str:
        """Letters the rule's inputs are drawn from."""
        return "".join(src for src, _ in self.table) if self.family == "map" else _LETTERS

    def apply(self, word: str) -> str:
        if self.family == "reverse":
            return word[::-1]
        if self.family == "shift":
            return "".join(chr((ord(c) - 97 + self.shift) % 26 + 97) for c in word)
        if self.family == "rotate":
            return word[1:] + word[:1]
        if self.family == "double":
            return "".join(c + c for c in word)
        if self.family == "map":
            table = dict(self.table)
            return "".join(table[c] for c in word)
        raise GenerationError(f"unknown rule family {self.family!r}")


def random_rule(rng: random.Random, family: str) -> Rule:
    if family == "shift":
        return Rule("shift", shift=rng.choice(SHIFTS))
    if family == "map":
        letters = list(_LETTERS)
        rng.shuffle(letters)
        targets = list(_LETTERS)
        rng.shuffle(targets)
        src = sorted(letters[:MAP_LETTERS])
        return Rule("map", table=tuple(zip(src, targets[:MAP_LETTERS])))
    if family not in FAMILIES:
        raise GenerationError(f"unknown rule family {family!r}")
    return Rule(family)


def random_word(rng: random.Random, alphabet: str) -> str:
    return "".join(rng.choices(alphabet, k=rng.randrange(WORD_MIN, WORD_MAX + 1)))


def example_block(rule: Rule, rng: random.Random, count: int) -> tuple[tuple[tuple[str, str], ...], str]:
    """`count` examples of `rule` with distinct inputs: (pairs, segment text)."""
    seen: set[str] = set()
    pairs = []
    while len(pairs) < count:
        word = random_word(rng, rule.alphabet)
        if word not in seen:
            seen.add(word)
            pairs.append((word, rule.apply(word)))
    return tuple(pairs), "".join(EXAMPLE_TEMPLATE.format(inp=i, out=o) for i, o in pairs)


def consistent_answers(examples: Sequence[tuple[str, str]], query: str) -> set[str]:
    """Answers to `query` of every candidate rule consistent with all `examples` (any
    family, any shift 1..25, the letter table the examples imply)."""
    candidates = [Rule("reverse"), Rule("rotate"), Rule("double")]
    candidates += [Rule("shift", shift=k) for k in range(1, 26)]
    out = {rule.apply(query) for rule in candidates if all(rule.apply(i) == o for i, o in examples)}
    table: dict[str, str] = {}
    if all(len(i) == len(o) for i, o in examples):
        ok = True
        for i, o in examples:
            for a, b in zip(i, o):
                if table.setdefault(a, b) != b:
                    ok = False
        if ok and all(c in table for c in query):
            out.add("".join(table[c] for c in query))
    return out


@dataclass(frozen=True)
class FewshotPool:
    rules: tuple[Rule, ...]
    blocks: tuple[tuple[tuple[str, str], ...], ...]  # examples of block j
    texts: tuple[str, ...]                          # text of block j
    sampler: ZipfSampler                            # over all blocks
    rule_blocks: tuple[tuple[int, ...], ...]        # blocks of each rule, most popular first
    rule_samplers: tuple[ZipfSampler, ...]


def build_pool(cfg: WorkloadConfig, rng: random.Random) -> FewshotPool:
    rules = tuple(random_rule(rng, FAMILIES[r % len(FAMILIES)]) for r in range(cfg.num_rules))
    blocks, texts = [], []
    for j, count in enumerate(doc_fact_counts(cfg, rng, cfg.pool_size)):
        pairs, text = example_block(rules[j % cfg.num_rules], rng, count)
        blocks.append(pairs)
        texts.append(text)
    rule_blocks = tuple(tuple(range(r, cfg.pool_size, cfg.num_rules)) for r in range(cfg.num_rules))
    return FewshotPool(rules, tuple(blocks), tuple(texts), ZipfSampler(cfg.pool_size, cfg.zipf),
                       rule_blocks, tuple(ZipfSampler(len(b), cfg.zipf) for b in rule_blocks))


def _request(rule: Rule, blocks: Sequence[Sequence[tuple[str, str]]], texts: Sequence[str],
             rng: random.Random, request_id: str) -> Request:
    examples = [pair for block in blocks for pair in block]
    shown = {i for i, _ in examples}
    alphabet = "".join(sorted({c for i in shown for c in i})) if rule.family == "map" else _LETTERS
    for _ in range(100):
        query = random_word(rng, alphabet)
        if query in shown:
            continue
        answer = rule.apply(query)
        if consistent_answers(examples, query) == {answer}:
            segments = [Segment(t, cache=True) for t in texts]
            segments.append(question_segment(query))
            return Request(request_id, NAME, tuple(segments), answer, METRIC)
    raise GenerationError(f"{request_id}: no unambiguous question for rule {rule} after 100 tries")


def make_request(pool: FewshotPool, cfg: WorkloadConfig, rng: random.Random, request_id: str) -> Request:
    k = rng.randrange(cfg.docs_min, cfg.docs_max + 1)
    primary = pool.sampler.draw(rng)
    r = primary % cfg.num_rules
    own = pool.rule_blocks[r]
    others = pool.rule_samplers[r].draw_distinct(rng, k - 1, exclude=(own.index(primary),))
    chosen = [primary] + [own[p] for p in others]
    rng.shuffle(chosen)
    return _request(pool.rules[r], [pool.blocks[j] for j in chosen], [pool.texts[j] for j in chosen],
                    rng, request_id)


def fresh_request(cfg: WorkloadConfig, rng: random.Random, request_id: str) -> Request:
    """A request with a fresh random rule and fresh examples (training data)."""
    rule = random_rule(rng, rng.choice(FAMILIES))
    k = rng.randrange(cfg.docs_min, cfg.docs_max + 1)
    made = [example_block(rule, rng, count) for count in doc_fact_counts(cfg, rng, k)]
    return _request(rule, [m[0] for m in made], [m[1] for m in made], rng, request_id)
