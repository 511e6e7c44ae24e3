"""The benchmark's requests: segmented prompts from tools/workloads, and their warm-up
*twins*.

For the five document workloads (TASKS) a twin holds the same cacheable segments as its
request in another order (the documents rotated by one; rag keeps its system prompt
first, as production RAG does) and the same question. Running a request's twin first
warms a cache with every segment of the request, but not with its prefix beyond the
first document: exactly the situation position-independent caching is for (documents
recur across requests in varying order), and the one prefix caching cannot reuse past
the first boundary that differs.

Prefix caching's own cases (EXTRA_TASKS), built from rag requests:
- `repeat`: exact repeats: the twin is the request itself (same documents, same order,
  same question), prefix caching's best case;
- `chat`: multi-turn chat over a rag context: the request is turn CHAT_TURNS of a
  conversation (system prompt and documents, then earlier user turns and assistant
  answers, all cacheable, then the new question); its twin is the previous turn as
  it was served (its own last question uncached), so prefix caching reuses everything
  up to the last answer before it;
- `mix`: the requests of all seven workloads interleaved (each with its own twin; at
  least one of each).

`BenchRequest.warm` holds the twin's segments where a workload defines them (`twin`
returns it), else the rotation above applies.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from tools.workloads import iter_requests

TASKS = ("fact", "twohop", "aggregate", "fewshot", "rag")
#: workloads built here from rag requests (module docstring)
EXTRA_TASKS = ("repeat", "chat", "mix")
ALL_TASKS = TASKS + EXTRA_TASKS
#: the turn of a conversation a `chat` request is (its twin: the turn before)
CHAT_TURNS = 3
#: seed offsets of the extra workloads' rag requests (no request shared with `rag` itself)
_SEED_OFFSET = {"repeat": 1001, "chat": 2002, "mix": 3003}


@dataclass(frozen=True)
class BenchRequest:
    id: str
    task: str
    segments: tuple[dict, ...]  # {"text", "cache"}
    warm: Optional[tuple[dict, ...]] = None  # the twin's segments, where the workload defines them

    @property
    def num_bytes(self) -> int:
        return sum(len(s["text"]) for s in self.segments)

    def as_prompt(self) -> list[dict]:
        return [dict(s) for s in self.segments]


def load(task: str, n: int, seed: int, scale: str, max_tokens: Optional[int] = None,
         docs: Optional[str] = None) -> list[BenchRequest]:
    """n requests of `task` at `scale` (tools.workloads; `max_tokens` bounds prompt +
    answer, `docs` the documents per request, "MIN-MAX"); the EXTRA_TASKS are built
    from rag requests (module docstring)."""
    if task == "repeat":
        return [BenchRequest(r.id.replace("rag", "repeat", 1), "repeat", r.segments, r.segments)
                for r in load("rag", n, seed + _SEED_OFFSET[task], scale, max_tokens, docs)]
    if task == "chat":
        base = load("rag", n * CHAT_TURNS, seed + _SEED_OFFSET[task], scale, max_tokens, docs)
        return [chat_turn(base[i * CHAT_TURNS:(i + 1) * CHAT_TURNS]) for i in range(n)]
    if task == "mix":
        per = -(-n // (len(ALL_TASKS) - 1))
        pools = [load(t, per, seed + _SEED_OFFSET[task], scale, max_tokens, docs) for t in ALL_TASKS if t != "mix"]
        mixed = [pool[i] for i in range(per) for pool in pools if i < len(pool)]
        return [BenchRequest(r.id, "mix", r.segments, r.warm) for r in mixed[:max(n, len(pools))]]
    overrides = {}
    if max_tokens:
        overrides["max_tokens"] = max_tokens
    if docs:
        overrides["docs"] = docs
    return [BenchRequest(r.id, r.task, tuple(s.to_dict() for s in r.segments))
            for r in iter_requests(task, n, seed, scale=scale, **overrides)]


def chat_turn(convo: list[BenchRequest]) -> BenchRequest:
    """Turn len(convo) of a conversation over convo[0]'s context (its cached segments):
    the earlier turns ask convo[k]'s questions and get a short answer each (cacheable,
    as a chat server caches its history); the last question is new. Its twin: the turn
    before (module docstring)."""
    context = [s for s in convo[0].segments if s["cache"]]
    questions = [next(s for s in r.segments if not s["cache"])["text"] for r in convo]
    history: list[dict] = []
    for k, q in enumerate(questions[:-1]):
        history += [{"text": q, "cache": True}, {"text": f"The answer is in the documents above ({k + 1}).\n",
                                                  "cache": True}]
    before = context + history[:-2] + [{"text": questions[-2], "cache": False}] if len(questions) > 1 else None
    turn = context + history + [{"text": questions[-1], "cache": False}]
    return BenchRequest(convo[0].id.replace("rag", "chat", 1), "chat", tuple(turn),
                        None if before is None else tuple(before))


def twin(req: BenchRequest) -> BenchRequest:
    """The request's warm-up twin (module docstring): `req.warm` where the workload
    defines it, else its segments in another order."""
    if req.warm is not None:
        return BenchRequest(req.id + "-twin", req.task, req.warm)
    cached = [s for s in req.segments if s["cache"]]
    rest = [s for s in req.segments if not s["cache"]]
    head, body = (cached[:1], cached[1:]) if req.task == "rag" else ([], cached)
    if len(body) > 1:
        body = body[1:] + body[:1]
    return BenchRequest(req.id + "-twin", req.task, tuple(head + body + rest))
