"""The daemon's fast Lookup socket: `<socket>.fast`, served on the daemon's event loop.

Owns: the asyncio unix-socket server for the msgpack Lookup protocol of
kvstore.rpc.fastwire (binding with mode 0600, an asyncio.Protocol per connection that
cuts frames out of the stream, checks them and answers in order, error frames) and its
shutdown (close every connection, remove the file). A Protocol rather than streams: no
coroutine per request, which is most of the socket's cost at this size.

A Lookup here does the same work as the gRPC one (`KVStoreServicer.presence`: the same
key checks and messages, the lock-free probe on the loop, a worker thread when the
store's lock is busy) and records the same per-RPC latency/error metrics under "Lookup".
What it saves is gRPC's per-call cost. A bad frame gets an error frame naming the
problem; a frame over the size limit also closes its connection (the stream cannot be
resynchronised without reading it). Nothing a client sends stops the server.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path
from typing import Any, Optional

from kvstore import errors
from kvstore.rpc import fastwire
from kvstore.rpc.service import PROTOCOL_VERSION
from kvstore.server.servicer import BUSY, KVStoreServicer

log = logging.getLogger("kvstore.server")

_INVALID = errors.InvalidRequest.code


class FastLookupServer:
    """The fast Lookup socket of one daemon. `start()` and `stop()` run on the daemon's loop."""

    def __init__(self, servicer: KVStoreServicer, path: Path, max_frame: int) -> None:
        self.servicer = servicer
        self.path = Path(path)
        self.max_frame = max_frame
        self._server: Optional[asyncio.AbstractServer] = None
        self.connections: set["_Connection"] = set()

    async def start(self) -> None:
        if self.path.exists() or self.path.is_symlink():
            self.path.unlink()  # stale: the daemon holds the socket lock, so no live daemon owns it
        loop = asyncio.get_running_loop()
        old_umask = os.umask(0o177)
        try:
            self._server = await loop.create_unix_server(lambda: _Connection(self), path=str(self.path))
        finally:
            os.umask(old_umask)
        os.chmod(self.path, 0o600)

    async def stop(self) -> None:
        """Stop accepting, close every connection (replies already written are flushed;
        a lookup waiting for the store's lock is answered into a closed connection),
        remove the socket file."""
        if self._server is not None:
            self._server.close()
            for conn in list(self.connections):
                conn.close()
            try:
                await asyncio.wait_for(self._server.wait_closed(), 2.0)
            except (asyncio.TimeoutError, Exception):
                for conn in list(self.connections):
                    conn.abort()
            self._server = None
        try:
            if self.path.is_socket():
                self.path.unlink()
        except OSError:
            pass

    # ------------------------------------------------------------------ requests

    def answer_now(self, body: bytes, start: float) -> Any:
        """The reply frame to one request frame's payload, or the request's keys when the
        store's lock is busy (then `answer_later` answers it from a worker thread)."""
        try:
            keys = self._parse(body)
            found = self.servicer.presence(keys, False)
            if found is BUSY:
                return keys
            reply = fastwire.lookup_reply(found)
            code: Optional[str] = None
        except Exception as exc:
            code, reply = self._error(exc)
        self.servicer.metrics.observe("Lookup", time.perf_counter() - start, code)
        return reply

    async def answer_later(self, keys: Any, start: float) -> bytes:
        code: Optional[str] = None
        try:
            loop = asyncio.get_running_loop()
            found = await loop.run_in_executor(self.servicer.executor, self.servicer.presence, keys, True)
            return fastwire.lookup_reply(found)
        except Exception as exc:
            code, reply = self._error(exc)
            return reply
        finally:
            self.servicer.metrics.observe("Lookup", time.perf_counter() - start, code)

    @staticmethod
    def _error(exc: Exception) -> tuple[str, bytes]:
        if isinstance(exc, errors.KVStoreError):
            return exc.code, fastwire.error_reply(exc.code, str(exc))
        log.error("fast Lookup failed with an unexpected error", exc_info=exc)  # a bug: report it, keep serving
        return "INTERNAL", fastwire.error_reply(errors.KVStoreError.code,
                                                f"internal error in Lookup: {type(exc).__name__}: {exc}")

    @staticmethod
    def _parse(body: bytes) -> Any:
        """The keys of a lookup request; InvalidRequest naming what is wrong."""
        try:
            msg = fastwire.decode(body)
        except Exception as exc:
            raise errors.InvalidRequest(f"frame of {len(body)} bytes is not one msgpack value: "
                                        f"{type(exc).__name__}: {exc}") from None
        if not isinstance(msg, dict):
            raise errors.InvalidRequest(f"a request must be a msgpack map, got {type(msg).__name__}")
        version = msg.get("v")
        if version != PROTOCOL_VERSION:
            raise errors.VersionMismatch(f"client speaks kvstore protocol {version!r}, this daemon speaks "
                                         f"{PROTOCOL_VERSION}; upgrade the older side")
        op = msg.get("op")
        if op != fastwire.OP_LOOKUP:
            raise errors.InvalidRequest(f"unknown op {op!r}; the fast socket serves only {fastwire.OP_LOOKUP!r}")
        keys = msg.get("keys")
        if not isinstance(keys, tuple):
            raise errors.InvalidRequest(f"keys must be an array of bin keys, got {type(keys).__name__}")
        for i, k in enumerate(keys):
            if type(k) is not bytes:
                raise errors.InvalidRequest(f"keys[{i}] is {type(k).__name__}, expected bin (bytes)")
        return keys


class _Connection(asyncio.Protocol):
    """One client connection: frames are cut out of the byte stream and answered in
    order, on the loop; while a lookup waits for a worker thread (the store's lock was
    busy) or the client does not read its replies, reading pauses."""

    def __init__(self, server: FastLookupServer) -> None:
        self.server = server
        self.transport: Optional[asyncio.Transport] = None
        self.buf = bytearray()
        self.waiting = False  # a lookup is on a worker thread
        self.write_paused = False
        self.closing = False

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.server.connections.add(self)

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self.server.connections.discard(self)
        self.transport = None
        self.buf.clear()

    def close(self) -> None:
        self.closing = True
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    def pause_writing(self) -> None:
        self.write_paused = True
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        self.write_paused = False
        if self.transport is not None and not self.waiting:
            self.transport.resume_reading()
            self._drain()

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if not self.waiting and not self.write_paused:
            self._drain()

    def _drain(self) -> None:
        """Answer every whole frame in the buffer (stops at a lookup sent to a thread)."""
        buf, server = self.buf, self.server
        hs = fastwire.HEADER_SIZE
        while len(buf) >= hs and self.transport is not None and not self.closing:
            (n,) = fastwire.HEADER.unpack_from(buf)
            if n > server.max_frame:
                self.transport.write(fastwire.error_reply(
                    _INVALID, f"frame of {n} bytes is over the limit of {server.max_frame}; closing the connection"))
                self.close()
                return
            if len(buf) < hs + n:
                return
            start = time.perf_counter()
            body = bytes(buf[hs:hs + n])
            del buf[:hs + n]
            out = server.answer_now(body, start)
            if type(out) is bytes:
                self.transport.write(out)
                continue
            self.waiting = True
            self.transport.pause_reading()
            asyncio.get_running_loop().create_task(self._answer_later(out, start))
            return

    async def _answer_later(self, keys: Any, start: float) -> None:
        try:
            reply = await self.server.answer_later(keys, start)
        finally:
            self.waiting = False
        if self.transport is not None and not self.closing:
            self.transport.write(reply)
            if not self.write_paused:
                self.transport.resume_reading()
                self._drain()


__all__ = ["FastLookupServer"]
