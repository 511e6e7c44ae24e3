"""The CPU tier: one shared-memory file in /dev/shm, split into slots by ExtentAllocator.

The daemon creates `/dev/shm/<shm_name>.<random>.arena` exclusively (O_CREAT | O_EXCL |
O_NOFOLLOW: a file or symlink planted under any name makes creation fail, and the random
part makes the name unguessable), checks that what it opened is a regular file it owns
with the mode it asked for (0600 by default: only the daemon's user can map it; the
`arena_mode` setting 0640 / 0660 shares it with the group, and nothing wider), allocates
its pages up front (`posix_fallocate`, so a full /dev/shm fails at start, not at first
write) and pre-touches its own mapping (first touch of a page is slow). Clients learn the
path from each Region, map the file read-only for reads (and read-write only to write
their own puts) and read/write objects in place: a slot's Region is (file path, offset,
length). Where CUDA is present the daemon's mapping is registered as pinned memory
(cudaHostRegister) so copies to the GPU run at PCIe speed; clients pin their own mapping
the same way.

One arena per shm_name: the daemon holds an exclusive flock on its file while open. At
open it looks at the files `<shm_name>.*.arena` this user owns: one still locked means a
live daemon uses the name (AlreadyExists); unlocked ones were left by a crashed daemon
and are removed. Files of other users, and symlinks, are never opened or removed.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import secrets
import stat
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
ARENA_MODES = (0o600, 0o640, 0o660)


def _check_name(shm_name: str) -> None:
    if not shm_name or "/" in shm_name or shm_name.startswith("."):
        raise InvalidRequest(f"shm name must be a plain non-empty file name, got {shm_name!r}")


def arena_path(shm_name: str, shm_dir: Path = SHM_DIR) -> Path:
    """A fresh, unguessable arena file path for a daemon whose shm name is `shm_name`."""
    _check_name(shm_name)
    return shm_dir / f"{shm_name}.{secrets.token_hex(16)}.arena"


def arena_files(shm_name: str, shm_dir: Path = SHM_DIR) -> list[Path]:
    """Every arena file of `shm_name` (any user's; callers check owners)."""
    _check_name(shm_name)
    return sorted(shm_dir.glob(f"{shm_name}.*.arena"))


def check_arena_file(fd: int, path: Path, mode: Optional[int] = None) -> os.stat_result:
    """StorageError unless the open file is a regular file owned by this user (daemon
    side: with `mode`, exactly that mode)."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise StorageError(f"shared-memory arena {path} is not a regular file; refusing it")
    if st.st_uid != os.geteuid():
        raise StorageError(f"shared-memory arena {path} belongs to uid {st.st_uid}, not {os.geteuid()}; refusing it")
    if mode is not None and st.st_mode & 0o777 != mode:
        raise StorageError(f"shared-memory arena {path} has mode {st.st_mode & 0o777:o}, not {mode:o}; refusing it")
    return st


class CpuArena(ArenaTier):
    """Shared-memory arena tier; see the module docstring."""

    name = "cpu"

    def __init__(self, capacity: int, shm_name: str, shm_dir: Path = SHM_DIR, pin: Optional[bool] = None,
                 mode: int = 0o600) -> None:
        super().__init__(capacity)
        if mode not in ARENA_MODES:
            raise InvalidRequest(f"arena mode must be one of {', '.join(f'{m:04o}' for m in ARENA_MODES)}, "
                                 f"got {mode:04o}")
        _check_name(shm_name)
        self.shm_name, self.shm_dir, self.mode = shm_name, Path(shm_dir), mode
        self.path = Path()  # chosen at open
        self._pin = torch.cuda.is_available() if pin is None else pin
        self._fd = -1
        self._mm: Optional[mmap.mmap] = None
        self._pinned = False
        self._host: Optional[tuple[int, memoryview]] = None  # (base address, view of the whole mapping) while open

    def _sweep(self) -> None:
        """AlreadyExists when a live daemon holds an arena of this name; remove the ones
        crashed daemons left (this user's regular files only)."""
        legacy = self.shm_dir / f"{self.shm_name}.arena"  # the fixed name older daemons used
        for path in arena_files(self.shm_name, self.shm_dir) + ([legacy] if legacy.exists() else []):
            try:
                st = os.lstat(path)
                if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                    log.warning("cpu arena: ignoring %s (not a regular file of uid %d)", path, os.geteuid())
                    continue
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            except OSError:
                continue
            try:
                check_arena_file(fd, path)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise AlreadyExists(f"shared-memory arena {path} (name {self.shm_name!r}) is in use by another "
                                        f"daemon") from None
                log.info("cpu arena: removing %s, left by a daemon that did not stop cleanly", path)
                os.unlink(path)
            except StorageError:
                continue
            finally:
                os.close(fd)

    def open(self) -> None:
        cap = self._alloc.capacity
        self._sweep()
        self.path = arena_path(self.shm_name, self.shm_dir)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, self.mode)
        except OSError as exc:
            raise StorageError(f"cannot create the cpu arena {self.path}: {exc.strerror}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.fchmod(fd, self.mode)  # the umask may have taken bits off
            check_arena_file(fd, self.path, self.mode)
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
            os.unlink(self.path)
            raise
        self._fd, self._mm = fd, mm
        np.frombuffer(mm, dtype=np.uint8)[:: mmap.PAGESIZE] = 0  # pre-fault every page of our mapping
        self._base = torch.frombuffer(mm, dtype=torch.uint8)
        self._host = (self._base.data_ptr(), memoryview(mm))
        if self._pin:
            self._pinned = _cuda_host_register(self._base)

    def close(self) -> None:
        if self._mm is None:
            return
        if self._pinned:
            _cuda_host_unregister(self._base)
            self._pinned = False
        self._base = None
        # dropped, not released: a view sliced from it by a call racing this close stays
        # valid (and holds the mapping: then the BufferError below)
        self._host = None
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

    def host_extent(self, slot: Slot) -> Optional[tuple[int, memoryview]]:
        h = self._host
        if h is None:
            raise StorageError(f"cpu arena {self.path} is not open")
        off = slot.offset
        return h[0] + off, h[1][off : off + slot.length]

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
