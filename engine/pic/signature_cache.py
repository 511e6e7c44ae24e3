"""Where segment signatures are kept between requests: the `SignatureCache` interface, its
in-process implementation `InMemorySignatureCache` (LRU by bytes), and `segment_key`.

Keys. `segment_key(fingerprint, token_ids, variant)` is a 32-byte blake2b digest of a
domain tag, the model fingerprint, the signature variant (what else decides the
signature's content: the anchor tokens and the seam split, `signature_variant`) and the
segment's token ids (little-endian uint32). No position enters the key, and it is the same
in every process and machine (never Python's `hash()`), so engines sharing a store share
segments by content.

The interface (the store-backed cache of the integration issue implements the same one):

    lookup(keys) -> [bool]      presence only; no hit counting, no pinning
    get(key)     -> SegmentSignature | None   counts a hit or a miss; None on a miss
    put(key, signature) -> bool               False when it cannot be kept (too large)
    release(key)                              the caller is done with what get returned
    stats()      -> SignatureCacheStats

Contract: a signature returned by `get` stays valid (its tensors readable, unchanged)
until the caller calls `release(key)` for it; an implementation over shared memory holds
a lease until then, the in-process one needs nothing. Signatures are immutable once put:
a second put of the same key keeps one of the two (they are equal by construction).
`get` and `put` may be called from any thread.
"""
from __future__ import annotations

import abc
import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from engine.pic.errors import PicConfigError
from engine.pic.signature import SegmentSignature

KEY_TAG = b"kvengine-pic-segment-key-v1\x00"
KEY_BYTES = 32


def signature_variant(anchor_ids: Sequence[int], split: int) -> str:
    """The part of a key that is neither model nor tokens: anchor ids and seam split."""
    return f"anchor={','.join(str(int(t)) for t in anchor_ids)};split={int(split)}"


def segment_key(fingerprint: str, token_ids: Sequence[int], variant: str = "") -> bytes:
    """blake2b-256 of (tag, model fingerprint, variant, token ids); see the module docstring."""
    if not isinstance(fingerprint, str) or not fingerprint:
        raise PicConfigError(f"fingerprint must be a non-empty str, got {fingerprint!r}")
    try:
        ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
    except (TypeError, ValueError, OverflowError) as e:
        raise PicConfigError(f"token ids must be integers in [0, 2**32): {e}") from None
    if ids.size and (ids.min() < 0 or ids.max() >= 1 << 32):
        raise PicConfigError("token ids must lie in [0, 2**32)")
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    h.update(KEY_TAG)
    h.update(fingerprint.encode())
    h.update(b"\x00")
    h.update(variant.encode())
    h.update(b"\x00")
    h.update(ids.astype("<u4").tobytes())  # the bytes struct.pack("<nI") gives, without a Python loop
    return h.digest()


@dataclass(frozen=True)
class SignatureCacheStats:
    """Counters since the cache was created, and what it holds now."""

    hits: int
    misses: int
    puts: int
    rejected: int  # puts refused (larger than the whole capacity)
    evictions: int
    entries: int
    bytes: int
    capacity_bytes: int

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    def as_dict(self) -> dict:
        return {"hits": self.hits, "misses": self.misses, "puts": self.puts, "rejected": self.rejected,
                "evictions": self.evictions, "entries": self.entries, "bytes": self.bytes,
                "capacity_bytes": self.capacity_bytes, "hit_rate": self.hit_rate}


class SignatureCache(abc.ABC):
    """Keeps segment signatures by `segment_key` (module docstring for the contract)."""

    @abc.abstractmethod
    def lookup(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is held now. Counts nothing, pins nothing."""

    @abc.abstractmethod
    def get(self, key: bytes) -> Optional[SegmentSignature]:
        """The signature under `key` (valid until `release(key)`), or None on a miss.
        Counts one hit or one miss."""

    @abc.abstractmethod
    def put(self, key: bytes, signature: SegmentSignature) -> bool:
        """Keep `signature` under `key`; False if it cannot be kept."""

    def release(self, key: bytes) -> None:
        """The caller no longer uses what `get(key)` returned. Default: nothing to do."""
        return None

    @abc.abstractmethod
    def stats(self) -> SignatureCacheStats:
        """Counters and occupancy."""


class InMemorySignatureCache(SignatureCache):
    """Signatures in this process's memory (on whatever device they were computed),
    least-recently-used evicted first when the bytes held would pass `capacity_bytes`."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise PicConfigError(f"capacity_bytes={capacity_bytes} must be >= 0")
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[bytes, tuple[SegmentSignature, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._hits = self._misses = self._puts = self._rejected = self._evictions = 0

    def lookup(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            return [k in self._entries for k in keys]

    def get(self, key: bytes) -> Optional[SegmentSignature]:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self._misses += 1
                return None
            self._entries.move_to_end(key)
            self._hits += 1
            return entry[0]

    def put(self, key: bytes, signature: SegmentSignature) -> bool:
        size = signature.nbytes()
        with self._lock:
            if size > self.capacity_bytes:
                self._rejected += 1
                return False
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            while self._entries and self._bytes + size > self.capacity_bytes:
                _, (_, freed) = self._entries.popitem(last=False)
                self._bytes -= freed
                self._evictions += 1
            self._entries[key] = (signature, size)
            self._bytes += size
            self._puts += 1
            return True

    def discard(self, keys: Sequence[bytes]) -> int:
        """Drop these keys (absent ones are ignored); how many were held."""
        dropped = 0
        with self._lock:
            for key in keys:
                old = self._entries.pop(key, None)
                if old is not None:
                    self._bytes -= old[1]
                    dropped += 1
        return dropped

    def clear(self) -> int:
        """Drop every signature held; how many there were (the counters stay)."""
        with self._lock:
            n = len(self._entries)
            self._entries.clear()
            self._bytes = 0
        return n

    def stats(self) -> SignatureCacheStats:
        with self._lock:
            return SignatureCacheStats(self._hits, self._misses, self._puts, self._rejected, self._evictions,
                                       len(self._entries), self._bytes, self.capacity_bytes)
