"""`KVStoreClient`: the blocking client of the kvstore daemon.

Owns: the gRPC channel to one daemon (and its fast Lookup socket, see
kvstore.client.fastpath), the put flow (reserve -> write in place into the region ->
commit with the checksum; abort on failure; wait when another client is writing the
same key), gets that return lease-holding zero-copy views, and a keepalive thread that
renews this client's leases and sends releases queued by dropped views.

    with KVStoreClient.connect() as kv:
        kv.put(b"key", b"bytes", tier="cpu")
        with kv.get(b"key") as view:
            data = view.memoryview          # aliases the daemon's shared-memory arena
        kv.put_tensors(b"seg", {"k": k, "v": v}, fingerprint=fp, token_count=n)
        with kv.get_tensors(b"seg") as (header, tensors):
            ...                             # tensors are views over the arena

Over TCP (`KVStoreClient(tcp="host:port", tcp_token_file=F)`, optionally `tcp_tls_ca=CA`
for a daemon serving TLS) every call carries the daemon's token, and puts and gets move
the bytes in messages (PutBytes / GetBytes: objects up to the message size limit): a
view then holds a verified local copy, no lease.

What each call sends and how its reply is read lives once, in kvstore.client.ops (shared
with the asyncio client); this face carries out its steps by blocking.

A client is thread-safe. Do not share one across fork(); make a new one in the child.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

import grpc

from kvstore.client.common import (
    CONNECT_TIMEOUT_S, DEFAULT_MAX_MESSAGE, DEFAULT_TIMEOUT_S, ClientCore, DaemonInfo, KeyLike, PutResult, ShowResult,
    TcpAuth, check_reachable,
)
from kvstore.client.fastpath import FastLookup
from kvstore.client.ops import Call, ClientOps, Health, Op, Step, T, Write, drive
from kvstore.client.ops import FastLookup as FastLookupStep
from kvstore.client.status import translate
from kvstore.client.views import ObjectView, TensorsView
from kvstore.errors import KVStoreError
from kvstore.records import LookupEntry, ObjectInfo
from kvstore.rpc.service import HEALTH_CHECK_METHOD, KVStoreStub, client_channel_options, encode_health_request


class KVStoreClient:
    """Blocking client; see the module docstring. Methods raise kvstore.errors classes."""

    def __init__(self, socket: Optional[Union[str, Path]] = None, tcp: Optional[str] = None, *,
                 client_id: Optional[str] = None, timeout: float = DEFAULT_TIMEOUT_S,
                 max_message_size: int = DEFAULT_MAX_MESSAGE, connect: bool = True,
                 tcp_token_file: Optional[Union[str, Path]] = None,
                 tcp_tls_ca: Optional[Union[str, Path]] = None) -> None:
        self._core = ClientCore(socket, tcp, client_id, timeout, max_message_size,
                                TcpAuth(tcp_token_file, tcp_tls_ca))
        self._ops = ClientOps(self._core)
        self._fast = FastLookup(self._core.target, timeout)
        self._channel: Optional[grpc.Channel] = None
        self._stub: Optional[KVStoreStub] = None
        self._keepalive: Optional[threading.Thread] = None
        self._closing = threading.Event()
        if connect:
            self.connect()

    @classmethod
    def open(cls, socket: Optional[Union[str, Path]] = None, tcp: Optional[str] = None, **kwargs: Any) \
            -> "KVStoreClient":
        """A connected client (same as the constructor; reads well at call sites)."""
        return cls(socket, tcp, **kwargs)

    # ------------------------------------------------------------------ how steps are carried out

    def _run(self, op: Op[T]) -> T:
        return drive(op, self._do)

    def _do(self, step: Step) -> Any:
        if isinstance(step, Call):
            if step.if_connected and self._stub is None:
                return None
            return self._call(step.rpc, step.request, step.timeout)
        if isinstance(step, Write):
            return step.fn(step.region)
        if isinstance(step, FastLookupStep):
            return self._fast.lookup(step.keys) if self._stub is not None else None
        if isinstance(step, Health):
            return self._health_raw(step.timeout)
        raise TypeError(f"unknown client step {step!r}")

    def _call(self, rpc: str, request: Any, timeout: Optional[float] = None) -> Any:
        if self._stub is None:
            raise KVStoreError(f"the client for {self.target} is closed")
        try:
            return getattr(self._stub, rpc)(request, timeout=timeout or self._core.timeout,
                                            metadata=self._core.metadata)
        except grpc.RpcError as exc:
            raise translate(exc, self.target, rpc) from None

    def _health_raw(self, timeout: float) -> bytes:
        if self._channel is None:
            raise KVStoreError(f"the client for {self.target} is closed")
        call = self._channel.unary_unary(HEALTH_CHECK_METHOD)
        try:
            return call(encode_health_request(), timeout=timeout, metadata=self._core.metadata)
        except grpc.RpcError as exc:
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

    def connect(self) -> DaemonInfo:
        """Open the channel and fetch the daemon's Info (protocol check). DaemonNotRunning
        when nothing answers."""
        if self._channel is None:
            check_reachable(self.target)
            opts = client_channel_options(self._core.max_message_size, self.target)
            creds = self._core.channel_credentials()
            self._channel = (grpc.secure_channel(self.target, creds, options=opts) if creds is not None
                             else grpc.insecure_channel(self.target, options=opts))
            self._stub = KVStoreStub(self._channel)
        info = self._run(self._ops.info())
        if self._keepalive is None:
            self._keepalive = threading.Thread(target=self._keepalive_loop, name="kvstore-keepalive", daemon=True)
            self._keepalive.start()
        return info

    def close(self) -> None:
        """Release every lease still held, stop the keepalive, close the channel."""
        if self._channel is None:
            return
        self._closing.set()
        self._run(self._ops.release_all())
        if self._keepalive is not None and self._keepalive is not threading.current_thread():
            self._keepalive.join(timeout=2.0)
        self._fast.close()
        self._channel.close()
        self._channel = None
        self._stub = None
        self._core.regions.close()

    def __enter__(self) -> "KVStoreClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _keepalive_loop(self) -> None:
        while not self._closing.wait(self._core.keepalive_interval):
            self._run(self._ops.keepalive_round())

    def renew(self) -> None:
        """Extend every lease and reservation this client holds (the keepalive does this)."""
        self._run(self._ops.renew())

    # ------------------------------------------------------------------ control plane

    def health(self, timeout: float = CONNECT_TIMEOUT_S) -> bool:
        """True when the daemon answers grpc.health.v1 Check with SERVING."""
        return self._run(self._ops.health(timeout))

    def lookup(self, keys: Sequence[KeyLike]) -> list[LookupEntry]:
        """Presence, tier and size of each key (no lease). Over the fast socket when the
        daemon has one, else (or when it fails) over gRPC; the same answer either way."""
        return self._run(self._ops.lookup(keys))

    def lookup_grpc(self, keys: Sequence[KeyLike]) -> list[LookupEntry]:
        """`lookup` over gRPC only (for comparisons and benchmarks)."""
        return self._run(self._ops.lookup_grpc(keys))

    def delete(self, keys: Sequence[KeyLike]) -> int:
        return self._run(self._ops.delete(keys))

    def prefetch(self, keys: Sequence[KeyLike], tier: Optional[str] = None) -> int:
        return self._run(self._ops.prefetch(keys, tier))

    def evict(self, tier: str) -> int:
        return self._run(self._ops.evict(tier))

    def stats(self) -> dict[str, Any]:
        return self._run(self._ops.stats())

    def map_arenas(self, pin: bool = True) -> list[str]:
        """Map the daemon's shared-memory arena(s) into this process now and, with `pin`
        where CUDA is usable, pin them for full-speed host-to-device copies, instead of at
        the first read that needs each: pinning a large arena takes seconds (every page
        is locked). Mappings are shared by every client of the process. Returns the
        arenas' paths."""
        paths = self._run(self._ops.arena_paths())
        for path in paths:
            self._core.regions.map_arena(path, pin=pin)
        return paths

    def list(self, fingerprint: Optional[str] = None, prefix: Optional[KeyLike] = None, tier: Optional[str] = None,
             limit: Optional[int] = None) -> list[ObjectInfo]:
        return self._run(self._ops.list(fingerprint, prefix, tier, limit))

    def show(self, key: KeyLike) -> ShowResult:
        return self._run(self._ops.show(key))

    def wait_for(self, key: KeyLike, timeout: float = 10.0) -> bool:
        return self._run(self._ops.wait_for(key, timeout))

    # ------------------------------------------------------------------ put

    def put(self, key: KeyLike, data: Any, *, tier: Optional[str] = None, fingerprint: str = "",
            token_count: int = 0, cost: float = 0.0, extra: Optional[Mapping[str, Any]] = None) -> PutResult:
        """Store `data` (any bytes-like object) under `key`: reserve, write in place, commit."""
        return self._run(self._ops.put(key, data, tier, fingerprint, token_count, cost, extra))

    def put_tensors(self, key: KeyLike, tensors: Mapping[str, Any], *, fingerprint: str = "", token_count: int = 0,
                    tier: Optional[str] = None, cost: float = 0.0, meta: Optional[Mapping[str, Any]] = None,
                    layers: Optional[Mapping[str, int]] = None, extra: Optional[Mapping[str, Any]] = None) \
            -> PutResult:
        """Store named tensors as one object-format blob, written straight into the
        reserved region (no intermediate copy). `meta` goes into the blob header, `extra`
        into the daemon's record."""
        return self._run(self._ops.put_tensors(key, tensors, fingerprint, token_count, tier, cost, meta, layers,
                                               extra))

    # ------------------------------------------------------------------ get

    def _release_one(self, lease_id: int) -> None:
        self._run(self._ops.release_ids([lease_id]))

    def get_many(self, keys: Sequence[KeyLike], *, promote: bool = True,
                 client_verifies: bool = False) -> list[Optional[ObjectView]]:
        """Lease every present key (None for a miss) and map its bytes in place.

        `client_verifies=True`: this client checks the bytes itself (`copy_to` /
        `read_into` with verify=True, or `verify()`), so the daemon serves NVMe objects
        without reading them back first (verify_nvme = "always"): a read without
        promotion then reads the disk once. A corrupt object raises BadObject in the
        client and is not dropped from the store."""
        return self._run(self._ops.get_many(keys, promote, client_verifies, self._release_one))

    def get(self, key: KeyLike, *, promote: bool = True, client_verifies: bool = False) -> ObjectView:
        """Lease one key and map its bytes in place; UnknownKey on a miss (`client_verifies`
        as for get_many)."""
        return self._run(self._ops.get(key, promote, client_verifies, self._release_one))

    def get_tensors(self, key: KeyLike, *, promote: bool = True, verify: bool = False) -> TensorsView:
        """Lease one object-format blob and decode it: (header, name -> tensor), zero copy."""
        return self._run(self._ops.get_tensors(key, promote, verify, self._release_one))

    def release_many(self, views: Sequence[ObjectView]) -> None:
        """Release several views in one RPC."""
        self._run(self._ops.release_many(views))
