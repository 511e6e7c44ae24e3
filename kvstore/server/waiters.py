"""WaitFor without a thread per waiter.

Owns: `KeyWaiters`, the event-loop side of waiting for a key another client is writing.
A waiter registers a future for its key *before* it looks at the key's state, so a
commit or abort between the look and the wait is never missed; the Store reports every
reservation that ends through its settle listener (`Store.add_settle_listener`), which
only schedules a wake-up on the loop. So a thousand waiters cost a thousand futures, no
worker threads: the worker pool stays free for the requests that need it.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable, Optional


class KeyWaiters:
    """Futures per key on one event loop; `notify(key)` may be called from any thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._by_key: dict[bytes, set[asyncio.Future]] = {}
        self.active = 0  # WaitFor calls waiting now (an int: safe to read from any thread)

    def notify(self, key: Optional[bytes]) -> None:
        """Wake the waiters of `key` (None: every waiter). Thread-safe and non-blocking."""
        try:
            self._loop.call_soon_threadsafe(self._wake, key)
        except RuntimeError:  # the loop is closed (daemon shutting down): nobody waits any more
            pass

    def _wake(self, key: Optional[bytes]) -> None:
        groups = list(self._by_key.values()) if key is None else [self._by_key.get(key, set())]
        for group in groups:
            for fut in group:
                if not fut.done():
                    fut.set_result(None)

    def _watch(self, key: bytes) -> asyncio.Future:
        fut = self._loop.create_future()
        self._by_key.setdefault(key, set()).add(fut)
        return fut

    def _unwatch(self, key: bytes, fut: asyncio.Future) -> None:
        group = self._by_key.get(key)
        if group is not None:
            group.discard(fut)
            if not group:
                del self._by_key[key]

    async def wait(self, key: bytes, timeout_s: float, state: Callable[[bytes], Awaitable[str]]) -> bool:
        """True once `state(key)` is "present"; False when it is "absent" (nobody writes
        it, or the writer gave up) or `timeout_s` passes first."""
        deadline = self._loop.time() + max(0.0, timeout_s)
        self.active += 1
        try:
            return await self._wait(key, deadline, state)
        finally:
            self.active -= 1

    async def _wait(self, key: bytes, deadline: float, state: Callable[[bytes], Awaitable[str]]) -> bool:
        while True:
            fut = self._watch(key)
            try:
                now = await state(key)
                if now != "in_flight":
                    return now == "present"
                left = deadline - self._loop.time()
                if left <= 0:
                    return False
                try:
                    await asyncio.wait_for(fut, left)
                except asyncio.TimeoutError:
                    return (await state(key)) == "present"
            finally:
                self._unwatch(key, fut)
