"""The daemon's fast Lookup socket: `<socket>.fast`, served on the daemon's event loop.

Owns: the asyncio unix-socket server for the msgpack Lookup protocol of
kvstore.rpc.fastwire (binding with mode 0600, one reader task per connection, frame
checks, error frames) and its shutdown (close every connection, remove the file).

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
_WRITE_HIGH_WATER = 1 << 20  # drain a connection's writer only past this many buffered bytes


class FastLookupServer:
    """The fast Lookup socket of one daemon. `start()` and `stop()` run on the daemon's loop."""

    def __init__(self, servicer: KVStoreServicer, path: Path, max_frame: int) -> None:
        self.servicer = servicer
        self.path = Path(path)
        self.max_frame = max_frame
        self._server: Optional[asyncio.AbstractServer] = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        if self.path.exists() or self.path.is_symlink():
            self.path.unlink()  # stale: the daemon holds the socket lock, so no live daemon owns it
        old_umask = os.umask(0o177)
        try:
            self._server = await asyncio.start_unix_server(self._serve, path=str(self.path))
        finally:
            os.umask(old_umask)
        os.chmod(self.path, 0o600)

    async def stop(self) -> None:
        """Stop accepting, close every connection (a request being answered finishes
        first only if it is already past its store call), remove the socket file."""
        if self._server is not None:
            self._server.close()
            for w in list(self._writers):
                w.close()
            try:
                await asyncio.wait_for(self._server.wait_closed(), 2.0)
            except (asyncio.TimeoutError, Exception):
                pass
            self._server = None
        try:
            if self.path.is_socket():
                self.path.unlink()
        except OSError:
            pass

    # ------------------------------------------------------------------ connections

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            while True:
                try:
                    head = await reader.readexactly(fastwire.HEADER_SIZE)
                except asyncio.IncompleteReadError:
                    return  # the client closed (cleanly or mid-header)
                (n,) = fastwire.HEADER.unpack(head)
                if n > self.max_frame:
                    writer.write(fastwire.error_reply(
                        _INVALID, f"frame of {n} bytes is over the limit of {self.max_frame}; closing the connection"))
                    await writer.drain()
                    return
                try:
                    body = await reader.readexactly(n)
                except asyncio.IncompleteReadError:
                    return  # the client went away mid-frame: nothing to answer
                writer.write(await self._answer(body))
                if writer.transport.get_write_buffer_size() > _WRITE_HIGH_WATER:
                    await writer.drain()
        except (ConnectionError, OSError):
            pass  # the peer reset the connection
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug: log it, drop this connection, keep serving
            log.exception("fast lookup connection failed")
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _answer(self, body: bytes) -> bytes:
        start = time.perf_counter()
        code: Optional[str] = None
        try:
            keys = self._parse(body)
            found = self.servicer.presence(keys, False)
            if found is BUSY:
                loop = asyncio.get_running_loop()
                found = await loop.run_in_executor(self.servicer.executor, self.servicer.presence, keys, True)
            return fastwire.lookup_reply(found)
        except errors.KVStoreError as exc:
            code = exc.code
            return fastwire.error_reply(exc.code, str(exc))
        except Exception as exc:  # a bug: report it, keep serving
            code = "INTERNAL"
            log.exception("fast Lookup failed with an unexpected error")
            return fastwire.error_reply(errors.KVStoreError.code,
                                        f"internal error in Lookup: {type(exc).__name__}: {exc}")
        finally:
            self.servicer.metrics.observe("Lookup", time.perf_counter() - start, code)

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


__all__ = ["FastLookupServer"]
