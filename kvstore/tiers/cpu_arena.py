"""The CPU tier: one shared-memory file in /dev/shm, split into slots by ExtentAllocator.

The daemon creates `/dev/shm/<shm_name>.arena` (mode 0600, so only the daemon's user can
map it), allocates its pages up front (`posix_fallocate`, so a full /dev/shm fails at
start, not at first write) and pre-touches its own mapping (first touch of a page is
slow). Clients map the same file once and read/write objects in place: a slot's Region
is (file path, offset, length). Where CUDA is present the daemon's mapping is registered
as pinned memory (cudaHostRegister) so copies to the GPU run at PCIe speed; clients pin
their own mapping the same way.

One arena file per daemon: it holds an exclusive flock on the file while open, so a
second daemon with the same shm_name gets AlreadyExists, and a stale file left by a
crashed daemon (no lock holder) is reused from scratch.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from kvstore.checksums import host_checksum
from kvstore.errors import AlreadyExists, InvalidRequest, StorageError
from kvstore.records import Region
from kvstore.tiers.arena import ArenaTier
from kvstore.tiers.base import Slot, check_tensor_arg

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")


def arena_path(shm_name: str, shm_dir: Path = SHM_DIR) -> Path:
    """The arena file of a daemon whose shm name is `shm_name`."""
    if not shm_name or "/" in shm_name or shm_name.startswith("."):
        raise InvalidRequest(f"shm name must be a plain non-empty file name, got {shm_name!r}")
    return shm_dir / f"{shm_name}.arena"


class CpuArena(ArenaTier):
    """Shared-memory arena tier; see the module docstring."""

    name = "cpu"

    def __init__(self, capacity: int, shm_name: str, shm_dir: Path = SHM_DIR, pin: Optional[bool] = None) -> None:
        super().__init__(capacity)
        self.path = arena_path(shm_name, shm_dir)
        self._pin = torch.cuda.is_available() if pin is None else pin
        self._fd = -1
        self._mm: Optional[mmap.mmap] = None
        self._pinned = False

    def open(self) -> None:
        cap = self._alloc.capacity
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise AlreadyExists(f"shared-memory arena {self.path} is in use by another daemon") from None
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, 0)  # a stale arena's bytes must not leak into this one
            os.ftruncate(fd, cap)
            try:
                os.posix_fallocate(fd, 0, cap)
            except OSError as exc:
                raise StorageError(
                    f"cannot allocate a {cap}-byte cpu arena at {self.path}: {exc.strerror} "
                    f"(/dev/shm too small? lower the cpu capacity)"
                ) from exc
            mm = mmap.mmap(fd, cap, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        self._fd, self._mm = fd, mm
        np.frombuffer(mm, dtype=np.uint8)[:: mmap.PAGESIZE] = 0  # pre-fault every page of our mapping
        self._base = torch.frombuffer(mm, dtype=torch.uint8)
        if self._pin:
            self._pinned = _cuda_host_register(self._base)

    def close(self) -> None:
        if self._mm is None:
            return
        if self._pinned:
            _cuda_host_unregister(self._base)
            self._pinned = False
        self._base = None
        try:
            self._mm.close()
        except BufferError:  # a view is still alive somewhere; the mapping goes with the process
            log.warning("cpu arena %s: views still alive at close; leaving the mapping to the GC", self.path)
        self._mm = None
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.close(self._fd)  # releases the flock
        self._fd = -1

    def _require_open(self) -> torch.Tensor:
        if self._base is None:
            raise StorageError(f"cpu arena {self.path} is not open")
        return self._base

    def region(self, slot: Slot) -> Region:
        return Region("shm", str(self.path), slot.offset, slot.size)

    def read_into(self, slot: Slot, dst: torch.Tensor) -> None:
        check_tensor_arg(self.name, "read_into", dst, slot.size)
        try:
            dst[: slot.size].copy_(self.view(slot))
        except RuntimeError as exc:
            raise StorageError(f"cpu arena read of {slot} failed: {exc}") from exc

    def write_from(self, slot: Slot, src: torch.Tensor) -> None:
        check_tensor_arg(self.name, "write_from", src, slot.size)
        try:
            self.view(slot).copy_(src[: slot.size])
        except RuntimeError as exc:
            raise StorageError(f"cpu arena write of {slot} failed: {exc}") from exc

    def checksum(self, slot: Slot) -> int:
        self._require_open()
        assert self._mm is not None
        with memoryview(self._mm) as mv:
            return host_checksum(mv[slot.offset : slot.offset + slot.size])

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "path": str(self.path), "pinned": self._pinned}


def _cuda_host_register(base: torch.Tensor) -> bool:
    """Pin a host mapping for fast H2D/D2H copies; False (logged) when it fails."""
    try:
        rc = torch.cuda.cudart().cudaHostRegister(base.data_ptr(), base.numel(), 0)
        ok = int(rc) == 0 if not hasattr(rc, "value") else rc.value == 0
        if not ok:
            log.warning("cudaHostRegister of the cpu arena failed (%s); copies will be unpinned", rc)
        return ok
    except Exception as exc:  # pragma: no cover - GPU only
        log.warning("cudaHostRegister of the cpu arena failed: %s", exc)
        return False


def _cuda_host_unregister(base: Optional[torch.Tensor]) -> None:
    if base is None:
        return
    try:  # pragma: no cover - GPU only
        torch.cuda.cudart().cudaHostUnregister(base.data_ptr())
    except Exception as exc:  # pragma: no cover
        log.warning("cudaHostUnregister of the cpu arena failed: %s", exc)
