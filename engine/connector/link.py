"""`StoreLink`: the connector's one connection to the kvstore daemon, and what happens
when the daemon goes away.

Owns the `KVStoreClient`, the availability state (the `store_available` gauge), the
classification of failures (transport: daemon not running, too slow, arena gone ->
unavailable; logical: unknown key, no capacity, bad object -> the caller's problem), and
a reconnect thread with exponential backoff that probes the daemon's health and swaps
in a fresh client once it answers, counting daemon restarts (a new daemon pid).

    link = StoreLink(config, metrics)
    link.start()                       # never raises; unavailable until a probe succeeds
    entries = link.call("lookup", lambda kv: kv.lookup(keys))   # StoreUnavailable when away

`call` never blocks on an unavailable daemon: it raises `StoreUnavailable` at once, and
a call that fails for transport reasons marks the link unavailable and wakes the
reconnect thread. Thread-safe.

Claims use the client's public `reserve` / `abort` (a reservation never committed).
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Optional, TypeVar

from engine.connector.config import StoreConnectorConfig
from engine.connector.errors import StoreUnavailable
from engine.connector.metrics import ConnectorMetrics
from kvstore.client import KVStoreClient
from kvstore.client.common import CONNECT_TIMEOUT_S
from kvstore.errors import DaemonNotRunning, KVStoreError

log = logging.getLogger("engine.connector")
T = TypeVar("T")


def is_transport_error(exc: BaseException) -> bool:
    """True for failures that say the daemon is unreachable or too slow (not running,
    deadline exceeded, channel closed, arena gone), as opposed to a logical answer."""
    return isinstance(exc, DaemonNotRunning) or type(exc) is KVStoreError


class StoreLink:
    """One connection to the daemon with reconnect (module docstring)."""

    def __init__(self, config: StoreConnectorConfig, metrics: ConnectorMetrics,
                 client_factory: Optional[Callable[[], KVStoreClient]] = None) -> None:
        self.config = config
        self.metrics = metrics
        self._factory = client_factory or self._new_client
        self._client: Optional[KVStoreClient] = None
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._daemon_pid: Optional[int] = None
        self._on_restart: list[Callable[[], None]] = []
        self._on_connect: list[Callable[[], None]] = []
        self._generation = 0  # bumps on every new client

    def _new_client(self) -> KVStoreClient:
        return KVStoreClient(self.config.socket, self.config.tcp, timeout=self.config.rpc_timeout_s)

    # ------------------------------------------------------------------ state
    @property
    def available(self) -> bool:
        return self._client is not None

    @property
    def generation(self) -> int:
        """Increases each time a new connection is made (a restarted daemon invalidates
        reservations and leases of the previous generation)."""
        return self._generation

    @property
    def target(self) -> str:
        client = self._client
        if client is not None:
            return client.target
        from kvstore.client.common import resolve_target

        return resolve_target(self.config.socket, self.config.tcp)

    def on_restart(self, fn: Callable[[], None]) -> None:
        """Call `fn()` (from the reconnect thread) when the daemon came back as a new process."""
        self._on_restart.append(fn)

    def on_connect(self, fn: Callable[[], None]) -> None:
        """Call `fn()` after every successful connection (the first one and each reconnect),
        from the thread that connected: it must return quickly."""
        self._on_connect.append(fn)

    def start(self) -> bool:
        """Try to connect once; start the reconnect thread either way. True if connected."""
        ok = self._try_connect()
        if self._thread is None:
            self._thread = threading.Thread(target=self._reconnect_loop, name="kvconn-reconnect", daemon=True)
            self._thread.start()
        if not ok:
            log.warning("kvstore daemon at %s is not available; serving by recomputation until it is", self.target)
        return ok

    def close(self) -> None:
        self._closed.set()
        self._wake.set()
        with self._lock:
            client, self._client = self._client, None
        self.metrics.set_available(False)
        if client is not None:
            client.close()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)

    # ------------------------------------------------------------------ calls
    def client(self) -> KVStoreClient:
        """The live client; StoreUnavailable when the daemon is away."""
        client = self._client
        if client is None:
            raise StoreUnavailable(f"kvstore daemon at {self.target} is unavailable")
        return client

    def call(self, what: str, fn: Callable[[KVStoreClient], T]) -> T:
        """Run `fn(client)`. Transport failures mark the daemon unavailable and raise
        StoreUnavailable; logical kvstore errors propagate unchanged."""
        client = self.client()
        try:
            return fn(client)
        except KVStoreError as exc:
            if is_transport_error(exc):
                self.lost(client, f"{what}: {exc}")
                raise StoreUnavailable(f"kvstore daemon at {self.target} failed {what}: {exc}") from exc
            raise

    def lost(self, client: KVStoreClient, why: str) -> None:
        """`client` failed for transport reasons: drop it and let the reconnect loop work."""
        with self._lock:
            if self._client is not client:
                return
            self._client = None
        self.metrics.set_available(False)
        self.metrics.inc("disconnects")
        log.warning("kvstore daemon unavailable (%s); serving by recomputation, reconnecting", why)
        threading.Thread(target=_close_quietly, args=(client,), name="kvconn-close", daemon=True).start()
        self._wake.set()

    # ------------------------------------------------------------------ reconnect
    def _try_connect(self) -> bool:
        try:
            client = self._factory()
        except KVStoreError as exc:
            log.debug("connect to %s failed: %s", self.target, exc)
            return False
        try:
            if not client.health(timeout=min(self.config.rpc_timeout_s, CONNECT_TIMEOUT_S)):
                raise KVStoreError("daemon health is not SERVING")
        except KVStoreError as exc:
            log.debug("daemon at %s not healthy: %s", self.target, exc)
            _close_quietly(client)
            return False
        pid = client.info.pid if client.info else None
        restarted = self._daemon_pid is not None and pid != self._daemon_pid
        with self._lock:
            if self._closed.is_set():
                _close_quietly(client)
                return False
            was_connected = self._daemon_pid is not None
            self._client = client
            self._daemon_pid = pid
            self._generation += 1
        self.metrics.set_available(True)
        if was_connected:
            self.metrics.inc("reconnects")
            log.info("reconnected to the kvstore daemon at %s (pid %s)", self.target, pid)
        callbacks = list(self._on_connect)
        if restarted:
            self.metrics.inc("daemon_restarts")
            callbacks = self._on_restart + callbacks
        for fn in callbacks:
            try:
                fn()
            except Exception:  # a callback must not kill the reconnect loop
                log.exception("connect callback failed")
        return True

    def _reconnect_loop(self) -> None:
        delay = self.config.reconnect_min_s
        while not self._closed.is_set():
            if self._client is not None:
                self._wake.wait()
                self._wake.clear()
                delay = self.config.reconnect_min_s
                continue
            if self._try_connect():
                continue
            self._closed.wait(delay)
            delay = min(delay * 2, self.config.reconnect_max_s)


def _close_quietly(client: Any) -> None:
    try:
        client.close()
    except Exception:  # closing a client of a dead daemon: nothing left to tell it
        log.debug("closing a kvstore client failed", exc_info=True)
