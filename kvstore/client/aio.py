"""`AsyncKVStoreClient`: the asyncio client of the kvstore daemon, with the same API and
semantics as `KVStoreClient` (every method is a coroutine; views are the same classes).

Owns: a grpc.aio channel (and the fast Lookup socket, see kvstore.client.fastpath), the
asyncio put flow, and a keepalive task that renews leases and sends releases queued by
dropped views. Copies into the arena larger than
OFFLOAD_BYTES run in a worker thread so the event loop keeps turning. Over TCP it
authenticates and moves bytes over the wire exactly as KVStoreClient does.

    async with AsyncKVStoreClient(socket) as kv:
        await kv.put(b"key", data)
        view = await kv.get(b"key")
        ...
        await kv.release_many([view])
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

import grpc
import grpc.aio
import xxhash

from kvstore import checksums as cks
from kvstore.client.common import (
    CONNECT_TIMEOUT_S, DEFAULT_MAX_MESSAGE, DEFAULT_TIMEOUT_S, FUSED_HASH_MIN, PUT_ATTEMPTS, ClientCore,
    DaemonInfo, TcpAuth,
    KeyLike, PutResult, ShowResult, as_bytes_view, as_key, check_reachable,
)
from kvstore.client.fastpath import AsyncFastLookup
from kvstore.client.status import translate
from kvstore.client.views import ObjectView, TensorsView, decode_view
from kvstore.errors import CapacityExhausted, KVStoreError, UnknownKey
from kvstore.records import LookupEntry, ObjectInfo
from kvstore.rpc import codec
from kvstore.rpc import kvstore_pb2 as pb
from kvstore.rpc.service import (
    HEALTH_CHECK_METHOD, HEALTH_SERVING, KVStoreStub, client_channel_options, decode_health_status,
    encode_health_request,
)

OFFLOAD_BYTES = 1 << 20


class AsyncKVStoreClient:
    """asyncio client; `await client.connect()` (or `async with`) before use."""

    def __init__(self, socket: Optional[Union[str, Path]] = None, tcp: Optional[str] = None, *,
                 client_id: Optional[str] = None, timeout: float = DEFAULT_TIMEOUT_S,
                 max_message_size: int = DEFAULT_MAX_MESSAGE,
                 tcp_token_file: Optional[Union[str, Path]] = None,
                 tcp_tls_ca: Optional[Union[str, Path]] = None) -> None:
        self._core = ClientCore(socket, tcp, client_id, timeout, max_message_size,
                                TcpAuth(tcp_token_file, tcp_tls_ca))
        self._fast = AsyncFastLookup(self._core.target, timeout)
        self._channel: Optional[grpc.aio.Channel] = None
        self._stub: Optional[KVStoreStub] = None
        self._keepalive: Optional[asyncio.Task] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None

    @property
    def target(self) -> str:
        return self._core.target

    @property
    def client_id(self) -> str:
        return self._core.client_id

    @property
    def info(self) -> Optional[DaemonInfo]:
        return self._core.info

    async def connect(self) -> DaemonInfo:
        if self._channel is None:
            check_reachable(self.target)
            opts = client_channel_options(self._core.max_message_size, self.target)
            creds = self._core.channel_credentials()
            self._channel = (grpc.aio.secure_channel(self.target, creds, options=opts) if creds is not None
                             else grpc.aio.insecure_channel(self.target, options=opts))
            self._stub = KVStoreStub(self._channel)
            self._loop = asyncio.get_running_loop()
        info = self._core.set_info(await self._call("Info", pb.InfoRequest(), timeout=CONNECT_TIMEOUT_S))
        if self._keepalive is None:
            self._keepalive = asyncio.create_task(self._keepalive_loop(), name="kvstore-keepalive")
        return info

    async def close(self) -> None:
        if self._channel is None:
            return
        if self._keepalive is not None:
            self._keepalive.cancel()
            try:
                await self._keepalive
            except (asyncio.CancelledError, Exception):
                pass
            self._keepalive = None
        try:
            ids = self._core.take_pending() + self._core.held_ids()
            if ids:
                await self._call("Release", pb.ReleaseRequest(lease_ids=ids, client_id=self.client_id),
                                 timeout=CONNECT_TIMEOUT_S)
        except KVStoreError:
            pass
        await self._fast.close()
        await self._channel.close()
        self._channel = None
        self._stub = None
        self._core.regions.close()

    async def __aenter__(self) -> "AsyncKVStoreClient":
        await self.connect()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def _call(self, rpc: str, request: Any, timeout: Optional[float] = None) -> Any:
        if self._stub is None:
            raise KVStoreError(f"the client for {self.target} is not connected (await connect() first)")
        try:
            return await getattr(self._stub, rpc)(request, timeout=timeout or self._core.timeout,
                                                  metadata=self._core.metadata)
        except grpc.aio.AioRpcError as exc:
            raise translate(exc, self.target, rpc) from None

    async def _keepalive_loop(self) -> None:
        while True:
            await asyncio.sleep(self._core.keepalive_interval)
            try:
                await self._flush_pending()
                if self._core.holds_leases:
                    await self._call("Renew", pb.RenewRequest(client_id=self.client_id))
            except KVStoreError:
                pass

    async def _flush_pending(self) -> None:
        pending = self._core.take_pending()
        if pending:
            self._core.untrack(pending)
            await self._call("Release", pb.ReleaseRequest(lease_ids=pending, client_id=self.client_id))

    async def renew(self) -> None:
        await self._call("Renew", pb.RenewRequest(client_id=self.client_id))

    # ------------------------------------------------------------------ control plane

    async def health(self, timeout: float = CONNECT_TIMEOUT_S) -> bool:
        if self._channel is None:
            raise KVStoreError(f"the client for {self.target} is not connected")
        call = self._channel.unary_unary(HEALTH_CHECK_METHOD)
        try:
            raw = await call(encode_health_request(), timeout=timeout, metadata=self._core.metadata)
        except grpc.aio.AioRpcError as exc:
            raise translate(exc, self.target, "Health") from None
        return decode_health_status(raw) == HEALTH_SERVING

    async def lookup(self, keys: Sequence[KeyLike]) -> list[LookupEntry]:
        """Presence, tier and size of each key (no lease). Over the fast socket when the
        daemon has one, else (or when it fails) over gRPC; the same answer either way."""
        ks = self._core.lookup_keys(keys)
        if self._stub is not None:
            found = await self._fast.lookup(ks)
            if found is not None:
                return self._core.found_lookups(ks, found)
        return self._core.lookups(await self._call("Lookup", pb.LookupRequest(keys=ks)))

    async def lookup_grpc(self, keys: Sequence[KeyLike]) -> list[LookupEntry]:
        """`lookup` over gRPC only (for comparisons and benchmarks)."""
        return self._core.lookups(await self._call("Lookup", self._core.lookup_request(keys)))

    async def delete(self, keys: Sequence[KeyLike]) -> int:
        return (await self._call("Delete", pb.DeleteRequest(keys=[as_key(k) for k in keys]))).deleted

    async def prefetch(self, keys: Sequence[KeyLike], tier: Optional[str] = None) -> int:
        req = pb.PrefetchRequest(keys=[as_key(k) for k in keys], tier=tier or "")
        return (await self._call("Prefetch", req)).in_tier

    async def evict(self, tier: str) -> int:
        return (await self._call("Evict", pb.EvictRequest(tier=tier))).moved

    async def stats(self) -> dict[str, Any]:
        return codec.stats_from_pb(await self._call("Stats", pb.StatsRequest()))

    async def list(self, fingerprint: Optional[str] = None, prefix: Optional[KeyLike] = None,
                   tier: Optional[str] = None, limit: Optional[int] = None) -> list[ObjectInfo]:
        return self._core.objects(await self._call("List", self._core.list_request(fingerprint, prefix, tier, limit)))

    async def show(self, key: KeyLike) -> ShowResult:
        return self._core.show_result(await self._call("Show", pb.ShowRequest(key=as_key(key))))

    async def wait_for(self, key: KeyLike, timeout: float = 10.0) -> bool:
        req = pb.WaitForRequest(key=as_key(key), timeout_s=timeout)
        return (await self._call("WaitFor", req, timeout=timeout + self._core.timeout)).present

    # ------------------------------------------------------------------ put

    async def _put_wire(self, key: bytes, data: memoryview, tier: Optional[str], meta: pb.ObjectMeta) -> PutResult:
        for _ in range(PUT_ATTEMPTS):
            res = await self._call("PutBytes", self._core.put_bytes_request(key, data, tier, meta))
            if res.status in ("stored", "exists"):
                return PutResult(key, res.tier, data.nbytes, res.status, res.checksum)
            if await self.wait_for(key, self._core.timeout):
                return PutResult(key, res.tier, data.nbytes, "exists")
        raise CapacityExhausted(f"put of {key!r}: other writers kept aborting it ({PUT_ATTEMPTS} tries)")

    async def _put(self, key: bytes, size: int, tier: Optional[str], meta: pb.ObjectMeta, write: Any) -> PutResult:
        for _ in range(PUT_ATTEMPTS):
            res = await self._call("Reserve", self._core.reserve_request(key, size, tier, meta))
            if res.status == "exists":
                return PutResult(key, res.tier, size, "exists")
            if res.status == "in_flight":
                if await self.wait_for(key, self._core.timeout):
                    return PutResult(key, res.tier, size, "exists")
                continue
            region = codec.region_from_pb(res.region)
            try:
                checksum = await asyncio.to_thread(write, region) if size >= OFFLOAD_BYTES else write(region)
                entry = await self._call("Commit",
                                         pb.CommitRequest(reservation_id=res.reservation_id, checksum=checksum,
                                                          client_id=self.client_id))
            except BaseException:
                try:
                    await self._call("Abort",
                                     pb.AbortRequest(reservation_id=res.reservation_id, client_id=self.client_id),
                                     timeout=CONNECT_TIMEOUT_S)
                except KVStoreError:
                    pass
                raise
            return PutResult(key, entry.entry.tier, size, "stored", checksum)
        raise CapacityExhausted(f"put of {key!r}: other writers kept aborting it ({PUT_ATTEMPTS} tries)")

    async def put(self, key: KeyLike, data: Any, *, tier: Optional[str] = None, fingerprint: str = "",
                  token_count: int = 0, cost: float = 0.0, extra: Optional[Mapping[str, Any]] = None) -> PutResult:
        k = as_key(key)
        mv = as_bytes_view(data)
        if self._core.remote:
            meta = self._core.meta_pb(fingerprint, token_count, cost, dict(extra) if extra else None)
            return await self._put_wire(k, mv, tier, meta)

        def write(region: Any) -> int:
            if mv.nbytes <= FUSED_HASH_MIN:  # small: one copy, one hash call
                self._core.regions.write(region, mv)
                if cks.algorithm_of(mv[: cks.PREFIX_BYTES]) == cks.XXH3:
                    return xxhash.xxh3_64_intdigest(mv)
                return cks.host_checksum(mv)  # the bytes are a kvsum64 blob
            return self._core.regions.write_hashed(region, mv)  # large: hash while copying

        meta = self._core.meta_pb(fingerprint, token_count, cost, dict(extra) if extra else None)
        return await self._put(k, mv.nbytes, tier, meta, write)

    async def put_tensors(self, key: KeyLike, tensors: Mapping[str, Any], *, fingerprint: str = "",
                          token_count: int = 0, tier: Optional[str] = None, cost: float = 0.0,
                          meta: Optional[Mapping[str, Any]] = None, layers: Optional[Mapping[str, int]] = None,
                          extra: Optional[Mapping[str, Any]] = None) -> PutResult:
        from kvstore import format as fmt

        k = as_key(key)
        plan = fmt.plan_blob(tensors, fingerprint=fingerprint, token_count=token_count, meta=meta, layers=layers)
        m = self._core.meta_pb(fingerprint, token_count, cost, dict(extra) if extra else None)
        if self._core.remote:
            return await self._put_wire(k, self._core.blob_bytes(plan, tensors), tier, m)
        return await self._put(k, plan.total_size, tier, m, self._core.blob_writer(plan, tensors))

    # ------------------------------------------------------------------ get

    async def _release_ids(self, lease_ids: Sequence[int]) -> None:
        self._core.untrack(lease_ids)
        if lease_ids and self._stub is not None:
            await self._call("Release", pb.ReleaseRequest(lease_ids=list(lease_ids), client_id=self.client_id))

    def _release_soon(self, lease_id: int) -> None:
        """ObjectView.release() is synchronous: queue the RPC for the keepalive, or send it
        now as a task when called on the loop."""
        self._core.untrack([lease_id])
        self._core.queue_release(lease_id)
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                if asyncio.get_running_loop() is loop:
                    loop.create_task(self._flush_quietly())
            except RuntimeError:
                pass  # not on the loop's thread; the keepalive sends it

    async def _flush_quietly(self) -> None:
        try:
            await self._flush_pending()
        except KVStoreError:
            pass

    async def get_many(self, keys: Sequence[KeyLike], *, promote: bool = True,
                       client_verifies: bool = False) -> list[Optional[ObjectView]]:
        """As KVStoreClient.get_many (`client_verifies` included)."""
        ks = [as_key(k) for k in keys]
        if self._core.remote:  # bytes over the wire, verified here
            got = await self._call("GetBytes", pb.GetBytesRequest(keys=ks, no_promote=not promote))
            return [self._core.wire_view(o) if o.found else None for o in got.objects]
        leases = self._core.leases(await self._call("Get", self._core.get_request(ks, promote, client_verifies)))
        views: list[Optional[ObjectView]] = []
        try:
            for lease in leases:
                views.append(None if lease is None else self._core.make_view(lease, self._release_soon))
        except BaseException:
            done = {v.lease_id for v in views if v is not None}
            await self.release_many([v for v in views if v is not None])
            rest = [x.lease_id for x in leases if x is not None and x.lease_id not in done]
            try:
                await self._release_ids(rest)
            except KVStoreError:
                pass
            raise
        return views

    async def get(self, key: KeyLike, *, promote: bool = True, client_verifies: bool = False) -> ObjectView:
        view = (await self.get_many([key], promote=promote, client_verifies=client_verifies))[0]
        if view is None:
            raise UnknownKey(f"key {codec.key_text(as_key(key))!r} is not in the store")
        return view

    async def get_tensors(self, key: KeyLike, *, promote: bool = True, verify: bool = False) -> TensorsView:
        view = await self.get(key, promote=promote)
        try:
            return decode_view(view, verify=verify)
        except BaseException:
            await self.release_many([view])
            raise

    async def release_many(self, views: Sequence[ObjectView]) -> None:
        ids = [i for i in (v.detach() for v in views) if i]  # 0: a wire view, no lease
        await self._release_ids(ids)
