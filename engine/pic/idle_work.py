"""The PIC planner's idle work (engine.pic.planner.PicPlanner mixes `IdleWork` in): what
an engine runs while it has no request, one unit per `help_idle` call, and indexing
segments ahead of requests.

In order, each `help_idle`: context signatures of finished prefills waiting to be
published (`keep_captured`); one batch of the queued cold-fallback segments (the
planner's `deferred` queue: a packed alone pass whose claims the store gives, resumed
where it gave way when a request arrived: `idle_pass`); one queued exact prefix
(engine.pic.exact_prefix, giving way between layers); segments other engines offered
through the store (cold sharing). `idle_poll_s` tells the engine how often to call.

Everything here runs on the engine loop's thread and reads the planner's state
(`store`, `deferred`, `captured`, `exact`, `idle_pass`, `costs`, `config`); the alone
passes themselves are the planner's (`_alone`, `_start_alone`, `_signed`).
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Optional, Sequence

from engine.pic.compute import AlonePass
from engine.pic.errors import AlonePassStopped
from engine.pic.segment_store import ClaimedJob
from engine.pic.signature import SegmentSignature

log = logging.getLogger("engine.pic")

#: how often an idle engine polls `help_idle` while segments are queued (seconds)
IDLE_POLL_S = 0.02


class IdleWork:
    """Idle work and indexing of a PIC planner (module docstring)."""

    def index(self, runner, contents: Sequence[Sequence[int]], progress=None):
        """Compute and store the signatures of segments (token ids, tokenized alone) ahead
        of any request: engine.pic.index.index_segments (an IndexReport)."""
        from engine.pic.index import index_segments

        return index_segments(self, runner, contents, progress)

    def keep_captured(self) -> int:
        """Turn the captures of finished prefills into signatures and publish them in the
        store; how many. Deferred from `on_prefill_done`, which the engine calls before it
        samples the request's first token, to the next `plan()` that looks segments up
        (before its lookup) or idle call, so that a request's TTFT does not carry its
        signatures' bookkeeping (an exact repeat's plan leaves them for later)."""
        n = 0
        while self.captured:
            caps = self.captured.popleft()
            for cap, sig in zip(caps.captures, caps.signatures({"fingerprint": self.fingerprint})):
                self.store.publish(cap.key, sig, float(len(self.anchor_ids) + cap.num_tokens))
                n += 1
        return n

    @property
    def idle_poll_s(self) -> Optional[float]:
        """How often the engine should call `help_idle` while idle (None: never)."""
        queues = self.config.cold_full_fraction is not None or self.config.miss_path == "context"
        if self.config.miss_signatures == "context":  # misses' signatures come from their requests
            queues = bool(self.captured)
        if self.exact is not None and self.exact.pending:
            queues = True
        polls = [p for p in (IDLE_POLL_S if queues else None, self.store.idle_poll_s) if p is not None]
        return min(polls) if polls else None

    def help_idle(self, runner, should_stop: Optional[Callable[[], bool]] = None) -> int:
        """Idle work, one unit per call; how many segments (or prefixes) it computed.
        Called by the engine while it has no request. In order: context signatures
        waiting to be published (`keep_captured`); one batch of the queued cold-fallback
        segments (`deferred`, a batch of up to its `batch_tokens`: those the store's `claim_jobs`
        gives, one packed alone pass, `publish_jobs`); one queued exact prefix; segments
        other engines offered (the store's `offered`). `should_stop` (e.g. "a request
        arrived"): asked between the pass's layers; when it says so the pass gives way,
        0 is returned, the store releases its claims, and a pass over the queue is kept
        (`idle_pass`) and resumed by the next call. Failures are logged, never raised."""
        kept = self.keep_captured()
        if kept:
            return kept
        if self.idle_pass is not None or self.deferred:
            return self._help_deferred(runner, should_stop)
        if self.exact is not None and self.exact.pending:
            stopped = self.exact.stopped
            done = self.exact.help(runner, self.store, should_stop)
            self.idle_stopped += self.exact.stopped - stopped
            return done
        return self._help_offered(runner, should_stop)

    def _help_deferred(self, runner, should_stop: Optional[Callable[[], bool]]) -> int:
        if self.idle_pass is not None:
            mine, alone = self.idle_pass
        else:
            mine = self.store.claim_jobs(self.deferred.next_batch())
            if not mine:
                return 0
            alone = self._start_alone(runner, [(c.job.token_ids, c.job.split) for c in mine])
        t0 = time.perf_counter()
        try:
            sigs = self._run_idle(mine, alone, should_stop)
        except Exception:  # idle work must not stop this engine; a later request computes them
            log.exception("computing %d deferred segments failed", len(mine))
            self.idle_pass = None
            self.store.release_jobs(mine, "failed")
            return 0
        ms = (time.perf_counter() - t0) * 1e3
        if sigs is None:  # a request arrived: claims released, the pass resumed later
            self.store.release_jobs(mine, "stopped", ms)
            if self.idle_pass is None:  # not kept (idle_resume=False): queued again
                self.deferred.requeue([c.job for c in mine])
            return 0
        self.store.publish_jobs(mine, sigs, ms)
        return len(mine)

    def _help_offered(self, runner, should_stop: Optional[Callable[[], bool]]) -> int:
        """Segments other engines offered (cold sharing), computed in one packed pass."""
        taken: list[ClaimedJob] = []
        for c in self.store.offered():
            if self.key(c.job.token_ids, c.job.split) != c.job.key:  # other anchor/seam/options, or forged
                self.store.release_jobs([c], "rejected")
            else:
                taken.append(c)
        if not taken:
            return 0
        t0 = time.perf_counter()
        try:
            sigs = self._alone(runner, [(c.job.token_ids, c.job.split) for c in taken], should_stop)
        except AlonePassStopped:  # a request arrived: the requesters compute them (or another helper)
            self.store.release_jobs(taken, "stopped")
            return 0
        except Exception:  # helping must not stop this engine; the requesters compute them
            log.exception("computing %d offered segments failed", len(taken))
            self.store.release_jobs(taken, "failed")
            return 0
        self.store.publish_jobs(taken, sigs, (time.perf_counter() - t0) * 1e3)
        return len(taken)

    def _run_idle(self, items: list[ClaimedJob], alone: AlonePass,
                  should_stop: Optional[Callable[[], bool]]) -> Optional[list[SegmentSignature]]:
        """Run (or resume) the idle batch `items`' alone pass: its signatures, or None when
        it gave way to a request; it is then kept with its items (`idle_pass`) and the next
        `help_idle` resumes it where it stopped. Only a pass run in one go is measured."""
        self.idle_pass = None
        fresh = alone.layer == 0
        with self.costs.measure("alone", alone.tokens if fresh else 0) as sample:
            finished = alone.run(should_stop)
            if not finished:
                sample.discard()
        if not finished:
            if self.config.idle_resume:
                self.idle_pass = (items, alone)
            self.idle_stopped += 1
            return None
        return self._signed(alone)
