"""The kvstore daemon process: one Store behind a gRPC server, and its lifecycle.

Owns: turning a `Config` into `StoreSettings`, start-up checks (one daemon per socket,
guarded by a lock file; shared-memory room for the CPU arena), the gRPC server (unix
socket with mode 0600 in a 0700 directory, message-size limits, standard
grpc.health.v1 health checking), the optional TCP listener (a second gRPC server on the
same loop: every call must carry the bearer token of --tcp-token-file, checked by
kvstore.server.tcpauth; TLS with --tcp-tls-cert/--tcp-tls-key; bytes over the wire, no
regions), the background thread that expires dead leases and
reservations, the optional Prometheus endpoint, the fast Lookup socket `<socket>.fast`
(kvstore.server.fastpath; config `fast_lookup`), and graceful shutdown on SIGTERM/SIGINT:
stop accepting, let in-flight RPCs finish (a short grace), abort open reservations,
optionally write the CPU tier back to NVMe, flush and close the index, remove the sockets.

The server is a grpc.aio server on an asyncio event loop that runs in its own thread
("kvstore-loop"): an RPC is served without a thread hand-off when it can be (see
kvstore.server.servicer), and work that blocks (hashing, fsync, LMDB, tier moves, WaitFor)
runs on a pool of `workers` threads. `start()` and `stop()` stay synchronous.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import signal
import threading
from concurrent import futures
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable, Optional

import grpc

from kvstore.config import Config, ConfigError, ensure_socket_dir, format_size, resolve_gpu_capacity
from kvstore.errors import AlreadyExists
from kvstore.rpc import codec, fastwire
from kvstore.rpc import kvstore_pb2 as pb
from kvstore.rpc.service import (
    HEALTH_CHECK_METHOD, HEALTH_SERVING, PROTOCOL_VERSION, channel_options, generic_handler,
)
from kvstore.server.fastpath import FastLookupServer
from kvstore.server.metrics import DaemonMetrics
from kvstore.server.servicer import KVStoreServicer
from kvstore.server.tcpauth import TcpSettings, TokenCheck, server_credentials, tcp_settings
from kvstore.tiers.registry import TIERS

log = logging.getLogger("kvstore.server")

SHUTDOWN_GRACE_S = 5.0


def daemon_version() -> str:
    try:
        from importlib.metadata import version

        return version("hypercache")
    except Exception:  # running from a checkout, not installed
        return "0.1.0+checkout"

SHM_DIR = Path("/dev/shm")


def _cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # pragma: no cover - torch is a dependency
        return False


def store_settings(config: Config, cuda_available: Callable[[], bool] = _cuda_available) -> Any:
    """The StoreSettings a config describes (GPU capacity resolved against CUDA presence)."""
    from kvstore.store import StoreSettings

    return StoreSettings(
        dir=Path(config.dir),
        cpu_capacity=config.cpu_capacity,
        nvme_capacity=config.nvme_capacity,
        gpu_capacity=resolve_gpu_capacity(config, cuda_available),
        shm_name=config.shm_name,
        lease_ttl_s=config.lease_ttl,
        eviction=config.eviction,
        default_tier=config.default_tier,
        writeback_on_close=config.writeback_on_close,
        writeback_watermark=config.writeback_watermark,
        verify_nvme=config.verify_nvme,
        remote_url=config.remote,
        remote_policy=config.remote_policy,
        remote_timeout_s=config.remote_timeout,
        verify_memory=config.verify_memory,
        index_recovery=config.index_recovery,
        arena_mode=int(config.arena_mode, 8),
        max_key_bytes=config.max_key_bytes,
    )


def check_shm_room(cpu_capacity: int, shm_dir: Path = SHM_DIR) -> None:
    """Refuse a CPU arena larger than the free space of /dev/shm (writes past it would
    kill the daemon and its clients with SIGBUS)."""
    if cpu_capacity <= 0 or not shm_dir.is_dir():
        return
    st = os.statvfs(shm_dir)
    free = st.f_bavail * st.f_frsize
    if cpu_capacity > free:
        raise ConfigError(
            f"cpu_capacity {format_size(cpu_capacity)} exceeds the free space in {shm_dir} ({format_size(free)}); "
            f"pass a smaller --cpu-capacity or enlarge {shm_dir}"
        )


SECRET_WORDS = ("token", "secret", "password")  # options whose values a settings report leaves out


def settings_report(config: Config) -> dict[str, Any]:
    """The daemon's effective settings as Stats reports them (`kvstore config --socket`):
    values, where each came from, the config file; values of secret options withheld."""
    values = {name: ("(set, not shown)" if any(w in name for w in SECRET_WORDS) and value else value)
              for name, value in config.as_dict().items()}
    return {"config": values, "sources": dict(config.sources),
            "config_file": str(config.config_file) if config.config_file else None}


class _SocketLock:
    """An flock on SOCKET.lock: held for the daemon's life, so a second daemon on the same
    socket fails fast instead of unlinking the first one's socket."""

    def __init__(self, socket: Path) -> None:
        self.path = Path(str(socket) + ".lock")
        self._fd: Optional[int] = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                owner = os.pread(fd, 32, 0).decode(errors="replace").strip()
            finally:
                os.close(fd)
            raise AlreadyExists(
                f"a kvstore daemon (pid {owner or '?'}) already serves {self.path.with_suffix('')}; "
                "stop it first or pass another --socket"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        if self._fd is not None:
            try:
                self.path.unlink(missing_ok=True)
            finally:
                os.close(self._fd)
                self._fd = None


def _health_handler() -> grpc.GenericRpcHandler:
    """grpc.health.v1 health: the grpcio-health-checking servicer when installed, else a
    wire-compatible Check that answers SERVING (see kvstore.rpc.service)."""

    async def check(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return bytes([0x08, HEALTH_SERVING])

    method = HEALTH_CHECK_METHOD.rsplit("/", 1)[1]
    handler = grpc.unary_unary_rpc_method_handler(check)  # raw bytes in and out
    return grpc.method_handlers_generic_handler(HEALTH_CHECK_METHOD.split("/")[1], {method: handler})


class Daemon:
    """One running daemon. `start()` opens the store and starts serving; `stop()` shuts it
    down gracefully; `serve_forever()` does both around waiting for SIGTERM/SIGINT."""

    def __init__(self, config: Config, store_factory: Optional[Callable[[Any], Any]] = None) -> None:
        self.config = config
        self._store_factory = store_factory
        self.store: Any = None
        self.server: Optional[grpc.aio.Server] = None
        self.tcp_server: Optional[grpc.aio.Server] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._loop_thread: Optional[threading.Thread] = None
        self._pool: Optional[futures.ThreadPoolExecutor] = None
        self.metrics: Optional[DaemonMetrics] = None
        self.metrics_port: Optional[int] = None
        self.tcp_port: Optional[int] = None
        self._health: Any = None
        self.fast: Optional[FastLookupServer] = None
        self._lock = _SocketLock(config.socket)
        self._stopping = threading.Event()
        self._expirer: Optional[threading.Thread] = None
        self._stopped = False

    # ------------------------------------------------------------------ start

    def start(self) -> None:
        cfg = self.config
        ensure_socket_dir(cfg.socket)
        self._lock.acquire()
        try:
            self._start_locked()
        except BaseException:
            self._teardown()
            raise

    def _start_locked(self) -> None:
        cfg = self.config
        settings = store_settings(cfg)
        tcp = tcp_settings(cfg)  # before anything opens: --tcp without a token never starts
        check_shm_room(settings.cpu_capacity)
        if self._store_factory is not None:
            self.store = self._store_factory(settings)
        else:
            from kvstore.store import Store

            self.store = Store(settings)
        self.store.open()
        tiers = codec.tiers_enabled(TIERS.capacities(settings))
        if not tiers:
            raise ConfigError("every tier has capacity 0; give at least one of --cpu-capacity, --nvme-capacity, "
                              "--gpu-capacity a size")
        default_tier = cfg.default_tier if cfg.default_tier in tiers else tiers[0]
        limits = codec.Limits(max_batch=cfg.max_batch, max_key_bytes=cfg.max_key_bytes, tiers=tiers,
                              default_tier=default_tier, max_message_bytes=cfg.max_message_size)
        info = pb.InfoResponse(
            protocol_version=PROTOCOL_VERSION, daemon_version=daemon_version(), pid=os.getpid(),
            lease_ttl_s=cfg.lease_ttl, max_message_bytes=cfg.max_message_size, max_batch=cfg.max_batch,
            max_key_bytes=cfg.max_key_bytes, tiers=list(tiers), default_tier=default_tier,
        )
        self.metrics = DaemonMetrics(self.store.stats)
        self._pool = futures.ThreadPoolExecutor(max_workers=cfg.workers, thread_name_prefix="kvstore-rpc")
        servicer = KVStoreServicer(self.store, limits, self.metrics, info, executor=self._pool,
                                   settings_report=settings_report(cfg))
        self._start_loop()
        assert self._loop is not None
        servicer.attach_loop(self._loop)
        sock = Path(cfg.socket).absolute()
        # The fast socket first: its bind changes the process umask for an instant, which
        # must not happen while the gRPC server already serves puts (new NVMe files).
        if cfg.fast_lookup:
            self.fast = FastLookupServer(servicer, fastwire.fast_socket_path(sock), cfg.max_message_size)
            self._on_loop(self.fast.start()).result()
        elif fastwire.fast_socket_path(sock).is_socket():  # a killed daemon's: clients would try it
            fastwire.fast_socket_path(sock).unlink()
        self._on_loop(self._start_server(servicer, sock)).result()
        os.chmod(sock, 0o600)
        if tcp is not None:
            self._on_loop(self._start_tcp_server(servicer.for_tcp(), tcp)).result()

        self._expirer = threading.Thread(target=self._expire_loop, name="kvstore-expire", daemon=True)
        self._expirer.start()
        if cfg.metrics_port:
            self.metrics_port = self.metrics.serve_http(cfg.metrics_host, cfg.metrics_port)
        log.info(
            "kvstore daemon ready: socket=%s%s%s pid=%d tiers=%s dir=%s%s", sock,
            f" fast={self.fast.path}" if self.fast else "",
            f" tcp={tcp.target}{'+tls' if tcp.tls else ''}" if tcp else "", os.getpid(),
            ",".join(f"{t}={format_size(c)}" for t, c in TIERS.capacities(settings) if c),
            cfg.dir, f" metrics=http://{cfg.metrics_host}:{self.metrics_port}/metrics" if self.metrics_port else "",
        )

    # ------------------------------------------------------------------ the event loop

    def _start_loop(self) -> None:
        loop = asyncio.new_event_loop()
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(loop)
            loop.call_soon(ready.set)
            try:
                loop.run_forever()
            finally:
                loop.close()

        self._loop = loop
        self._loop_thread = threading.Thread(target=run, name="kvstore-loop", daemon=True)
        self._loop_thread.start()
        ready.wait()

    def _on_loop(self, coro: Any) -> Future:
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _stop_loop(self) -> None:
        if self._loop is None:
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        if self._loop_thread is not None:
            self._loop_thread.join(timeout=5.0)
        self._loop = None
        self._loop_thread = None

    async def _start_server(self, servicer: KVStoreServicer, sock: Path) -> None:
        """Build, bind and start the grpc.aio server (on the loop: it binds to it)."""
        cfg = self.config
        self.server = grpc.aio.server(
            options=channel_options(cfg.max_message_size) + [("grpc.so_reuseport", 0)],
        )
        self.server.add_generic_rpc_handlers((generic_handler(servicer.handlers()),))
        await self._add_health()
        if sock.exists() or sock.is_symlink():
            sock.unlink()  # stale: we hold the lock, so no live daemon owns it
        old_umask = os.umask(0o177)
        try:
            bound = self.server.add_insecure_port(f"unix:{sock}")
        except RuntimeError:
            bound = 0
        finally:
            os.umask(old_umask)
        if bound == 0:
            raise ConfigError(f"cannot listen on unix socket {sock}")
        await self.server.start()

    async def _start_tcp_server(self, servicer: KVStoreServicer, tcp: TcpSettings) -> None:
        """The TCP listener: its own server, every call checked for the token first."""
        cfg = self.config
        assert self.metrics is not None
        self.tcp_server = grpc.aio.server(
            options=channel_options(cfg.max_message_size) + [("grpc.so_reuseport", 0)],
            interceptors=[TokenCheck(tcp.token, self.metrics.refused)],
        )
        self.tcp_server.add_generic_rpc_handlers((generic_handler(servicer.handlers()), _health_handler()))
        try:
            if tcp.tls is not None:
                self.tcp_port = self.tcp_server.add_secure_port(tcp.target, server_credentials(tcp.tls))
            else:
                self.tcp_port = self.tcp_server.add_insecure_port(tcp.target)
        except RuntimeError:
            self.tcp_port = 0
        if self.tcp_port == 0:
            raise ConfigError(f"cannot listen on TCP {tcp.target} (address in use or not local?)")
        await self.tcp_server.start()

    async def _add_health(self) -> None:
        try:
            from grpc_health.v1 import health, health_pb2, health_pb2_grpc
        except Exception:  # grpcio-health-checking missing or built for another protobuf
            log.debug("grpc_health not importable; serving the built-in grpc.health.v1 Check")
            assert self.server is not None
            self.server.add_generic_rpc_handlers((_health_handler(),))
            return
        self._health = health.aio.HealthServicer()
        for service in ("", "kvstore.v1.KVStore"):
            await self._health.set(service, health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self.server)

    async def _stop_server(self, grace: float) -> None:
        if self.fast is not None:
            await self.fast.stop()
        if self._health is not None:
            try:
                await self._health.enter_graceful_shutdown()
            except Exception:  # older grpc_health without it
                pass
        await asyncio.gather(*(server.stop(grace) for server in (self.tcp_server, self.server) if server is not None))

    def _expire_loop(self) -> None:
        interval = self.config.expire_interval
        while not self._stopping.wait(interval):
            try:
                self.store.expire()
            except Exception:
                log.exception("store.expire() failed; will retry in %.3gs", interval)

    # ------------------------------------------------------------------ stop

    def stop(self, grace: float = SHUTDOWN_GRACE_S) -> None:
        """Graceful shutdown (idempotent): NOT_SERVING, stop accepting, wait up to `grace`
        for in-flight RPCs, then close the store (aborts reservations, flushes the index)."""
        if self._stopped or not self._lock.held:  # never started (or another daemon owns the socket)
            return
        self._stopped = True
        log.info("kvstore daemon shutting down")
        self._stopping.set()
        if self._loop is not None:
            try:
                self._on_loop(self._stop_server(grace)).result(grace + 2.0)
            except Exception:
                log.exception("stopping the gRPC server failed")
        self._teardown()
        log.info("kvstore daemon stopped")

    def _teardown(self) -> None:
        """Release what start() acquired; only ever runs while holding the socket lock."""
        if not self._lock.held:
            return
        self._stopping.set()
        if self._expirer is not None:
            self._expirer.join(timeout=self.config.expire_interval + 1.0)
        if self._loop is not None and not self._stopped:  # start() failed half way
            for server in (self.tcp_server, self.server):
                if server is None:
                    continue
                try:
                    self._on_loop(server.stop(0)).result(2.0)
                except Exception:
                    pass
        if self._loop is not None and self.fast is not None and not self._stopped:
            try:
                self._on_loop(self.fast.stop()).result(3.0)
            except Exception:
                pass
        self._stop_loop()
        if self.metrics is not None:
            self.metrics.stop_http()
        if self.store is not None:
            try:
                self.store.close()
            except Exception:
                log.exception("closing the store failed")
        if self._pool is not None:  # after close: a WaitFor still waiting returns when the store closes
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        try:
            sock = Path(self.config.socket)
            for path in (sock, fastwire.fast_socket_path(sock)):
                if path.is_socket():
                    path.unlink()
        except OSError:
            pass
        self._lock.release()

    # ------------------------------------------------------------------ main loop

    def serve_forever(self) -> None:
        """Start, wait for SIGTERM or SIGINT, stop. Call from the main thread."""
        done = threading.Event()

        def on_signal(signum: int, _frame: Any) -> None:
            if done.is_set():
                log.warning("second %s: already shutting down", signal.Signals(signum).name)
                return
            log.info("received %s", signal.Signals(signum).name)
            done.set()

        previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            self.start()
            while not done.wait(1.0):
                pass
        finally:
            self.stop()
            for s, h in previous.items():
                signal.signal(s, h)


def serve(config: Config) -> None:
    """Run a daemon for `config` until SIGTERM/SIGINT (the body of `kvstore serve`)."""
    logging.basicConfig(
        level=getattr(logging, config.log_level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    Daemon(config).serve_forever()


__all__ = ["Daemon", "serve", "store_settings", "check_shm_room", "settings_report"]
