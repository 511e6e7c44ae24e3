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

A client is thread-safe. Do not share one across fork(); make a new one in the child.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

import grpc
import xxhash

from kvstore import checksums as cks
from kvstore.client.common import (
    CONNECT_TIMEOUT_S, DEFAULT_MAX_MESSAGE, DEFAULT_TIMEOUT_S, FUSED_HASH_MIN, PUT_ATTEMPTS, ClientCore,
    DaemonInfo, TcpAuth,
    KeyLike, PutResult, ShowResult, as_bytes_view, as_key, check_reachable,
)
from kvstore.client.fastpath import FastLookup
from kvstore.client.status import translate
from kvstore.client.views import ObjectView, TensorsView, decode_view
from kvstore.errors import CapacityExhausted, KVStoreError, UnknownKey
from kvstore.records import LookupEntry, ObjectInfo, Reservation
from kvstore.rpc import codec
from kvstore.rpc import kvstore_pb2 as pb
from kvstore.rpc.service import (
    HEALTH_CHECK_METHOD, HEALTH_SERVING, KVStoreStub, client_channel_options, decode_health_status,
    encode_health_request,
)


class KVStoreClient:
    """Blocking client; see the module docstring. Methods raise kvstore.errors classes."""

    def __init__(self, socket: Optional[Union[str, Path]] = None, tcp: Optional[str] = None, *,
                 client_id: Optional[str] = None, timeout: float = DEFAULT_TIMEOUT_S,
                 max_message_size: int = DEFAULT_MAX_MESSAGE, connect: bool = True,
                 tcp_token_file: Optional[Union[str, Path]] = None,
                 tcp_tls_ca: Optional[Union[str, Path]] = None) -> None:
        self._core = ClientCore(socket, tcp, client_id, timeout, max_message_size,
                                TcpAuth(tcp_token_file, tcp_tls_ca))
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
        info = self._core.set_info(self._call("Info", pb.InfoRequest(), timeout=CONNECT_TIMEOUT_S))
        if self._keepalive is None:
            self._keepalive = threading.Thread(target=self._keepalive_loop, name="kvstore-keepalive", daemon=True)
            self._keepalive.start()
        return info

    def close(self) -> None:
        """Release every lease still held, stop the keepalive, close the channel."""
        if self._channel is None:
            return
        self._closing.set()
        try:
            ids = self._core.take_pending() + self._core.held_ids()
            if ids:
                self._call("Release", pb.ReleaseRequest(lease_ids=ids, client_id=self.client_id),
                           timeout=CONNECT_TIMEOUT_S)
        except KVStoreError:
            pass
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

    def _call(self, rpc: str, request: Any, timeout: Optional[float] = None) -> Any:
        if self._stub is None:
            raise KVStoreError(f"the client for {self.target} is closed")
        try:
            return getattr(self._stub, rpc)(request, timeout=timeout or self._core.timeout,
                                            metadata=self._core.metadata)
        except grpc.RpcError as exc:
            raise translate(exc, self.target, rpc) from None

    def _keepalive_loop(self) -> None:
        while not self._closing.wait(self._core.keepalive_interval):
            try:
                pending = self._core.take_pending()
                if pending:
                    self._core.untrack(pending)
                    self._call("Release", pb.ReleaseRequest(lease_ids=pending, client_id=self.client_id))
                if self._core.holds_leases:
                    self._call("Renew", pb.RenewRequest(client_id=self.client_id))
            except KVStoreError:
                pass  # daemon gone or restarting; the next call reports it

    def renew(self) -> None:
        """Extend every lease and reservation this client holds (the keepalive does this)."""
        self._call("Renew", pb.RenewRequest(client_id=self.client_id))

    def reserve(self, key: bytes, size: int, tier: Optional[str] = None, *, fingerprint: str = "",
                token_count: int = 0) -> Reservation:
        """Reserve `size` bytes for `key` without writing them yet: status "reserved" (this
        client's, until `abort` or its lease TTL; engines use one as a claim on a segment
        they compute, engine.connector.claims), "in_flight" (another client holds it: wait
        with `wait_for`) or "exists"."""
        meta = self._core.meta_pb(fingerprint, token_count, 0.0, None)
        res = self._call("Reserve", self._core.reserve_request(key, size, tier, meta))
        region = codec.region_from_pb(res.region) if res.status == "reserved" else None
        return Reservation(res.reservation_id, res.key, res.tier, region, res.status)

    def abort(self, reservation_id: int) -> None:
        """Free a reservation (idempotent on the daemon side); waiters on its key wake."""
        self._call("Abort", pb.AbortRequest(reservation_id=reservation_id, client_id=self.client_id),
                   timeout=CONNECT_TIMEOUT_S)

    # ------------------------------------------------------------------ control plane

    def health(self, timeout: float = CONNECT_TIMEOUT_S) -> bool:
        """True when the daemon answers grpc.health.v1 Check with SERVING."""
        if self._channel is None:
            raise KVStoreError(f"the client for {self.target} is closed")
        call = self._channel.unary_unary(HEALTH_CHECK_METHOD)
        try:
            raw = call(encode_health_request(), timeout=timeout, metadata=self._core.metadata)
        except grpc.RpcError as exc:
            raise translate(exc, self.target, "Health") from None
        return decode_health_status(raw) == HEALTH_SERVING

    def lookup(self, keys: Sequence[KeyLike]) -> list[LookupEntry]:
        """Presence, tier and size of each key (no lease). Over the fast socket when the
        daemon has one, else (or when it fails) over gRPC; the same answer either way."""
        ks = self._core.lookup_keys(keys)
        if self._stub is not None:
            found = self._fast.lookup(ks)
            if found is not None:
                return self._core.found_lookups(ks, found)
        return self._core.lookups(self._call("Lookup", pb.LookupRequest(keys=ks)))

    def lookup_grpc(self, keys: Sequence[KeyLike]) -> list[LookupEntry]:
        """`lookup` over gRPC only (for comparisons and benchmarks)."""
        return self._core.lookups(self._call("Lookup", self._core.lookup_request(keys)))

    def delete(self, keys: Sequence[KeyLike]) -> int:
        return self._call("Delete", pb.DeleteRequest(keys=[as_key(k) for k in keys])).deleted

    def prefetch(self, keys: Sequence[KeyLike], tier: Optional[str] = None) -> int:
        return self._call("Prefetch", pb.PrefetchRequest(keys=[as_key(k) for k in keys], tier=tier or "")).in_tier

    def evict(self, tier: str) -> int:
        return self._call("Evict", pb.EvictRequest(tier=tier)).moved

    def stats(self) -> dict[str, Any]:
        return codec.stats_from_pb(self._call("Stats", pb.StatsRequest()))

    def map_arenas(self, pin: bool = True) -> list[str]:
        """Map the daemon's shared-memory arena(s) into this process now and, with `pin`
        where CUDA is usable, pin them for full-speed host-to-device copies, instead of at
        the first read that needs each: pinning a large arena takes seconds (every page
        is locked). Mappings are shared by every client of the process. Returns the
        arenas' paths."""
        if self._core.remote:  # the daemon's memory is on its host: nothing to map
            return []
        paths = [t["path"] for t in self.stats().get("tiers", []) if t.get("name") == "cpu" and t.get("path")]
        for path in paths:
            self._core.regions.map_arena(path, pin=pin)
        return paths

    def list(self, fingerprint: Optional[str] = None, prefix: Optional[KeyLike] = None, tier: Optional[str] = None,
             limit: Optional[int] = None) -> list[ObjectInfo]:
        return self._core.objects(self._call("List", self._core.list_request(fingerprint, prefix, tier, limit)))

    def show(self, key: KeyLike) -> ShowResult:
        return self._core.show_result(self._call("Show", pb.ShowRequest(key=as_key(key))))

    def wait_for(self, key: KeyLike, timeout: float = 10.0) -> bool:
        req = pb.WaitForRequest(key=as_key(key), timeout_s=timeout)
        return self._call("WaitFor", req, timeout=timeout + self._core.timeout).present

    # ------------------------------------------------------------------ put

    def _put_wire(self, key: bytes, data: memoryview, tier: Optional[str], meta: pb.ObjectMeta) -> PutResult:
        """A put over TCP: the bytes travel in the request; the daemon writes and checksums them."""
        for _ in range(PUT_ATTEMPTS):
            res = self._call("PutBytes", self._core.put_bytes_request(key, data, tier, meta))
            if res.status in ("stored", "exists"):
                return PutResult(key, res.tier, data.nbytes, res.status, res.checksum)
            if self.wait_for(key, self._core.timeout):  # "in_flight": another client writes it
                return PutResult(key, res.tier, data.nbytes, "exists")
        raise CapacityExhausted(f"put of {key!r}: other writers kept aborting it ({PUT_ATTEMPTS} tries)")

    def _put(self, key: bytes, size: int, tier: Optional[str], meta: pb.ObjectMeta, write: Any) -> PutResult:
        for _ in range(PUT_ATTEMPTS):
            res = self._call("Reserve", self._core.reserve_request(key, size, tier, meta))
            if res.status == "exists":
                return PutResult(key, res.tier, size, "exists")
            if res.status == "in_flight":
                if self.wait_for(key, self._core.timeout):
                    return PutResult(key, res.tier, size, "exists")
                continue  # the other writer gave up; try again
            region = codec.region_from_pb(res.region)
            try:
                checksum = write(region)
                entry = self._call("Commit", pb.CommitRequest(reservation_id=res.reservation_id, checksum=checksum,
                                                              client_id=self.client_id))
            except BaseException:
                try:
                    self._call("Abort", pb.AbortRequest(reservation_id=res.reservation_id, client_id=self.client_id),
                               timeout=CONNECT_TIMEOUT_S)
                except KVStoreError:
                    pass  # already gone (e.g. commit failed and freed it); it expires anyway
                raise
            return PutResult(key, entry.entry.tier, size, "stored", checksum)
        raise CapacityExhausted(f"put of {key!r}: other writers kept aborting it ({PUT_ATTEMPTS} tries)")

    def put(self, key: KeyLike, data: Any, *, tier: Optional[str] = None, fingerprint: str = "",
            token_count: int = 0, cost: float = 0.0, extra: Optional[Mapping[str, Any]] = None) -> PutResult:
        """Store `data` (any bytes-like object) under `key`: reserve, write in place, commit."""
        k = as_key(key)
        mv = as_bytes_view(data)
        if self._core.remote:
            meta = self._core.meta_pb(fingerprint, token_count, cost, dict(extra) if extra else None)
            return self._put_wire(k, mv, tier, meta)

        def write(region: Any) -> int:
            if mv.nbytes <= FUSED_HASH_MIN:  # small: one copy, one hash call
                self._core.regions.write(region, mv)
                if cks.algorithm_of(mv[: cks.PREFIX_BYTES]) == cks.XXH3:
                    return xxhash.xxh3_64_intdigest(mv)
                return cks.host_checksum(mv)  # the bytes are a kvsum64 blob
            return self._core.regions.write_hashed(region, mv)  # large: hash while copying

        meta = self._core.meta_pb(fingerprint, token_count, cost, dict(extra) if extra else None)
        return self._put(k, mv.nbytes, tier, meta, write)

    def put_tensors(self, key: KeyLike, tensors: Mapping[str, Any], *, fingerprint: str = "", token_count: int = 0,
                    tier: Optional[str] = None, cost: float = 0.0, meta: Optional[Mapping[str, Any]] = None,
                    layers: Optional[Mapping[str, int]] = None, extra: Optional[Mapping[str, Any]] = None) \
            -> PutResult:
        """Store named tensors as one object-format blob, written straight into the
        reserved region (no intermediate copy). `meta` goes into the blob header, `extra`
        into the daemon's record."""
        from kvstore import format as fmt

        k = as_key(key)
        plan = fmt.plan_blob(tensors, fingerprint=fingerprint, token_count=token_count, meta=meta, layers=layers)
        m = self._core.meta_pb(fingerprint, token_count, cost, dict(extra) if extra else None)
        if self._core.remote:
            return self._put_wire(k, self._core.blob_bytes(plan, tensors), tier, m)
        return self._put(k, plan.total_size, tier, m, self._core.blob_writer(plan, tensors))

    # ------------------------------------------------------------------ get

    def _release_ids(self, lease_ids: Sequence[int]) -> None:
        self._core.untrack(lease_ids)
        if lease_ids and self._stub is not None:
            self._call("Release", pb.ReleaseRequest(lease_ids=list(lease_ids), client_id=self.client_id))

    def _release_one(self, lease_id: int) -> None:
        self._release_ids([lease_id])

    def get_many(self, keys: Sequence[KeyLike], *, promote: bool = True,
                 client_verifies: bool = False) -> list[Optional[ObjectView]]:
        """Lease every present key (None for a miss) and map its bytes in place.

        `client_verifies=True`: this client checks the bytes itself (`copy_to` /
        `read_into` with verify=True, or `verify()`), so the daemon serves NVMe objects
        without reading them back first (verify_nvme = "always"): a read without
        promotion then reads the disk once. A corrupt object raises BadObject in the
        client and is not dropped from the store."""
        ks = [as_key(k) for k in keys]
        if self._core.remote:  # bytes over the wire, verified here
            got = self._call("GetBytes", pb.GetBytesRequest(keys=ks, no_promote=not promote))
            return [self._core.wire_view(o) if o.found else None for o in got.objects]
        leases = self._core.leases(self._call("Get", self._core.get_request(ks, promote, client_verifies)))
        views: list[Optional[ObjectView]] = []
        try:
            for lease in leases:
                views.append(None if lease is None else self._core.make_view(lease, self._release_one))
        except BaseException:
            self.release_many([v for v in views if v is not None])
            done = {v.lease_id for v in views if v is not None}
            rest = [x.lease_id for x in leases if x is not None and x.lease_id not in done]
            try:
                self._release_ids(rest)
            except KVStoreError:
                pass
            raise
        return views

    def get(self, key: KeyLike, *, promote: bool = True, client_verifies: bool = False) -> ObjectView:
        """Lease one key and map its bytes in place; UnknownKey on a miss (`client_verifies`
        as for get_many)."""
        view = self.get_many([key], promote=promote, client_verifies=client_verifies)[0]
        if view is None:
            raise UnknownKey(f"key {codec.key_text(as_key(key))!r} is not in the store")
        return view

    def get_tensors(self, key: KeyLike, *, promote: bool = True, verify: bool = False) -> TensorsView:
        """Lease one object-format blob and decode it: (header, name -> tensor), zero copy."""
        view = self.get(key, promote=promote)
        try:
            return decode_view(view, verify=verify)
        except BaseException:
            view.release()
            raise

    def release_many(self, views: Sequence[ObjectView]) -> None:
        """Release several views in one RPC."""
        ids = [i for i in (v.detach() for v in views) if i]  # 0: a wire view, no lease
        self._release_ids(ids)
