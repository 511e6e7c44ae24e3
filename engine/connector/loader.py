"""Loading segment signatures from the daemon into the engine's device, off the engine
loop's thread.

`SegmentLoader.submit(keys)` queues one `LoadBatch` on the loader thread (FIFO, so
requests load in admission order while earlier ones prefill). A batch does one Lookup
for all its keys (which tier holds each), one Get for the hits (leases, promoting NVMe
hits to the CPU arena), then per segment, by where its bytes lie:

| bytes in | engine on CPU | engine on CUDA |
|---|---|---|
| CPU arena (shm) | zero-copy views, lease held while used | async copies from the pinned arena on a side stream, layer by layer with an event per layer (engine.connector.layer_loads), lease released once the copies are done |
| GPU arena (CUDA IPC) | - | zero-copy views over the IPC mapping (same device; else a device-to-device copy) |
| NVMe file | views over the mapped file (page cache) | with `nvme_read_backend` resolving to kvikio (kvstore.tiers.nvme_read; auto: where GDS is available), a cuFile read straight into device memory; else promoted to the CPU arena by the Get |

A batch is published in stages: the Lookup answer first (`wait_lookup`: the planner
learns its misses and starts computing them while the hits load), then each segment
as soon as its copies are *issued* (`wait_key`). Each `LoadedSegment` carries the CUDA
event its copies complete on, and its consumer makes the compute stream wait on that
event just before the splice that reads it (`LoadedSegment.wait_device`), so later
segments decode and copy while earlier ones are spliced and their seams computed; a
segment copied layer by layer (in groups of consecutive layers of >= MIN_COPY_BYTES, later
groups larger: engine.connector.layer_loads) is waited on per layer by the fused pass instead
(`LoadedSegment.wait_layer`, from its `before_layer` hook), so early layers compute
while later groups' bytes arrive.
Leases of copied segments are released by the loader thread once the copies finish.

`hint(keys)` (queued, not yet admitted requests) looks keys up and asks the daemon to
promote NVMe hits to the CPU tier ahead of use; it takes no lease.

Gets, by tier: the memory-tier hits (GPU, CPU arena) are leased by one Get and placed
(their device copies issued) before the NVMe hits' Get, whose promotions read the disk
(and may make room in the CPU arena); so a memory-tier hit never waits for a disk read,
and each segment's `load_ms` holds a share of its own Get only.

Cost admission (engine.connector.tier_admission; StoreConnectorConfig.tier_admission):
a batch submitted with `compute_ms` (per key: what computing its positions in context
would take) loads only the hits whose expected load time, bytes over the tier's measured
read rate (`rates`, fed by every load this loader times), is at most that; the others
are `skipped` (key -> tier; not hits of the batch: the planner computes them). Of a
batch's skipped NVMe hits the first is promoted to the CPU tier in the background, timed
(the NVMe read rate stays measured while its hits are skipped), and only while no other
such promotion runs: a promotion reads the disk and can make room in a full CPU tier by
demoting to it, and a working set that lives on the disk must not have the serving
path's loads share the disk and the daemon with a stream of speculative promotions.

Timing: each batch records when it was submitted, started and finished (copies done),
and how long the engine loop blocked in `wait` (`wait_ms`), which gives the overlap.
"""
from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from engine.connector.codec import signature_from_blob
from engine.connector.errors import ConnectorConfigError, StoreUnavailable
from engine.connector.layer_loads import (COPY_GROUP_GROWTH, MAX_COPY_GROUP_BYTES, MIN_COPY_BYTES, CudaCopyQueue,
                                          LayerEvents, LayerPlanError, group_layers, groups_at, issue_layered,
                                          layer_plan)
from engine.connector.link import StoreLink
from engine.connector.metrics import ConnectorMetrics
from engine.connector.tier_admission import AlwaysAdmit, TierAdmission, TierReadRates
from engine.pic.errors import SignatureFormatError
from engine.pic.signature import SegmentSignature
from kvstore import format as fmt
from kvstore.client.views import ObjectView
from kvstore.errors import InvalidRequest, KVStoreError
from kvstore.tiers.nvme_read import NvmeReader, resolve_backend

log = logging.getLogger("engine.connector")


def _indexed(device: torch.device) -> torch.device:
    """cuda -> cuda:<current>, so device comparisons with tensors' devices hold."""
    if device.type == "cuda" and device.index is None:  # pragma: no cover - GPU only
        return torch.device("cuda", torch.cuda.current_device())
    return device


@dataclass
class LoadedSegment:
    """One loaded signature. `view` is the lease while the signature aliases store memory
    (None once copied out); `ready` the CUDA event its device copies complete on."""

    key: bytes
    signature: SegmentSignature
    tier: str  # where the lookup found it
    served_tier: str  # where the lease pointed (differs after an NVMe -> CPU promotion)
    nbytes: int
    view: Optional[ObjectView] = None
    ready: Optional[Any] = None
    copy_start: Optional[Any] = None
    load_ms: float = 0.0  # this segment's share of the RPCs + decode + device copy
    device_buffer: Optional[torch.Tensor] = None  # the blob's copy on this device (parts are views of it)
    #: per-layer copy events (engine.connector.layer_loads) when the copies went layer by layer
    layers: Optional[LayerEvents] = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _stream_recorded: bool = False

    @property
    def pending(self) -> bool:
        """True while device copies of this segment may still be running."""
        return self.ready is not None and not self.ready.query()

    def wait_device(self) -> None:
        """Make the current CUDA stream wait for this segment's copies (host does not
        block), and tell the allocator the tensors are used on that stream."""
        if self.ready is None:
            return
        stream = torch.cuda.current_stream(self.signature.device)
        stream.wait_event(self.ready)
        self._record_stream(stream)

    def wait_layer(self, layer: int) -> None:
        """Make the current CUDA stream wait for `layer`'s copies only (host does not
        block): the fused pass calls it just before it first reads `layer`; segments
        copied in one piece wait for all of it."""
        if self.layers is None:
            self.wait_device()
            return
        stream = torch.cuda.current_stream(self.signature.device)
        self._record_stream(stream)
        self.layers.wait_layer(layer, stream.wait_event)

    def _record_stream(self, stream) -> None:
        """Tell the allocator (once) that this segment's tensors are used on `stream`."""
        with self._lock:
            if self._stream_recorded:
                return
            self._stream_recorded = True
        if self.device_buffer is not None:
            self.device_buffer.record_stream(stream)
            return
        tensors, _, _ = self.signature.to_tensors()
        for t in tensors.values():
            if t.is_cuda:
                t.record_stream(stream)

    def release(self) -> None:
        """Drop the lease (if still held). The signature must not be used afterwards
        when it aliased store memory."""
        with self._lock:
            view, self.view = self.view, None
        if view is not None:
            try:
                view.release()
            except KVStoreError:
                pass  # daemon gone: the lease dies with it


class LoadBatch:
    """The loads of one request (or one synchronous get), published in two stages: the
    Lookup answer (`wait_lookup`: which keys are hits), then each segment as soon as
    it is placed (`wait_key`), so the engine can splice the first segments while the
    loader still decodes and copies later ones."""

    def __init__(self, request_id: Optional[str], keys: Sequence[bytes],
                 compute_ms: Optional[dict[bytes, float]] = None) -> None:
        self.request_id = request_id
        self.keys = list(dict.fromkeys(keys))
        #: per key, ms computing it in context would take (cost admission); None: load every hit
        self.compute_ms = compute_ms
        self.skipped: dict[bytes, str] = {}  # hits not loaded (slower than computing them) -> tier
        self.submitted = time.perf_counter()
        self.started: Optional[float] = None
        self.finished: Optional[float] = None  # every copy complete
        self.unavailable = False  # the daemon could not be reached
        self.error: Optional[str] = None
        self.wait_ms = 0.0  # time callers blocked in wait_lookup / wait_key
        self.tiers: dict[bytes, str] = {}  # hits at lookup -> tier
        self._cond = threading.Condition()
        self._looked_up = False
        self._done = False  # every key placed or failed
        self._placed: set[bytes] = set()  # keys whose outcome is known
        self._results: dict[bytes, LoadedSegment] = {}
        self._abandoned = False

    @property
    def load_ms(self) -> float:
        """Load latency of this batch: submitted -> last copy complete (0 until finished)."""
        if self.finished is None:
            return 0.0
        return (self.finished - self.submitted) * 1e3

    @property
    def hits(self) -> set[bytes]:
        """Keys the Lookup found (valid once `wait_lookup` returned True)."""
        return set(self.tiers)

    def _wait(self, ready, timeout: float) -> bool:
        t0 = time.perf_counter()
        with self._cond:
            ok = self._cond.wait_for(ready, timeout=timeout)
        self.wait_ms += (time.perf_counter() - t0) * 1e3
        return ok

    def wait_lookup(self, timeout: float) -> bool:
        """Block until the Lookup answered (or the batch failed); False on timeout."""
        return self._wait(lambda: self._looked_up, timeout)

    def wait_key(self, key: bytes, timeout: float) -> bool:
        """Block until `key`'s outcome is known (loaded, missing or failed); False on timeout."""
        return self._wait(lambda: self._done or key in self._placed, timeout)

    def wait_all(self, timeout: float) -> bool:
        return self._wait(lambda: self._done, timeout)

    def take(self, key: bytes) -> Optional[LoadedSegment]:
        """Hand the loaded segment of `key` to the caller (once); None on a miss or when
        its outcome is not known yet."""
        with self._cond:
            return self._results.pop(key, None)

    def abandon(self) -> None:
        """Nobody will take the remaining results: release their leases now, and those
        placed later as they are placed."""
        with self._cond:
            self._abandoned = True
            rest, self._results = list(self._results.values()), {}
        for seg in rest:
            seg.release()

    # ------------------------------------------------------------------ loader side
    def _set_looked_up(self, tiers: dict[bytes, str], skipped: Optional[dict[bytes, str]] = None) -> None:
        with self._cond:
            self.tiers = tiers
            self.skipped = dict(skipped or {})
            self._looked_up = True
            self._cond.notify_all()

    def _place(self, key: bytes, seg: Optional[LoadedSegment]) -> None:
        with self._cond:
            abandoned = self._abandoned
            if seg is not None and not abandoned:
                self._results[key] = seg
            self._placed.add(key)
            self._cond.notify_all()
        if seg is not None and abandoned:
            seg.release()

    def _finish(self) -> None:
        with self._cond:
            self._looked_up = True
            self._done = True
            self._cond.notify_all()


class SegmentLoader:
    """Runs LoadBatches on a loader thread (module docstring)."""

    def __init__(self, link: StoreLink, metrics: ConnectorMetrics, fingerprint: str, device: torch.device,
                 verify: bool = False, nvme_read_backend: str = "auto",
                 admission: Optional[TierAdmission] = None, rates: Optional[TierReadRates] = None) -> None:
        self.link = link
        self.metrics = metrics
        #: measured read rate per tier (every timed load feeds it) and the admission over it
        self.rates = rates or TierReadRates()
        self.admission = admission or AlwaysAdmit()
        #: held while a skipped NVMe hit is being promoted (one promotion in flight: _load)
        self._promoting = threading.Lock()
        self.fingerprint = fingerprint
        self.device = _indexed(torch.device(device))
        self.verify = verify
        self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvconn-load")
        self._hints = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvconn-hint")
        self._stream = None
        if self.device.type == "cuda":  # pragma: no cover - GPU only
            self._stream = torch.cuda.Stream(self.device)
        #: how NVMe hits reach the device (kvstore.tiers.nvme_read): "kvikio" reads them
        #: straight into device memory; "posix" lets the Get promote them to the CPU arena
        try:
            backend = resolve_backend(nvme_read_backend)
        except InvalidRequest as exc:
            raise ConnectorConfigError(str(exc)) from None
        self.nvme_backend = backend if self.device.type == "cuda" else "posix"
        self._nvme = NvmeReader("kvikio") if self.nvme_backend == "kvikio" else None

    def close(self) -> None:
        self._hints.shutdown(wait=True, cancel_futures=True)
        self._pool.shutdown(wait=True, cancel_futures=True)

    # ------------------------------------------------------------------ API
    def submit(self, request_id: Optional[str], keys: Sequence[bytes],
               compute_ms: Optional[dict[bytes, float]] = None) -> LoadBatch:
        """Queue the loads of `keys` (see the module docstring); `compute_ms`: per key,
        the in-context compute a hit saves (cost admission; None: load every hit)."""
        batch = LoadBatch(request_id, keys, compute_ms)
        if not batch.keys:
            batch.started = batch.finished = batch.submitted
            batch._finish()
            return batch
        try:
            self._pool.submit(self._run, batch)
        except RuntimeError:  # shut down
            batch.unavailable = True
            batch._finish()
        return batch

    def load_now(self, keys: Sequence[bytes]) -> LoadBatch:
        """Load `keys` on the calling thread (a get that had no prefetch)."""
        batch = LoadBatch(None, keys)
        self._run(batch)
        return batch

    def hint(self, keys: Sequence[bytes]) -> None:
        """Look `keys` up and promote NVMe hits toward the CPU tier (no leases)."""
        keys = list(dict.fromkeys(keys))
        if keys and self.link.available:
            try:
                self._hints.submit(self._hint, keys)
            except RuntimeError:
                pass

    # ------------------------------------------------------------------ worker
    def _promote(self, key: bytes, nbytes: int) -> None:
        """A skipped NVMe hit up to the CPU tier (hint thread), timed as an NVMe read; the
        caller holds `_promoting`, released here."""
        try:
            t0 = time.perf_counter()
            moved = self.link.call("prefetch", lambda kv: kv.prefetch([key], tier="cpu"))
            if moved == 1:  # read from the disk (or promoted meanwhile)
                self.rates.observe("nvme", nbytes, (time.perf_counter() - t0) * 1e3)
        except StoreUnavailable:
            pass
        except KVStoreError as exc:
            log.debug("promoting skipped hits failed: %s", exc)
        finally:
            self._promoting.release()

    def _hint(self, keys: list[bytes]) -> None:
        try:
            entries = self.link.call("lookup", lambda kv: kv.lookup(keys))
            self.metrics.inc("lookup_rpcs")
            cold = [e.key for e in entries if e.hit and e.tier == "nvme"]
            if cold:
                self.link.call("prefetch", lambda kv: kv.prefetch(cold, tier="cpu"))
        except StoreUnavailable:
            pass
        except KVStoreError as exc:
            log.debug("prefetch hint failed: %s", exc)

    def _run(self, batch: LoadBatch) -> None:
        batch.started = time.perf_counter()
        segments: list[LoadedSegment] = []
        try:
            self._load(batch, segments)
        except StoreUnavailable as exc:
            batch.unavailable = True
            batch.error = str(exc)
        except KVStoreError as exc:
            self.metrics.inc("store_errors")
            batch.error = str(exc)
            log.warning("loading %d segments failed: %s", len(batch.keys), exc)
        except Exception as exc:  # a loader bug must not take the engine down: recompute
            self.metrics.inc("store_errors")
            batch.error = repr(exc)
            log.exception("loading %d segments failed", len(batch.keys))
        batch._finish()
        for seg in segments:  # copies were issued; finish them here, off the engine thread
            if seg.ready is not None:  # pragma: no cover - GPU only
                seg.ready.synchronize()
                copy_ms = seg.copy_start.elapsed_time(seg.ready)
                seg.load_ms += copy_ms
                if seg.served_tier == "cpu":
                    self.metrics.inc("h2d_copy_bytes", seg.nbytes)
                    self.metrics.inc("h2d_copy_ms_total", copy_ms)
                seg.release()  # the device copy is complete: the store's bytes are no longer read
            self.metrics.add_load(seg.tier, seg.nbytes, seg.load_ms)
            self.rates.observe(seg.tier, seg.nbytes, seg.load_ms)
        batch.finished = time.perf_counter()
        if batch.request_id is not None and batch.keys:
            self.metrics.inc("load_ms_total", batch.load_ms)

    def _load(self, batch: LoadBatch, segments: list[LoadedSegment]) -> None:
        keys = batch.keys
        t0 = time.perf_counter()
        entries = self.link.call("lookup", lambda kv: kv.lookup(keys))
        self.metrics.inc("lookup_rpcs")
        self.metrics.inc("lookup_keys", len(keys))
        hits = [e for e in entries if e.hit]
        self.metrics.inc("lookup_hits", len(hits))
        hits, skipped = self._admit(batch, hits)
        batch._set_looked_up({e.key: e.tier or "cpu" for e in hits}, {e.key: e.tier or "cpu" for e in skipped})
        cold = [e for e in skipped if e.tier == "nvme"]
        if cold and self._promoting.acquire(blocking=False):  # one at a time (module docstring)
            try:
                self._hints.submit(self._promote, cold[0].key, cold[0].size)
            except RuntimeError:
                self._promoting.release()
        if not hits:
            return
        lookup_share = (time.perf_counter() - t0) * 1e3 / len(hits)
        # memory-tier hits first, so none waits for the NVMe hits' disk reads (module docstring)
        memory = [e.key for e in hits if e.tier != "nvme"]
        direct = [e.key for e in hits if e.tier == "nvme" and self._nvme is not None]
        promoted = [e.key for e in hits if e.tier == "nvme" and self._nvme is None]
        for group, promote in ((memory, True), (promoted, True), (direct, False)):
            if group:
                self._get_and_place(batch, group, promote, lookup_share, segments)

    def _admit(self, batch: LoadBatch, hits: list) -> tuple[list, list]:
        """Split the Lookup's hits into those to load and those the admission skips."""
        if batch.compute_ms is None:
            return hits, []
        keep, skip = [], []
        for e in hits:
            ok = self.admission.admit(e.tier or "cpu", e.size, batch.compute_ms.get(e.key))
            (keep if ok else skip).append(e)
        for e in skip:
            self.metrics.add_skipped(e.tier or "cpu")
        return keep, skip

    def _get_and_place(self, batch: LoadBatch, group: list[bytes], promote: bool, lookup_share: float,
                       segments: list[LoadedSegment]) -> None:
        """One Get for `group` (one tier's hits), then each segment decoded and placed;
        each one's `load_ms` starts with its share of the lookup and of this Get."""
        t0 = time.perf_counter()
        got = self.link.call("get", lambda kv: kv.get_many(group, promote=promote))
        views = list(zip(group, got))
        rpc_share = lookup_share + (time.perf_counter() - t0) * 1e3 / len(views)
        for i, (key, view) in enumerate(views):
            if view is None:  # evicted between lookup and get
                batch._place(key, None)
                continue
            t1 = time.perf_counter()
            try:
                seg = self._place(key, view, batch.tiers[key])
            except (KVStoreError, SignatureFormatError, RuntimeError) as exc:
                self.metrics.inc("store_errors")
                log.warning("segment %s could not be loaded (%s); it will be recomputed", key.hex()[:16], exc)
                view.release()
                batch._place(key, None)
                continue
            except BaseException:
                for _, rest in views[i:]:
                    if rest is not None:
                        rest.release()
                raise
            seg.load_ms = rpc_share + (time.perf_counter() - t1) * 1e3
            if seg.tier == "nvme" and seg.served_tier != "nvme":
                self.metrics.inc("promotions")
            segments.append(seg)
            batch._place(key, seg)

    def _place(self, key: bytes, view: ObjectView, tier: str) -> LoadedSegment:
        """Decode one leased blob and put its signature where the engine reads it."""
        if view.lease.region.kind == "file" and self._nvme is not None:  # pragma: no cover - GPU + kvikio
            buf = torch.empty(view.size, dtype=torch.uint8, device=self.device)
            self._nvme.read(view.lease.region.path, view.lease.region.offset, view.size, buf)
            view.release()
            header, tensors = fmt.decode_tensors(buf, check=self.verify)
            sig = signature_from_blob(header.meta, tensors, header.fingerprint, self.fingerprint)
            return LoadedSegment(key, sig, tier, "nvme", view.size)
        buf = view.tensor()
        same = buf.device.type == self.device.type and (buf.device.type != "cuda" or buf.device == self.device)
        if same:  # zero copy: the signature aliases the leased bytes
            if buf.device.type == "cuda" and self._stream is not None:  # pragma: no cover - GPU tier only
                # the header read (and checksum) of device bytes copies to the host: on this
                # thread's default stream that copy would wait for every kernel the engine
                # queued before it (GPU-tier loads then crawl at a few GB/s); the side
                # stream does not synchronise with the compute stream
                with torch.cuda.stream(self._stream):
                    header, tensors = fmt.decode_tensors(buf, check=self.verify)
            else:
                header, tensors = fmt.decode_tensors(buf, check=self.verify)
            sig = signature_from_blob(header.meta, tensors, header.fingerprint, self.fingerprint)
            return LoadedSegment(key, sig, tier, view.tier, view.size, view)
        # pragma: no cover - GPU only: pinned host (or another GPU) -> this device. The
        # header is read on the host; the whole blob then moves in one copy (chunked DMAs
        # on the side stream, ObjectView.copy_to) and the parts are views over the copy:
        # a handful of copies per segment instead of one per tensor.
        if buf.device.type == "cuda":  # the daemon's GPU tier on another device (CUDA IPC, peer copy)
            self.metrics.inc("peer_loads")
            self.metrics.inc("peer_load_bytes", view.size)
        # the header from the leased bytes themselves (stable while leased), never from the
        # copy, which the side stream may still be writing
        header = fmt.read_header(view.array if buf.device.type != "cuda" else buf)
        stream = self._stream
        copy_start = torch.cuda.Event(enable_timing=True)
        copy_start.record(stream)
        dev = torch.empty(view.size, dtype=torch.uint8, device=self.device)
        layers = plan = None
        if buf.device.type == "cpu" and not self.verify and view.lease.region.kind != "file":
            try:
                per_layer = layer_plan(header.parts, header.meta.get("stacked"))
                bands = header.meta.get("bands")  # the codec's bands: one copy a group
                plan = (groups_at(per_layer, bands) if bands else
                        group_layers(per_layer, MIN_COPY_BYTES, COPY_GROUP_GROWTH, MAX_COPY_GROUP_BYTES))
            except LayerPlanError as exc:  # copied in one piece instead
                log.debug("segment %s: no per-layer plan (%s)", key.hex()[:16], exc)
        if plan is not None:
            # the CPU arena (pinned, mapped in place): groups of layers of >= MIN_COPY_BYTES,
            # an event per group, so the fused pass computes early layers while later ones
            # arrive (layer_loads)
            stream.wait_stream(torch.cuda.current_stream(self.device))  # dst may be in use there
            copy_start.record(stream)  # after that wait: the copies' own time (h2d_copy_ms_total)
            t_issue = time.perf_counter()
            with torch.cuda.stream(stream):
                layers = issue_layered(buf, dev, plan, CudaCopyQueue(stream))
            # host time issuing them (this thread, GIL waits included): near the copies'
            # device time, the host is what bounds them
            self.metrics.inc("h2d_issue_ms_total", (time.perf_counter() - t_issue) * 1e3)
            self.metrics.inc("h2d_copy_groups", len(plan))
            dev.record_stream(stream)
        else:
            view.copy_to(dev, stream=stream, verify=self.verify)
        ready = torch.cuda.Event(enable_timing=True)  # after the last piece (same stream), timed
        ready.record(stream)
        tensors = fmt.tensors_over(header, dev)
        sig = signature_from_blob(header.meta, tensors, header.fingerprint, self.fingerprint)
        seg = LoadedSegment(key, sig, tier, view.tier, view.size, view)
        seg.copy_start, seg.ready, seg.device_buffer, seg.layers = copy_start, ready, dev, layers
        return seg
