"""The seam between the PIC planner and wherever segment signatures are kept: the
`SegmentStore` interface, its records, and the in-process implementation
`InProcessSegmentStore` (over a `SignatureCache`, engine.pic.signature_cache).

`PicPlanner` (engine.pic.planner) owns the plan: the layout, the report, the cold
fallback, the deferred queue and the alone passes. A `SegmentStore` owns where signatures
come from and go to: loads, leases, claims (who computes a segment several requests or
engines miss), waiting for another engine's result, cold sharing, and accounting of its
own. The daemon-backed implementation is engine.connector.daemon_store.DaemonSegmentStore;
tests use a dict-backed fake (tests/engine/pic/test_segment_store_contract.py runs one
contract suite over all three).

Calls, in the order they happen for one request (all from the engine loop's thread):

  plan time (scheduler side)
    admit(request_id, keys, prefix, compute_ms)
                                      optional: the request's distinct segment keys, so
                                      loading can start now (prefetch); `prefix` is the
                                      exact prefix the request restores, if any;
                                      `compute_ms` (None: unknown), per key, the time
                                      computing its positions in context would take: a
                                      store may skip a hit slower to load than that
    hint_depth() / hint(keys)         optional: how many queued requests to look ahead at
                                      (0: none), then their keys (promotion, no lease)
  the `lookup` step
    lookup(request_id, keys) -> {key: signature | None}
                                      the hits, exactly: a key absent from the answer is a
                                      miss. A signature is usable now; None means "a hit
                                      whose signature `take` hands over at its splice"
    slow_hits(request_id) -> {key}    optional, after `lookup`: the keys it left out that
                                      are hits the store chose not to load (slower than
                                      `compute_ms`): the planner computes them in context
                                      and neither claims nor publishes them (the store
                                      holds them). Default: none
  the `miss` step
    claim(request_id, jobs, compute) -> [Filled]
                                      the misses (one `SegmentJob` per distinct key, prompt
                                      order). The store decides which this engine computes
                                      (calling `compute(jobs)` -> signatures, one packed
                                      alone pass per call, and publishing each itself)
                                      and which it gets otherwise (present by now, computed
                                      by another engine it waited for). Returns exactly one
                                      `Filled` per job. Exceptions of `compute` propagate
                                      after the store released its claims
  each splice step
    take(request_id, keys, layered=False) -> {key: signature | None}
                                      `keys`: every key about to be spliced. Returns the
                                      signatures of the hits `lookup` answered None for
                                      (waiting until they are placed); None: the hit could
                                      not be loaded after all: the planner computes it and
                                      `publish`es it with the request id. Any device copy
                                      of a key in `keys` is complete (on the compute stream)
                                      when this returns, except with `layered` (the fused
                                      pass follows): a key copied layer by layer may still
                                      be in flight, its waits left to `layer_hook`
    layer_hook(request_id) -> before_layer | None
                                      optional, right after a `layered` take: the fused
                                      pass calls `before_layer(i)` before it first reads
                                      layer i of the signatures; the store makes the
                                      compute stream wait there for the layer-i copies it
                                      left in flight (engine.connector.layer_loads). None
                                      (the default): nothing to wait for per layer
  any time, for a signature computed here
    publish(key, signature, cost, request_id=None)
                                      keep it; `cost` is the alone pass's tokens (what a
                                      hit saves). With `request_id`: that request computed
                                      it (late miss); without: a context signature
  prefill done or request freed
    finish(request_id, done)          release everything the request holds (leases,
                                      pins); idempotent; `done`: its prefill completed
                                      (its report is kept for `take_report`)

Idle work (`PicPlanner.help_idle`, engine loop thread, no request running):

    claim_jobs(jobs) -> [ClaimedJob]  of the planner's queued segments, those to compute
                                      now (not held, not computed by another engine),
                                      each under this engine's claim
    offered() -> [ClaimedJob]         optional (cold sharing): segments other engines
                                      asked idle engines for (one batch), claimed; []
                                      by default
    publish_jobs(claimed, signatures, alone_ms)   the pass finished: keep them all
    release_jobs(claimed, reason, alone_ms)       it did not: "stopped" (gave way to a
                                      request), "failed", or "rejected" (an offered
                                      segment whose key does not match its tokens here)
    idle_poll_s                       optional: how often the engine should call
                                      help_idle for the store's own sake (None: never)

Exact-prefix checkpoints (optional; the in-process store keeps none beyond the
planner's own tree): `find_prefix(ids, ends)`, `put_prefix(ids, tip)`,
`has_prefix(ids)`. Reports and lifecycle (optional): `take_report(request_id)`,
`register_metrics(registry)`, `flush()` (publishing may run in the background: wait
until it is kept), `close()`.

Thread-safety: every call above comes from the engine loop's thread; an implementation
that runs threads of its own (loads, puts) guards its state itself. A signature a store
hands out (from `lookup`, `take`, `claim`) stays valid until `finish` for that request.
Failure: a store whose backend is gone answers lookups with misses, claims by asking to
compute, and drops puts (counted); it never raises into a request.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from engine.pic.signature import SegmentSignature
from engine.pic.signature_cache import SignatureCache, SignatureCacheStats

#: why an idle batch was not published (`SegmentStore.release_jobs`)
RELEASE_REASONS = ("stopped", "failed", "rejected")


@dataclass(frozen=True)
class SegmentJob:
    """A segment to compute alone behind the anchor: its key, content tokens and seam
    split; `cost`: tokens of its alone pass (anchor + content), the work a hit saves."""

    key: bytes
    token_ids: tuple[int, ...]
    split: int
    cost: float

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class Filled:
    """One miss after `SegmentStore.claim`: its signature and whether this request
    computed it (an alone pass here) or got it otherwise (landed meanwhile, or another
    engine computed it while this one waited)."""

    key: bytes
    signature: SegmentSignature
    computed: bool


@dataclass
class ClaimedJob:
    """A segment idle work computes: the job, where it came from ("deferred": this
    engine's queue; "offered": another engine's cold segment), and the store's own claim
    record (opaque to the planner)."""

    job: SegmentJob
    origin: str = "deferred"
    claim: object = None


ComputeFn = Callable[[Sequence[SegmentJob]], list[SegmentSignature]]


class SegmentStore(abc.ABC):
    """Where the PIC planner's segment signatures live (module docstring: call order)."""

    #: the signature cache behind the store, when it has one (stats; None otherwise)
    cache: Optional[SignatureCache] = None

    # ------------------------------------------------------------ plan time (optional)
    def admit(self, request_id: str, keys: Sequence[bytes], prefix=None,
              compute_ms: Optional[dict[bytes, float]] = None) -> None:
        """A request was planned; `keys`: its distinct segment keys; `compute_ms`: per
        key, the in-context compute a hit saves (None: unknown). Default: nothing."""
        return None

    def hint_depth(self) -> int:
        """How many queued requests' keys `hint` wants now (0: none). Default: 0."""
        return 0

    def hint(self, keys: Sequence[bytes]) -> None:
        """Keys of queued requests, to make cheap to load. Default: nothing."""
        return None

    # ------------------------------------------------------------ request steps
    @abc.abstractmethod
    def lookup(self, request_id: str, keys: Sequence[bytes]) -> dict[bytes, Optional[SegmentSignature]]:
        """The hits among `keys`: key -> signature, or None for one `take` hands over."""

    def slow_hits(self, request_id: str) -> frozenset[bytes]:
        """Hits `lookup` left out because loading them was expected to take longer than
        computing them (module docstring). Default: none."""
        return frozenset()

    @abc.abstractmethod
    def claim(self, request_id: str, jobs: Sequence[SegmentJob], compute: ComputeFn) -> list[Filled]:
        """Resolve the request's misses, computing through `compute` what falls to this
        engine; one `Filled` per job, in job order."""

    @abc.abstractmethod
    def take(self, request_id: str, keys: Sequence[bytes],
             layered: bool = False) -> dict[bytes, Optional[SegmentSignature]]:
        """Signatures of hits `lookup` answered None for, among `keys` (None: could not
        be loaded after all); device copies of every key in `keys` complete (with
        `layered`: those copied layer by layer may be left to `layer_hook`)."""

    def layer_hook(self, request_id: str) -> Optional[Callable[[int], None]]:
        """The fused pass's `before_layer(i)` for the copies a `layered` take left in
        flight; None: nothing to wait for per layer. Default: None."""
        return None

    @abc.abstractmethod
    def publish(self, key: bytes, signature: SegmentSignature, cost: float, request_id: Optional[str] = None) -> None:
        """Keep a signature computed here (`request_id`: the request that computed it)."""

    @abc.abstractmethod
    def finish(self, request_id: str, done: bool) -> None:
        """Release what the request holds; `done`: its prefill completed. Idempotent."""

    # ------------------------------------------------------------ idle work
    @abc.abstractmethod
    def claim_jobs(self, jobs: Sequence[SegmentJob], strict: bool = False) -> list[ClaimedJob]:
        """Of queued segments, those idle work should compute now, claimed (the others are
        held, or being computed elsewhere). A store that cannot tell (its backend is away)
        answers none, or with `strict` raises (indexing must not count them as held)."""

    def offered(self) -> list[ClaimedJob]:
        """Segments other engines offered (cold sharing), claimed. Default: none."""
        return []

    @abc.abstractmethod
    def publish_jobs(self, claimed: Sequence[ClaimedJob], signatures: Sequence[SegmentSignature],
                     alone_ms: float = 0.0) -> None:
        """Keep the signatures an idle pass computed for `claimed` (same order)."""

    def release_jobs(self, claimed: Sequence[ClaimedJob], reason: str, alone_ms: float = 0.0) -> None:
        """An idle pass over `claimed` was not published (RELEASE_REASONS). Default: nothing."""
        return None

    @property
    def idle_poll_s(self) -> Optional[float]:
        """How often the engine should call help_idle for this store (None: never)."""
        return None

    # ------------------------------------------------------------ exact prefixes (optional)
    @property
    def keeps_prefixes(self) -> bool:
        """Whether `put_prefix` keeps anything (a planner need not offer it prefixes
        otherwise). Default: False."""
        return False

    def find_prefix(self, ids: Sequence[int], ends: Sequence[int]):
        """The deepest exact checkpoint of `ids[:end]` for an end in `ends` held by the
        store, as (BoundaryCheckpoint, tier), or None. Default: None."""
        return None

    def put_prefix(self, ids: Sequence[int], tip) -> None:
        """Exact checkpoints of `ids`' prefix down to the tree node `tip` were computed
        (engine.pic.prefix). Default: nothing."""
        return None

    def has_prefix(self, ids: Sequence[int]) -> bool:
        """Whether the store holds the exact prefix `ids` already. Default: False."""
        return False

    # ------------------------------------------------------------ reports, lifecycle (optional)
    def take_report(self, request_id: str):
        """The store's own report of a finished request (returned once), or None."""
        return None

    def register_metrics(self, registry) -> None:
        """Expose the store's metrics in a prometheus_client registry. Default: nothing."""
        return None

    def stats(self) -> Optional[SignatureCacheStats]:
        """The cache's counters, when the store has a cache."""
        return None if self.cache is None else self.cache.stats()

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until what was published is kept (a store may publish in the background);
        False when `timeout` passed first. Default: True (nothing in flight)."""
        return True

    def close(self, timeout: float = 30.0) -> None:
        """Finish queued work and release everything. Default: nothing."""
        return None


class InProcessSegmentStore(SegmentStore):
    """Signatures in a `SignatureCache` of this process (an LRU by bytes by default):
    every hit is usable at lookup, misses are computed here, nothing is shared."""

    def __init__(self, cache: SignatureCache) -> None:
        self.cache = cache
        self._held: dict[str, list[bytes]] = {}

    def lookup(self, request_id: str, keys: Sequence[bytes]) -> dict[bytes, Optional[SegmentSignature]]:
        hits: dict[bytes, Optional[SegmentSignature]] = {}
        for key in keys:
            sig = self.cache.get(key)
            if sig is not None:
                self._held.setdefault(request_id, []).append(key)
                hits[key] = sig
        return hits

    def claim(self, request_id: str, jobs: Sequence[SegmentJob], compute: ComputeFn) -> list[Filled]:
        sigs = compute(jobs) if jobs else []
        for job, sig in zip(jobs, sigs):
            self.cache.put(job.key, sig)
        return [Filled(job.key, sig, True) for job, sig in zip(jobs, sigs)]

    def take(self, request_id: str, keys: Sequence[bytes],
             layered: bool = False) -> dict[bytes, Optional[SegmentSignature]]:
        return {}  # every hit came with its signature at lookup

    def publish(self, key: bytes, signature: SegmentSignature, cost: float, request_id: Optional[str] = None) -> None:
        self.cache.put(key, signature)

    def finish(self, request_id: str, done: bool) -> None:
        for key in self._held.pop(request_id, ()):
            self.cache.release(key)

    def claim_jobs(self, jobs: Sequence[SegmentJob], strict: bool = False) -> list[ClaimedJob]:
        held = self.cache.lookup([j.key for j in jobs])
        return [ClaimedJob(j) for j, h in zip(jobs, held) if not h]

    def publish_jobs(self, claimed: Sequence[ClaimedJob], signatures: Sequence[SegmentSignature],
                     alone_ms: float = 0.0) -> None:
        for c, sig in zip(claimed, signatures):
            self.cache.put(c.job.key, sig)
