"""Shared pieces of the workload generators: request records, seeded randomness, the
Zipf-popular segment pool, and the word allocator that keeps keys unique.

Owns:
- `Segment` and `Request`: the request record written as one JSON line
  (`{"id", "task", "segments": [{"text", "cache"}], "answer", "metric"}`); the engine's
  `kvengine run --requests` reads `id` and `segments` and ignores the other fields.
- `derive_rng`: a `random.Random` derived from (seed, labels) through SHA-256, so the
  pool and the request stream of each task are independent, reproducible streams.
- `ZipfSampler`: draws distinct pool indices with probability proportional to
  1 / (rank + 1) ** s (rank = pool index).
- `WordAllocator`: short random alphanumeric words, never the same word twice.
- The prompt text conventions shared by every task (question segment, answer delimiter).

Determinism: only `random.Random` methods whose streams are stable across CPython
versions are used (`random`, `choice`, `choices`, `shuffle`, `randrange`).
"""
from __future__ import annotations

import bisect
import hashlib
import itertools
import json
import random
import string
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from .errors import GenerationError, RecordFormatError, UnknownTaskError, WorkloadConfigError

TASKS: tuple[str, ...] = ("fact", "twohop", "aggregate", "fewshot", "rag")
METRICS: tuple[str, ...] = ("em", "f1", "rougeL")

#: Characters of keys and values (lowercase letters and digits).
WORD_ALPHABET = string.ascii_lowercase + string.digits
#: The question segment is "Q: <question>\nA: "; the model answers after ANSWER_PREFIX.
QUESTION_PREFIX = "Q: "
ANSWER_PREFIX = "\nA: "
#: The answer ends at the first newline; training targets end with it.
ANSWER_END = "\n"


def check_task(task: str) -> str:
    """Return `task` if it is one of TASKS, else raise UnknownTaskError naming it."""
    if task not in TASKS:
        raise UnknownTaskError(f"unknown task {task!r}; expected one of {', '.join(TASKS)}")
    return task


def token_count(text: str) -> int:
    """Prompt length in tokens of the byte-level tokenizer: the UTF-8 byte count."""
    return len(text.encode("utf-8"))


@dataclass(frozen=True)
class Segment:
    """One piece of a prompt. `cache=True`: a reusable document / example block / system
    prompt that recurs across requests; `cache=False`: the request's own question."""

    text: str
    cache: bool

    def to_dict(self) -> dict[str, Any]:
        return {"text": self.text, "cache": self.cache}


@dataclass(frozen=True)
class Request:
    """A generated request: segments (the last one is the question, cache=False), the
    reference answer (no trailing newline) and the metric that scores it."""

    id: str
    task: str
    segments: tuple[Segment, ...]
    answer: str
    metric: str

    @property
    def prompt(self) -> str:
        """The full prompt text: the segments concatenated in order."""
        return "".join(seg.text for seg in self.segments)

    @property
    def prompt_tokens(self) -> int:
        return token_count(self.prompt)

    @property
    def question(self) -> Segment:
        return self.segments[-1]

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "task": self.task,
            "segments": [seg.to_dict() for seg in self.segments],
            "answer": self.answer,
            "metric": self.metric,
        }

    def to_json(self) -> str:
        """One JSON line (no newline), keys in a fixed order, ASCII only."""
        return json.dumps(self.to_dict(), ensure_ascii=True, separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Request":
        """Parse a record written by `to_dict`/`to_json`; raise RecordFormatError naming
        the field that is missing or malformed."""
        if not isinstance(data, Mapping):
            raise RecordFormatError(f"request record must be an object, got {type(data).__name__}")
        for field in ("id", "task", "segments", "answer", "metric"):
            if field not in data:
                raise RecordFormatError(f"request record {data.get('id')!r} lacks field {field!r}")
        if data["metric"] not in METRICS:
            raise RecordFormatError(f"request {data['id']!r}: unknown metric {data['metric']!r}")
        raw = data["segments"]
        if not isinstance(raw, list) or not raw:
            raise RecordFormatError(f"request {data['id']!r}: segments must be a non-empty list")
        segments = []
        for i, seg in enumerate(raw):
            if not isinstance(seg, Mapping) or not isinstance(seg.get("text"), str) \
                    or not isinstance(seg.get("cache"), bool):
                raise RecordFormatError(
                    f"request {data['id']!r}: segment {i} must be {{'text': str, 'cache': bool}}, got {seg!r}")
            segments.append(Segment(seg["text"], seg["cache"]))
        return cls(str(data["id"]), check_task(str(data["task"])), tuple(segments),
                   str(data["answer"]), str(data["metric"]))

    @classmethod
    def from_json(cls, line: str) -> "Request":
        try:
            data = json.loads(line)
        except json.JSONDecodeError as exc:
            raise RecordFormatError(f"not a JSON request line: {line[:80]!r} ({exc})") from exc
        return cls.from_dict(data)


def question_segment(question: str) -> Segment:
    """The final, uncached segment: "Q: <question>\\nA: "."""
    return Segment(f"{QUESTION_PREFIX}{question}{ANSWER_PREFIX}", cache=False)


def derive_rng(seed: int, *labels: str) -> random.Random:
    """A random.Random seeded from SHA-256 of (seed, labels): independent streams for the
    pool and the requests of each task, identical on every machine and Python version."""
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise WorkloadConfigError(f"seed must be an int, got {seed!r}")
    material = "/".join([str(seed), *labels]).encode("utf-8")
    return random.Random(int.from_bytes(hashlib.sha256(material).digest()[:8], "big"))


class ZipfSampler:
    """Draws pool indices 0..n-1 with P(i) proportional to 1 / (i + 1) ** s.

    Index 0 is the most popular item; s = 0 is uniform. `draw_distinct` returns k
    different indices (rejection sampling, then the most popular unused ones as a bounded
    fallback, so it always terminates deterministically)."""

    def __init__(self, n: int, s: float) -> None:
        if n < 1:
            raise WorkloadConfigError(f"Zipf pool size must be >= 1, got {n}")
        if s < 0:
            raise WorkloadConfigError(f"Zipf exponent must be >= 0, got {s}")
        self.n = n
        self.s = s
        self._cum = list(itertools.accumulate(1.0 / (i + 1) ** s for i in range(n)))

    def draw(self, rng: random.Random) -> int:
        idx = bisect.bisect_right(self._cum, rng.random() * self._cum[-1])
        return min(idx, self.n - 1)

    def draw_distinct(self, rng: random.Random, k: int, exclude: Iterable[int] = ()) -> list[int]:
        taken = set(exclude)
        if k + len(taken) > self.n:
            raise WorkloadConfigError(
                f"cannot draw {k} distinct items from a pool of {self.n} ({len(taken)} excluded)")
        out: list[int] = []
        for _ in range(50 * k + 50):
            if len(out) == k:
                break
            idx = self.draw(rng)
            if idx not in taken:
                taken.add(idx)
                out.append(idx)
        for idx in range(self.n):  # fallback for extreme exponents: most popular unused
            if len(out) == k:
                break
            if idx not in taken:
                taken.add(idx)
                out.append(idx)
        return out


class WordAllocator:
    """Random alphanumeric words of a fixed length, each handed out at most once (plus
    a set of reserved words that are never handed out), so keys never repeat in a pool."""

    def __init__(self, length: int, reserved: Iterable[str] = (), alphabet: str = WORD_ALPHABET) -> None:
        if length < 2:
            raise WorkloadConfigError(f"word length must be >= 2, got {length}")
        self.length = length
        self.alphabet = alphabet
        self.used: set[str] = set(reserved)
        self.capacity = len(alphabet) ** length

    def word(self, rng: random.Random) -> str:
        if len(self.used) >= self.capacity // 2:
            raise GenerationError(
                f"word space exhausted: {len(self.used)} words of length {self.length} in use; "
                "use a longer word length or a smaller pool")
        alphabet, base = self.alphabet, len(self.alphabet)
        while True:
            v = rng.randrange(self.capacity)
            chars = []
            for _ in range(self.length):
                v, d = divmod(v, base)
                chars.append(alphabet[d])
            w = "".join(chars)
            if w not in self.used:
                self.used.add(w)
                return w

    def words(self, rng: random.Random, n: int) -> list[str]:
        return [self.word(rng) for _ in range(n)]


def write_requests(path: str, requests: Iterable[Request]) -> int:
    """Write requests as JSONL (one `Request.to_json()` per line); return the count."""
    n = 0
    with open(path, "w", encoding="ascii", newline="\n") as f:
        for req in requests:
            f.write(req.to_json() + "\n")
            n += 1
    return n


def read_requests(path: str) -> list[Request]:
    """Read a JSONL file written by `write_requests` or the CLI; blank lines are skipped,
    a malformed line raises RecordFormatError naming the file and line number."""
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append(Request.from_json(line))
            except RecordFormatError as exc:
                raise RecordFormatError(f"{path}:{lineno}: {exc}") from exc
    return out
