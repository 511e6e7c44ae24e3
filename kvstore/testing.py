"""A real kvstore daemon in a subprocess, for tests and benchmarks (of this package and of
the engine's store connector).

Owns: `DaemonProcess`, which starts `python -m kvstore.cli serve` on a private socket,
cache directory and shared-memory name, waits until it answers grpc.health.v1 Check,
and stops it (SIGTERM), kills it (SIGKILL) or restarts it on the same directory, and
cleans up what a killed daemon leaves behind (its /dev/shm arena, its socket); and
`record_figures`, through which reliability tests report what they did (operations,
objects verified, losses) to tools/reliability_report.py.

    with DaemonProcess(tmp_path, cpu_capacity="64MiB") as daemon:
        with daemon.client() as kv:
            kv.put(b"k", b"v")
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

REPO_ROOT = Path(__file__).resolve().parent.parent
PR_SET_PDEATHSIG = 1
FIGURES_ENV = "KVSTORE_RELIABILITY_FIGURES"


def record_figures(test: str, **figures: Any) -> None:
    """Append `{"test": test, **figures}` as one JSON line to the file named by
    $KVSTORE_RELIABILITY_FIGURES (set by tools/reliability_report.py; unset: nothing is
    written). Figures are what the test counted, e.g. operations=, objects_verified=,
    losses=."""
    path = os.environ.get(FIGURES_ENV)
    if not path:
        return
    with open(path, "a") as fh:
        fh.write(json.dumps({"test": test, **figures}, sort_keys=True) + "\n")


def drop_page_cache(path: str) -> None:
    """fsync a file and evict its pages from the page cache, so the next read hits the disk
    (cold-read tests and benchmarks)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (for metrics/TCP listeners)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Run as `python -c _PDEATHSIG_EXEC PARENT_PID CMD...`: the child asks for SIGTERM when its
# parent dies (Linux prctl; kept across execve), then becomes CMD. Done in the child's own
# interpreter rather than as Popen's preexec_fn, which runs Python between fork and exec of
# a multi-threaded parent and can deadlock there (a lock another thread held at fork).
_PDEATHSIG_EXEC = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(%d, int(signal.SIGTERM), 0, 0, 0)\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit('kvstore.testing: the test process died before the daemon started')\n"
    "os.execv(sys.executable, [sys.executable] + sys.argv[2:])\n" % PR_SET_PDEATHSIG)


def _with_parent_death_signal(cmd: list[str]) -> list[str]:
    """`cmd` (a `python -m ...` command) wrapped so the child gets SIGTERM when its parent
    dies (Linux), so a test run that is killed does not leave daemons behind; `cmd`
    unchanged where prctl is unavailable."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl  # noqa: B018  (present?)
    except (OSError, AttributeError):
        return cmd
    return [sys.executable, "-c", _PDEATHSIG_EXEC, str(os.getpid()), *cmd[1:]]


class DaemonProcess:
    """One daemon subprocess; see the module docstring."""

    def __init__(self, root: Path, *, cpu_capacity: str = "64MiB", nvme_capacity: str = "256MiB",
                 gpu_capacity: str = "0", lease_ttl: float = 30.0, expire_interval: float = 0.2,
                 extra_args: Sequence[str] = (), env: Optional[dict[str, str]] = None,
                 entry: str = "kvstore.cli") -> None:
        self.root = Path(root)
        # "kvstore.cli" runs `kvstore serve`; "kvstore.server" the same daemon without typer/rich
        self.entry = entry
        self.dir = self.root / "cache"
        self._sockdir = Path(tempfile.mkdtemp(prefix="kvs-", dir="/tmp"))  # short: sun_path is 108 bytes
        self.socket = self._sockdir / "kvstore.sock"
        digest = hashlib.sha1(str(self.socket).encode()).hexdigest()[:12]
        self.shm_name = f"kvstore-test-{os.getuid()}-{digest}"
        self.args = [
            "--socket", str(self.socket), "--dir", str(self.dir), "--cpu-capacity", cpu_capacity,
            "--nvme-capacity", nvme_capacity, "--gpu-capacity", gpu_capacity, "--lease-ttl", str(lease_ttl),
            "--expire-interval", str(expire_interval), "--shm-name", self.shm_name, *extra_args,
        ]
        self.env = dict(os.environ if env is None else env)
        path = self.env.get("PYTHONPATH", "")
        self.env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + ([path] if path else []))
        for name in list(self.env):  # the daemon's config must come from our flags only
            if name.startswith("KVSTORE_"):
                del self.env[name]
        self.env["KVSTORE_CONFIG"] = os.devnull  # an empty config file, never the user's
        self.proc: Optional[subprocess.Popen] = None
        self.log_path = self.root / "daemon.log"
        self._log: Any = None

    # ------------------------------------------------------------------ lifecycle

    def start(self, timeout: float = 60.0) -> "DaemonProcess":
        self.root.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        cmd = [sys.executable, "-m", self.entry, *(["serve"] if self.entry == "kvstore.cli" else []), *self.args]
        self.proc = subprocess.Popen(_with_parent_death_signal(cmd), stdout=self._log, stderr=subprocess.STDOUT,
                                     env=self.env, cwd=str(REPO_ROOT))
        self.wait_healthy(timeout)
        return self

    def wait_healthy(self, timeout: float = 60.0) -> None:
        from kvstore.client import KVStoreClient
        from kvstore.errors import KVStoreError

        deadline = time.monotonic() + timeout
        while True:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvstore daemon exited with {self.proc.returncode} during start:\n{self.log_tail()}")
            if self.socket.exists():
                try:
                    with KVStoreClient(socket=self.socket, timeout=5.0) as kv:
                        if kv.health():
                            return
                except KVStoreError:
                    pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"kvstore daemon not healthy after {timeout}s:\n{self.log_tail()}")
            time.sleep(0.05)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Signal the daemon and wait for it; returns its exit code."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
                raise RuntimeError(f"kvstore daemon ignored signal {sig} for {timeout}s:\n{self.log_tail()}")
        code = self.proc.returncode
        self.proc = None
        if self._log is not None:
            self._log.close()
            self._log = None
        return code

    def kill(self) -> int:
        """SIGKILL: no shutdown code runs (a crash)."""
        return self.stop(signal.SIGKILL)

    def restart(self, timeout: float = 60.0) -> "DaemonProcess":
        self.stop()
        return self.start(timeout)

    def cleanup(self) -> None:
        """Stop if running; remove what a killed daemon leaves (arena file, socket dir)."""
        try:
            self.stop()
        finally:
            for leftover in Path("/dev/shm").glob(f"{self.shm_name}.*.arena"):
                try:
                    leftover.unlink()
                except FileNotFoundError:
                    pass
            shutil.rmtree(self._sockdir, ignore_errors=True)

    def arena_files(self) -> list[Path]:
        """The daemon's shared-memory arena file(s) (the name has a random part)."""
        return sorted(Path("/dev/shm").glob(f"{self.shm_name}.*.arena"))

    def __enter__(self) -> "DaemonProcess":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.cleanup()

    # ------------------------------------------------------------------ helpers

    @property
    def pid(self) -> Optional[int]:
        return self.proc.pid if self.proc else None

    def client(self, **kwargs: Any) -> Any:
        from kvstore.client import KVStoreClient

        return KVStoreClient(socket=self.socket, **kwargs)

    def cli(self, *args: str, input: Optional[bytes] = None, timeout: float = 60.0) -> subprocess.CompletedProcess:
        """Run `python -m kvstore.cli ARGS --socket <this daemon's socket>`."""
        cmd = [sys.executable, "-m", "kvstore.cli", *args]
        if args and args[0] not in ("serve", "config"):
            cmd += ["--socket", str(self.socket)]
        return subprocess.run(cmd, input=input, capture_output=True, env=self.env, cwd=str(REPO_ROOT),
                              timeout=timeout)

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except FileNotFoundError:
            return "(no daemon log)"
