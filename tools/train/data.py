"""Training batches: workload examples over fresh random content, encoded as byte tokens
with a per-token loss class, length-bucketed and padded, produced ahead of the GPU by
worker processes.

Example layout (ByteTokenizer ids; the engine prepends BOS to a request's first segment):

    [BOS] prompt bytes ... "A: " answer "\\n" ["Q: ...\\nA: " answer "\\n"] ...

Every token carries a loss class (`kinds`), each with its own weight in the loss:
- PAD_KIND: padding and BOS, no loss;
- PROMPT_KIND: document text (random keys and values; teaches the format);
- QUESTION_KIND: question segments "Q: value of k3x9?\\nA: " (the first and the extra
  ones): after a key's first byte the rest of it is predictable by copying it from the
  documents, which is the same lookup the answers need;
- ANSWER_KIND: answer bytes and the newline that ends each answer;
- DEMO_KIND: the outputs of fewshot demonstration lines (`input -> OUTPUT`), predictable
  once the rule is seen, so each line is one more supervised rule application.
The model predicts token t+1 from tokens <= t, so the class of the *target* token
decides its weight.

Curriculum (`DataConfig.curriculum_frac` = c): an example's size level s in [0, 1] scales
documents per prompt and facts per document linearly from `min_docs` documents of
`min_items` facts (s = 0; default 2 of 3) to the tiny workload defaults (s = 1). At
training progress p: p < c: s ~ U(0, p / c); c <= p < 2c: s = 1 with probability
(p - c) / c, else U(0, 1); p >= 2c: s = 1. Short prompts (fewer distractors) teach the
lookup quickly; the full-size examples then teach the length the evaluation uses.

Batches: `batch_size` sequences padded to a multiple of `pad_multiple` tokens (few
distinct shapes, so kernels that autotune on shapes do it a few times only). A worker
builds `group` batches at once from `group * batch_size` examples sorted by length, so
little of a batch is padding, and returns them in random order.

`BatchStream` keeps `prefetch` such groups in flight in a process pool (spawned workers,
safe next to CUDA); consumption follows submission order, and group i is built from
`derive_seed(seed, i)`, so a run is reproducible for a given stage schedule. With
`workers=0` everything runs in the calling process (tests, CPU runs).
"""
from __future__ import annotations

import collections
import concurrent.futures as cf
import functools
import hashlib
import multiprocessing
import random
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

from engine.tokenizer import ByteTokenizer
from tools.workloads import TASKS, Request, make_config, sample_training_request
from tools.workloads.config import WorkloadConfig
from tools.workloads.errors import GenerationError

from .errors import DataError, TrainConfigError
from .questions import extra_questions

PAD_KIND, PROMPT_KIND, ANSWER_KIND, DEMO_KIND, QUESTION_KIND = 0, 1, 2, 3, 4
#: names of the loss classes, in kind order (PAD has none)
KIND_NAMES = {PROMPT_KIND: "prompt", ANSWER_KIND: "answer", DEMO_KIND: "demo", QUESTION_KIND: "question"}
BOS_ID, PAD_ID = ByteTokenizer.BOS, ByteTokenizer.PAD
#: separator of a fewshot demonstration line `input -> output`
DEMO_ARROW = " -> "
#: Default task mixture: weighted towards the tasks the models find hardest.
DEFAULT_MIX: Mapping[str, float] = {"fact": 0.8, "twohop": 2.5, "aggregate": 0.5, "fewshot": 2.0, "rag": 0.8}
_MAX_REDRAWS = 20


@dataclass(frozen=True)
class DataConfig:
    """What the training sequences look like."""

    mix: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_MIX))
    #: further questions appended after the first answer (see questions.py)
    extra_questions: int = 3
    #: prepend BOS (the engine does, for a request's first segment)
    bos: bool = True
    #: sequences longer than this lose extra questions until they fit (then are redrawn)
    max_len: int = 1152
    pad_multiple: int = 128
    #: curriculum length c: widening sizes until c, mixed until 2c, then full size (0: none)
    curriculum_frac: float = 0.3
    #: cap on the size level (1: full size reachable; < 1: short prompts only, for CPU runs)
    max_level: float = 1.0
    #: the smallest prompt of the curriculum (level 0): documents per prompt, items per document
    min_docs: int = 2
    min_items: int = 3
    scale: str = "tiny"

    def validate(self) -> None:
        unknown = set(self.mix) - set(TASKS)
        if unknown:
            raise TrainConfigError(f"task mixture names unknown task(s) {sorted(unknown)}; known: {TASKS}")
        if not self.mix or any(w < 0 for w in self.mix.values()) or sum(self.mix.values()) <= 0:
            raise TrainConfigError(f"task mixture weights must be >= 0 with a positive sum, got {dict(self.mix)}")
        if self.extra_questions < 0:
            raise TrainConfigError(f"extra_questions={self.extra_questions} must be >= 0")
        if self.pad_multiple < 1:
            raise TrainConfigError(f"pad_multiple={self.pad_multiple} must be >= 1")
        if self.max_len < 64:
            raise TrainConfigError(f"max_len={self.max_len} must be >= 64")
        if not 0.0 <= self.curriculum_frac <= 0.5:
            raise TrainConfigError(f"curriculum_frac={self.curriculum_frac} must be in [0, 0.5]")
        if not 0.0 <= self.max_level <= 1.0:
            raise TrainConfigError(f"max_level={self.max_level} must be in [0, 1]")
        if self.min_docs < 2 or self.min_items < 2:
            raise TrainConfigError(f"min_docs={self.min_docs} and min_items={self.min_items} must be >= 2 "
                                   "(two-hop needs two documents of two facts)")


def parse_mix(text: str) -> dict[str, float]:
    """'fact=1,twohop=2' -> {'fact': 1.0, 'twohop': 2.0}; raises TrainConfigError naming the bad part."""
    out: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, weight = part.partition("=")
        if name not in TASKS:
            raise TrainConfigError(f"--mix names unknown task {name!r}; known: {', '.join(TASKS)}")
        try:
            out[name] = float(weight) if weight else 1.0
        except ValueError:
            raise TrainConfigError(f"--mix weight of {name!r} is not a number: {weight!r}") from None
    if not out:
        raise TrainConfigError(f"--mix is empty: {text!r}")
    return out


def derive_seed(seed: int, *labels: object) -> int:
    """A 63-bit seed from (seed, labels) through SHA-256 (stable across processes)."""
    material = "/".join(map(str, (seed, *labels))).encode()
    return int.from_bytes(hashlib.sha256(material).digest()[:8], "big") >> 1


# ------------------------------------------------------------------ curriculum
@functools.lru_cache(maxsize=4096)
def _sized_config(task: str, scale: str, docs_min: int, docs_max: int, items: int) -> WorkloadConfig:
    return make_config(task, scale, docs=(docs_min, docs_max), facts_per_doc=items)


@functools.lru_cache(maxsize=None)
def _full_config(task: str, scale: str) -> WorkloadConfig:
    return make_config(task, scale)


def example_config(task: str, level: float, scale: str = "tiny", min_docs: int = 2,
                   min_items: int = 3) -> WorkloadConfig:
    """The workload config of an example of size level in [0, 1]: 1 is the scale's default,
    0 is `min_docs` documents of `min_items` items, linear in between."""
    full = _full_config(task, scale)
    if level >= 1.0:
        return full
    lerp = lambda lo, hi: int(round(lo + (hi - lo) * level))  # noqa: E731
    docs_max = max(min_docs, lerp(min_docs, full.docs_max))
    docs_min = max(2, min(full.docs_min, docs_max - 1))
    items = max(min_items, lerp(min_items, full.facts_per_doc))
    return _sized_config(task, scale, docs_min, docs_max, items)


def size_level(rng: random.Random, progress: float, curriculum_frac: float) -> float:
    """Size level of one example at training progress p, with c = curriculum_frac:
    p < c: U(0, p / c) (the run starts on the smallest prompts and widens the range);
    c <= p < 2c: full size with probability (p - c) / c, else U(0, 1); p >= 2c: full size."""
    if curriculum_frac <= 0:
        return 1.0
    ramp = progress / curriculum_frac
    if ramp < 1.0:
        return rng.random() * ramp
    if ramp >= 2.0 or rng.random() < ramp - 1.0:
        return 1.0
    return rng.random()


# -------------------------------------------------------------------- encoding
@dataclass(frozen=True)
class Example:
    """One encoded training sequence: token ids and the loss class of each token."""

    task: str
    ids: np.ndarray    # int16 [n]
    kinds: np.ndarray  # uint8 [n]

    def __len__(self) -> int:
        return int(self.ids.shape[0])


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def encode_request(request: Request, extras=(), bos: bool = True) -> Example:
    """BOS? + documents (PROMPT; in fewshot blocks the `output\\n` of each `input -> output`
    line is DEMO) + question (QUESTION) + answer "\\n" (ANSWER) + for each extra QA:
    question (QUESTION) + answer "\\n" (ANSWER)."""
    ids: list[int] = [BOS_ID] if bos else []
    kinds: list[int] = [PAD_KIND] if bos else []

    def put(text: str, kind: int) -> None:
        b = _bytes(text)
        ids.extend(b)
        kinds.extend([kind] * len(b))

    for seg in request.segments:
        if request.task == "fewshot" and seg.cache:
            for line in seg.text.splitlines(keepends=True):
                head, arrow, tail = line.partition(DEMO_ARROW)
                if arrow:
                    put(head + arrow, PROMPT_KIND)
                    put(tail, DEMO_KIND)
                else:
                    put(line, PROMPT_KIND)
        else:
            put(seg.text, PROMPT_KIND if seg.cache else QUESTION_KIND)
    put(request.answer + "\n", ANSWER_KIND)
    for qa in extras:
        put(qa.question, QUESTION_KIND)
        put(qa.answer + "\n", ANSWER_KIND)
    return Example(request.task, np.asarray(ids, dtype=np.int16), np.asarray(kinds, dtype=np.uint8))


def make_example(rng: random.Random, cfg: DataConfig, progress: float) -> Example:
    """One training example: task from the mixture, size from the curriculum, extra
    questions while the sequence stays within cfg.max_len."""
    tasks, weights = list(cfg.mix), list(cfg.mix.values())
    for _ in range(_MAX_REDRAWS):
        task = rng.choices(tasks, weights=weights)[0]
        level = min(cfg.max_level, size_level(rng, progress, cfg.curriculum_frac))
        wcfg = example_config(task, level, cfg.scale, cfg.min_docs, cfg.min_items)
        try:
            request = sample_training_request(task, rng, cfg.scale, wcfg)
        except GenerationError:
            continue  # e.g. a tiny fewshot prompt with no unambiguous question: redraw
        extras = extra_questions(request, rng, cfg.extra_questions)
        while True:
            ex = encode_request(request, extras, cfg.bos)
            if len(ex) <= cfg.max_len or not extras:
                break
            extras = extras[:-1]
        if len(ex) <= cfg.max_len:
            return ex
    raise DataError(f"no example of the mixture {dict(cfg.mix)} fits max_len={cfg.max_len} "
                    f"in {_MAX_REDRAWS} draws")


# --------------------------------------------------------------------- batches
@dataclass
class Batch:
    """`batch_size` padded sequences: ids int64-able `[B, T]`, kinds uint8 `[B, T]`."""

    ids: np.ndarray
    kinds: np.ndarray
    tasks: tuple[str, ...]

    @property
    def answer_tokens(self) -> int:
        return int((self.kinds == ANSWER_KIND).sum())

    @property
    def real_tokens(self) -> int:
        return int((self.kinds != PAD_KIND).sum()) + int(self.ids.shape[0])


def collate(examples: list[Example], pad_multiple: int) -> Batch:
    """Right-pad to the longest example rounded up to `pad_multiple` (PAD ids, PAD_KIND)."""
    if not examples:
        raise DataError("cannot collate an empty list of examples")
    longest = max(len(e) for e in examples)
    t = -(-longest // pad_multiple) * pad_multiple
    ids = np.full((len(examples), t), PAD_ID, dtype=np.int16)
    kinds = np.zeros((len(examples), t), dtype=np.uint8)
    for i, e in enumerate(examples):
        ids[i, :len(e)] = e.ids
        kinds[i, :len(e)] = e.kinds
    return Batch(ids, kinds, tuple(e.task for e in examples))


def build_group(seed: int, cfg: DataConfig, batch_size: int, group: int, progress: float) -> list[Batch]:
    """`group` batches from `group * batch_size` examples sorted by length (little padding),
    returned in random order. Pure function of its arguments (run in worker processes)."""
    rng = random.Random(seed)
    examples = [make_example(rng, cfg, progress) for _ in range(group * batch_size)]
    examples.sort(key=len)
    batches = [collate(examples[i:i + batch_size], cfg.pad_multiple)
               for i in range(0, len(examples), batch_size)]
    rng.shuffle(batches)
    return batches


class BatchStream:
    """Batches for a training run, built ahead in worker processes.

    `next(progress)` returns the next batch; `progress` (0..1) is the training progress used
    for the curriculum of groups submitted from now on (groups already in flight keep the
    progress they were submitted with). Close with `close()` (or use as a context manager).
    """

    def __init__(self, cfg: DataConfig, batch_size: int, seed: int, workers: int = 0,
                 group: int = 8, prefetch: int | None = None) -> None:
        cfg.validate()
        if batch_size < 1:
            raise TrainConfigError(f"batch_size={batch_size} must be >= 1")
        if group < 1:
            raise TrainConfigError(f"group={group} must be >= 1")
        self.cfg, self.batch_size, self.seed, self.group = cfg, batch_size, seed, group
        self.workers = max(0, workers)
        self.prefetch = prefetch if prefetch is not None else max(2, 2 * self.workers)
        self._next_group = 0
        self._ready: collections.deque[Batch] = collections.deque()
        self._futures: collections.deque[cf.Future] = collections.deque()
        self._pool = None
        if self.workers:
            self._pool = cf.ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"))

    def _submit(self, progress: float) -> None:
        seed = derive_seed(self.seed, "group", self._next_group)
        self._next_group += 1
        args = (seed, self.cfg, self.batch_size, self.group, progress)
        if self._pool is None:
            fut: cf.Future = cf.Future()
            fut.set_result(build_group(*args))
        else:
            fut = self._pool.submit(build_group, *args)
        self._futures.append(fut)

    def next(self, progress: float = 1.0) -> Batch:
        self._fill(progress)
        return self._ready.popleft()

    def peek(self, progress: float = 1.0) -> Batch:
        """The batch the next `next()` returns, without consuming it."""
        self._fill(progress)
        return self._ready[0]

    def _fill(self, progress: float) -> None:
        if self._pool is not None:
            while len(self._futures) < self.prefetch:
                self._submit(progress)
        while not self._ready:
            if not self._futures:
                self._submit(progress)
            self._ready.extend(self._futures.popleft().result())

    def close(self) -> None:
        if self._pool is not None:
            for fut in self._futures:
                fut.cancel()
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        self._futures.clear()

    def __enter__(self) -> "BatchStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
