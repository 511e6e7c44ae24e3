"""The gRPC servicer: each RPC of kvstore.v1.KVStore as a thin call into one `Store`.

Owns: request validation (through kvstore.rpc.codec) before the Store sees a request,
the mapping of kvstore errors to gRPC status codes (with the error class code in the
trailing metadata "kvstore-error-code"), the protocol-version check, per-RPC latency
metrics, and the Show RPC's header read. A bad request gets INVALID_ARGUMENT with a
message naming the bad value; an unexpected exception gets INTERNAL and is logged with
its traceback; either way the daemon keeps serving.

The handlers are coroutines for a grpc.aio server. Where each RPC's work runs:

- on the event loop: Info (no Store call), and Lookup, Release and Renew when the
  Store's lock is free at that instant (`wait=False`: a few dict operations, no I/O);
- WaitFor waits on the event loop (kvstore.server.waiters), never on a worker: its
  look at the key's state is inline when the lock is free, else a short worker call;
- on the worker pool (`executor`): those three when the lock is busy, and every other
  RPC (they may hash, fsync, write LMDB, move objects between tiers), so the event
  loop never blocks on the Store's lock or on I/O.

One servicer serves each listener: the unix socket's ("unix") and, with --tcp, a copy
for the TCP listener ("tcp", `for_tcp`) that never hands out a Region (only meaningful on
the daemon's host) and never publishes bytes the daemon did not receive: Commit and Get
are refused there, Reserve answers without a region (a reservation then only marks the
key in flight, e.g. an engine's claim, until Abort or expiry), and the bytes travel
over the wire instead (PutBytes, GetBytes; kvstore.server.wiredata).

The RPC methods themselves are plain functions `fn(request, remaining_s)`, where
`remaining_s` is the call's deadline budget (None: no deadline).
"""

from __future__ import annotations

import asyncio
import json
import logging
import mmap
import os
import time
from concurrent.futures import Executor
from typing import Any, Callable, Optional

import grpc

from kvstore import errors
from kvstore.checksums import ALGORITHMS
from kvstore.rpc import codec
from kvstore.rpc import kvstore_pb2 as pb
from kvstore.rpc.service import ERROR_CODE_METADATA_KEY, PROTOCOL_METADATA_KEY, PROTOCOL_VERSION, MalformedRequest
from kvstore.server import wiredata
from kvstore.server.metrics import DaemonMetrics
from kvstore.server.waiters import KeyWaiters
from kvstore.tiers.registry import TIERS

log = logging.getLogger("kvstore.server")

# kvstore error class -> gRPC status code.
STATUS_BY_ERROR: dict[type, grpc.StatusCode] = {
    errors.InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    errors.UnknownKey: grpc.StatusCode.NOT_FOUND,
    errors.CapacityExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.BadObject: grpc.StatusCode.DATA_LOSS,
    errors.VersionMismatch: grpc.StatusCode.FAILED_PRECONDITION,
    errors.AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    errors.DaemonNotRunning: grpc.StatusCode.UNAVAILABLE,
}
_STORAGE_ERROR = getattr(errors, "StorageError", None)
if _STORAGE_ERROR is not None:
    STATUS_BY_ERROR[_STORAGE_ERROR] = grpc.StatusCode.UNAVAILABLE

SHOW_CLIENT_ID = "kvstore-daemon-show"


def status_for(exc: errors.KVStoreError) -> grpc.StatusCode:
    for cls in type(exc).__mro__:
        if cls in STATUS_BY_ERROR:
            return STATUS_BY_ERROR[cls]
    return grpc.StatusCode.INTERNAL


# RPCs whose Store call is a few dict operations: tried on the event loop first.
_TRY_INLINE = ("Lookup", "Release", "Renew")
_INLINE = ("Info",)
_ASYNC = ("WaitFor",)  # coroutines that wait on the event loop
_LOCAL_ONLY = ("Commit", "Get")  # publish bytes written in place / answer with Regions: unix socket only
BUSY = object()  # what a `wait=False` RPC returns when the Store's lock is taken


def _json_value(value: Any) -> Any:
    """JSON for a header value json cannot encode: bytes as "hex:..." (not a Python repr)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return "hex:" + bytes(value).hex()
    return str(value)


class KVStoreServicer:
    """Implements every RPC of the service over `store` (a kvstore.store.Store), for a
    grpc.aio server; blocking work runs on `executor` (see the module docstring)."""

    NAMES = ("Info", "Lookup", "Reserve", "Commit", "Abort", "WaitFor", "Get", "Release", "Renew",
             "Delete", "Prefetch", "Evict", "Stats", "List", "Show", "PutBytes", "GetBytes")

    def __init__(self, store: Any, limits: codec.Limits, metrics: DaemonMetrics, info: pb.InfoResponse,
                 executor: Optional[Executor] = None, transport: str = "unix",
                 settings_report: Optional[dict[str, Any]] = None) -> None:
        self.store = store
        self.settings_report = settings_report  # the daemon's effective config, in Stats as "daemon_config"
        self.limits = limits
        self.metrics = metrics
        self._info = info
        self.executor = executor
        self.transport = transport
        self._fast = hasattr(store, "presence")  # a Store stand-in may lack the lock-free probes
        self._waiters: Optional[KeyWaiters] = None

    def attach_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """Serve WaitFor on `loop` (the server's event loop) instead of on a worker: the
        Store tells the waiters when a reservation ends. Without it (or with a Store
        stand-in lacking the listener) WaitFor blocks a worker as before."""
        if hasattr(self.store, "add_settle_listener") and hasattr(self.store, "key_state"):
            self._waiters = KeyWaiters(loop)
            self.store.add_settle_listener(self._waiters.notify)

    def for_tcp(self) -> "KVStoreServicer":
        """The servicer of the TCP listener: same store, limits, metrics and waiters;
        region RPCs refused, bytes served over the wire."""
        twin = KVStoreServicer(self.store, self.limits, self.metrics, self._info, self.executor, transport="tcp",
                               settings_report=self.settings_report)
        twin._waiters = self._waiters
        return twin

    # ------------------------------------------------------------------ plumbing

    def handlers(self) -> dict[str, Callable]:
        """RPC name -> async handler(request, context), each wrapped in error mapping and metrics."""
        return {name: self._wrap(name, getattr(self, name)) for name in self.NAMES}

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable:
        inline = name in _INLINE
        try_inline = name in _TRY_INLINE and self._fast
        run_async = name in _ASYNC
        refused = name in _LOCAL_ONLY and self.transport == "tcp"

        async def handler(request: Any, context: grpc.aio.ServicerContext) -> Any:
            start = time.perf_counter()
            code: Optional[str] = None
            try:
                self._check_protocol(context)
                if isinstance(request, MalformedRequest):
                    raise errors.InvalidRequest(request.reason)
                if refused:
                    raise errors.InvalidRequest(
                        f"{name} is not served over TCP: it works on bytes in the daemon host's memory or files; "
                        "a TCP client sends and receives the bytes (PutBytes, GetBytes)")
                remaining = context.time_remaining()
                if inline:
                    return fn(request, remaining)
                if run_async:
                    return await fn(request, remaining)
                if try_inline:
                    out = fn(request, remaining, wait=False)
                    if out is not BUSY:
                        return out
                    return await self._offload(lambda: fn(request, remaining, wait=True))
                return await self._offload(lambda: fn(request, remaining))
            except errors.KVStoreError as exc:
                code = exc.code
                context.set_trailing_metadata(((ERROR_CODE_METADATA_KEY, exc.code),))
                log.debug("%s -> %s: %s", name, exc.code, exc)
                await context.abort(status_for(exc), str(exc))
            except Exception as exc:  # a bug: report it, keep serving
                code = "INTERNAL"
                log.exception("%s failed with an unexpected error", name)
                context.set_trailing_metadata(((ERROR_CODE_METADATA_KEY, errors.KVStoreError.code),))
                await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {name}: {type(exc).__name__}: {exc}")
            finally:
                self.metrics.observe(name, time.perf_counter() - start, code)

        return handler

    async def _offload(self, call: Callable[[], Any]) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.executor, call)

    @staticmethod
    def _check_protocol(context: Any) -> None:
        for key, value in context.invocation_metadata() or ():
            if key == PROTOCOL_METADATA_KEY and value != str(PROTOCOL_VERSION):
                raise errors.VersionMismatch(
                    f"client speaks kvstore protocol {value}, this daemon speaks {PROTOCOL_VERSION}; "
                    "upgrade the older side"
                )

    # ------------------------------------------------------------------ RPCs

    def Info(self, request: pb.InfoRequest, remaining: Optional[float]) -> pb.InfoResponse:
        return self._info

    def Lookup(self, request: pb.LookupRequest, remaining: Optional[float], wait: bool = True) -> Any:
        # The latency-critical RPC: no per-key records or message copies. Keys of a parsed
        # request are bytes already; only a bad one goes through check_key (its message).
        keys = request.keys
        if not self._fast:  # a Store stand-in without the fast path
            self.check_lookup_keys(keys)
            return pb.LookupResponse(entries=[codec.lookup_entry_to_pb(e) for e in self.store.lookup(list(keys))])
        found = self.presence(keys, wait)
        if found is BUSY:
            return BUSY
        out = pb.LookupResponse()
        add = out.entries.add
        for k, f in zip(keys, found):
            if f is None:
                add(key=k)
            else:
                add(key=k, hit=True, tier=f[0], size=f[1])
        return out

    def check_lookup_keys(self, keys: Any) -> None:
        """InvalidRequest naming the batch size or the first bad key (keys are bytes)."""
        if len(keys) > self.limits.max_batch:
            codec.check_keys(keys, self.limits)  # raises, naming the batch size
        max_key = self.limits.max_key_bytes
        for k in keys:
            if not k or len(k) > max_key:
                codec.check_key(k, self.limits)  # raises, naming the key

    def presence(self, keys: Any, wait: bool) -> Any:
        """Lookup's work for both transports (gRPC and the fast socket): validate `keys`,
        then None or (tier, size) per key; BUSY when `wait` is False and the lock is taken."""
        self.check_lookup_keys(keys)
        if not self._fast:
            return [(e.tier, e.size) if e.hit else None for e in self.store.lookup(list(keys))]
        found = self.store.presence(keys, wait=wait)
        return BUSY if found is None else found

    def Reserve(self, request: pb.ReserveRequest, remaining: Optional[float]) -> pb.ReserveResponse:
        key = codec.check_key(request.key, self.limits)
        tier = codec.check_tier(request.tier, self.limits, default=self.limits.default_tier)
        if request.size == 0:
            raise errors.InvalidRequest(f"size must be > 0 bytes for key {codec.key_text(key)!r}")
        meta = codec.meta_from_pb(request.meta)
        client_id = codec.check_client_id(request.client_id, required=False)
        res = self.store.reserve(key, int(request.size), tier, meta, client_id=client_id)
        out = codec.reservation_to_pb(res)
        if self.transport == "tcp":
            out.ClearField("region")  # nothing to write through: it can only be aborted
        return out

    def Commit(self, request: pb.CommitRequest, remaining: Optional[float]) -> pb.CommitResponse:
        if request.reservation_id == 0:
            raise errors.InvalidRequest("reservation_id is required (the id Reserve returned)")
        client_id = codec.check_client_id(request.client_id, required=False)
        entry = self.store.commit(int(request.reservation_id), int(request.checksum), client_id=client_id)
        return pb.CommitResponse(entry=codec.lookup_entry_to_pb(entry))

    def Abort(self, request: pb.AbortRequest, remaining: Optional[float]) -> pb.AbortResponse:
        if request.reservation_id == 0:
            raise errors.InvalidRequest("reservation_id is required (the id Reserve returned)")
        self.store.abort(int(request.reservation_id), client_id=codec.check_client_id(request.client_id, required=False))
        return pb.AbortResponse()

    async def WaitFor(self, request: pb.WaitForRequest, remaining: Optional[float]) -> pb.WaitForResponse:
        key = codec.check_key(request.key, self.limits)
        timeout = codec.check_timeout(request.timeout_s)
        if remaining is not None:
            timeout = max(0.0, min(timeout, remaining - 0.05))
        if self._waiters is None:
            present = await self._offload(lambda: self.store.wait_for(key, timeout))
        else:
            present = await self._waiters.wait(key, timeout, self._key_state)
        return pb.WaitForResponse(present=bool(present))

    async def _key_state(self, key: bytes) -> str:
        state = self.store.key_state(key, wait=False)  # inline when the lock is free
        if state is None:
            state = await self._offload(lambda: self.store.key_state(key))
        return state

    def Get(self, request: pb.GetRequest, remaining: Optional[float]) -> pb.GetResponse:
        keys = codec.check_keys(request.keys, self.limits)
        client_id = codec.check_client_id(request.client_id, required=True)
        leases = self.store.get(keys, client_id, promote=not request.no_promote,
                                client_verifies=request.client_verifies)
        return pb.GetResponse(leases=[codec.lease_to_pb(x) for x in leases])

    def Release(self, request: pb.ReleaseRequest, remaining: Optional[float], wait: bool = True) -> Any:
        if len(request.lease_ids) > self.limits.max_batch:
            raise errors.InvalidRequest(
                f"batch of {len(request.lease_ids)} lease ids is over the limit of {self.limits.max_batch}")
        client_id = codec.check_client_id(request.client_id, required=False)
        if self.store.release(list(request.lease_ids), client_id, wait=wait) is False:
            return BUSY
        return pb.ReleaseResponse()

    def Renew(self, request: pb.RenewRequest, remaining: Optional[float], wait: bool = True) -> Any:
        if self.store.renew(codec.check_client_id(request.client_id, required=True), wait=wait) is False:
            return BUSY
        return pb.RenewResponse()

    def Delete(self, request: pb.DeleteRequest, remaining: Optional[float]) -> pb.DeleteResponse:
        keys = codec.check_keys(request.keys, self.limits)
        return pb.DeleteResponse(deleted=int(self.store.delete(keys)))

    def Prefetch(self, request: pb.PrefetchRequest, remaining: Optional[float]) -> pb.PrefetchResponse:
        keys = codec.check_keys(request.keys, self.limits)
        tier = codec.check_tier(request.tier, self.limits, default=self.limits.tiers[0])
        return pb.PrefetchResponse(in_tier=int(self.store.prefetch(keys, tier)))

    def Evict(self, request: pb.EvictRequest, remaining: Optional[float]) -> pb.EvictResponse:
        tier = codec.check_tier(request.tier, self.limits)
        return pb.EvictResponse(moved=int(self.store.evict_tier(tier)))

    def Stats(self, request: pb.StatsRequest, remaining: Optional[float]) -> pb.StatsResponse:
        stats = dict(self.store.stats())
        stats["tcp_auth_failures"] = self.metrics.auth_failures
        stats["waiting"] = self._waiters.active if self._waiters is not None else 0
        if self.settings_report is not None:  # for `kvstore config --socket`
            stats["daemon_config"] = self.settings_report
        return codec.stats_to_pb(stats)

    def PutBytes(self, request: pb.PutBytesRequest, remaining: Optional[float]) -> pb.PutBytesResponse:
        key = codec.check_key(request.key, self.limits)
        host = [t for t in TIERS.names if not TIERS.spec(t).device]  # the daemon copies wire bytes into these
        host_tiers = [t for t in self.limits.tiers if t in host] or host[:1]
        default = self.limits.default_tier if self.limits.default_tier in host_tiers else host_tiers[0]
        tier = codec.check_tier(request.tier, self.limits, default=default)
        if TIERS.spec(tier).device:
            raise errors.InvalidRequest("PutBytes stores into the cpu or nvme tier, not gpu (the daemon does not "
                                        "copy wire bytes onto a GPU)")
        size = len(request.data)
        if size == 0:
            raise errors.InvalidRequest(f"PutBytes of key {codec.key_text(key)!r} carries no bytes (at least 1)")
        meta = codec.meta_from_pb(request.meta)
        client_id = codec.check_client_id(request.client_id, required=False) or wiredata.SERVER_CLIENT_ID
        res = self.store.reserve(key, size, tier, meta, client_id=client_id)
        if res.status != "reserved":
            return pb.PutBytesResponse(status=res.status, tier=res.tier, size=size)
        try:
            checksum = wiredata.write_region(res.region, request.data)
            entry = self.store.commit(res.reservation_id, checksum)
        except BaseException:
            try:
                self.store.abort(res.reservation_id)
            except errors.KVStoreError:
                pass  # commit already ended it
            raise
        return pb.PutBytesResponse(status="stored", tier=entry.tier, size=size, checksum=checksum)

    def GetBytes(self, request: pb.GetBytesRequest, remaining: Optional[float]) -> pb.GetBytesResponse:
        keys = codec.check_keys(request.keys, self.limits)
        leases = self.store.get(keys, wiredata.SERVER_CLIENT_ID, promote=not request.no_promote)
        try:
            wiredata.check_answer_size([x.size if x is not None else None for x in leases],
                                       self.limits.max_message_bytes)
            out = pb.GetBytesResponse()
            for key, lease in zip(keys, leases):
                if lease is None:
                    out.objects.add(key=key)
                    continue
                out.objects.add(found=True, key=key, tier=lease.tier, checksum=lease.checksum,
                                meta=codec.meta_to_pb(lease.meta), data=wiredata.read_region(lease.region))
            return out
        finally:
            held = [x.lease_id for x in leases if x is not None]
            if held:
                self.store.release(held)

    def List(self, request: pb.ListRequest, remaining: Optional[float]) -> pb.ListResponse:
        tier = codec.check_tier(request.tier, self.limits, default="") if request.tier else None
        if request.prefix and len(request.prefix) > self.limits.max_key_bytes:
            raise errors.InvalidRequest(f"prefix is {len(request.prefix)} bytes, over the key limit of "
                                        f"{self.limits.max_key_bytes}")
        limit = min(request.limit or self.limits.list_limit, self.limits.list_limit)
        objs = self.store.list_objects(
            fingerprint=request.fingerprint or None, prefix=bytes(request.prefix) or None, tier=tier, limit=limit)
        return pb.ListResponse(objects=[codec.object_info_to_pb(o) for o in objs])

    def Show(self, request: pb.ShowRequest, remaining: Optional[float]) -> pb.ShowResponse:
        key = codec.check_key(request.key, self.limits)
        info = self.store.object_info(key)
        out = pb.ShowResponse(info=codec.object_info_to_pb(info))
        header = self._read_header(key)
        if header is not None:
            out.is_blob = True
            d = header.to_dict()
            d["checksum_algorithm"] = ALGORITHMS.get(header.algorithm, str(header.algorithm))
            out.header_json = json.dumps(d, sort_keys=True, default=_json_value)
            for p in header.parts:
                out.parts.add(name=p.name, layer=p.layer, dtype=p.dtype, shape=list(p.shape), offset=p.offset,
                              length=p.length)
        return out

    def _read_header(self, key: bytes) -> Any:
        """The object's blob header, or None when it is not a blob or its bytes are on the GPU."""
        from kvstore import format as fmt  # torch import, only when Show is used

        leases = self.store.get([key], SHOW_CLIENT_ID, promote=False)
        lease = leases[0] if leases else None
        if lease is None:
            raise errors.UnknownKey(f"key {codec.key_text(key)!r} is not in the store")
        try:
            region = lease.region
            if region.kind not in ("shm", "file") or region.length < fmt.PREAMBLE_SIZE + fmt.TRAILER_SIZE:
                return None
            fd = os.open(region.path, os.O_RDONLY)
            try:
                size = os.fstat(fd).st_size
                if region.offset + region.length > size:
                    raise errors.BadObject(f"object {codec.key_text(key)!r} lies past the end of {region.path}")
                start = region.offset - region.offset % mmap.ALLOCATIONGRANULARITY
                mm = mmap.mmap(fd, region.offset + region.length - start, prot=mmap.PROT_READ, offset=start)
                mv = memoryview(mm)[region.offset - start:]
                try:
                    return fmt.read_header(mv) if fmt.is_blob(mv) else None
                except (errors.BadObject, errors.VersionMismatch) as exc:
                    log.info("Show %s: not a readable blob: %s", codec.key_text(key), exc)
                    return None
                finally:
                    try:
                        mv.release()
                        mm.close()
                    except BufferError:  # a view still alive somewhere; the GC unmaps it
                        pass
            finally:
                os.close(fd)
        finally:
            self.store.release([lease.lease_id])
