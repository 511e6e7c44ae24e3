"""The fast Lookup wire format: length-prefixed msgpack frames on `<socket>.fast`.

Owns: the fast socket's path, its framing and its messages, shared by the daemon
(kvstore.server.fastpath) and the clients (kvstore.client.fastpath). It exists because a
gRPC unary call costs several hundred microseconds of C-core work (sendmsg, epoll,
wakeups) even when empty, while a 64-key Lookup is ~100 us of our own work.

A frame is a 4-byte big-endian payload length, then that many bytes of msgpack:

    request   {"v": PROTOCOL_VERSION, "op": "lookup", "keys": [bin, ...]}
    reply     {"v": PROTOCOL_VERSION, "found": [nil | [tier, size], ...]}   one per key, in order
    error     {"v": PROTOCOL_VERSION, "error": {"code": "INVALID_REQUEST", "message": "..."}}

A miss is nil, a hit its tier name and size in bytes: the same information as the gRPC
LookupResponse (whose entries echo the key, which the caller already has). A request the
daemon cannot use gets an error frame; after an error about the frame itself (too large)
the daemon closes the connection, after any other error the connection stays usable.
Requests on one connection are answered in order.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, Union

import msgpack

from kvstore.rpc.service import PROTOCOL_VERSION

FAST_SUFFIX = ".fast"
HEADER = struct.Struct(">I")
HEADER_SIZE = HEADER.size
OP_LOOKUP = "lookup"

_pack = msgpack.Packer(use_bin_type=True).pack


def fast_socket_path(socket: Union[str, Path]) -> Path:
    """The fast socket beside the gRPC socket `socket`."""
    return Path(str(socket) + FAST_SUFFIX)


def frame(payload: bytes) -> bytes:
    return HEADER.pack(len(payload)) + payload


def lookup_request(keys: list[bytes]) -> bytes:
    """A whole lookup request frame (header included)."""
    body = _pack({"v": PROTOCOL_VERSION, "op": OP_LOOKUP, "keys": keys})
    return HEADER.pack(len(body)) + body


def lookup_reply(found: list[Any]) -> bytes:
    """A whole reply frame for `Store.presence`'s list: None or (tier, size) per key."""
    body = _pack({"v": PROTOCOL_VERSION, "found": found})
    return HEADER.pack(len(body)) + body


def error_reply(code: str, message: str) -> bytes:
    body = _pack({"v": PROTOCOL_VERSION, "error": {"code": code, "message": message}})
    return HEADER.pack(len(body)) + body


def decode(payload: bytes) -> Any:
    """A frame's msgpack payload (arrays as tuples, bin as bytes, str as str)."""
    return msgpack.unpackb(payload, raw=False, use_list=False)


__all__ = ["FAST_SUFFIX", "HEADER", "HEADER_SIZE", "OP_LOOKUP", "fast_socket_path", "frame", "lookup_request",
           "lookup_reply", "error_reply", "decode"]
