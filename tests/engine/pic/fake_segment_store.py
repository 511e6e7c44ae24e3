"""`DictSegmentStore`: an in-memory, dict-backed `SegmentStore` for tests, and
`RecordingStore`, which wraps any store and records the calls the planner makes.

The fake behaves as a remote store would where it matters to the planner: a hit at
lookup comes without its signature (handed over by `take`), what a request took is held
until `finish`, and `fail()` makes its backend go away (lookups miss, puts are dropped
and counted, nothing raises). It keeps no claims: every miss is computed by the
request that claims it."""
from __future__ import annotations

from typing import Optional, Sequence

from engine.pic.segment_store import ClaimedJob, ComputeFn, Filled, SegmentJob, SegmentStore
from engine.pic.signature import SegmentSignature


class DictSegmentStore(SegmentStore):
    """Signatures in a dict; see the module docstring."""

    def __init__(self) -> None:
        self.entries: dict[bytes, SegmentSignature] = {}
        self.held: dict[str, list[bytes]] = {}
        self.pending: dict[str, set[bytes]] = {}
        self.gone = False
        self.dropped = 0

    def fail(self) -> None:
        """The backend goes away."""
        self.gone = True

    def outstanding(self) -> int:
        return sum(len(v) for v in self.held.values())

    def _keep(self, key: bytes, sig: SegmentSignature) -> None:
        if self.gone:
            self.dropped += 1
        else:
            self.entries.setdefault(key, sig)

    def lookup(self, request_id: str, keys: Sequence[bytes]) -> dict[bytes, Optional[SegmentSignature]]:
        if self.gone:
            return {}
        hits = {k: None for k in keys if k in self.entries}
        self.pending.setdefault(request_id, set()).update(hits)
        return hits

    def claim(self, request_id: str, jobs: Sequence[SegmentJob], compute: ComputeFn) -> list[Filled]:
        sigs = compute(jobs) if jobs else []
        for job, sig in zip(jobs, sigs):
            self._keep(job.key, sig)
        return [Filled(j.key, s, True) for j, s in zip(jobs, sigs)]

    def take(self, request_id: str, keys: Sequence[bytes],
             layered: bool = False) -> dict[bytes, Optional[SegmentSignature]]:
        pending = self.pending.get(request_id, set())
        out: dict[bytes, Optional[SegmentSignature]] = {}
        for key in keys:
            if key in pending:
                pending.discard(key)
                sig = None if self.gone else self.entries.get(key)
                if sig is not None:
                    self.held.setdefault(request_id, []).append(key)
                out[key] = sig
        return out

    def publish(self, key: bytes, signature: SegmentSignature, cost: float, request_id: Optional[str] = None) -> None:
        self._keep(key, signature)

    def finish(self, request_id: str, done: bool) -> None:
        self.held.pop(request_id, None)
        self.pending.pop(request_id, None)

    def claim_jobs(self, jobs: Sequence[SegmentJob], strict: bool = False) -> list[ClaimedJob]:
        return [ClaimedJob(j) for j in jobs if j.key not in self.entries]

    def publish_jobs(self, claimed: Sequence[ClaimedJob], signatures: Sequence[SegmentSignature],
                     alone_ms: float = 0.0) -> None:
        for c, sig in zip(claimed, signatures):
            self._keep(c.job.key, sig)


class RecordingStore(SegmentStore):
    """Forwards every call to `inner` and records (method, request id or None) in `calls`."""

    def __init__(self, inner: SegmentStore) -> None:
        self.inner = inner
        self.cache = inner.cache
        self.calls: list[tuple[str, Optional[str]]] = []

    def _rec(self, name: str, request_id: Optional[str] = None) -> None:
        self.calls.append((name, request_id))

    def admit(self, request_id, keys, prefix=None, compute_ms=None):
        self._rec("admit", request_id)
        return self.inner.admit(request_id, keys, prefix, compute_ms)

    def lookup(self, request_id, keys):
        self._rec("lookup", request_id)
        return self.inner.lookup(request_id, keys)

    def slow_hits(self, request_id):
        return self.inner.slow_hits(request_id)

    def claim(self, request_id, jobs, compute):
        self._rec("claim", request_id)
        return self.inner.claim(request_id, jobs, compute)

    def take(self, request_id, keys, layered=False):
        self._rec("take", request_id)
        return self.inner.take(request_id, keys, layered=layered)

    def layer_hook(self, request_id):
        self._rec("layer_hook", request_id)
        return self.inner.layer_hook(request_id)

    def publish(self, key, signature, cost, request_id=None):
        self._rec("publish", request_id)
        return self.inner.publish(key, signature, cost, request_id)

    def finish(self, request_id, done):
        self._rec("finish", request_id)
        return self.inner.finish(request_id, done)

    def claim_jobs(self, jobs, strict=False):
        self._rec("claim_jobs")
        return self.inner.claim_jobs(jobs, strict)

    def publish_jobs(self, claimed, signatures, alone_ms=0.0):
        self._rec("publish_jobs")
        return self.inner.publish_jobs(claimed, signatures, alone_ms)

    def release_jobs(self, claimed, reason, alone_ms=0.0):
        self._rec("release_jobs")
        return self.inner.release_jobs(claimed, reason, alone_ms)
