"""Extra questions over a training prompt: more supervised answers per forward pass.

A workload request asks one question; its answer is ~4 bytes, so answer-only training gets
~5 supervised tokens from a ~700-token sequence. `extra_questions(request, rng, n)` reads
the request's documents (only the prompt text, as a solver would) and asks up to `n`
further questions of the same task over the same documents, with the workloads' own
question templates. The training sequence is then

    <prompt ending in "Q: <q1>\\nA: "><a1>\\n Q: <q2>\\nA: <a2>\\n ...

so the first question sits exactly where an evaluation question sits, and each extra
question adds its answer tokens to the loss at ~25 extra tokens of compute.

Per task (the same rules the generators use, so every extra answer is correct and unique):
- `fact`: "value of <key>?" for other keys of the prompt's documents;
- `twohop`: "value of value of <a>?" (answer "b: c") for other complete chains a -> b -> c in the prompt
  (b is a key of another fact), falling back to single-fact questions;
- `rag`: fact or two-hop questions, half and half;
- `aggregate`: "which keys are <category>?" for other categories present, keys in prompt
  order;
- `fewshot`: a new input word (letters the examples show, 3-6 letters, not an example
  input) whose answer every rule consistent with the examples agrees on.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass

from tools.workloads import Request
from tools.workloads import aggregate as aggregate_task
from tools.workloads import fact as fact_task
from tools.workloads import fewshot as fewshot_task
from tools.workloads import twohop as twohop_task
from tools.workloads.common import question_segment

FACT_LINE = re.compile(r"^([a-z0-9]+): ([a-z0-9]+)$")
EXAMPLE_LINE = re.compile(r"^([a-z]+) -> ([a-z]+)$")
#: tries per extra fewshot question before giving up on it (ambiguous words are skipped)
_FEWSHOT_TRIES = 40


@dataclass(frozen=True)
class QA:
    """One question segment text ("Q: ...\\nA: ") and its answer (no trailing newline)."""

    question: str
    answer: str


def parse_facts(request: Request) -> list[tuple[str, str]]:
    """(key, value) of every `key: value` line of the request's cacheable segments, in
    prompt order (system prompts and headers do not match the line pattern)."""
    out = []
    for seg in request.segments[:-1]:
        for line in seg.text.splitlines():
            m = FACT_LINE.match(line)
            if m:
                out.append((m.group(1), m.group(2)))
    return out


def parse_examples(request: Request) -> list[tuple[str, str]]:
    """(input, output) of every `input -> output` line of a fewshot request's blocks."""
    out = []
    for seg in request.segments[:-1]:
        for line in seg.text.splitlines():
            m = EXAMPLE_LINE.match(line)
            if m:
                out.append((m.group(1), m.group(2)))
    return out


def _original_question(request: Request) -> str:
    text = request.segments[-1].text
    return text[len("Q: "):-len("\nA: ")]


def _fact_qas(facts: list[tuple[str, str]], rng: random.Random, n: int, skip: set[str]) -> list[QA]:
    pool = [(k, v) for k, v in facts if fact_task.QUESTION_TEMPLATE.format(key=k) not in skip]
    picked = rng.sample(pool, min(n, len(pool)))
    return [QA(question_segment(fact_task.QUESTION_TEMPLATE.format(key=k)).text, v) for k, v in picked]


def _chain_qas(facts: list[tuple[str, str]], rng: random.Random, n: int, skip: set[str]) -> list[QA]:
    value_of = dict(facts)
    chains = [(a, twohop_task.chain_text(b, value_of[b])) for a, b in facts if b in value_of]
    chains = [(a, c) for a, c in chains if twohop_task.QUESTION_TEMPLATE.format(key=a) not in skip]
    picked = rng.sample(chains, min(n, len(chains)))
    return [QA(question_segment(twohop_task.QUESTION_TEMPLATE.format(key=a)).text, c) for a, c in picked]


def _aggregate_qas(facts: list[tuple[str, str]], rng: random.Random, n: int, skip: set[str]) -> list[QA]:
    present = sorted({v for _, v in facts})
    cats = [c for c in present if aggregate_task.QUESTION_TEMPLATE.format(category=c) not in skip]
    out = []
    for cat in rng.sample(cats, min(n, len(cats))):
        answer = " ".join(k for k, v in facts if v == cat)
        out.append(QA(question_segment(aggregate_task.QUESTION_TEMPLATE.format(category=cat)).text, answer))
    return out


class _RuleSet:
    """Every rule consistent with a prompt's examples, found once, then applied to many
    query words: the same candidates and answers as `fewshot.consistent_answers` (reverse,
    rotate, double, shift 1..25, and the letter table the examples imply)."""

    def __init__(self, examples: list[tuple[str, str]]) -> None:
        candidates = [fewshot_task.Rule("reverse"), fewshot_task.Rule("rotate"), fewshot_task.Rule("double")]
        candidates += [fewshot_task.Rule("shift", shift=k) for k in range(1, 26)]
        self.rules = [r for r in candidates if all(r.apply(i) == o for i, o in examples)]
        self.table: dict[str, str] | None = None
        if all(len(i) == len(o) for i, o in examples):
            table: dict[str, str] = {}
            if all(table.setdefault(a, b) == b for i, o in examples for a, b in zip(i, o)):
                self.table = table

    def answers(self, word: str) -> set[str]:
        out = {r.apply(word) for r in self.rules}
        if self.table is not None and all(c in self.table for c in word):
            out.add("".join(self.table[c] for c in word))
        return out


def _fewshot_qas(examples: list[tuple[str, str]], rng: random.Random, n: int, skip: set[str]) -> list[QA]:
    shown = {i for i, _ in examples}
    letters = "".join(sorted({c for i in shown for c in i}))
    if not letters:
        return []
    rules = _RuleSet(examples)
    out: list[QA] = []
    used = set(skip)
    for _ in range(n * _FEWSHOT_TRIES):
        if len(out) == n:
            break
        word = fewshot_task.random_word(rng, letters)
        if word in shown or word in used:
            continue
        answers = rules.answers(word)
        if len(answers) == 1:
            used.add(word)
            out.append(QA(question_segment(word).text, answers.pop()))
    return out


def extra_questions(request: Request, rng: random.Random, n: int) -> list[QA]:
    """Up to `n` further questions of the request's task over its documents (fewer when the
    prompt does not hold enough distinct ones); never the request's own question."""
    if n <= 0:
        return []
    skip = {_original_question(request)}
    task = request.task
    if task == "fewshot":
        return _fewshot_qas(parse_examples(request), rng, n, skip)
    facts = parse_facts(request)
    if task == "aggregate":
        return _aggregate_qas(facts, rng, n, skip)
    if task == "fact":
        return _fact_qas(facts, rng, n, skip)
    if task == "twohop":
        out = _chain_qas(facts, rng, n, skip)
        return out + _fact_qas(facts, rng, n - len(out), skip)
    if task == "rag":
        n_chain = sum(rng.random() < 0.5 for _ in range(n))
        out = _chain_qas(facts, rng, n_chain, skip)
        return out + _fact_qas(facts, rng, n - len(out), skip)
    raise ValueError(f"no extra questions for task {task!r}")
