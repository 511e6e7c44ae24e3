"""`StoreSignatureCache`: engine.pic's `SignatureCache` over the kvstore daemon.

Keys are pic's `segment_key` (blake2b of the model fingerprint, the signature variant:
anchor tokens and seam split, and the segment's token ids), used as the daemon's object
keys unchanged, so every engine serving the same weights shares every segment by content.

The plain interface works as engine.pic documents it:

    lookup(keys) -> [bool]     one Lookup RPC; all False while the daemon is away
    get(key)     -> SegmentSignature | None   from this request's prefetch when there is
                                one, else a Get on the spot; zero copy where the bytes
                                allow it (engine.connector.loader)
    put(key, signature) -> bool   queued for the put thread; True when queued
    release(key)                  the caller is done with what get returned: the lease
                                is released once no request uses the segment
    stats()

and the segment store over it (engine.connector.daemon_store) uses its capabilities:

    prefetch(request_id, keys, compute_ms=None)  at admission: one batch load on the
                                loader thread (hits slower to load than `compute_ms`
                                are skipped: engine.connector.tier_admission)
    acquire(key, request_id, wait_device=False) -> LoadedSegment | None
    finish_request(request_id)  release what the request's prefetch holds, account it
    hint(keys)                  queued requests: lookup + NVMe->CPU promotion, no lease
    claim(key) -> Claim         in-flight dedup across engines (below); never waits
    wait_inflight(claim) -> Claim   wait for a segment another engine computes
    store(key, signature, claim, cost)   put with the claim to drop once stored
    flush(), close()
    share                       the ColdShare (engine.connector.coldshare) when
                                `config.sharing`, else None: offers cold segments to idle
                                engines and takes theirs

Loaded segments are shared: two requests splicing the same segment share one load
(reference counted; the lease is released with the last reference).

In-flight dedup. Before computing a miss, an engine reserves the segment's *claim key*
(a tag + the segment key; one page, never committed) in the daemon:
- "reserved": this engine owns the claim. It computes the signature, queues the put,
  and aborts the claim reservation once the put finished (stored or failed), which
  wakes every waiter. A claim held by a dead engine expires with its reservation
  (the daemon's lease TTL: no keepalive renews it any more).
- "in_flight": another engine is computing the segment. `claim` answers INFLIGHT; the
  caller computes its own misses first, then `wait_inflight` waits (`WaitFor` on the
  claim key, at most `inflight_wait_s`) and Gets the segment: a hit is used like any
  hit; a miss (the other engine failed or was too slow) is computed here.
Right after winning a claim the engine looks the segment up once more: it may have
landed between this request's lookup and the claim.

Failure: nothing here raises into a request. A daemon that is down or too slow makes
lookups miss, puts fail (counted) and claims compute; `metrics` says so
(`store_available` 0, `fallback_requests`, `fallback_segments`), and the link
reconnects by itself (engine.connector.link).
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from engine.connector.claims import (  # noqa: F401 (re-exported: the claim record and its outcomes)
    CLAIM_BYTES, CLAIM_TAG, COMPUTE, INFLIGHT, OWNED, PRESENT, WAITED, Claim, claim_key)
from engine.connector.codec import SignatureBlob, signature_blob
from engine.connector.coldshare import ColdShare
from engine.connector.config import StoreConnectorConfig, device_cache_capacity
from engine.connector.errors import StoreUnavailable
from engine.connector.link import StoreLink
from engine.connector.loader import LoadBatch, LoadedSegment, SegmentLoader
from engine.connector.metrics import ConnectorMetrics
from engine.connector.putter import PutJob, SignaturePutter
from engine.connector.tier_admission import TierReadRates, make_admission
from engine.pic.signature import SegmentSignature
from engine.pic.signature_cache import InMemorySignatureCache, SignatureCache, SignatureCacheStats
from kvstore.errors import KVStoreError

log = logging.getLogger("engine.connector")

class _Resident:
    __slots__ = ("segment", "refs")

    def __init__(self, segment: LoadedSegment) -> None:
        self.segment = segment
        self.refs = 1


class StoreSignatureCache(SignatureCache):
    """Signatures in the kvstore daemon (module docstring)."""

    def __init__(self, fingerprint: str, device: torch.device | str = "cpu",
                 config: Optional[StoreConnectorConfig] = None, *, metrics: Optional[ConnectorMetrics] = None,
                 link: Optional[StoreLink] = None, connect: bool = True) -> None:
        self.config = config or StoreConnectorConfig()
        self.fingerprint = fingerprint
        self.device = torch.device(device)
        self.metrics = metrics or ConnectorMetrics()
        self.link = link or StoreLink(self.config, self.metrics)
        self.link.on_restart(self._forget_claims)
        rates = TierReadRates()
        self.loader = SegmentLoader(self.link, self.metrics, fingerprint, self.device, self.config.verify,
                                    nvme_read_backend=self.config.nvme_read_backend,
                                    admission=make_admission(self.config.tier_admission, rates), rates=rates)
        self.putter = SignaturePutter(self.link, self.metrics, self.config.put_queue_depth,
                                      renew_claims=self._renew_claims)
        self._releaser = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvconn-release")
        self._lock = threading.Lock()
        self._resident: dict[bytes, _Resident] = {}
        self._batches: dict[str, LoadBatch] = {}
        self._claims: dict[bytes, Claim] = {}
        self._closed = False
        self.share: Optional[ColdShare] = ColdShare(self) if self.config.sharing else None
        #: the engine's own device-resident signatures, bounded (StoreConnectorConfig.device_cache_bytes /
        #: device_cache_fraction): the working set beyond it comes from the daemon's tiers
        self.near = InMemorySignatureCache(device_cache_capacity(self.config, self.device))
        if self.device.type == "cuda":  # pragma: no cover - GPU only
            self.link.on_connect(self.map_arenas_soon)
        if connect:
            self.link.start()

    def map_arenas_soon(self) -> None:
        """Map and pin the daemon's CPU arena in the background (called on connecting when
        the engine runs on CUDA), so the first CPU-tier load does not pay it (pinning a
        24 GiB arena takes seconds). The mapping is the process's
        (kvstore.client.regions.mapped_arenas); failures are logged, the first load maps it."""
        def run() -> None:
            try:
                self.link.call("map_arenas", lambda kv: kv.map_arenas())
            except Exception as exc:  # the first load maps it then
                log.debug("mapping the daemon's arenas ahead failed: %s", exc)

        threading.Thread(target=run, name="kvconn-map-arenas", daemon=True).start()

    # ------------------------------------------------------------------ device cache
    def near_get(self, key: bytes) -> Optional[SegmentSignature]:
        """The signature of `key` from the engine's device cache, or None."""
        if self.near.capacity_bytes == 0:
            return None
        sig = self.near.get(key)
        if sig is not None:
            self.metrics.inc("near_hits")
        return sig

    def remember(self, key: bytes, signature: SegmentSignature) -> None:
        """Keep a signature whose tensors this engine owns in its device cache."""
        if self.near.capacity_bytes:
            self.near.put(key, signature)

    @property
    def available(self) -> bool:
        """The daemon answers now."""
        return self.link.available

    # ------------------------------------------------------------------ SignatureCache
    def lookup(self, keys: Sequence[bytes], strict: bool = False) -> list[bool]:
        """Presence of each key in the daemon (one Lookup RPC; all False when it is away,
        or with `strict` StoreUnavailable raised: a caller that must not read "absent")."""
        keys = list(keys)
        if not keys:
            return []
        try:
            entries = self.link.call("lookup", lambda kv: kv.lookup(keys))
        except (StoreUnavailable, KVStoreError) as exc:
            if strict:
                raise StoreUnavailable(f"the kvstore daemon did not answer a lookup of {len(keys)} keys: {exc}") \
                    from exc
            return [False] * len(keys)
        self.metrics.inc("lookup_rpcs")
        self.metrics.inc("lookup_keys", len(keys))
        self.metrics.inc("lookup_hits", sum(e.hit for e in entries))
        return [e.hit for e in entries]

    def get(self, key: bytes) -> Optional[SegmentSignature]:
        seg = self.acquire(key, wait_device=True)
        return None if seg is None else seg.signature

    def put(self, key: bytes, signature: SegmentSignature) -> bool:
        return self.store(key, signature)

    def release(self, key: bytes) -> None:
        with self._lock:
            entry = self._resident.get(key)
            if entry is None:
                return
            entry.refs -= 1
            if entry.refs > 0:
                return
            del self._resident[key]
        self._release_segment(entry.segment)

    def _release_segment(self, seg: LoadedSegment) -> None:
        """Release `seg`'s lease. A lease over device memory (the GPU tier, zero copy) is
        released only after the work queued on the compute stream so far (the splices
        reading it) has run: the daemon may reuse those bytes as soon as it is released."""
        if seg.view is None or seg.view.lease.region.kind != "cuda_ipc":
            seg.release()
            return
        event = torch.cuda.Event()  # pragma: no cover - GPU tier only
        event.record(torch.cuda.current_stream(seg.signature.device))

        def later() -> None:  # pragma: no cover - GPU tier only
            event.synchronize()
            seg.release()

        self._releaser.submit(later)  # pragma: no cover - GPU tier only

    def stats(self) -> SignatureCacheStats:
        """Gets and puts of this engine; entries, bytes, capacity and evictions of the
        daemon (zeros while it is away)."""
        m = self.metrics
        entries = used = capacity = evictions = 0
        try:
            s = self.link.call("stats", lambda kv: kv.stats())
            for t in s.get("tiers", []):
                entries += int(t.get("objects", 0))
                used += int(t.get("used_bytes", 0))
                capacity += int(t.get("capacity_bytes", 0))
            evictions = int(s.get("evictions", 0))
        except (StoreUnavailable, KVStoreError):
            pass
        snap = m.snapshot()
        rejected = snap["puts_dropped"] + sum(snap["puts_failed"].values())
        return SignatureCacheStats(int(snap["hits"]), int(snap["misses"]), int(snap["puts_stored"]), rejected,
                                   evictions, entries, used, capacity)

    # ------------------------------------------------------------------ loads
    def prefetch(self, request_id: str, keys: Sequence[bytes],
                 compute_ms: Optional[dict[bytes, float]] = None) -> LoadBatch:
        """Start loading `keys` for `request_id` on the loader thread (admission);
        `compute_ms`: per key, the in-context compute a hit saves, for the cost
        admission (SegmentLoader.submit; None: every hit is loaded)."""
        batch = self.loader.submit(request_id, keys, compute_ms)
        with self._lock:
            old = self._batches.pop(request_id, None)
            self._batches[request_id] = batch
        if old is not None:
            old.abandon()
        return batch

    def hint(self, keys: Sequence[bytes]) -> None:
        """Queued requests: look `keys` up and promote NVMe hits (no leases)."""
        self.loader.hint(keys)

    def acquire(self, key: bytes, request_id: Optional[str] = None,
                wait_device: bool = True) -> Optional[LoadedSegment]:
        """The loaded segment of `key` (one reference; `release(key)` drops it), or None
        on a miss. Uses `request_id`'s prefetch when it has one, else the loads of any
        request that loads `key`, else a Get on the spot. With `wait_device`, the current
        CUDA stream waits for its copies before this returns."""
        with self._lock:
            entry = self._resident.get(key)
            if entry is not None:
                entry.refs += 1
                self.metrics.inc("hits")
                seg = entry.segment
            else:
                batch = self._batches.get(request_id) if request_id is not None else None
                if batch is None or key not in batch.keys:
                    batch = next((b for b in self._batches.values() if key in b.keys), None)
                seg = None
        if entry is None:
            seg = self._load(key, batch)
            with self._lock:
                entry = self._resident.get(key)
                if seg is not None and entry is not None:  # loaded twice (raced): keep the first
                    entry.refs += 1
                    seg.release()
                    seg = entry.segment
                elif seg is not None:
                    self._resident[key] = _Resident(seg)
            self.metrics.inc("hits" if seg is not None else "misses")
        if seg is not None and wait_device:
            seg.wait_device()
        return seg

    def _load(self, key: bytes, batch: Optional[LoadBatch]) -> Optional[LoadedSegment]:
        if batch is not None:
            if not batch.wait_key(key, self.config.load_timeout_s):
                self.metrics.inc("load_timeouts")
                log.warning("loads of request %s not done after %.1f s; recomputing", batch.request_id,
                            self.config.load_timeout_s)
                return None
            if batch.unavailable:
                self.metrics.inc("fallback_segments")
                return None
            seg = batch.take(key)
            if seg is not None or key in batch.tiers:
                return seg  # loaded, or a hit at lookup that could not be loaded
            # a miss at the batch's lookup: it may have landed since (another engine)
        if not self.link.available:
            self.metrics.inc("fallback_segments")
            return None
        self.metrics.inc("sync_loads")
        b = self.loader.load_now([key])
        if b.unavailable:
            self.metrics.inc("fallback_segments")
        return b.take(key)

    def finish_request(self, request_id: str) -> Optional[LoadBatch]:
        """The request will take no more loads: release what its prefetch still holds
        and account its wait time. Returns its batch (None when it had none)."""
        with self._lock:
            batch = self._batches.pop(request_id, None)
        if batch is None:
            return None
        batch.abandon()
        self.metrics.inc("load_wait_ms_total", batch.wait_ms)
        if batch.unavailable:
            self.metrics.inc("fallback_requests")
        return batch

    # ------------------------------------------------------------------ claims
    def claim(self, key: bytes) -> Claim:
        """Decide who computes the missing segment `key` (module docstring). Never
        waits: an `INFLIGHT` answer is followed by `wait_inflight`, so an engine first
        claims all its misses, computes its own, and only then waits for the others'
        (two engines that each claimed a segment the other needs cannot wait on each
        other)."""
        if not self.config.dedup:
            return Claim(key, COMPUTE)
        ck = claim_key(key)
        try:
            kv = self.link.client()
            tier = "cpu" if kv.info is not None and "cpu" in kv.info.tiers else None
            gen = self.link.generation
            res = self.link.call("reserve", lambda c: c.reserve(ck, CLAIM_BYTES, tier))
        except StoreUnavailable:
            self.metrics.inc("fallback_segments")
            return Claim(key, COMPUTE)
        except KVStoreError as exc:
            self.metrics.inc("store_errors")
            log.warning("claiming segment %s failed (%s); computing it", key.hex()[:16], exc)
            return Claim(key, COMPUTE)
        if res.status == "reserved":
            claim = Claim(key, OWNED, reservation_id=res.reservation_id, generation=gen)
            if any(self.lookup([key])):  # it landed after this request's lookup
                self.drop_claim(claim)
                seg = self.acquire(key, wait_device=False)
                if seg is not None:
                    return Claim(key, PRESENT, seg)
                return Claim(key, COMPUTE)
            with self._lock:
                self._claims[key] = claim
            self.metrics.inc("claims")
            return claim
        # "in_flight": another engine computes it ("exists" cannot happen: claims are never committed)
        return Claim(key, INFLIGHT)

    def wait_inflight(self, claim: Claim, timeout: Optional[float] = None) -> Claim:
        """Wait (at most `timeout`, default `inflight_wait_s`) for the engine computing
        `claim.key`, then load it: `WAITED` with the segment, or `COMPUTE` when it did
        not arrive."""
        key = claim.key
        self.metrics.inc("inflight_waits")
        wait_s = self.config.inflight_wait_s if timeout is None else timeout
        t0 = time.perf_counter()
        try:
            self.link.call("wait_for", lambda c: c.wait_for(claim_key(key), timeout=wait_s))
        except StoreUnavailable:
            self.metrics.inc("inflight_wait_misses")
            return Claim(key, COMPUTE, wait_ms=(time.perf_counter() - t0) * 1e3)
        except KVStoreError as exc:
            log.warning("waiting for segment %s failed (%s); loading or computing it", key.hex()[:16], exc)
        seg = self.acquire(key, wait_device=False)
        wait_ms = (time.perf_counter() - t0) * 1e3
        if seg is not None:
            self.metrics.inc("inflight_wait_hits")
            return Claim(key, WAITED, seg, wait_ms=wait_ms)
        self.metrics.inc("inflight_wait_misses")
        return Claim(key, COMPUTE, wait_ms=wait_ms)

    def drop_claim(self, claim: Optional[Claim]) -> None:
        """Abort an owned claim's reservation (waiters wake). Idempotent."""
        if claim is None or not claim.owned or claim.reservation_id == 0:
            return
        rid, claim.reservation_id = claim.reservation_id, 0
        with self._lock:
            if self._claims.get(claim.key) is claim:
                del self._claims[claim.key]
        if claim.generation != self.link.generation:
            return  # the daemon restarted: the reservation died with it
        try:
            self.link.call("abort", lambda c: c.abort(rid))
        except (StoreUnavailable, KVStoreError):
            pass  # it expires with its TTL

    def _renew_claims(self) -> None:
        if self._claims:
            self.link.call("renew", lambda c: c.renew())

    def _forget_claims(self) -> None:
        with self._lock:
            for c in self._claims.values():
                c.reservation_id = 0
            self._claims.clear()

    # ------------------------------------------------------------------ puts
    def store(self, key: bytes, signature: SegmentSignature, claim: Optional[Claim] = None,
              cost: float = 0.0) -> bool:
        """Queue `signature` for storage under `key` (never blocks on the daemon); the
        claim, if this engine owns it, is dropped once the put finished. False when the
        put was not queued (queue full, daemon away)."""
        if not self.link.available:
            self.metrics.add_put_failure("unavailable")
            self.drop_claim(claim)
            return False
        return self.store_blob(key, signature_blob(signature, self.fingerprint), signature.device, claim, cost)

    def store_blob(self, key: bytes, blob: SignatureBlob, device: torch.device, claim: Optional[Claim] = None,
                   cost: float = 0.0) -> bool:
        """Queue any object blob (a signature's, a prefix checkpoint's: engine.connector.
        prefix_store) for storage under `key`, as `store` does; `device`: where its
        tensors are (a CUDA put waits on the compute stream's work so far)."""
        if not self.link.available:
            self.metrics.add_put_failure("unavailable")
            self.drop_claim(claim)
            return False
        event = None
        if device.type == "cuda":  # pragma: no cover - GPU only
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
        release = None
        if claim is not None and claim.owned:
            release = lambda c=claim: self.drop_claim(c)  # noqa: E731
        job = PutJob(key, blob, cost=cost, tier=self.config.put_tier, event=event, device=device,
                     release_claim=release)
        return self.putter.submit(job)

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued put finished (True) or `timeout` passed."""
        return self.putter.flush(timeout)

    def close(self, timeout: float = 30.0) -> None:
        """Finish queued puts, drop claims still held, release every lease, disconnect."""
        if self._closed:
            return
        self._closed = True
        if self.share is not None:
            self.share.close()
        self.putter.close(timeout)
        self.loader.close()
        with self._lock:
            claims = list(self._claims.values())
        for claim in claims:  # computed but never stored: let the waiters go now
            self.drop_claim(claim)
        with self._lock:
            batches, self._batches = list(self._batches.values()), {}
            resident, self._resident = list(self._resident.values()), {}
        for b in batches:
            b.abandon()
        for r in resident:
            self._release_segment(r.segment)
        self._releaser.shutdown(wait=True)
        self.link.close()

    def __enter__(self) -> "StoreSignatureCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
