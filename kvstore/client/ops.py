"""The kvstore client's operations, written once for both faces (sans I/O).

Owns: every client call's logic (which requests to send, in which order, how replies
become results, the put flow's reserve -> write -> commit with abort on failure and
waits for other writers, get's lease-to-view mapping and its cleanup), as generators
that *yield steps* and receive each step's result. `KVStoreClient` (kvstore.client.sync)
and `AsyncKVStoreClient` (kvstore.client.aio) only say how a step is carried out, by
blocking or by awaiting, through `drive` / `drive_async`:

    Call(rpc, request, timeout)   one unary RPC; its reply is sent back, its failure (a
                                  kvstore.errors class) thrown in at the yield; a
                                  closed client fails it (skips it: `if_connected`)
    Health(timeout)               grpc.health.v1 Check; the raw reply bytes
    FastLookup(keys)              the fast Lookup socket; its answer, or None (use gRPC)
    Write(fn, region, size)       put's in-place write into a reserved region; the
                                  checksum (the async face runs large ones in a thread)

Request building and reply decoding stay in `ClientCore` (kvstore.client.common); lease
bookkeeping too. An operation's return value is the public method's result.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Generator, Mapping, Optional, Sequence, TypeVar

import xxhash

from kvstore import checksums as cks
from kvstore.client.common import (
    CONNECT_TIMEOUT_S, FUSED_HASH_MIN, PUT_ATTEMPTS, ClientCore, DaemonInfo, KeyLike, PutResult, ShowResult,
    as_bytes_view, as_key,
)
from kvstore.client.views import ObjectView, TensorsView, decode_view
from kvstore.errors import CapacityExhausted, KVStoreError, UnknownKey
from kvstore.records import LookupEntry, ObjectInfo, Region
from kvstore.rpc import codec
from kvstore.rpc import kvstore_pb2 as pb
from kvstore.rpc.service import HEALTH_SERVING, decode_health_status
from kvstore.tiers.registry import TIERS

T = TypeVar("T")


@dataclass(frozen=True)
class Call:
    rpc: str
    request: Any
    timeout: Optional[float] = None  # None: the client's timeout
    if_connected: bool = False  # on a closed client: skipped (None) rather than an error


@dataclass(frozen=True)
class Health:
    timeout: float


@dataclass(frozen=True)
class FastLookup:
    keys: list[bytes]


@dataclass(frozen=True)
class Write:
    fn: Callable[[Region], int]
    region: Region
    size: int


Step = Any  # Call | Health | FastLookup | Write
Op = Generator[Step, Any, T]
Release = Callable[[int], None]  # how a view's release() tells the daemon (the face decides)


def drive(op: Op[T], do: Callable[[Step], Any]) -> T:
    """Run `op` to its result, carrying out each step with `do` (blocking)."""
    send: Any = None
    exc: Optional[BaseException] = None
    while True:
        try:
            step = op.throw(exc) if exc is not None else op.send(send)
        except StopIteration as stop:
            return stop.value
        try:
            send, exc = do(step), None
        except BaseException as e:  # noqa: BLE001 - handed to the operation, which re-raises
            send, exc = None, e


async def drive_async(op: Op[T], do: Callable[[Step], Awaitable[Any]]) -> T:
    """`drive` for the asyncio face: each step is awaited."""
    send: Any = None
    exc: Optional[BaseException] = None
    while True:
        try:
            step = op.throw(exc) if exc is not None else op.send(send)
        except StopIteration as stop:
            return stop.value
        try:
            send, exc = await do(step), None
        except BaseException as e:  # noqa: BLE001 - handed to the operation, which re-raises
            send, exc = None, e


class ClientOps:
    """The operations of one client, over its `ClientCore` (module docstring)."""

    def __init__(self, core: ClientCore) -> None:
        self.core = core

    # ------------------------------------------------------------------ connection and leases

    def info(self) -> Op[DaemonInfo]:
        return self.core.set_info((yield Call("Info", pb.InfoRequest(), CONNECT_TIMEOUT_S)))

    def release_all(self) -> Op[None]:
        """On close: release every lease still held or queued (errors ignored)."""
        try:
            ids = self.core.take_pending() + self.core.held_ids()
            if ids:
                yield Call("Release", pb.ReleaseRequest(lease_ids=ids, client_id=self.core.client_id),
                           CONNECT_TIMEOUT_S)
        except KVStoreError:
            pass

    def flush_pending(self) -> Op[None]:
        """Send the releases that dropped views queued."""
        pending = self.core.take_pending()
        if pending:
            self.core.untrack(pending)
            yield Call("Release", pb.ReleaseRequest(lease_ids=pending, client_id=self.core.client_id))

    def keepalive_round(self) -> Op[None]:
        """The keepalive's body: queued releases, then a renew while leases are held.
        Errors are ignored (daemon gone or restarting; the next call reports it)."""
        try:
            yield from self.flush_pending()
            if self.core.holds_leases:
                yield from self.renew()
        except KVStoreError:
            pass

    def renew(self) -> Op[None]:
        yield Call("Renew", pb.RenewRequest(client_id=self.core.client_id))

    def release_ids(self, lease_ids: Sequence[int]) -> Op[None]:
        self.core.untrack(lease_ids)
        if lease_ids:
            yield Call("Release", pb.ReleaseRequest(lease_ids=list(lease_ids), client_id=self.core.client_id),
                       if_connected=True)

    def release_many(self, views: Sequence[ObjectView]) -> Op[None]:
        ids = [i for i in (v.detach() for v in views) if i]  # 0: a wire view, no lease
        yield from self.release_ids(ids)

    # ------------------------------------------------------------------ control plane

    def health(self, timeout: float) -> Op[bool]:
        return decode_health_status((yield Health(timeout))) == HEALTH_SERVING

    def lookup(self, keys: Sequence[KeyLike]) -> Op[list[LookupEntry]]:
        ks = self.core.lookup_keys(keys)
        found = yield FastLookup(ks)
        if found is not None:
            return self.core.found_lookups(ks, found)
        return self.core.lookups((yield Call("Lookup", pb.LookupRequest(keys=ks))))

    def lookup_grpc(self, keys: Sequence[KeyLike]) -> Op[list[LookupEntry]]:
        return self.core.lookups((yield Call("Lookup", self.core.lookup_request(keys))))

    def delete(self, keys: Sequence[KeyLike]) -> Op[int]:
        return (yield Call("Delete", pb.DeleteRequest(keys=[as_key(k) for k in keys]))).deleted

    def prefetch(self, keys: Sequence[KeyLike], tier: Optional[str]) -> Op[int]:
        return (yield Call("Prefetch", pb.PrefetchRequest(keys=[as_key(k) for k in keys], tier=tier or ""))).in_tier

    def evict(self, tier: str) -> Op[int]:
        return (yield Call("Evict", pb.EvictRequest(tier=tier))).moved

    def stats(self) -> Op[dict[str, Any]]:
        return codec.stats_from_pb((yield Call("Stats", pb.StatsRequest())))

    def arena_paths(self) -> Op[list[str]]:
        """Paths of the daemon's host-mapped arenas ([] over TCP: its memory is elsewhere)."""
        if self.core.remote:
            return []
        stats = yield from self.stats()
        return [t["path"] for t in stats.get("tiers", [])
                if t.get("name") in TIERS and TIERS.spec(t["name"]).host_mapped and t.get("path")]

    def list(self, fingerprint: Optional[str], prefix: Optional[KeyLike], tier: Optional[str],
             limit: Optional[int]) -> Op[list[ObjectInfo]]:
        return self.core.objects((yield Call("List", self.core.list_request(fingerprint, prefix, tier, limit))))

    def show(self, key: KeyLike) -> Op[ShowResult]:
        return self.core.show_result((yield Call("Show", pb.ShowRequest(key=as_key(key)))))

    def wait_for(self, key: KeyLike, timeout: float) -> Op[bool]:
        req = pb.WaitForRequest(key=as_key(key), timeout_s=timeout)
        return (yield Call("WaitFor", req, timeout + self.core.timeout)).present

    # ------------------------------------------------------------------ put

    def _put_wire(self, key: bytes, data: memoryview, tier: Optional[str], meta: pb.ObjectMeta) -> Op[PutResult]:
        """A put over TCP: the bytes travel in the request; the daemon writes and checksums them."""
        for _ in range(PUT_ATTEMPTS):
            res = yield Call("PutBytes", self.core.put_bytes_request(key, data, tier, meta))
            if res.status in ("stored", "exists"):
                return PutResult(key, res.tier, data.nbytes, res.status, res.checksum)
            if (yield from self.wait_for(key, self.core.timeout)):  # "in_flight": another client writes it
                return PutResult(key, res.tier, data.nbytes, "exists")
        raise CapacityExhausted(f"put of {key!r}: other writers kept aborting it ({PUT_ATTEMPTS} tries)")

    def _put(self, key: bytes, size: int, tier: Optional[str], meta: pb.ObjectMeta,
             write: Callable[[Region], int]) -> Op[PutResult]:
        core = self.core
        for _ in range(PUT_ATTEMPTS):
            res = yield Call("Reserve", core.reserve_request(key, size, tier, meta))
            if res.status == "exists":
                return PutResult(key, res.tier, size, "exists")
            if res.status == "in_flight":
                if (yield from self.wait_for(key, core.timeout)):
                    return PutResult(key, res.tier, size, "exists")
                continue  # the other writer gave up; try again
            region = codec.region_from_pb(res.region)
            try:
                checksum = yield Write(write, region, size)
                entry = yield Call("Commit", pb.CommitRequest(reservation_id=res.reservation_id, checksum=checksum,
                                                              client_id=core.client_id))
            except BaseException:
                try:
                    yield Call("Abort", pb.AbortRequest(reservation_id=res.reservation_id, client_id=core.client_id),
                               CONNECT_TIMEOUT_S)
                except KVStoreError:
                    pass  # already gone (e.g. commit failed and freed it); it expires anyway
                raise
            return PutResult(key, entry.entry.tier, size, "stored", checksum)
        raise CapacityExhausted(f"put of {key!r}: other writers kept aborting it ({PUT_ATTEMPTS} tries)")

    def put(self, key: KeyLike, data: Any, tier: Optional[str], fingerprint: str, token_count: int, cost: float,
            extra: Optional[Mapping[str, Any]]) -> Op[PutResult]:
        core = self.core
        k = as_key(key)
        mv = as_bytes_view(data)
        meta = core.meta_pb(fingerprint, token_count, cost, dict(extra) if extra else None)
        if core.remote:
            return (yield from self._put_wire(k, mv, tier, meta))

        def write(region: Region) -> int:
            if mv.nbytes <= FUSED_HASH_MIN:  # small: one copy, one hash call
                core.regions.write(region, mv)
                if cks.algorithm_of(mv[: cks.PREFIX_BYTES]) == cks.XXH3:
                    return xxhash.xxh3_64_intdigest(mv)
                return cks.host_checksum(mv)  # the bytes are a kvsum64 blob
            return core.regions.write_hashed(region, mv)  # large: hash while copying

        return (yield from self._put(k, mv.nbytes, tier, meta, write))

    def put_tensors(self, key: KeyLike, tensors: Mapping[str, Any], fingerprint: str, token_count: int,
                    tier: Optional[str], cost: float, meta: Optional[Mapping[str, Any]],
                    layers: Optional[Mapping[str, int]], extra: Optional[Mapping[str, Any]]) -> Op[PutResult]:
        from kvstore import format as fmt

        k = as_key(key)
        plan = fmt.plan_blob(tensors, fingerprint=fingerprint, token_count=token_count, meta=meta, layers=layers)
        m = self.core.meta_pb(fingerprint, token_count, cost, dict(extra) if extra else None)
        if self.core.remote:
            return (yield from self._put_wire(k, self.core.blob_bytes(plan, tensors), tier, m))
        return (yield from self._put(k, plan.total_size, tier, m, self.core.blob_writer(plan, tensors)))

    # ------------------------------------------------------------------ get

    def get_many(self, keys: Sequence[KeyLike], promote: bool, client_verifies: bool,
                 release: Release) -> Op[list[Optional[ObjectView]]]:
        core = self.core
        ks = [as_key(k) for k in keys]
        if core.remote:  # bytes over the wire, verified here
            got = yield Call("GetBytes", pb.GetBytesRequest(keys=ks, no_promote=not promote))
            return [core.wire_view(o) if o.found else None for o in got.objects]
        leases = core.leases((yield Call("Get", core.get_request(ks, promote, client_verifies))))
        views: list[Optional[ObjectView]] = []
        try:
            for lease in leases:
                views.append(None if lease is None else core.make_view(lease, release))
        except BaseException:
            done = {v.lease_id for v in views if v is not None}
            yield from self.release_many([v for v in views if v is not None])
            rest = [x.lease_id for x in leases if x is not None and x.lease_id not in done]
            try:
                yield from self.release_ids(rest)
            except KVStoreError:
                pass
            raise
        return views

    def get(self, key: KeyLike, promote: bool, client_verifies: bool, release: Release) -> Op[ObjectView]:
        view = (yield from self.get_many([key], promote, client_verifies, release))[0]
        if view is None:
            raise UnknownKey(f"key {codec.key_text(as_key(key))!r} is not in the store")
        return view

    def get_tensors(self, key: KeyLike, promote: bool, verify: bool, release: Release) -> Op[TensorsView]:
        view = yield from self.get(key, promote, False, release)
        try:
            return decode_view(view, verify=verify)
        except BaseException:
            yield from self.release_many([view])
            raise
