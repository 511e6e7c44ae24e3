"""The remote object format: how one store object is laid out in the remote tier.

Owns: remote object names (`remote_name`) and the envelope, a fixed 4 KiB header in front
of the object's bytes::

    0   8  magic b"KVSREMT1"
    8   4  header version (1)
    12  4  key length K
    16  4  meta length M (msgpack of the ObjectMeta)
    20  4  reserved (0)
    24  8  payload length P
    32  8  payload checksum (kvstore.format.checksum of the P bytes: the store's own)
    40  8  header checksum (xxh3_64 of bytes 0..39 and 48..48+K+M)
    48  K  the key, then M bytes of meta, then zeros up to 4096

The remote object is the header followed by the P payload bytes, P + 4096 in all. A
reader checks the magic, version, header checksum, that the key is the one it asked for
and that the object's size is P + 4096, then hashes the payload it read and compares it
with the recorded checksum: a remote object is never served unverified. Names are
`<namespace>/<hex key>` (keys over 64 bytes: `<namespace>/h<blake2b-256 of the key>`,
the full key is still checked in the header), so every host finds a key under one name.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

import msgpack
import xxhash

from kvstore.errors import BadObject
from kvstore.records import ObjectMeta

MAGIC = b"KVSREMT1"
VERSION = 1
HEADER_BYTES = 4096
_FIXED = struct.Struct("<8sIIII QQQ")  # magic, version, key len, meta len, reserved, payload len, payload sum, header sum
_FIXED_BYTES = _FIXED.size  # 48
_HEAD40 = struct.Struct("<8sIIII QQ")  # the fixed part before the header checksum
_SUM = struct.Struct("<Q")
_ZEROS = bytes(HEADER_BYTES)
MAX_INLINE_KEY = 64


def remote_name(namespace: str, key: bytes) -> str:
    """The remote object name of a store key (module docstring)."""
    if len(key) <= MAX_INLINE_KEY:
        return f"{namespace}/{key.hex()}"
    return f"{namespace}/h{hashlib.blake2b(key, digest_size=32).hexdigest()}"


@dataclass(frozen=True)
class RemoteHeader:
    """A decoded envelope header."""

    key: bytes
    meta: ObjectMeta
    payload_bytes: int
    checksum: int


def _meta_bytes(meta: ObjectMeta) -> bytes:
    return msgpack.packb({"f": meta.fingerprint, "t": meta.token_count, "c": meta.cost, "x": meta.extra},
                         use_bin_type=True)


def header_fits(key: bytes, meta: ObjectMeta) -> bool:
    """Whether the key and meta fit the fixed header (else the object is not written remotely)."""
    return _FIXED_BYTES + len(key) + len(_meta_bytes(meta)) <= HEADER_BYTES


def encode_header(key: bytes, meta: ObjectMeta, payload_bytes: int, checksum: int, out: memoryview) -> None:
    """Write the header of an object into `out` (HEADER_BYTES writable bytes).
    Raises BadObject when the key and meta do not fit."""
    mb = _meta_bytes(meta)
    end = _FIXED_BYTES + len(key) + len(mb)
    if end > HEADER_BYTES:
        raise BadObject(f"key and meta of {key!r} take {end} bytes, over the remote header's {HEADER_BYTES}")
    body = bytes(key) + mb
    head = _HEAD40.pack(MAGIC, VERSION, len(key), len(mb), 0, payload_bytes, checksum)
    out[:end] = head + _SUM.pack(xxhash.xxh3_64_intdigest(head + body)) + body
    out[end:HEADER_BYTES] = _ZEROS[: HEADER_BYTES - end]


def decode_header(buf: memoryview, key: bytes, object_bytes: int) -> RemoteHeader:
    """Check and decode a header read for `key` from a remote object of `object_bytes`
    bytes; BadObject naming what is wrong (a damaged, foreign or half-written object)."""
    if len(buf) < HEADER_BYTES:
        raise BadObject(f"remote object of {key!r}: header is {len(buf)} bytes, expected {HEADER_BYTES}")
    magic, version, klen, mlen, _, plen, psum, hsum = _FIXED.unpack_from(buf, 0)
    if magic != MAGIC:
        raise BadObject(f"remote object of {key!r}: bad magic {bytes(magic)!r}")
    if version != VERSION:
        raise BadObject(f"remote object of {key!r}: header version {version}, this daemon reads {VERSION}")
    end = _FIXED_BYTES + klen + mlen
    if end > HEADER_BYTES:
        raise BadObject(f"remote object of {key!r}: key and meta lengths {klen}+{mlen} overrun the header")
    h = xxhash.xxh3_64(buf[:40])
    h.update(buf[_FIXED_BYTES:end])
    if h.intdigest() != hsum:
        raise BadObject(f"remote object of {key!r}: header checksum mismatch")
    if buf[_FIXED_BYTES:_FIXED_BYTES + klen] != key:
        raise BadObject(f"remote object of {key!r} holds key {bytes(buf[_FIXED_BYTES:_FIXED_BYTES + klen])!r}")
    if plen + HEADER_BYTES != object_bytes:
        raise BadObject(f"remote object of {key!r} is {object_bytes} bytes, its header says {plen + HEADER_BYTES}")
    try:
        m = msgpack.unpackb(buf[_FIXED_BYTES + klen:end], raw=False)
        meta = ObjectMeta(str(m["f"]), int(m["t"]), float(m["c"]), dict(m["x"]))
    except Exception as exc:  # noqa: BLE001 - any decoding failure is a bad object
        raise BadObject(f"remote object of {key!r}: undecodable meta ({exc})") from None
    return RemoteHeader(bytes(key), meta, plen, psum)
