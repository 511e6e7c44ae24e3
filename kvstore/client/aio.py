"""`AsyncKVStoreClient`: the asyncio client of the kvstore daemon, with the same API and
semantics as `KVStoreClient` (every method is a coroutine; views are the same classes).

Owns: a grpc.aio channel (and the fast Lookup socket, see kvstore.client.fastpath), the
asyncio put flow, and a keepalive task that renews leases and sends releases queued by
dropped views. Copies into the arena larger than
OFFLOAD_BYTES run in a worker thread so the event loop keeps turning. Over TCP it
authenticates and moves bytes over the wire exactly as KVStoreClient does: what each call
sends and how its reply is read lives once, in kvstore.client.ops; this face carries out
its steps by awaiting.

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

from kvstore.client.common import (
    CONNECT_TIMEOUT_S, DEFAULT_MAX_MESSAGE, DEFAULT_TIMEOUT_S, ClientCore, DaemonInfo, KeyLike, PutResult, ShowResult,
    TcpAuth, check_reachable,
)
from kvstore.client.fastpath import AsyncFastLookup
from kvstore.client.ops import Call, ClientOps, Health, Op, Step, T, Write, drive_async
from kvstore.client.ops import FastLookup as FastLookupStep
from kvstore.client.status import translate
from kvstore.client.views import ObjectView, TensorsView
from kvstore.errors import KVStoreError
from kvstore.records import LookupEntry, ObjectInfo
from kvstore.rpc.service import HEALTH_CHECK_METHOD, KVStoreStub, client_channel_options, encode_health_request

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
        self._ops = ClientOps(self._core)
        self._fast = AsyncFastLookup(self._core.target, timeout)
        self._channel: Optional[grpc.aio.Channel] = None
        self._stub: Optional[KVStoreStub] = None
        self._keepalive: Optional[asyncio.Task] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None

    # ------------------------------------------------------------------ how steps are carried out

    async def _run(self, op: Op[T]) -> T:
        return await drive_async(op, self._do)

    async def _do(self, step: Step) -> Any:
        if isinstance(step, Call):
            if step.if_connected and self._stub is None:
                return None
            return await self._call(step.rpc, step.request, step.timeout)
        if isinstance(step, Write):
            return await asyncio.to_thread(step.fn, step.region) if step.size >= OFFLOAD_BYTES \
                else step.fn(step.region)
        if isinstance(step, FastLookupStep):
            return await self._fast.lookup(step.keys) if self._stub is not None else None
        if isinstance(step, Health):
            return await self._health_raw(step.timeout)
        raise TypeError(f"unknown client step {step!r}")

    async def _call(self, rpc: str, request: Any, timeout: Optional[float] = None) -> Any:
        if self._stub is None:
            raise KVStoreError(f"the client for {self.target} is not connected (await connect() first)")
        try:
            return await getattr(self._stub, rpc)(request, timeout=timeout or self._core.timeout,
                                                  metadata=self._core.metadata)
        except grpc.aio.AioRpcError as exc:
            raise translate(exc, self.target, rpc) from None

    async def _health_raw(self, timeout: float) -> bytes:
        if self._channel is None:
            raise KVStoreError(f"the client for {self.target} is not connected")
        call = self._channel.unary_unary(HEALTH_CHECK_METHOD)
        try:
            return await call(encode_health_request(), timeout=timeout, metadata=self._core.metadata)
        except grpc.aio.AioRpcError as exc:
            raise translate(exc, self.target, "Health") from None

    # ------------------------------------------------------------------ connection

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
        info = await self._run(self._ops.info())
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
        await self._run(self._ops.release_all())
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

    async def _keepalive_loop(self) -> None:
        while True:
            await asyncio.sleep(self._core.keepalive_interval)
            await self._run(self._ops.keepalive_round())

    async def renew(self) -> None:
        await self._run(self._ops.renew())

    # ------------------------------------------------------------------ control plane

    async def health(self, timeout: float = CONNECT_TIMEOUT_S) -> bool:
        return await self._run(self._ops.health(timeout))

    async def lookup(self, keys: Sequence[KeyLike]) -> list[LookupEntry]:
        """Presence, tier and size of each key (no lease). Over the fast socket when the
        daemon has one, else (or when it fails) over gRPC; the same answer either way."""
        return await self._run(self._ops.lookup(keys))

    async def lookup_grpc(self, keys: Sequence[KeyLike]) -> list[LookupEntry]:
        """`lookup` over gRPC only (for comparisons and benchmarks)."""
        return await self._run(self._ops.lookup_grpc(keys))

    async def delete(self, keys: Sequence[KeyLike]) -> int:
        return await self._run(self._ops.delete(keys))

    async def prefetch(self, keys: Sequence[KeyLike], tier: Optional[str] = None) -> int:
        return await self._run(self._ops.prefetch(keys, tier))

    async def evict(self, tier: str) -> int:
        return await self._run(self._ops.evict(tier))

    async def stats(self) -> dict[str, Any]:
        return await self._run(self._ops.stats())

    async def list(self, fingerprint: Optional[str] = None, prefix: Optional[KeyLike] = None,
                   tier: Optional[str] = None, limit: Optional[int] = None) -> list[ObjectInfo]:
        return await self._run(self._ops.list(fingerprint, prefix, tier, limit))

    async def show(self, key: KeyLike) -> ShowResult:
        return await self._run(self._ops.show(key))

    async def wait_for(self, key: KeyLike, timeout: float = 10.0) -> bool:
        return await self._run(self._ops.wait_for(key, timeout))

    # ------------------------------------------------------------------ put

    async def put(self, key: KeyLike, data: Any, *, tier: Optional[str] = None, fingerprint: str = "",
                  token_count: int = 0, cost: float = 0.0, extra: Optional[Mapping[str, Any]] = None) -> PutResult:
        return await self._run(self._ops.put(key, data, tier, fingerprint, token_count, cost, extra))

    async def put_tensors(self, key: KeyLike, tensors: Mapping[str, Any], *, fingerprint: str = "",
                          token_count: int = 0, tier: Optional[str] = None, cost: float = 0.0,
                          meta: Optional[Mapping[str, Any]] = None, layers: Optional[Mapping[str, int]] = None,
                          extra: Optional[Mapping[str, Any]] = None) -> PutResult:
        return await self._run(self._ops.put_tensors(key, tensors, fingerprint, token_count, tier, cost, meta,
                                                     layers, extra))

    # ------------------------------------------------------------------ get

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
            await self._run(self._ops.flush_pending())
        except KVStoreError:
            pass

    async def get_many(self, keys: Sequence[KeyLike], *, promote: bool = True,
                       client_verifies: bool = False) -> list[Optional[ObjectView]]:
        """As KVStoreClient.get_many (`client_verifies` included)."""
        return await self._run(self._ops.get_many(keys, promote, client_verifies, self._release_soon))

    async def get(self, key: KeyLike, *, promote: bool = True, client_verifies: bool = False) -> ObjectView:
        return await self._run(self._ops.get(key, promote, client_verifies, self._release_soon))

    async def get_tensors(self, key: KeyLike, *, promote: bool = True, verify: bool = False) -> TensorsView:
        return await self._run(self._ops.get_tensors(key, promote, verify, self._release_soon))

    async def release_many(self, views: Sequence[ObjectView]) -> None:
        await self._run(self._ops.release_many(views))
