"""The Mooncake Store adapter of the remote tier.

Owns: parsing `mooncake://MASTER_HOST:PORT?metadata=URL&protocol=tcp[&...]` into a
`MooncakeTarget`, and `MooncakeAdapter`, a `BlockingAdapter` over Mooncake's Python
client (`mooncake.store.MooncakeDistributedStore`, from the mooncake-transfer-engine
wheels: the `remote` extra).

The daemon joins the Mooncake cluster as one client: it mounts a segment of its own
memory into the cluster's pool (`segment=`, default 256MiB; 0 contributes nothing and
only uses what other clients and `mooncake_store_service` processes give) and moves
bytes with the transfer engine (`protocol=tcp`, or `rdma` with `device=`). Objects are
written and read straight from and into the caller's buffers (the CPU arena) in one
call per batch: `batch_put_from_multi_buffers` and `batch_get_into_multi_buffers`, the
calls LMCache's and SGLang HiCache's Mooncake backends use, or, for a batch of one
object in one range (the envelope's trailer in the slot's tail room), `put_from` /
`get_into`, the single-object calls, a few percent cheaper at 1-4 MiB. Mooncake makes
an object visible only when its put completed (PutStart / PutEnd at the master), so a
half-written object is never read.

Chunked reads: a get of one object in one range larger than `read_split` (default 3MiB)
or than `read_chunk` (default 8MiB), whichever is smaller, asks the master for the
object's replica once (`batch_get_session_start`), reads it in order in pieces of at
most `read_chunk`, at least two (`piece_bytes`: as many as that takes, of even size, so
a 4 MiB object with its trailer is two pieces of about 2 MiB and a 16 MiB one three of
about 5.3 MiB, not two of 8 MiB and a runt) with `batch_get_into_multi_buffer_ranges`
(ranged reads from that replica, into any memory on TCP), calls the item's `landed`
after each, so the remote tier hashes each piece right after it landed, and ends the
session. On loopback TCP this measured -23..+5% against one unverified `get_into` of a
16-64 MiB object and -29..+10% at 4 MiB, verification included (tools/bench_remote.py,
docs/remote.md); objects of 1 MiB read slower in pieces than in one get. Over RDMA it
is untested. Two gets of one name
at once on one client share Mooncake's session for it: one ending it can fail the
other's remaining pieces (an error, counted; the checksum means never wrong bytes).

URL parameters: `metadata` (the metadata server, e.g. the master's embedded one at
`http://HOST:8080/metadata`; default that URL on the master's host), `protocol` (tcp),
`device` (RDMA devices), `host` (the address this client advertises to peers; default
127.0.0.1 for a loopback master, else this host's name), `segment` and `buffer` (sizes:
the mounted segment and the client's staging buffer), `read_chunk` (the largest piece
of a chunked read, above; 0: every get in one call), `read_split` (objects larger than
this are read in at least two pieces, above), `namespace` (prefix of object
names; default `kvstore`), `rpc_timeout` (seconds, default 1.0: Mooncake's bound on each
request to the master, `MC_RPC_TIMEOUT_MS`, whose own default is 30 s; an environment
that sets MC_RPC_TIMEOUT_MS keeps its value).

Because that bound makes every blocking call end by itself (a hung master answers
TIMED_OUT after it), `inline_bound_s` is twice it and the remote tier's synchronous
calls (`call`, from a daemon worker thread) run on the caller's thread, with no hand-off
to the adapter's workers, whenever that is within the tier's timeout.

Mooncake's own health_check answers 0 even when the master is down, so the probe asks
`batch_is_exist` for one name instead (RPC_FAIL = -900 while the master is away). A
restarted master has lost its objects (no HA without etcd); the client re-registers
with it by itself, which the probe sees. A daemon started while no master answers does
not wait for it (Mooncake's setup fails only after ~90 s): it serves its local tiers
with the remote tier unreachable and keeps joining in the background.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence
from urllib.parse import parse_qs, urlsplit

from kvstore.config import ConfigError, parse_size
from kvstore.remote.base import FAILED, NOT_FOUND, UNREACHABLE, BlockingAdapter, GetItem, PutItem, RemoteConfigError

log = logging.getLogger(__name__)

SCHEME = "mooncake"
_PARAMS = ("metadata", "protocol", "device", "host", "segment", "buffer", "namespace", "rpc_timeout",
           "read_chunk", "read_split")
RPC_TIMEOUT_ENV = "MC_RPC_TIMEOUT_MS"  # Mooncake's bound on each RPC to the master (its default: 30 s)
PROTOCOLS = ("tcp", "rdma")
MIN_READ_CHUNK = 64 << 10  # smallest `read_chunk`: each piece is one transfer of its own


@dataclass(frozen=True)
class MooncakeTarget:
    """Where and how to join a Mooncake cluster (module docstring: the URL parameters)."""

    master: str  # HOST:PORT of mooncake_master's RPC service
    metadata: str
    protocol: str = "tcp"
    device: str = ""
    local_hostname: str = "127.0.0.1"
    segment_bytes: int = 256 << 20
    buffer_bytes: int = 16 << 20
    namespace: str = "kvstore"
    rpc_timeout_s: float = 1.0  # each master RPC (MC_RPC_TIMEOUT_MS, unless the environment sets it)
    read_chunk_bytes: int = 8 << 20  # the largest piece of a chunked get (module docstring); 0: never chunk
    read_split_bytes: int = 3 << 20  # gets of one range larger than this (or than read_chunk) are chunked

    @classmethod
    def from_url(cls, url: str) -> "MooncakeTarget":
        """Parse a mooncake:// URL; RemoteConfigError naming the bad part."""
        u = urlsplit(url.strip())
        if u.scheme != SCHEME:
            raise RemoteConfigError(f"remote URL {url!r}: scheme must be {SCHEME}://, got {u.scheme or 'none'!r}")
        try:
            host, port = u.hostname, u.port
        except ValueError as exc:
            raise RemoteConfigError(f"remote URL {url!r}: bad port ({exc})") from None
        if not host or not port:
            raise RemoteConfigError(f"remote URL {url!r}: expected mooncake://MASTER_HOST:PORT?metadata=URL")
        q = parse_qs(u.query, keep_blank_values=True)
        for name, values in q.items():
            if name not in _PARAMS:
                raise RemoteConfigError(f"remote URL {url!r}: unknown parameter {name!r} (known: {', '.join(_PARAMS)})")
            if len(values) != 1:
                raise RemoteConfigError(f"remote URL {url!r}: parameter {name!r} given {len(values)} times")
        p = {k: v[0] for k, v in q.items()}
        protocol = p.get("protocol", "tcp").lower()
        if protocol not in PROTOCOLS:
            raise RemoteConfigError(f"remote URL {url!r}: protocol {protocol!r} is not one of {', '.join(PROTOCOLS)}")
        metadata = p.get("metadata") or f"http://{_bracket(host)}:8080/metadata"
        if not metadata.startswith(("http://", "https://", "etcd://", "redis://")) and "://" in metadata:
            raise RemoteConfigError(f"remote URL {url!r}: metadata {metadata!r} is not an http/etcd/redis URL")
        try:
            seg = parse_size(p.get("segment", 256 << 20), "segment")
            buf = parse_size(p.get("buffer", 16 << 20), "buffer")
            chunk = parse_size(p.get("read_chunk", 8 << 20), "read_chunk")
            split = parse_size(p.get("read_split", 3 << 20), "read_split")
        except ConfigError as exc:
            raise RemoteConfigError(f"remote URL {url!r}: {exc}") from None
        if 0 < chunk < MIN_READ_CHUNK:
            raise RemoteConfigError(f"remote URL {url!r}: read_chunk must be 0 (off) or at least "
                                    f"{MIN_READ_CHUNK >> 10}KiB, got {chunk} bytes")
        if split < MIN_READ_CHUNK:
            raise RemoteConfigError(f"remote URL {url!r}: read_split must be at least {MIN_READ_CHUNK >> 10}KiB, "
                                    f"got {split} bytes")
        try:
            rpc_timeout = float(p.get("rpc_timeout", 1.0))
        except ValueError:
            raise RemoteConfigError(f"remote URL {url!r}: rpc_timeout must be seconds, got {p['rpc_timeout']!r}") from None
        if not 0.01 <= rpc_timeout <= 600:
            raise RemoteConfigError(f"remote URL {url!r}: rpc_timeout must be 0.01..600 seconds, got {rpc_timeout:g}")
        ns = p.get("namespace", "kvstore")
        if not ns or "/" in ns:
            raise RemoteConfigError(f"remote URL {url!r}: namespace must be non-empty and without '/', got {ns!r}")
        return cls(f"{_bracket(host)}:{port}", metadata, protocol, p.get("device", ""),
                   p.get("host") or _default_local_host(host), seg, buf, ns, rpc_timeout, chunk, split)


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _default_local_host(master_host: str) -> str:
    try:
        if ipaddress.ip_address(master_host).is_loopback:
            return "127.0.0.1"
    except ValueError:
        if master_host == "localhost":
            return "127.0.0.1"
    return socket.gethostname()


def piece_bytes(size: int, read_chunk: int, read_split: int = 0) -> int:
    """The piece size a chunked read of a `size`-byte object uses (module docstring):
    `size` itself (one get) when `read_chunk` is 0 or `size` is at most `read_split` and
    at most `read_chunk` (`read_split` 0: `read_chunk` alone decides); otherwise the
    object over as many pieces as `read_chunk` needs, at least two, evenly (rounded up to
    4 KiB, at most `read_chunk`), so the last piece is no runt."""
    if read_chunk <= 0 or size <= (min(read_split, read_chunk) if read_split > 0 else read_chunk):
        return size
    per = -(-size // max(2, -(-size // read_chunk)))
    return min(read_chunk, -(-per // 4096) * 4096)


def load_client_class() -> Any:
    """Mooncake's client class; RemoteConfigError saying how to install it when absent."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        raise RemoteConfigError(
            f"the mooncake remote tier needs the Mooncake Store client ({exc}); install the remote extra "
            "(pip install 'hypercache[remote]', i.e. mooncake-transfer-engine-non-cuda, or "
            "mooncake-transfer-engine on CUDA hosts) and the libibverbs1 librdmacm1 libnuma1 packages"
        ) from None
    return MooncakeDistributedStore


class MooncakeAdapter(BlockingAdapter):
    """The remote tier on Mooncake Store (module docstring)."""

    kind = "mooncake"

    def __init__(self, target: MooncakeTarget, workers: int = 4, probe_interval_s: float = 0.5,
                 connect_wait_s: float = 10.0, client_class: Any = None) -> None:
        """Join the cluster, waiting up to `connect_wait_s` for it; when that does not
        succeed (no master yet: Mooncake's setup then fails only after ~90 s), start
        unreachable and keep joining in the background (the probe), so the daemon serves
        its local tiers meanwhile. `client_class` (tests) stands in for Mooncake's."""
        cls = client_class if client_class is not None else load_client_class()
        super().__init__(workers=workers, probe_interval_s=probe_interval_s)
        self.target = target
        self.namespace = target.namespace
        self._cls = cls
        # A put asks the master twice (start, end), a get once or twice; the bytes move
        # by the transfer engine, bounded by its own progress timeouts. So every call is
        # bounded by the client itself, and `call` runs it on the caller's thread.
        self.inline_bound_s = 2 * self._rpc_timeout(target)
        self._client: Any = None
        self._closed = False
        self._join_lock = threading.Lock()
        self.join_failures = 0
        self._joiner: Optional[threading.Thread] = None
        self._start_join()
        assert self._joiner is not None
        self._joiner.join(connect_wait_s)
        if self._client is None:
            log.warning("not joined to the Mooncake cluster at master %s (metadata %s) after %.0f s; serving the "
                        "local tiers and joining in the background", target.master, target.metadata, connect_wait_s)
            self._mark_unreachable()
        self._probe_name = f"{target.namespace}/__probe__"

    @staticmethod
    def _rpc_timeout(target: MooncakeTarget) -> float:
        """Set Mooncake's RPC timeout from the target unless the environment already does
        (it is process-wide and read when a client joins); the seconds in force."""
        raw = os.environ.setdefault(RPC_TIMEOUT_ENV, str(max(1, round(target.rpc_timeout_s * 1000))))
        try:
            return max(0.001, int(raw) / 1000)
        except ValueError:
            raise RemoteConfigError(f"{RPC_TIMEOUT_ENV}={raw!r} is not a whole number of milliseconds") from None

    def _start_join(self) -> None:
        with self._join_lock:
            if self._joiner is not None and self._joiner.is_alive():
                return
            self._joiner = threading.Thread(target=self._join, name="kvstore-remote-join", daemon=True)
            self._joiner.start()

    def _join(self) -> None:
        t = self.target
        client = self._cls()
        rc = client.setup(t.local_hostname, t.metadata, t.segment_bytes, t.buffer_bytes, t.protocol, t.device,
                          t.master)
        with self._join_lock:
            if rc == 0 and not self._closed:
                self._client = client
                log.info("joined the Mooncake cluster at master %s", t.master)
                return
            self.join_failures += rc != 0
        if rc != 0:
            log.warning("joining the Mooncake cluster at master %s failed (setup returned %s)", t.master, rc)
        try:
            client.close()
        except Exception as exc:  # noqa: BLE001 - a client that never joined
            log.debug("closing an unjoined Mooncake client: %s", exc)

    @property
    def client(self) -> Any:
        """The joined Mooncake client (None until joined, and after close): for tools
        that compare against driving it directly."""
        return self._client

    def stat_now(self, names: Sequence[str]) -> list[int]:
        c = self._client
        if c is None:
            return [UNREACHABLE] * len(names)
        found = c.batch_is_exist(list(names))
        out: list[int] = []
        for name, f in zip(names, found):
            if f == 1:
                out.append(int(c.get_size(name)))
            elif f == 0:
                out.append(NOT_FOUND)
            else:
                out.append(int(f) if f < -1 else -1)
        return out

    def get_now(self, items: Sequence[GetItem]) -> list[int]:
        c = self._client
        if c is None:
            return [UNREACHABLE] * len(items)
        if len(items) == 1 and len(items[0].ranges) == 1:  # the single-object call: cheaper than a batch one
            ((addr, n),) = items[0].ranges
            return [self.get_one_now(items[0].name, addr, n, items[0].landed)]
        return list(c.batch_get_into_multi_buffers(
            [i.name for i in items], [[a for a, _ in i.ranges] for i in items],
            [[n for _, n in i.ranges] for i in items]))

    def get_one_now(self, name: str, addr: int, n: int, landed: Optional[Callable[[int], None]] = None) -> int:
        c = self._client
        if c is None:
            return UNREACHABLE
        t = self.target
        if 0 < t.read_chunk_bytes and (n > t.read_chunk_bytes or n > t.read_split_bytes):
            return self._get_chunked(c, name, addr, n, landed)
        return c.get_into(name, addr, n)

    def _get_chunked(self, c: Any, name: str, addr: int, n: int, landed: Optional[Callable[[int], None]]) -> int:
        """One object read in pieces (`piece_bytes`) from one replica lookup, `landed`
        called after each (module docstring); bytes read, or a negative code."""
        code = int(c.batch_get_session_start([name])[0])
        if code != 0:
            return code if code < 0 else FAILED
        step = piece_bytes(n, self.target.read_chunk_bytes, self.target.read_split_bytes)
        try:
            for off in range(0, n, step):
                ln = min(step, n - off)
                got = int(c.batch_get_into_multi_buffer_ranges([name], [[addr + off]], [[ln]], [[off]])[0])
                if got != ln:
                    return got if got < 0 else FAILED
                if landed is not None:
                    landed(off + ln)
            return n
        finally:
            c.batch_get_session_end([name])

    def put_now(self, items: Sequence[PutItem]) -> list[int]:
        c = self._client
        if c is None:
            return [UNREACHABLE] * len(items)
        if len(items) == 1 and len(items[0].ranges) == 1:  # the single-object call: cheaper than a batch one
            ((addr, n),) = items[0].ranges
            return [self.put_one_now(items[0].name, addr, n)]
        codes = c.batch_put_from_multi_buffers(
            [i.name for i in items], [[a for a, _ in i.ranges] for i in items],
            [[n for _, n in i.ranges] for i in items])
        return [i.size if c == 0 else int(c) for i, c in zip(items, codes)]

    def put_one_now(self, name: str, addr: int, n: int) -> int:
        c = self._client
        if c is None:
            return UNREACHABLE
        code = c.put_from(name, addr, n)
        return n if code == 0 else code

    def remove_now(self, names: Sequence[str]) -> list[int]:
        c = self._client
        if c is None:
            return [UNREACHABLE] * len(names)
        return [int(c.remove(n, True)) for n in names]

    def probe_now(self) -> bool:
        c = self._client
        if c is None:  # not joined yet: (re)start joining, answer later
            self._start_join()
            return False
        return c.batch_is_exist([self._probe_name])[0] in (0, 1)

    def close(self) -> None:
        super().close()
        with self._join_lock:
            self._closed = True
            client, self._client = self._client, None
        if client is None:
            return
        if not self.reachable():
            # Unmounting asks the master, holding the GIL: with a hung master that froze
            # the whole process for over a minute. Leave the client to the process's end.
            log.warning("the Mooncake master is not answering: leaving the client unclosed")
            _ABANDONED.append(client)
            return
        try:
            client.close()
        except Exception as exc:  # noqa: BLE001 - closing is best effort
            log.warning("closing the Mooncake client failed: %s", exc)


_ABANDONED: list[Any] = []  # clients not closed (their destructor would block on the master)
