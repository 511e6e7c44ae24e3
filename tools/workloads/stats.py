"""Summary statistics of a request stream: prompt lengths, segments, and segment reuse.

Reuse ratio = fraction of cacheable segment occurrences whose text already occurred in
an earlier request of the stream (what a warm, unbounded segment cache would hit).
Question segments (cache=False) are not counted.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Iterable, Sequence

from .common import Request, token_count


@dataclass(frozen=True)
class WorkloadStats:
    task: str
    requests: int
    mean_prompt_tokens: float
    min_prompt_tokens: int
    max_prompt_tokens: int
    mean_segments: float
    mean_cached_tokens: float      # tokens in cacheable segments per request
    distinct_segments: int         # distinct cacheable segment texts
    reuse_ratio: float             # repeated / all cacheable segment occurrences
    mean_answer_tokens: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def workload_stats(requests: Iterable[Request], task: str | None = None) -> WorkloadStats:
    reqs = list(requests)
    if not reqs:
        return WorkloadStats(task or "-", 0, 0.0, 0, 0, 0.0, 0.0, 0, 0.0, 0.0)
    lengths = [r.prompt_tokens for r in reqs]
    seen: set[str] = set()
    occurrences = repeats = cached_tokens = 0
    for r in reqs:
        for seg in r.segments:
            if not seg.cache:
                continue
            occurrences += 1
            cached_tokens += token_count(seg.text)
            if seg.text in seen:
                repeats += 1
            else:
                seen.add(seg.text)
    n = len(reqs)
    return WorkloadStats(
        task=task or ",".join(sorted({r.task for r in reqs})),
        requests=n,
        mean_prompt_tokens=sum(lengths) / n,
        min_prompt_tokens=min(lengths),
        max_prompt_tokens=max(lengths),
        mean_segments=sum(len(r.segments) for r in reqs) / n,
        mean_cached_tokens=cached_tokens / n,
        distinct_segments=len(seen),
        reuse_ratio=repeats / occurrences if occurrences else 0.0,
        mean_answer_tokens=sum(token_count(r.answer) for r in reqs) / n,
    )


def format_table(rows: Sequence[WorkloadStats]) -> str:
    """A plain-text table, one row per task."""
    header = ("task", "requests", "mean tok", "min tok", "max tok", "seg/req",
              "distinct seg", "reuse", "answer tok")
    body = [(s.task, str(s.requests), f"{s.mean_prompt_tokens:.0f}", str(s.min_prompt_tokens),
             str(s.max_prompt_tokens), f"{s.mean_segments:.2f}", str(s.distinct_segments),
             f"{s.reuse_ratio:.3f}", f"{s.mean_answer_tokens:.1f}") for s in rows]
    widths = [max(len(h), *(len(row[i]) for row in body)) if body else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip(header, widths)))]
    for row in body:
        lines.append("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))))
    return "\n".join(lines)
