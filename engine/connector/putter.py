"""Storing newly computed signatures in the daemon, on a background thread, never on a
request's critical path.

`SignaturePutter.submit(job)` queues a `PutJob` (the signature's blob parts, and the
in-flight claim to drop once it is stored) and returns at once; a full queue drops the
job (counted as `puts_dropped`). The put thread writes each blob straight into the
region the daemon reserved (`put_tensors`: reserve -> write in place -> commit); on a
CUDA engine it first waits (on a side stream, not the host) for the event recorded when
the signature was computed, so the device-to-host copy never blocks the compute stream.

A put that fails is logged and counted by reason and never raised: `capacity` (no room
even after eviction), `invalid` (e.g. larger than the tier), `unavailable` (daemon down
or too slow), `daemon_restarted` (the reservation died with the old daemon), `error`.
Whatever happens, the job's claim is released afterwards, so engines waiting for the
segment wake up (and load it, or compute it themselves).

The thread also renews this client's reservations (claims) while it holds any: the
client library's keepalive renews only when it holds leases.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from engine.connector.codec import SignatureBlob
from engine.connector.errors import StoreUnavailable
from engine.connector.link import StoreLink
from engine.connector.metrics import ConnectorMetrics
from kvstore.errors import CapacityExhausted, InvalidRequest, KVStoreError, UnknownKey

log = logging.getLogger("engine.connector")


@dataclass
class PutJob:
    """One signature to store. `done` is called with the outcome ("stored", "exists" or
    a failure reason) after the put and before the claim is released."""

    key: bytes
    blob: SignatureBlob
    cost: float = 0.0
    tier: Optional[str] = None
    event: Any = None  # CUDA event the signature's tensors are complete on
    device: Any = None  # their CUDA device (with `event`)
    release_claim: Optional[Callable[[], None]] = None
    done: Optional[Callable[[str], None]] = None
    queued_at: float = field(default_factory=time.perf_counter)


class SignaturePutter:
    """The put queue and its thread (module docstring)."""

    def __init__(self, link: StoreLink, metrics: ConnectorMetrics, depth: int,
                 renew_claims: Optional[Callable[[], None]] = None, renew_interval_s: float = 5.0) -> None:
        self.link = link
        self.metrics = metrics
        self._q: queue.Queue[Optional[PutJob]] = queue.Queue(maxsize=max(1, depth))
        self._renew = renew_claims
        self._renew_interval = renew_interval_s
        self._stream = None
        self._warned: dict[str, int] = {}
        self._thread = threading.Thread(target=self._loop, name="kvconn-put", daemon=True)
        self._thread.start()

    def submit(self, job: PutJob) -> bool:
        """Queue `job`; False (and the claim released) when the queue is full."""
        try:
            self._q.put_nowait(job)
        except queue.Full:
            self.metrics.inc("puts_dropped")
            self._warn("dropped", f"put queue full ({self._q.maxsize}); signature {job.key.hex()[:16]} not stored")
            self._finish(job, "dropped")
            return False
        self.metrics.inc("puts_queued")
        return True

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued put finished; False on timeout."""
        deadline = time.monotonic() + timeout
        while self._q.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def close(self, timeout: float = 30.0) -> None:
        """Finish the queued puts (up to `timeout`), then stop the thread."""
        self.flush(timeout)
        try:
            self._q.put(None, timeout=1.0)
        except queue.Full:
            pass
        self._thread.join(timeout=5.0)

    # ------------------------------------------------------------------ thread
    def _loop(self) -> None:
        while True:
            try:
                job = self._q.get(timeout=self._renew_interval)
            except queue.Empty:
                self._renew_claims()
                continue
            try:
                if job is None:
                    return
                self._put(job)
            finally:
                self._q.task_done()

    def _renew_claims(self) -> None:
        if self._renew is None:
            return
        try:
            self._renew()
        except (StoreUnavailable, KVStoreError):
            pass

    def _put(self, job: PutJob) -> None:
        t0 = time.perf_counter()
        outcome = "error"
        try:
            outcome = self._write(job)
        except StoreUnavailable as exc:
            outcome = "unavailable"
            self._warn(outcome, f"signature {job.key.hex()[:16]} not stored: {exc}")
        except CapacityExhausted as exc:
            outcome = "capacity"
            self._warn(outcome, f"signature {job.key.hex()[:16]} not stored: {exc}")
        except UnknownKey as exc:
            outcome = "daemon_restarted"
            self._warn(outcome, f"signature {job.key.hex()[:16]} not stored (daemon restarted?): {exc}")
        except InvalidRequest as exc:
            outcome = "invalid"
            self._warn(outcome, f"signature {job.key.hex()[:16]} not stored: {exc}")
        except KVStoreError as exc:
            self._warn(outcome, f"signature {job.key.hex()[:16]} not stored: {exc}")
        except Exception:  # a put bug must never reach a request
            log.exception("storing signature %s failed", job.key.hex()[:16])
        if outcome in ("stored", "exists"):
            self.metrics.inc("puts_stored" if outcome == "stored" else "puts_exists")
            if outcome == "stored":
                self.metrics.inc("put_bytes", job.blob.nbytes)
        else:
            self.metrics.add_put_failure(outcome)
        self.metrics.inc("put_ms_total", (time.perf_counter() - t0) * 1e3)
        self._finish(job, outcome)

    def _write(self, job: PutJob) -> str:
        b = job.blob

        def put(kv) -> str:
            res = kv.put_tensors(job.key, b.tensors, fingerprint=b.fingerprint, token_count=b.token_count,
                                 tier=job.tier, cost=job.cost, meta=b.meta, layers=b.layers,
                                 extra={"kind": b.kind})
            return res.status

        if job.event is None:
            return self.link.call("put", put)
        if self._stream is None:  # pragma: no cover - GPU only
            self._stream = torch.cuda.Stream(job.device)
        with torch.cuda.stream(self._stream):  # pragma: no cover - GPU only
            self._stream.wait_event(job.event)
            return self.link.call("put", put)

    def _finish(self, job: PutJob, outcome: str) -> None:
        for fn in (job.done, job.release_claim):
            if fn is None:
                continue
            try:
                fn(outcome) if fn is job.done else fn()
            except Exception:
                log.exception("put completion callback failed")

    def _warn(self, reason: str, message: str) -> None:
        n = self._warned.get(reason, 0)
        self._warned[reason] = n + 1
        if n < 3 or n % 100 == 0:
            log.warning("%s%s", message, f" ({n + 1} such failures)" if n else "")
