"""Which checksum an object's bytes use, and computing it on the host or the GPU.

Owns the rule every part of kvstore (client put and get, the daemon's commit and get
verification, tier moves, NVMe reads) applies to decide how an object is hashed:

- an object-format blob (kvstore.format) records its algorithm in the preamble's flags
  field (low 4 bits): 0 = xxh3_64 (`XXH3`), 1 = kvsum64 (`KVSUM64`, the device-side sum
  of kernels.blob_checksum); `put_tensors` into GPU memory writes KVSUM64 blobs, every
  other writer XXH3 ones;
- any other object (raw bytes) uses xxh3_64.

So the algorithm travels with the bytes: a GPU-tier blob demoted to the CPU arena or to
NVMe is still verified with kvsum64 (on the host: `KvsumHasher`, numpy, ~0.1-0.5 GB/s),
and the store's records need no algorithm field. xxh3 runs at ~15 GB/s on one core; on
the GPU kvsum64 runs at device-memory speed.

Streaming: `new_hasher(first_bytes)` returns an object with `update(buffer)` and
`intdigest()`, fed the object's bytes in order (the first update must hold at least the
first 16 bytes when the object is a blob, which every caller's chunking guarantees).
"""

from __future__ import annotations

import struct
from typing import Any, Union

import numpy as np
import xxhash

XXH3 = 0
KVSUM64 = 1
ALGORITHMS = {XXH3: "xxh3_64", KVSUM64: "kvsum64"}
FLAG_ALGORITHM_MASK = 0x000F

BLOB_MAGIC = b"KVSBLOB\x00"  # kvstore.format.MAGIC (kept here so this module imports no torch)
_PREAMBLE = struct.Struct("<8sHHI")
PREFIX_BYTES = _PREAMBLE.size  # 16: what `algorithm_of` needs to see

_M32 = np.uint32
_STEP = 1 << 20  # host kvsum works in 1 MiB pieces (cache-resident temporaries)


def algorithm_of(prefix: Union[bytes, bytearray, memoryview]) -> int:
    """The checksum algorithm of an object whose first bytes are `prefix` (>= 16 bytes
    for a blob; anything shorter is raw bytes). An unknown algorithm number in a blob
    header counts as XXH3 (the checksum then fails, loudly, rather than being skipped)."""
    if len(prefix) < PREFIX_BYTES:
        return XXH3
    magic, _version, flags, _hlen = _PREAMBLE.unpack(bytes(prefix[:PREFIX_BYTES]))
    if magic != BLOB_MAGIC:
        return XXH3
    algo = flags & FLAG_ALGORITHM_MASK
    return algo if algo in ALGORITHMS else XXH3


def _fmix32(h: np.ndarray) -> np.ndarray:
    h ^= h >> _M32(16)
    h *= _M32(0x85EBCA6B)
    h ^= h >> _M32(13)
    h *= _M32(0xC2B2AE35)
    h ^= h >> _M32(16)
    return h


def kvsum_words_host(words: np.ndarray, start_word: int) -> int:
    """kernels.blob_checksum's word sum S (mod 2**64) of uint32 `words` starting at word
    index `start_word`, with numpy (the host implementation; tested against the torch
    reference)."""
    n = words.size
    i = np.arange(start_word, start_word + n, dtype=np.uint64)
    x = i.astype(np.uint32) * _M32(0x9E3779B1)
    x ^= (i >> np.uint64(32)).astype(np.uint32) * _M32(0x85EBCA77)
    x ^= words
    b = x * _M32(0x27D4EB2F)
    b += _M32(0x165667B1)
    a = _fmix32(x)
    b = _fmix32(b)
    return ((int(a.sum(dtype=np.uint64)) << 32) + int(b.sum(dtype=np.uint64))) & 0xFFFFFFFFFFFFFFFF


def kvsum_finish(partial: int, nbytes: int) -> int:
    """kernels.blob_checksum.kvsum64_finish (repeated here so the host path imports no
    Triton): the checksum of `nbytes` bytes whose word sum is `partial`."""
    k = (partial ^ (nbytes * 0x9E3779B97F4A7C15)) & 0xFFFFFFFFFFFFFFFF
    k ^= k >> 33
    k = (k * 0xFF51AFD7ED558CCD) & 0xFFFFFFFFFFFFFFFF
    k ^= k >> 33
    k = (k * 0xC4CEB9FE1A85EC53) & 0xFFFFFFFFFFFFFFFF
    return k ^ (k >> 33)


class KvsumHasher:
    """Streaming kvsum64 on the host (the same interface as xxhash.xxh3_64)."""

    def __init__(self) -> None:
        self._sum = 0
        self._bytes = 0
        self._carry = b""  # up to 3 bytes of a word split across updates

    def update(self, data: Any) -> None:
        mv = memoryview(data).cast("B")
        if self._carry:
            need = 4 - len(self._carry)
            self._carry += bytes(mv[:need])
            mv = mv[need:]
            if len(self._carry) < 4:
                return
            self._add(np.frombuffer(self._carry, dtype="<u4"))
            self._carry = b""
        whole = len(mv) - len(mv) % 4
        for off in range(0, whole, _STEP):
            self._add(np.frombuffer(mv[off: min(off + _STEP, whole)], dtype="<u4"))
        if whole < len(mv):
            self._carry = bytes(mv[whole:])

    def _add(self, words: np.ndarray) -> None:
        self._sum = (self._sum + kvsum_words_host(words, self._bytes // 4)) & 0xFFFFFFFFFFFFFFFF
        self._bytes += words.size * 4

    def intdigest(self) -> int:
        total, nbytes = self._sum, self._bytes
        if self._carry:
            pad = self._carry + b"\x00" * (4 - len(self._carry))
            total = (total + kvsum_words_host(np.frombuffer(pad, dtype="<u4"), nbytes // 4)) & 0xFFFFFFFFFFFFFFFF
            nbytes += len(self._carry)
        return kvsum_finish(total, nbytes)


def new_hasher(prefix: Union[bytes, bytearray, memoryview]) -> Any:
    """A streaming hasher for an object whose first bytes are `prefix`."""
    return KvsumHasher() if algorithm_of(prefix) == KVSUM64 else xxhash.xxh3_64()


def host_checksum(data: Any) -> int:
    """The checksum of a whole object held in host memory (any bytes-like object)."""
    mv = memoryview(data).cast("B") if not isinstance(data, memoryview) or data.format != "B" else data
    if algorithm_of(mv[:PREFIX_BYTES]) == XXH3:
        return xxhash.xxh3_64_intdigest(mv)
    h = KvsumHasher()
    h.update(mv)
    return h.intdigest()
