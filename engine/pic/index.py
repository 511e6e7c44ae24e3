"""Indexing segments ahead of requests: segments a deployment knows will recur (a RAG
corpus's documents, a tool's outputs, system prompts) computed alone and stored before
any request names them, so the first request that does hits them.

`index_segments(planner, runner, contents)` takes each segment's token ids (tokenized
alone, without BOS, as `LLMEngine.add_request` tokenizes a segment), keys it as a request
would (`PicPlanner.key(content, min(n, seam))`: the same key at every placement), and
computes the segments the store does not hold in packed alone passes of up to the
planner's idle batch (`DeferredQueue.batch_tokens`), handing each batch to the store
(`claim_jobs` -> alone pass -> `publish_jobs`, the idle path's calls). A segment the store
already holds, or another engine is computing (`claim_jobs` leaves it out), is counted
`present` and not computed; a store that cannot tell (the daemon away) raises
(`claim_jobs(strict=True)`: engine.connector.errors.StoreUnavailable), never counts
them. The store's puts run on its put thread; every `flush_every` batches and at the end
the call waits for them (`SegmentStore.flush`), so the put queue never overflows (a full
queue drops puts) and the segments are stored when it returns.

Call order and threads: on the engine loop's thread while no request is in the engine
(`LLMEngine.index_segments` checks); it runs to the end (no `should_stop`). A failing
pass releases its claims and raises.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional, Sequence

from engine.pic.deferred import DeferredQueue
from engine.pic.segment_store import SegmentJob

#: batches computed between waits for the store's puts (each waits for the queued puts)
FLUSH_EVERY = 16
#: longest wait for the store's puts at a flush (seconds)
FLUSH_TIMEOUT_S = 120.0


@dataclass
class IndexReport:
    """What an `index_segments` call did: `segments` distinct keys given (`tokens` their
    content tokens), `computed` signatures computed and handed to the store, `present`
    held already (or being computed by another engine), `batches` alone passes, `seconds`
    wall time including the waits for the puts, `flushed` whether every put finished."""

    segments: int
    tokens: int
    computed: int = 0
    present: int = 0
    batches: int = 0
    seconds: float = 0.0
    flushed: bool = True

    def to_dict(self) -> dict:
        return asdict(self)


def index_jobs(planner, contents: Sequence[Sequence[int]]) -> list[SegmentJob]:
    """One job per distinct key of `contents` (empty contents skipped), in order."""
    jobs: dict[bytes, SegmentJob] = {}
    anchor = len(planner.anchor_ids)
    for ids in contents:
        ids = tuple(int(t) for t in ids)
        if not ids:
            continue
        split = min(len(ids), planner.seam)
        key = planner.key(ids, split)
        if key not in jobs:
            jobs[key] = SegmentJob(key, ids, split, float(anchor + len(ids)))
    return list(jobs.values())


def index_segments(planner, runner, contents: Sequence[Sequence[int]],
                   progress: Optional[Callable[[IndexReport], None]] = None,
                   flush_every: int = FLUSH_EVERY) -> IndexReport:
    """Compute and store the signatures of `contents` the store lacks (module docstring).
    `progress(report so far)` after each batch."""
    t0 = time.perf_counter()
    jobs = index_jobs(planner, contents)
    report = IndexReport(segments=len(jobs), tokens=sum(j.num_tokens for j in jobs))
    queue = DeferredQueue(max_entries=max(1, len(jobs)), batch_tokens=planner.deferred.batch_tokens)
    queue.add(jobs)
    store = planner.store
    while queue:
        batch = queue.next_batch()
        mine = store.claim_jobs(batch, strict=True)
        report.present += len(batch) - len(mine)
        if mine:
            t1 = time.perf_counter()
            try:
                sigs = planner._alone(runner, [(c.job.token_ids, c.job.split) for c in mine])
            except BaseException:
                store.release_jobs(mine, "failed")
                raise
            store.publish_jobs(mine, sigs, (time.perf_counter() - t1) * 1e3)
            report.computed += len(mine)
            report.batches += 1
            if report.batches % max(1, flush_every) == 0:
                report.flushed = store.flush(FLUSH_TIMEOUT_S) and report.flushed
        report.seconds = time.perf_counter() - t0
        if progress is not None:
            progress(report)
    report.flushed = store.flush(FLUSH_TIMEOUT_S) and report.flushed
    report.seconds = time.perf_counter() - t0
    return report
