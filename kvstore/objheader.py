"""The self-describing record every sealed NVMe object file carries: `ObjectHeader`.

An object file is the object's bytes, then the header record, then a fixed 16-byte tail::

    [object bytes: size] [body: msgpack map, n bytes] [n: u32 LE] [crc32(body): u32 LE] [magic: 8 bytes]

The record sits after the bytes (not before them) so an object's bytes start at offset 0
of its file, where clients read and map them. It holds what the LMDB index needs to serve
the object after a restart (key, size, checksum, meta, creation time), so a missing,
truncated or corrupt index is rebuilt from the files alone (kvstore.recovery).

The magic says the file's state: MAGIC_LIVE for a committed object, MAGIC_DEAD once the
daemon dropped the object while a reader still held the file (the file goes when the last
pin does; a crash in between must not bring a deleted object back). A file without a tail
is a file of the old layout (its index record alone describes it).

`decode_trailer` is a pure function over bytes (it is fuzzed); `read_trailer` reads a
file's tail and calls it.
"""

from __future__ import annotations

import os
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any, Optional

import msgpack

from kvstore.errors import BadObject

MAGIC_LIVE = b"KVSOBJ01"
MAGIC_DEAD = b"KVSODEAD"
TAIL = struct.Struct("<II8s")  # body length, crc32 of the body, magic
MAX_BODY_BYTES = 1 << 20  # a header record is small: key (<= 1 KiB) plus meta
HEADER_VERSION = 1


@dataclass(frozen=True)
class ObjectHeader:
    """What an object file says about itself (enough to rebuild its index record)."""

    key: bytes
    size: int  # object bytes (the file is size + trailer bytes)
    checksum: int
    fingerprint: str = ""
    token_count: int = 0
    cost: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    created: float = 0.0

    def encode_trailer(self, magic: bytes = MAGIC_LIVE) -> bytes:
        """The bytes written after the object's bytes: body, then the 16-byte tail."""
        body = msgpack.packb({
            "v": HEADER_VERSION, "key": bytes(self.key), "size": self.size, "checksum": self.checksum,
            "fingerprint": self.fingerprint, "token_count": self.token_count, "cost": float(self.cost),
            "extra": self.extra, "created": float(self.created),
        }, use_bin_type=True)
        return body + TAIL.pack(len(body), zlib.crc32(body), magic)


@dataclass(frozen=True)
class Trailer:
    """A decoded trailer: the header, whether the object is live, and the trailer's length."""

    header: ObjectHeader
    live: bool
    nbytes: int  # body + tail


def _field(d: dict, name: str, kind: type | tuple[type, ...]) -> Any:
    v = d.get(name)
    if not isinstance(v, kind) or isinstance(v, bool) and kind is not bool:
        raise BadObject(f"object header field {name!r} is {type(v).__name__}, not {getattr(kind, '__name__', kind)}")
    return v


def decode_trailer(data: bytes, file_size: Optional[int] = None) -> Optional[Trailer]:
    """Decode the trailer at the end of `data` (a file's last bytes, or the whole file).

    None when `data` does not end in a header tail (a file of the old layout). BadObject,
    naming what is wrong, for a damaged record: short, bad length, bad crc, a body that
    does not decode or lacks a field, or (with `file_size`) a size that does not add up.
    """
    if len(data) < TAIL.size:
        return None
    n, crc, magic = TAIL.unpack_from(data, len(data) - TAIL.size)
    if magic not in (MAGIC_LIVE, MAGIC_DEAD):
        return None
    if n > MAX_BODY_BYTES or n + TAIL.size > len(data):
        raise BadObject(f"object header claims a {n}-byte record, more than the {len(data) - TAIL.size} bytes before "
                        f"its tail (limit {MAX_BODY_BYTES})")
    body = bytes(data[len(data) - TAIL.size - n: len(data) - TAIL.size])
    if zlib.crc32(body) != crc:
        raise BadObject(f"object header record fails its crc32 (stored {crc:#x}, computed {zlib.crc32(body):#x})")
    try:
        d = msgpack.unpackb(body, raw=False, strict_map_key=False, max_bin_len=MAX_BODY_BYTES,
                            max_str_len=MAX_BODY_BYTES, max_array_len=1 << 16, max_map_len=1 << 16)
    except Exception as exc:  # noqa: BLE001 - any decode failure is a damaged record
        raise BadObject(f"object header record does not decode: {type(exc).__name__}: {exc}") from None
    if not isinstance(d, dict):
        raise BadObject(f"object header record is a {type(d).__name__}, not a map")
    if d.get("v") != HEADER_VERSION:
        raise BadObject(f"object header version {d.get('v')!r} is not {HEADER_VERSION}")
    key = _field(d, "key", bytes)
    size = _field(d, "size", int)
    checksum = _field(d, "checksum", int)
    extra = _field(d, "extra", dict)
    if not key or size <= 0 or not 0 <= checksum < 1 << 64:
        raise BadObject(f"object header holds an empty key, size {size} or checksum {checksum}")
    if file_size is not None and size + n + TAIL.size != file_size:
        raise BadObject(f"object header says {size} bytes + a {n + TAIL.size}-byte trailer, the file has {file_size}")
    h = ObjectHeader(key, size, checksum, _field(d, "fingerprint", str), _field(d, "token_count", int),
                     float(_field(d, "cost", (int, float))), extra, float(_field(d, "created", (int, float))))
    return Trailer(h, magic == MAGIC_LIVE, n + TAIL.size)


def read_trailer(path: str) -> Optional[Trailer]:
    """The trailer of the object file at `path` (see decode_trailer); OSError when the
    file cannot be read."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        size = os.fstat(fd).st_size
        if size < TAIL.size:
            return None
        tail = os.pread(fd, TAIL.size, size - TAIL.size)
        if len(tail) < TAIL.size:
            return None
        n, _, magic = TAIL.unpack(tail)
        if magic not in (MAGIC_LIVE, MAGIC_DEAD) or n > MAX_BODY_BYTES or n + TAIL.size > size:
            return decode_trailer(tail)  # None, or the BadObject naming the bad length
        data = os.pread(fd, n + TAIL.size, size - n - TAIL.size)
        return decode_trailer(data, file_size=size if len(data) == n + TAIL.size else None)
    finally:
        os.close(fd)


def mark_dead(path: str) -> bool:
    """Turn a live trailer's magic into MAGIC_DEAD in place (the object's bytes are left
    alone for readers still holding the file). False when the file has no live trailer."""
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    try:
        size = os.fstat(fd).st_size
        if size < TAIL.size or os.pread(fd, 8, size - 8) != MAGIC_LIVE:
            return False
        os.pwrite(fd, MAGIC_DEAD, size - 8)
        return True
    finally:
        os.close(fd)
