"""Leases: time-limited pins that clients hold on objects (and the Store on reservations).

`LeaseTable` maps lease id -> (key, client id, expiry, payload). Ids are random 63-bit
numbers (never 0): a client cannot guess another's, and `owned` tells the Store whether
the client naming an id is the one that took it. A lease expires
`ttl_s` after it was taken or last renewed; `renew(client_id)` extends every lease of a
client (the client library renews on a timer while it lives), so the leases of a client
that died go away by themselves. The Store never evicts, moves or frees an object while a
lease on it is live.

Not thread-safe: the Store calls it under its lock. Times are time.monotonic() seconds.
"""

from __future__ import annotations

import heapq
import secrets
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Optional

from kvstore.errors import InvalidRequest


@dataclass
class LeaseEntry:
    lease_id: int
    key: bytes
    client_id: str
    expires_at: float
    payload: Any = None


class LeaseTable:
    """Lease id -> LeaseEntry, with per-key counts, per-client renew and TTL expiry."""

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if ttl_s <= 0:
            raise InvalidRequest(f"lease ttl must be > 0 seconds, got {ttl_s}")
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: dict[int, LeaseEntry] = {}
        self._by_key: Counter[bytes] = Counter()
        self._by_client: dict[str, set[int]] = {}
        self._heap: list[tuple[float, int]] = []  # (expiry, id); stale items skipped lazily

    def __len__(self) -> int:
        return len(self._entries)

    def acquire(self, key: bytes, client_id: str, payload: Any = None, now: Optional[float] = None) -> LeaseEntry:
        """Take a new lease on `key` for `client_id`."""
        now = self._clock() if now is None else now
        lease_id = 0
        while lease_id == 0 or lease_id in self._entries:
            lease_id = secrets.randbits(63)
        e = LeaseEntry(lease_id, key, client_id, now + self.ttl_s, payload)
        self._entries[e.lease_id] = e
        self._by_key[key] += 1
        self._by_client.setdefault(client_id, set()).add(e.lease_id)
        heapq.heappush(self._heap, (e.expires_at, e.lease_id))
        return e

    def get(self, lease_id: int) -> Optional[LeaseEntry]:
        return self._entries.get(lease_id)

    def owned(self, lease_id: int, client_id: Optional[str]) -> Optional[LeaseEntry]:
        """The lease if `client_id` took it (None: unknown, gone, or another client's;
        `client_id` None skips the check: the Store's own in-process callers)."""
        e = self._entries.get(lease_id)
        if e is None or (client_id is not None and e.client_id != client_id):
            return None
        return e

    def _remove(self, e: LeaseEntry) -> None:
        del self._entries[e.lease_id]
        self._by_key[e.key] -= 1
        if self._by_key[e.key] <= 0:
            del self._by_key[e.key]
        ids = self._by_client.get(e.client_id)
        if ids is not None:
            ids.discard(e.lease_id)
            if not ids:
                del self._by_client[e.client_id]

    def release(self, lease_id: int) -> Optional[LeaseEntry]:
        """End a lease; returns it, or None when unknown or already gone (idempotent)."""
        e = self._entries.get(lease_id)
        if e is not None:
            self._remove(e)
        return e

    def renew(self, client_id: str, now: Optional[float] = None) -> int:
        """Push every lease of `client_id` to now + ttl; returns how many."""
        now = self._clock() if now is None else now
        ids = self._by_client.get(client_id, ())
        for i in ids:
            e = self._entries[i]
            e.expires_at = now + self.ttl_s
            heapq.heappush(self._heap, (e.expires_at, i))
        return len(ids)

    def expire(self, now: Optional[float] = None, keep: Callable[[LeaseEntry], bool] = lambda e: False) -> list[LeaseEntry]:
        """Remove and return every lease whose expiry is <= now, except those `keep`
        says to hold on to (they get a fresh ttl)."""
        now = self._clock() if now is None else now
        out = []
        while self._heap and self._heap[0][0] <= now:
            exp, i = heapq.heappop(self._heap)
            e = self._entries.get(i)
            if e is None or e.expires_at != exp:
                continue  # released, or renewed since this heap item was pushed
            if e.expires_at > now:
                continue
            if keep(e):
                e.expires_at = now + self.ttl_s
                heapq.heappush(self._heap, (e.expires_at, i))
                continue
            self._remove(e)
            out.append(e)
        return out

    def count(self, key: bytes) -> int:
        return self._by_key.get(key, 0)

    def is_leased(self, key: bytes) -> bool:
        return key in self._by_key

    def entries(self) -> list[LeaseEntry]:
        return list(self._entries.values())
