"""The remote object format: how one store object is laid out in the remote tier.

Owns: remote object names (`remote_name`) and the envelope, a variable-length *trailer*
after the object's bytes, so that an object is one contiguous range in a memory-tier
slot (the payload, then the trailer in the slot's tail room): a get, and a put from a
slot whose page rounding leaves room for the trailer, move it as ONE transfer range
(a put from a slot without that room sends the trailer as a second range)::

    0      P  the payload (the store object's bytes)
    P      K  the key
    P+K    M  the meta (msgpack of the ObjectMeta)
    P+K+M 56  the footer:
        0   8  magic b"KVSREMT2"
        8   4  envelope version (2)
        12  4  key length K
        16  4  meta length M
        20  4  reserved (0)
        24  8  payload length P
        32  8  store checksum of the payload (kvstore.format.checksum: the store's own,
               which the reader records for the adopted object)
        40  8  transfer checksum: xxh3_64 of the P payload bytes (equal to the store
               checksum for any object the store hashes with xxh3; computed apart only
               for kvsum64 blobs, so a reader always verifies at xxh3 speed)
        48  8  trailer checksum: xxh3_64 of the key, the meta and footer bytes 0..47
               (all of the trailer before it), the object's last 8 bytes

A trailer is K + M + 56 bytes, at most `MAX_TRAILER_BYTES`. A reader reads the whole
object (its size from a stat) and checks, from the end: the magic, version, trailer
checksum, that the key is the one it asked for and that P + K + M + 56 is the object's
size; then it hashes the payload and compares it with the transfer checksum: a remote
object is never served unverified, and a truncated, torn or foreign object fails the
checks. `PayloadVerifier` does the same while the object arrives: a get that lands it
in pieces (the Mooncake adapter's chunked reads, kvstore.remote.mooncake) hands it each
piece's end as it lands, and the bytes that are certainly payload (all but the last
`MAX_TRAILER_BYTES`) are hashed right then, between the pieces' transfers; `finish`
checks the trailer and hashes the rest (streaming xxh3: the same checksum as one call
over the whole payload). Names are `<namespace>/<hex key>` (keys over 64 bytes:
`<namespace>/h<blake2b-256 of the key>`, the full key is still checked in the trailer),
so every host finds a key under one name.
"""

from __future__ import annotations

import hashlib
import struct
from typing import NamedTuple, Optional

import msgpack
import xxhash

from kvstore.errors import BadObject
from kvstore.records import ObjectMeta

MAGIC = b"KVSREMT2"
VERSION = 2
MAX_TRAILER_BYTES = 4096
_FOOTER = struct.Struct("<8sIIII QQQ")  # magic, version, key len, meta len, reserved, payload len, store sum, xfer sum
_SUM = struct.Struct("<Q")
FOOTER_BYTES = _FOOTER.size + _SUM.size  # 56: the fixed part at the end of every object
_FOOTER_READ = struct.Struct("<8sIIII QQQQ")  # the whole footer at once, the trailer checksum last (readers)
_xxh3 = xxhash.xxh3_64_intdigest
_tuple_new = tuple.__new__
MAX_INLINE_KEY = 64


def remote_name(namespace: str, key: bytes) -> str:
    """The remote object name of a store key (module docstring)."""
    if len(key) <= MAX_INLINE_KEY:
        return f"{namespace}/{key.hex()}"
    return f"{namespace}/h{hashlib.blake2b(key, digest_size=32).hexdigest()}"


class RemoteHeader(NamedTuple):
    """A decoded envelope trailer (a named tuple: made once per remote read, where a
    frozen dataclass's field-by-field construction costs several times more)."""

    key: bytes
    meta: ObjectMeta
    payload_bytes: int
    checksum: int  # the store checksum of the payload
    transfer_checksum: int  # xxh3_64 of the payload, what a reader verifies


def _meta_bytes(meta: ObjectMeta) -> bytes:
    return msgpack.packb({"f": meta.fingerprint, "t": meta.token_count, "c": meta.cost, "x": meta.extra},
                         use_bin_type=True)


def trailer_body(key: bytes, meta: ObjectMeta) -> bytes:
    """The key and meta part of an object's trailer (`encode_trailer`); BadObject when
    they do not fit `MAX_TRAILER_BYTES` (then the object is not written remotely)."""
    body = bytes(key) + _meta_bytes(meta)
    if len(body) + FOOTER_BYTES > MAX_TRAILER_BYTES:
        raise BadObject(f"key and meta of {key!r} take a {len(body) + FOOTER_BYTES}-byte trailer, over the "
                        f"remote tier's {MAX_TRAILER_BYTES}")
    return body


def transfer_checksum(payload: memoryview) -> int:
    """The transfer checksum of payload bytes (module docstring)."""
    return xxhash.xxh3_64_intdigest(payload)


def encode_trailer(key: bytes, meta: ObjectMeta, payload_bytes: int, checksum: int, xfer_checksum: int,
                   body: Optional[bytes] = None) -> bytes:
    """The trailer of an object (module docstring); `body`: its `trailer_body` when
    already made. BadObject when the key and meta do not fit `MAX_TRAILER_BYTES`."""
    if body is None:
        body = trailer_body(key, meta)
    klen = len(key)
    head = body + _FOOTER.pack(MAGIC, VERSION, klen, len(body) - klen, 0, payload_bytes, checksum, xfer_checksum)
    return head + _SUM.pack(xxhash.xxh3_64_intdigest(head))


def decode_trailer(obj: memoryview, key: bytes) -> RemoteHeader:
    """Check and decode the trailer of a whole remote object `obj` (its bytes as read)
    read for `key`; BadObject naming what is wrong (a damaged, foreign, truncated or
    half-written object). The payload itself is verified by the caller
    (`transfer_checksum`), against the returned `transfer_checksum`."""
    return _decode(obj, key, False)[0]


def _decode(obj: memoryview, key: bytes, hash_payload: bool) -> tuple[RemoteHeader, int]:
    """`decode_trailer`, and with `hash_payload` the xxh3 of the payload the footer
    delimits (-1 without). The payload is hashed before the rest of the trailer is read:
    streaming through it brings the trailer that follows it into the cache; its hash is
    compared by the caller, after every check here, so a damaged trailer is named as
    such. Lean on purpose (one unpack of the footer, no intermediate copies): it runs
    once per remote read, right after the transfer has flushed the caches."""
    size = len(obj)
    if size < FOOTER_BYTES:
        raise BadObject(f"remote object of {key!r} is {size} bytes, shorter than its {FOOTER_BYTES}-byte footer")
    fo = size - FOOTER_BYTES
    magic, version, klen, mlen, _, plen, psum, xsum, tsum = _FOOTER_READ.unpack_from(obj, fo)
    tlen = klen + mlen + FOOTER_BYTES
    actual = _xxh3(obj[:plen]) if hash_payload and plen + tlen == size else -1
    if magic != MAGIC:
        raise BadObject(f"remote object of {key!r}: bad magic {bytes(magic)!r}")
    if version != VERSION:
        raise BadObject(f"remote object of {key!r}: envelope version {version}, this daemon reads {VERSION}")
    if tlen > MAX_TRAILER_BYTES or tlen > size:
        raise BadObject(f"remote object of {key!r}: key and meta lengths {klen}+{mlen} overrun the object")
    start = size - tlen
    if _xxh3(obj[start:size - _SUM.size]) != tsum:
        raise BadObject(f"remote object of {key!r}: trailer checksum mismatch")
    if obj[start:start + klen] != key:
        raise BadObject(f"remote object of {key!r} holds key {bytes(obj[start:start + klen])!r}")
    if plen + tlen != size:
        raise BadObject(f"remote object of {key!r} is {size} bytes, its trailer says {plen + tlen}")
    try:
        m = msgpack.unpackb(obj[start + klen:fo], raw=False)
        f, t, c, x = m["f"], m["t"], m["c"], m["x"]
        if type(f) is not str or type(t) is not int or type(c) is not float or type(x) is not dict:
            f, t, c, x = str(f), int(t), float(c), dict(x)  # what the writer's encoder makes has these types
        meta = ObjectMeta(f, t, c, x)
    except Exception as exc:  # noqa: BLE001 - any decoding failure is a bad object
        raise BadObject(f"remote object of {key!r}: undecodable meta ({exc})") from None
    # tuple.__new__ is what RemoteHeader(...) ends in, without its Python-level __new__
    return _tuple_new(RemoteHeader, (key if type(key) is bytes else bytes(key), meta, plen, psum, xsum)), actual


class PayloadVerifier:
    """Verifies one remote object while its bytes land (module docstring).

    `obj` is the buffer the whole object is read into (its exact size); the caller owns
    it and keeps it alive. Call order: `landed(end)` any number of times, with
    non-decreasing `end`, each time the object's bytes [0, end) have landed (from the
    thread doing the get; not thread-safe: one get drives it), then `finish()` once, after
    the whole object has landed. `landed` may never be called (`finish` hashes all)."""

    __slots__ = ("_obj", "_key", "_hash", "_done")

    def __init__(self, obj: memoryview, key: bytes) -> None:
        self._obj = obj
        self._key = key
        self._hash: Optional[xxhash.xxh3_64] = None
        self._done = 0  # payload bytes hashed so far

    def landed(self, end: int) -> None:
        """Bytes [0, end) of the object have landed: hash those that are certainly payload
        (all but the last MAX_TRAILER_BYTES of the object, whatever its trailer says)."""
        stop = min(end, len(self._obj) - MAX_TRAILER_BYTES)
        if stop > self._done:
            if self._hash is None:
                self._hash = xxhash.xxh3_64()
            self._hash.update(self._obj[self._done:stop])
            self._done = stop

    def finish(self) -> RemoteHeader:
        """The decoded trailer of the whole object, its payload hash checked against the
        transfer checksum; BadObject naming what is wrong otherwise (never wrong bytes)."""
        if self._hash is None:  # nothing hashed while landing: one call over the payload, first
            h, actual = _decode(self._obj, self._key, True)
        else:
            h = _decode(self._obj, self._key, False)[0]
            p = h.payload_bytes
            if p > self._done:
                self._hash.update(self._obj[self._done:p])
            actual = self._hash.intdigest()
        if actual != h.transfer_checksum:
            raise BadObject(f"remote object of {self._key!r}: payload hashes to {actual:#x}, "
                            f"its trailer records {h.transfer_checksum:#x}")
        return h


def verify_object(obj: memoryview, key: bytes) -> RemoteHeader:
    """`decode_trailer`, then the payload hashed and compared with the transfer checksum:
    the decoded trailer of an object whose every byte checked out; BadObject otherwise."""
    return PayloadVerifier(obj, key).finish()
