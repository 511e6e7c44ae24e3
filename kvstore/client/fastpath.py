"""The clients' side of the fast Lookup socket (`<socket>.fast`, kvstore.rpc.fastwire).

Owns: one persistent connection per client (a blocking socket for `KVStoreClient`, an
asyncio stream for `AsyncKVStoreClient`), opened on first use, dropped on any failure
and reopened on a later call, and the rule that makes the fast path invisible to callers:
`lookup(keys)` returns the daemon's per-key answer (None or (tier, size) per key), or
None whenever it cannot give one (no fast socket: TCP target, daemon run with
`--no-fast-lookup` or an older daemon; an I/O error; a timeout; an error frame). On None
the client asks over gRPC, which gives the answer or the canonical error, so results
and errors are the same on either path.

After a failed connect the fast path is not tried again for RETRY_S seconds, so a
daemon without the socket costs one stat per call at most, not a connect.
"""

from __future__ import annotations

import asyncio
import socket as _socket
import struct
import threading
import time
from pathlib import Path
from typing import Any, Optional

from kvstore.rpc import fastwire

RETRY_S = 1.0
_RECV = 1 << 16


def _fast_path(target: str) -> Optional[Path]:
    return fastwire.fast_socket_path(target[5:]) if target.startswith("unix:") else None


def _found(msg: Any, n: int) -> Optional[tuple]:
    """The reply's per-key list, or None for an error frame or anything malformed."""
    if type(msg) is dict:
        found = msg.get("found")
        if type(found) is tuple and len(found) == n:
            return found
    return None


class FastLookup:
    """The blocking client's fast Lookup connection (thread-safe: one request at a time)."""

    def __init__(self, target: str, timeout: float) -> None:
        self.path = _fast_path(target)
        self.timeout = timeout
        self._sock: Optional[_socket.socket] = None
        self._lock = threading.Lock()
        self._retry_at = 0.0

    @property
    def connected(self) -> bool:
        return self._sock is not None

    def lookup(self, keys: list[bytes]) -> Optional[tuple]:
        if self.path is None:
            return None
        with self._lock:
            sock = self._sock or self._connect()
            if sock is None:
                return None
            try:
                sock.sendall(fastwire.lookup_request(keys))
                msg = fastwire.decode(self._read(sock))
            except Exception:  # I/O error, timeout, closed by the daemon, garbage: gRPC answers this one
                self._drop()
                return None
        return _found(msg, len(keys))

    def _connect(self) -> Optional[_socket.socket]:
        assert self.path is not None
        if time.monotonic() < self._retry_at:
            return None
        sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(str(self.path))
            # Blocking calls bounded by the kernel (SO_RCVTIMEO/SO_SNDTIMEO) rather than
            # Python's timeout mode, which polls before every send and recv; a timeout
            # surfaces as an OSError (EAGAIN), handled like any other failure.
            tv = struct.pack("ll", int(self.timeout), int(self.timeout % 1 * 1e6))
            sock.setsockopt(_socket.SOL_SOCKET, _socket.SO_RCVTIMEO, tv)
            sock.setsockopt(_socket.SOL_SOCKET, _socket.SO_SNDTIMEO, tv)
            sock.settimeout(None)
        except OSError:
            sock.close()
            self._retry_at = time.monotonic() + RETRY_S
            return None
        self._sock = sock
        return sock

    @staticmethod
    def _read(sock: _socket.socket) -> memoryview:
        buf = sock.recv(_RECV)
        while len(buf) < fastwire.HEADER_SIZE:
            more = sock.recv(_RECV)
            if not more:
                raise ConnectionError("the daemon closed the fast socket")
            buf += more
        end = fastwire.HEADER_SIZE + fastwire.HEADER.unpack_from(buf)[0]
        if len(buf) < end:
            out = bytearray(buf)
            while len(out) < end:
                more = sock.recv(max(_RECV, end - len(out)))
                if not more:
                    raise ConnectionError("the daemon closed the fast socket mid-frame")
                out += more
            buf = bytes(out)
        if len(buf) != end:
            raise ConnectionError("the daemon sent more than one frame")
        return memoryview(buf)[fastwire.HEADER_SIZE:]

    def _drop(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None

    def close(self) -> None:
        with self._lock:
            self._drop()


class AsyncFastLookup:
    """The asyncio client's fast Lookup connection (one request at a time per client)."""

    def __init__(self, target: str, timeout: float) -> None:
        self.path = _fast_path(target)
        self.timeout = timeout
        self._reader: Optional[asyncio.StreamReader] = None
        self._writer: Optional[asyncio.StreamWriter] = None
        self._lock: Optional[asyncio.Lock] = None
        self._retry_at = 0.0

    @property
    def connected(self) -> bool:
        return self._writer is not None

    async def lookup(self, keys: list[bytes]) -> Optional[tuple]:
        if self.path is None:
            return None
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._writer is None and not await self._connect():
                return None
            reader, writer = self._reader, self._writer
            assert reader is not None and writer is not None
            try:
                async with asyncio.timeout(self.timeout):
                    writer.write(fastwire.lookup_request(keys))
                    head = await reader.readexactly(fastwire.HEADER_SIZE)
                    body = await reader.readexactly(fastwire.HEADER.unpack(head)[0])
                msg = fastwire.decode(body)
            except asyncio.CancelledError:  # the reply may still come: the stream is out of step
                self._drop()
                raise
            except Exception:
                self._drop()
                return None
        return _found(msg, len(keys))

    async def _connect(self) -> bool:
        assert self.path is not None
        if time.monotonic() < self._retry_at:
            return False
        try:
            async with asyncio.timeout(self.timeout):
                self._reader, self._writer = await asyncio.open_unix_connection(str(self.path))
        except (OSError, asyncio.TimeoutError):
            self._retry_at = time.monotonic() + RETRY_S
            return False
        return True

    def _drop(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._reader = self._writer = None

    async def close(self) -> None:
        writer = self._writer
        self._drop()
        if writer is not None:
            try:
                await writer.wait_closed()
            except Exception:
                pass


__all__ = ["FastLookup", "AsyncFastLookup", "RETRY_S"]
