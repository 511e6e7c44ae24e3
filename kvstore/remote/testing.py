"""A real `mooncake_master` on loopback, for tests and benchmarks of the remote tier.

Owns: `MooncakeMaster`, which starts the master with its embedded HTTP metadata server
on free loopback ports, waits until it answers, pauses and resumes it (SIGSTOP/SIGCONT:
a hung master), kills and restarts it on the same ports (a master restart), and `mooncake_unavailable()`, the reason
the remote tier cannot run here (None when it can).

    with MooncakeMaster(tmp_path) as master:
        url = master.url  # mooncake://127.0.0.1:PORT?metadata=http://127.0.0.1:PORT/metadata&protocol=tcp
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

from kvstore.testing import free_port


def master_binary() -> Optional[str]:
    """The mooncake_master executable beside this Python, else on PATH."""
    here = Path(sys.executable).parent / "mooncake_master"
    if here.exists():
        return str(here)
    return shutil.which("mooncake_master")


def mooncake_unavailable() -> Optional[str]:
    """Why Mooncake Store cannot run here (the client does not import, no master binary), or None."""
    try:
        from mooncake.store import MooncakeDistributedStore  # noqa: F401
    except ImportError as exc:
        return f"the Mooncake Store client does not import ({exc}): install the remote extra and libibverbs1 librdmacm1 libnuma1"
    if master_binary() is None:
        return "no mooncake_master executable (install mooncake-transfer-engine-non-cuda)"
    return None


class MooncakeMaster:
    """One mooncake_master process on loopback (module docstring)."""

    def __init__(self, root: Path, extra_args: tuple[str, ...] = ()) -> None:
        self.root = Path(root)
        self.rpc_port, self.http_port, self.metrics_port = free_port(), free_port(), free_port()
        self.extra_args = extra_args
        self.proc: Optional[subprocess.Popen] = None
        self.log_path = self.root / "mooncake_master.log"
        self.restarts = 0

    @property
    def metadata(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metadata"

    @property
    def url(self) -> str:
        return f"mooncake://127.0.0.1:{self.rpc_port}?metadata={self.metadata}&protocol=tcp"

    def start(self, timeout: float = 30.0) -> "MooncakeMaster":
        binary = master_binary()
        if binary is None:
            raise RuntimeError("no mooncake_master executable")
        self.root.mkdir(parents=True, exist_ok=True)
        cmd = [binary, f"--rpc_port={self.rpc_port}", "--rpc_address=127.0.0.1",
               "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
               f"--http_metadata_server_port={self.http_port}", f"--metrics_port={self.metrics_port}",
               *self.extra_args]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while not (self._listening(self.rpc_port) and self._listening(self.http_port)):
            if self.proc.poll() is not None:
                raise RuntimeError(f"mooncake_master exited with {self.proc.returncode}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"mooncake_master not listening after {timeout}s:\n{self.log_tail()}")
            time.sleep(0.05)
        return self

    @staticmethod
    def _listening(port: int) -> bool:
        with socket.socket() as s:
            s.settimeout(0.2)
            return s.connect_ex(("127.0.0.1", port)) == 0

    def kill(self) -> None:
        """SIGKILL: the master and everything it knew are gone."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def pause(self, timeout: float = 5.0) -> None:
        """SIGSTOP: the master hangs (accepts connections, answers nothing) until `resume`.
        Returns once every thread of it is stopped (signal delivery is asynchronous: on a
        loaded machine a thread could still answer a request sent right after the kill)."""
        if self.proc is None:
            return
        self.proc.send_signal(signal.SIGSTOP)
        tasks = Path(f"/proc/{self.proc.pid}/task")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                states = [(t / "stat").read_text().rsplit(")", 1)[1].split()[0] for t in tasks.iterdir()]
            except (FileNotFoundError, ProcessLookupError, IndexError):
                return  # no /proc here, or the master is gone: nothing more to wait for
            if all(st in ("T", "t") for st in states):
                return
            time.sleep(0.005)

    def resume(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGCONT)

    def restart(self) -> "MooncakeMaster":
        self.kill()
        self.restarts += 1
        return self.start()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a paused master cannot act on SIGTERM
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except FileNotFoundError:
            return "(no master log)"

    def __enter__(self) -> "MooncakeMaster":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
