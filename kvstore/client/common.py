"""The parts of the kvstore client that do not depend on sync vs asyncio: resolving where
the daemon listens, request building, put_tensors' in-place write step, response decoding,
lease bookkeeping, and the records the client API returns.

Owns: `ClientCore`, which `KVStoreClient` (sync) and `AsyncKVStoreClient` (asyncio)
both build on, so the two offer the same API with the same semantics; and the TCP
connection facts (the bearer token sent with every call, the TLS trust roots) and the
over-the-wire data path's views (a TCP client gets and sends bytes, never regions).
"""

from __future__ import annotations

import collections
import json
import os
import socket as _socket
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Optional, Sequence, Union

from kvstore.client.regions import RegionMapper
from kvstore.client.status import not_running
from kvstore.client.views import ObjectView
from kvstore.errors import BadObject, InvalidRequest, VersionMismatch
from kvstore.records import Lease, LookupEntry, ObjectInfo, Region
from kvstore.rpc import codec
from kvstore.rpc import kvstore_pb2 as pb
from kvstore.rpc.auth import bearer_metadata, read_pem, read_token_file
from kvstore.rpc.service import PROTOCOL_METADATA_KEY, PROTOCOL_VERSION

if TYPE_CHECKING:
    from kvstore.format import BlobPlan

KeyLike = Union[bytes, bytearray, memoryview, str]
DEFAULT_TIMEOUT_S = 30.0
CONNECT_TIMEOUT_S = 5.0
DEFAULT_MAX_MESSAGE = 64 << 20
METADATA = ((PROTOCOL_METADATA_KEY, str(PROTOCOL_VERSION)),)
PUT_ATTEMPTS = 8
# Puts larger than this hash their bytes while copying them into the region (one pass
# over memory, kvstore.client.regions.RegionMapper.write_hashed); smaller ones copy, then
# hash in one call (cheaper per call, and the bytes are in cache either way).
FUSED_HASH_MIN = 1 << 20


def as_key(key: KeyLike) -> bytes:
    """bytes of a key given as bytes-like or str (UTF-8)."""
    if isinstance(key, str):
        return key.encode()
    if isinstance(key, (bytes, bytearray, memoryview)):
        return bytes(key)
    raise InvalidRequest(f"a key must be bytes or str, got {type(key).__name__}")


def as_bytes_view(data: Any) -> memoryview:
    """A flat, contiguous byte memoryview of `data` (no copy); InvalidRequest otherwise."""
    try:
        mv = memoryview(data)
    except TypeError:
        raise InvalidRequest(f"put needs a bytes-like object, got {type(data).__name__} "
                             "(use put_tensors for tensors)") from None
    if not mv.contiguous:
        raise InvalidRequest("put needs a contiguous buffer")
    if mv.nbytes == 0:
        raise InvalidRequest("put of 0 bytes: objects must hold at least 1 byte")
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


def resolve_target(socket: Optional[Union[str, Path]] = None, tcp: Optional[str] = None) -> str:
    """The gRPC target: "unix:/abs/path" or "host:port". With neither given, the socket
    the daemon would use by default (KVSTORE_SOCKET, the config file, the per-user path)."""
    if tcp:
        from kvstore.config import parse_hostport

        host, port = parse_hostport(tcp, "tcp")
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if socket is None:
        from kvstore.config import load_config

        socket = load_config().socket
    return f"unix:{Path(socket).expanduser().absolute()}"


def check_reachable(target: str) -> None:
    """Fail fast with DaemonNotRunning when a unix socket does not exist at all."""
    if target.startswith("unix:"):
        path = target[5:]
        if not os.path.exists(path):
            raise not_running(target, "the socket does not exist")


@dataclass(frozen=True)
class DaemonInfo:
    protocol_version: int
    daemon_version: str
    pid: int
    lease_ttl_s: float
    max_message_bytes: int
    max_batch: int
    max_key_bytes: int
    tiers: tuple[str, ...]
    default_tier: str


@dataclass(frozen=True)
class PutResult:
    """What a put did: "stored" (this call wrote it) or "exists" (already there, or
    written concurrently by another client)."""

    key: bytes
    tier: str
    size: int
    status: str
    checksum: int = 0


@dataclass(frozen=True)
class ShowResult:
    info: ObjectInfo
    is_blob: bool
    header: Optional[dict[str, Any]]
    parts: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class TcpAuth:
    """How a TCP client proves itself: the token file (None: tcp_token_file from the
    config / KVSTORE_TCP_TOKEN_FILE) and, for a daemon serving TLS, the PEM bundle of
    the certificate authorities to trust."""

    token_file: Optional[Union[str, Path]] = None
    tls_ca: Optional[Union[str, Path]] = None


def _no_release(lease_id: int) -> None:
    """Views of wire bytes hold no lease."""


class ClientCore:
    """State and pure logic shared by the sync and asyncio clients."""

    def __init__(self, socket: Optional[Union[str, Path]], tcp: Optional[str], client_id: Optional[str],
                 timeout: float, max_message_size: int, auth: Optional[TcpAuth] = None) -> None:
        self.target = resolve_target(socket, tcp)
        # Over TCP the daemon is (maybe) on another host: bytes travel in messages.
        self.remote = not self.target.startswith("unix:")
        self.metadata: tuple[tuple[str, str], ...] = METADATA
        self.tls_ca: Optional[bytes] = None
        if self.remote:
            auth = auth or TcpAuth()
            token_file = auth.token_file
            if token_file is None:
                from kvstore.config import load_config

                token_file = load_config().tcp_token_file or None
            if token_file:
                self.metadata = METADATA + (bearer_metadata(read_token_file(token_file, "--tcp-token-file")),)
            if auth.tls_ca:
                self.tls_ca = read_pem(auth.tls_ca, "--tcp-tls-ca")
        self.client_id = client_id or f"{_socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.timeout = timeout
        self.max_message_size = max_message_size
        self.regions = RegionMapper()
        self.info: Optional[DaemonInfo] = None
        self._held: set[int] = set()
        self._held_lock = threading.Lock()
        self._pending: collections.deque[int] = collections.deque()

    def channel_credentials(self) -> Any:
        """grpc channel credentials for TLS, or None for a plain channel."""
        if self.tls_ca is None:
            return None
        import grpc

        return grpc.ssl_channel_credentials(root_certificates=self.tls_ca)

    # ------------------------------------------------------------------ leases

    def track(self, lease_id: int) -> None:
        with self._held_lock:
            self._held.add(lease_id)

    def untrack(self, lease_ids: Iterable[int]) -> None:
        with self._held_lock:
            self._held.difference_update(lease_ids)

    def queue_release(self, lease_id: int) -> None:
        """Called by a view's finalizer (any thread, possibly inside GC): defer the RPC."""
        self._pending.append(lease_id)

    def take_pending(self) -> list[int]:
        out = []
        while True:
            try:
                out.append(self._pending.popleft())
            except IndexError:
                return out

    def held_ids(self) -> list[int]:
        with self._held_lock:
            return list(self._held)

    @property
    def holds_leases(self) -> bool:
        return bool(self._held)

    @property
    def keepalive_interval(self) -> float:
        ttl = self.info.lease_ttl_s if self.info else 30.0
        return max(0.05, min(ttl / 3.0, 10.0))

    # ------------------------------------------------------------------ requests

    @staticmethod
    def meta_pb(fingerprint: str, token_count: int, cost: float, extra: Optional[dict[str, Any]]) -> pb.ObjectMeta:
        return pb.ObjectMeta(fingerprint=fingerprint, token_count=int(token_count), cost=float(cost),
                             extra_json=json.dumps(extra, sort_keys=True) if extra else "")

    def reserve_request(self, key: bytes, size: int, tier: Optional[str], meta: pb.ObjectMeta) -> pb.ReserveRequest:
        return pb.ReserveRequest(key=key, size=size, tier=tier or "", meta=meta, client_id=self.client_id)

    def get_request(self, keys: Sequence[bytes], promote: bool, client_verifies: bool = False) -> pb.GetRequest:
        return pb.GetRequest(keys=list(keys), client_id=self.client_id, no_promote=not promote,
                             client_verifies=client_verifies)

    def blob_writer(self, plan: "BlobPlan", tensors: Mapping[str, Any]) -> Callable[[Region], int]:
        """put_tensors' write step: lay `tensors` out by `plan` straight into a reserved
        region (no intermediate copy) and return the blob's checksum."""
        from kvstore import format as fmt

        def write(region: Region) -> int:
            import torch

            if region.kind == "cuda_ipc":
                buf: Any = self.regions.cuda_tensor(region)
            else:
                buf = torch.from_numpy(self.regions.host_array(region, writable=True))
                self.regions.pin_arena_of(region, for_write=True)  # copies from a GPU tensor then run pinned
            checksum = fmt.write_blob(buf, plan, tensors)
            if region.kind == "cuda_ipc":
                torch.cuda.current_stream(buf.device).synchronize()
            return checksum

        return write

    # ------------------------------------------------------------------ responses

    def set_info(self, m: pb.InfoResponse) -> DaemonInfo:
        if m.protocol_version != PROTOCOL_VERSION:
            raise VersionMismatch(f"the daemon at {self.target} speaks kvstore protocol {m.protocol_version}, "
                                  f"this client speaks {PROTOCOL_VERSION}; upgrade the older side")
        self.info = DaemonInfo(
            protocol_version=m.protocol_version, daemon_version=m.daemon_version, pid=m.pid,
            lease_ttl_s=m.lease_ttl_s, max_message_bytes=m.max_message_bytes, max_batch=m.max_batch,
            max_key_bytes=m.max_key_bytes, tiers=tuple(m.tiers), default_tier=m.default_tier,
        )
        return self.info

    def make_view(self, lease: Lease, release: Any) -> ObjectView:
        """Map a lease's region and wrap it (tracks the lease until released)."""
        self.track(lease.lease_id)
        try:
            if lease.region.kind == "cuda_ipc":
                host, device = None, self.regions.cuda_tensor(lease.region)
            else:
                host, device = self.regions.host_array(lease.region, writable=False), None
        except BaseException:
            self.untrack([lease.lease_id])
            self.queue_release(lease.lease_id)
            raise
        return ObjectView(lease, host, device, release, self.queue_release,
                          before_tensor=lambda: self.regions.pin_arena_of(lease.region),
                          before_host=(lambda: self.regions.prefetch(lease.region))
                          if lease.region.kind == "file" else None)

    def put_bytes_request(self, key: bytes, data: memoryview, tier: Optional[str],
                          meta: pb.ObjectMeta) -> pb.PutBytesRequest:
        return pb.PutBytesRequest(key=key, data=bytes(data), tier=tier or "", meta=meta, client_id=self.client_id)

    @staticmethod
    def wire_view(o: pb.ObjectBytes) -> ObjectView:
        """A view over bytes that came over the wire (GetBytes), checked against the
        checksum the daemon recorded: BadObject when they differ. It holds no lease."""
        import numpy as np

        from kvstore.checksums import host_checksum

        data = o.data
        actual = host_checksum(data)
        if actual != o.checksum:
            raise BadObject(f"object {codec.key_text(o.key)!r}: the {len(data)} bytes received hash to "
                            f"{actual:#018x}, the daemon recorded {o.checksum:#018x}")
        lease = Lease(0, o.key, o.tier, Region("wire", "", 0, len(data)), len(data), o.checksum, float("inf"),
                      codec.meta_from_pb(o.meta))
        return ObjectView(lease, np.frombuffer(data, dtype=np.uint8), None, _no_release, _no_release)

    @staticmethod
    def blob_bytes(plan: "BlobPlan", tensors: Mapping[str, Any]) -> memoryview:
        """put_tensors over the wire: the blob laid out in a local buffer."""
        import torch

        from kvstore import format as fmt

        buf = torch.empty(plan.total_size, dtype=torch.uint8)
        fmt.write_blob(buf, plan, tensors)
        return memoryview(buf.numpy())

    @staticmethod
    def leases(m: pb.GetResponse) -> list[Optional[Lease]]:
        return [codec.lease_from_pb(x) for x in m.leases]

    @staticmethod
    def lookups(m: pb.LookupResponse) -> list[LookupEntry]:
        return [LookupEntry(e.key, e.hit, e.tier or None, e.size) for e in m.entries]  # codec's, inlined

    @staticmethod
    def lookup_keys(keys: Sequence[KeyLike]) -> list[bytes]:
        return [k if type(k) is bytes else as_key(k) for k in keys]

    @staticmethod
    def lookup_request(keys: Sequence[KeyLike]) -> pb.LookupRequest:
        return pb.LookupRequest(keys=[k if type(k) is bytes else as_key(k) for k in keys])

    @staticmethod
    def found_lookups(keys: Sequence[bytes], found: Sequence[Any]) -> list[LookupEntry]:
        """The fast socket's answer (None or (tier, size) per key) as `lookups` gives it."""
        return [LookupEntry(k, True, f[0], f[1]) if f else LookupEntry(k, False, None, 0) for k, f in zip(keys, found)]

    @staticmethod
    def objects(m: pb.ListResponse) -> list[ObjectInfo]:
        return [codec.object_info_from_pb(o) for o in m.objects]

    @staticmethod
    def show_result(m: pb.ShowResponse) -> ShowResult:
        return ShowResult(
            info=codec.object_info_from_pb(m.info), is_blob=m.is_blob,
            header=json.loads(m.header_json) if m.header_json else None,
            parts=[{"name": p.name, "layer": p.layer, "dtype": p.dtype, "shape": list(p.shape), "offset": p.offset,
                    "length": p.length} for p in m.parts],
        )

    @staticmethod
    def list_request(fingerprint: Optional[str], prefix: Optional[KeyLike], tier: Optional[str],
                     limit: Optional[int]) -> pb.ListRequest:
        return pb.ListRequest(fingerprint=fingerprint or "", prefix=as_key(prefix) if prefix else b"",
                              tier=tier or "", limit=int(limit or 0))

