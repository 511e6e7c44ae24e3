"""Open reservations of a Store: puts between `reserve` and their commit, abort or expiry.

Owns the reservation table (kvstore.leases: ids, owners, expiry), the index of keys with
a put in flight (one reservation per key), and telling whoever waits on a key that its
reservation ended: `Store.wait_for` through the store's condition variable, the server's
asyncio waiters through settle listeners. What a reservation holds (`PendingPut`: its
tier slot and meta) is freed or committed by the Store; `check_put` checks a put's
arguments before anything is reserved.

Not thread-safe: the Store calls it under its lock (the condition's lock).
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional

import msgpack

from kvstore.errors import InvalidRequest
from kvstore.leases import LeaseEntry, LeaseTable
from kvstore.records import ObjectMeta
from kvstore.tiers.base import Slot


def check_put(key: Any, size: Any, meta: Any, max_key_bytes: int) -> bytes:
    """The key of a well-formed put as bytes; InvalidRequest naming what is wrong: a key
    that is not bytes or not 1..max_key_bytes long, a size that is not an int > 0, a meta
    that is not an ObjectMeta or whose `extra` msgpack cannot encode."""
    if not isinstance(key, (bytes, bytearray)):
        raise InvalidRequest(f"keys must be bytes, got {type(key).__name__}")
    if not key or len(key) > max_key_bytes:
        raise InvalidRequest(f"key length must be 1..{max_key_bytes} bytes (the NVMe tier's index limit), "
                             f"got {len(key)}")
    if not isinstance(size, int) or size <= 0:
        raise InvalidRequest(f"object size must be an int > 0 bytes, got {size!r}")
    if not isinstance(meta, ObjectMeta):
        raise InvalidRequest(f"meta must be an ObjectMeta, got {type(meta).__name__}")
    try:
        msgpack.packb(meta.extra, use_bin_type=True)
    except (TypeError, ValueError) as exc:
        raise InvalidRequest(f"object meta.extra is not msgpack-serialisable: {exc}") from exc
    return bytes(key)


class PendingPut:
    """A reservation's state (the LeaseTable entry's payload)."""

    __slots__ = ("key", "tier", "slot", "meta", "committing")

    def __init__(self, key: bytes, tier: str, slot: Slot, meta: ObjectMeta) -> None:
        self.key, self.tier, self.slot, self.meta = key, tier, slot, meta
        self.committing = False


class Reservations:
    """The open reservations of one Store (module docstring)."""

    def __init__(self, ttl_s: float, cond: threading.Condition) -> None:
        self.ttl_s = ttl_s
        self.cond = cond
        self.table = LeaseTable(ttl_s)
        self._inflight: dict[bytes, int] = {}  # key -> reservation id
        self._listeners: list[Callable[[Optional[bytes]], None]] = []

    def __len__(self) -> int:
        return len(self.table)

    def open(self, put: PendingPut, client_id: str) -> LeaseEntry:
        e = self.table.acquire(put.key, client_id, put)
        self._inflight[put.key] = e.lease_id
        return e

    def in_flight(self, key: bytes) -> bool:
        return key in self._inflight

    def tier_of(self, key: bytes) -> Optional[str]:
        """The tier the in-flight put of `key` writes into (None: none, or it just ended)."""
        rid = self._inflight.get(key)
        e = self.table.get(rid) if rid is not None else None
        return e.payload.tier if e is not None else None

    def end(self, e: LeaseEntry) -> None:
        """Forget a reservation (its slot is the caller's) and wake its key's waiters."""
        self.table.release(e.lease_id)
        if self._inflight.get(e.key) == e.lease_id:
            del self._inflight[e.key]
        self.notify(e.key)

    def reset(self) -> None:
        """Forget every reservation (the store closed; their slots went with the tiers)."""
        self._inflight.clear()
        self.table = LeaseTable(self.ttl_s)

    def add_listener(self, fn: Callable[[Optional[bytes]], None]) -> None:
        self._listeners.append(fn)

    def notify(self, key: Optional[bytes]) -> None:
        """Wake the waiters: on `key`, or on every key (None: the store closed)."""
        self.cond.notify_all()
        for fn in self._listeners:
            fn(key)
