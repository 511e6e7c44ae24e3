"""The benchmark's requests: segmented prompts from tools/workloads, and their warm-up
*twins*.

A twin holds the same cacheable segments as its request in another order (the
documents rotated by one; rag keeps its system prompt first, as production RAG does)
and the same question. Running a request's twin first warms a cache with every
segment of the request, but not with its prefix beyond the first document: exactly
the situation position-independent caching is for (documents recur across requests in
varying order), and the one prefix caching cannot reuse past the first boundary that
differs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from tools.workloads import iter_requests

TASKS = ("fact", "twohop", "aggregate", "fewshot", "rag")


@dataclass(frozen=True)
class BenchRequest:
    id: str
    task: str
    segments: tuple[dict, ...]  # {"text", "cache"}

    @property
    def num_bytes(self) -> int:
        return sum(len(s["text"]) for s in self.segments)

    def as_prompt(self) -> list[dict]:
        return [dict(s) for s in self.segments]


def load(task: str, n: int, seed: int, scale: str, max_tokens: Optional[int] = None,
         docs: Optional[str] = None) -> list[BenchRequest]:
    """n requests of `task` at `scale` (tools.workloads; `max_tokens` bounds prompt +
    answer, `docs` the documents per request, "MIN-MAX")."""
    overrides = {}
    if max_tokens:
        overrides["max_tokens"] = max_tokens
    if docs:
        overrides["docs"] = docs
    return [BenchRequest(r.id, r.task, tuple(s.to_dict() for s in r.segments))
            for r in iter_requests(task, n, seed, scale=scale, **overrides)]


def twin(req: BenchRequest) -> BenchRequest:
    """The request's segments in another order (module docstring)."""
    cached = [s for s in req.segments if s["cache"]]
    rest = [s for s in req.segments if not s["cache"]]
    head, body = (cached[:1], cached[1:]) if req.task == "rag" else ([], cached)
    if len(body) > 1:
        body = body[1:] + body[:1]
    return BenchRequest(req.id + "-twin", req.task, tuple(head + body + rest))
