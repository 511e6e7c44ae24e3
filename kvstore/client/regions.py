"""Client-side access to the bytes a Region names: the daemon's shared-memory arena, NVMe
object files, and the GPU arena over CUDA IPC.

Owns: mapping each shm arena once per process and caching the mapping (shared by every
client in the process; re-mapped when the daemon restarted and the arena file is a new
one). Reads go through a read-only mapping (PROT_READ: a reader cannot change another
object's bytes by mistake); a read-write mapping is made only when this process writes a
put. Arena files are opened without following links and refused unless regular and not
writable by every user. Mappings are pinned with cudaHostRegister where CUDA is present
(the read-only one with cudaHostRegisterReadOnly), so copies to and from the GPU run at
PCIe speed. Also: mapping object files for in-place reads and writes (copies out of
them read the file instead: kvstore.client.fileio), and opening CUDA IPC handles once.

Buffers come back as numpy uint8 arrays that alias the mapping. Whatever is derived from
one (a memoryview, `torch.from_numpy`, slices) keeps that array, and so the mapping, alive;
`ObjectView` ties its lease to the same array, so a lease is held while any view of its
bytes exists.

`mapped_arenas()` reports the process's arena mappings (path, size, pinned, users).
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import stat
import sys
import threading
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from kvstore import checksums as cks
from kvstore.errors import BadObject, InvalidRequest, KVStoreError, StorageError
from kvstore.records import Region

log = logging.getLogger("kvstore.client")

IO_CHUNK = 64 << 20  # bytes per pwrite when writing a file region
# Bytes per step of `write_hashed`: small enough that a chunk just copied is still in the
# L2/L3 cache when it is hashed, large enough that the per-step overhead is negligible.
HASH_CHUNK = 256 << 10


@dataclass
class _Arena:
    """One arena file mapped by this process: read-only for reads (`array`); read-write
    (`rw_array`) only once this process writes a put into it."""

    ino: tuple[int, int]
    mm: mmap.mmap
    array: np.ndarray
    pinned: bool
    rw_mm: Optional[mmap.mmap] = None
    rw_array: Optional[np.ndarray] = None
    rw_pinned: bool = False


CUDA_HOST_REGISTER_READ_ONLY = 8  # cudaHostRegisterReadOnly: pin a PROT_READ mapping


def _open_arena(path: str, writable: bool) -> int:
    """Open an arena file without following links; KVStoreError unless it is a regular
    file that no other user may write (the daemon makes it 0600, 0640 or 0660)."""
    try:
        fd = os.open(path, (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW | os.O_CLOEXEC)
    except PermissionError:
        raise KVStoreError(f"no permission to map the daemon's arena {path} (it belongs to another user)") from None
    except OSError as exc:
        raise KVStoreError(f"cannot open the daemon's arena {path}: {exc.strerror}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_mode & 0o002:
        os.close(fd)
        raise KVStoreError(f"refusing to map {path}: not a regular file, or writable by any user "
                           f"(mode {st.st_mode & 0o777:o})")
    return fd


def _cuda_ready(import_torch: bool = True) -> bool:
    """True when torch has a CUDA device. With import_torch=False, a process that has not
    imported torch counts as CUDA-less (importing torch costs seconds; a CLI has no use
    for it)."""
    if not import_torch and "torch" not in sys.modules:
        return False
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def _write_error(region: Region, exc: OSError) -> StorageError:
    """A failed write into a reserved object file, as a kvstore error (a full disk is
    named as such; the put is aborted and nothing becomes visible)."""
    full = " (the disk under the NVMe tier is full)" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else ""
    return StorageError(f"writing the object file {region.path} failed: {exc.strerror or exc}{full}")


class _ArenaTable:
    """The shm arena mappings of this process, shared by every RegionMapper (client): an
    arena is mapped, and pinned with cudaHostRegister, once per process however many
    clients read it. Pinning a 24 GiB arena takes seconds (every page is locked), which a
    per-client mapping would pay again in the first load of each new connection (seconds
    that look like slow hits). Each mapping counts the clients using it; the last one to
    close drops it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.arenas: dict[str, _Arena] = {}
        self.users: dict[str, set[int]] = {}


_TABLE = _ArenaTable()


@dataclass(frozen=True)
class ArenaMapping:
    """One shm arena as this process maps it now (a snapshot: `mapped_arenas`)."""

    path: str
    nbytes: int
    pinned: bool  # the read-only mapping is pinned with cudaHostRegister
    users: int  # clients of this process that have used it
    mapping_id: int  # the same number while the same mapping lives (a re-map gets another)


def mapped_arenas() -> dict[str, ArenaMapping]:
    """The shm arenas this process has mapped, by path (shared by every client here)."""
    with _TABLE.lock:
        return {path: ArenaMapping(path, a.array.size, a.pinned, len(_TABLE.users.get(path, ())), id(a))
                for path, a in _TABLE.arenas.items()}


class RegionMapper:
    """Maps regions into this process. Thread-safe; one per client (shm arena mappings
    are shared process-wide: _ArenaTable)."""

    def __init__(self, pin: Optional[bool] = None) -> None:
        self._table = _TABLE
        self._lock = _TABLE.lock
        self._pin = pin

    # ------------------------------------------------------------------ shm arena

    def _arena(self, path: str) -> _Arena:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            raise KVStoreError(f"shared-memory arena {path} does not exist (did the daemon stop?)") from None
        ino = (st.st_dev, st.st_ino)
        with self._lock:
            self._table.users.setdefault(path, set()).add(id(self))
            arena = self._table.arenas.get(path)
            if arena is not None and arena.ino == ino:
                return arena
            if arena is not None:  # the daemon restarted: a new arena file at the same path
                self._drop(path)
            fd = _open_arena(path, writable=False)
            try:
                if (os.fstat(fd).st_dev, os.fstat(fd).st_ino) != ino:
                    raise KVStoreError(f"shared-memory arena {path} was replaced while being opened; retry")
                mm = mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ)
            finally:
                os.close(fd)
            array = np.frombuffer(mm, dtype=np.uint8)
            arena = _Arena(ino, mm, array, self._maybe_pin(array, import_torch=False, read_only=True))
            self._table.arenas[path] = arena
            return arena

    def _writable(self, path: str) -> np.ndarray:
        """The read-write mapping of an arena (made on the first write of this process)."""
        arena = self._arena(path)
        with self._lock:
            if arena.rw_array is None:
                fd = _open_arena(path, writable=True)
                try:
                    st = os.fstat(fd)
                    if (st.st_dev, st.st_ino) != arena.ino:
                        raise KVStoreError(f"shared-memory arena {path} was replaced; retry")
                    arena.rw_mm = mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                finally:
                    os.close(fd)
                arena.rw_array = np.frombuffer(arena.rw_mm, dtype=np.uint8)
            return arena.rw_array

    def map_arena(self, path: str, pin: bool = True) -> bool:
        """Map the shm arena at `path` now and, with `pin` and CUDA usable, pin it (ahead
        of the first read that needs it). True when the mapping is pinned."""
        arena = self._arena(path)
        if pin:
            with self._lock:
                if not arena.pinned:
                    arena.pinned = self._maybe_pin(arena.array, import_torch=True, read_only=True)
        return arena.pinned

    def pin_arena_of(self, region: Region, *, for_write: bool = False) -> None:
        """Pin the arena behind a shm region (once) if CUDA is usable: called before a
        view's bytes are handed out as a tensor (the read-only mapping), or before a put
        copies from the GPU into it (`for_write`: the read-write mapping), so copies
        between host and device run pinned."""
        if region.kind != "shm":
            return
        with self._lock:
            arena = self._table.arenas.get(region.path)
            if arena is None:
                return
            if for_write:
                if arena.rw_array is not None and not arena.rw_pinned:
                    arena.rw_pinned = self._maybe_pin(arena.rw_array, import_torch=True, read_only=False)
            elif not arena.pinned:
                arena.pinned = self._maybe_pin(arena.array, import_torch=True, read_only=True)

    def _maybe_pin(self, array: np.ndarray, import_torch: bool, *, read_only: bool) -> bool:
        pin = self._pin if self._pin is not None else _cuda_ready(import_torch)
        if not pin or array.size == 0:
            return False
        try:  # pragma: no cover - GPU only
            import torch

            flags = CUDA_HOST_REGISTER_READ_ONLY if read_only else 0
            rc = torch.cuda.cudart().cudaHostRegister(array.ctypes.data, array.nbytes, flags)
            ok = (rc.value if hasattr(rc, "value") else int(rc)) == 0
            if not ok:
                log.warning("cudaHostRegister of the arena mapping failed (%s); host-to-device copies unpinned", rc)
            return ok
        except Exception as exc:  # pragma: no cover - GPU only
            log.warning("cudaHostRegister of the arena mapping failed: %s", exc)
            return False

    def _drop(self, path: str) -> None:
        arena = self._table.arenas.pop(path)
        for pinned, array in ((arena.pinned, arena.array), (arena.rw_pinned, arena.rw_array)):
            if pinned and array is not None:  # pragma: no cover - GPU only
                try:
                    import torch

                    torch.cuda.cudart().cudaHostUnregister(array.ctypes.data)
                except Exception:
                    pass
        del arena  # the mmaps close when the last view of them is gone

    @staticmethod
    def _check_bounds(region: Region, size: int) -> None:
        if region.offset + region.length > size:
            raise BadObject(f"region [{region.offset}, +{region.length}) lies past the end of {region.path} "
                            f"({size} bytes)")

    # ------------------------------------------------------------------ public

    def host_array(self, region: Region, *, writable: bool) -> np.ndarray:
        """A uint8 array aliasing a shm or file region's bytes (read-only unless `writable`)."""
        if region.kind == "shm":
            base = self._writable(region.path) if writable else self._arena(region.path).array
            self._check_bounds(region, base.size)
            return base[region.offset: region.offset + region.length]
        if region.kind == "file":
            return self._file_array(region, writable=writable)
        if region.kind == "cuda_ipc":
            raise InvalidRequest("this object lives in the GPU tier; use .tensor() (a CUDA tensor), not host memory")
        raise InvalidRequest(f"unknown region kind {region.kind!r}")

    def _file_array(self, region: Region, *, writable: bool) -> np.ndarray:
        flags = os.O_RDWR if writable else os.O_RDONLY
        try:
            fd = os.open(region.path, flags)
        except FileNotFoundError:
            raise KVStoreError(f"object file {region.path} is gone (evicted or deleted under the lease?)") from None
        try:
            size = os.fstat(fd).st_size
            self._check_bounds(region, size)
            start = region.offset - region.offset % mmap.ALLOCATIONGRANULARITY
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            mm = mmap.mmap(fd, region.offset + region.length - start, mmap.MAP_SHARED, prot, offset=start)
        finally:
            os.close(fd)
        if not writable and hasattr(mm, "madvise"):
            try:  # faults read ahead generously; `prefetch` starts the whole read when the mapping is first used
                mm.madvise(mmap.MADV_SEQUENTIAL)
            except OSError:
                pass
        arr = np.frombuffer(mm, dtype=np.uint8)[region.offset - start:]
        if not writable:
            arr.flags.writeable = False
        return arr

    @staticmethod
    def prefetch(region: Region) -> None:
        """Start reading a file region's bytes into the page cache (POSIX_FADV_WILLNEED):
        called when a view's mapping is first read through, so a cold NVMe read streams.
        Not done when the region is mapped at get: a copy that reads the file directly
        (kvstore.client.fileio, O_DIRECT) would race a read-ahead and read the disk twice."""
        if region.kind != "file":
            return
        try:
            fd = os.open(region.path, os.O_RDONLY)
        except OSError:
            return  # the read through the mapping reports it
        try:
            os.posix_fadvise(fd, region.offset, region.length, os.POSIX_FADV_WILLNEED)
        except (OSError, AttributeError):
            pass
        finally:
            os.close(fd)

    def write(self, region: Region, data: memoryview) -> None:
        """Copy `data` (exactly region.length bytes) into the region, in place."""
        if data.nbytes != region.length:
            raise InvalidRequest(f"writing {data.nbytes} bytes into a region of {region.length}")
        if region.kind == "shm":
            dst = self.host_array(region, writable=True)
            dst[:] = np.frombuffer(data, dtype=np.uint8)
        elif region.kind == "file":
            try:
                fd = os.open(region.path, os.O_WRONLY | os.O_NOFOLLOW)
                try:
                    done = 0
                    while done < data.nbytes:
                        n = os.pwrite(fd, data[done: done + IO_CHUNK], region.offset + done)
                        if n <= 0:
                            raise KVStoreError(f"short write to {region.path} at {region.offset + done}")
                        done += n
                finally:
                    os.close(fd)
            except OSError as exc:
                raise _write_error(region, exc) from None
        elif region.kind == "cuda_ipc":
            import torch

            dst = self.cuda_tensor(region)
            dst.copy_(torch.frombuffer(data, dtype=torch.uint8))
            torch.cuda.current_stream(dst.device).synchronize()
        else:
            raise InvalidRequest(f"unknown region kind {region.kind!r}")

    def write_hashed(self, region: Region, data: memoryview) -> int:
        """`write`, fused with the checksum of the bytes (the store checksum, with the
        algorithm the bytes call for: kvstore.checksums): the region is
        filled in HASH_CHUNK steps and each step is hashed while it is still in cache, so
        the bytes cross memory once instead of twice. For shm regions the hash is taken
        over the bytes as they landed in the arena (what the daemon will verify)."""
        n = data.nbytes
        if n != region.length:
            raise InvalidRequest(f"writing {n} bytes into a region of {region.length}")
        h = cks.new_hasher(data[: cks.PREFIX_BYTES])
        if region.kind == "shm":
            dst = self.host_array(region, writable=True)
            src = np.frombuffer(data, dtype=np.uint8)
            for off in range(0, n, HASH_CHUNK):
                d = dst[off: off + HASH_CHUNK]
                np.copyto(d, src[off: off + HASH_CHUNK])
                h.update(d)
            return h.intdigest()
        if region.kind == "file":
            try:
                fd = os.open(region.path, os.O_WRONLY | os.O_NOFOLLOW)
                try:
                    for off in range(0, n, HASH_CHUNK):
                        chunk = data[off: off + HASH_CHUNK]
                        done = 0
                        while done < chunk.nbytes:
                            w = os.pwrite(fd, chunk[done:], region.offset + off + done)
                            if w <= 0:
                                raise KVStoreError(f"short write to {region.path} at {region.offset + off + done}")
                            done += w
                        h.update(chunk)  # just read by pwrite: still in cache
                finally:
                    os.close(fd)
            except OSError as exc:
                raise _write_error(region, exc) from None
            return h.intdigest()
        self.write(region, data)  # cuda_ipc: the device copy dominates; hash the host source
        return cks.host_checksum(data)

    def cuda_tensor(self, region: Region) -> Any:
        """A CUDA uint8 tensor aliasing a cuda_ipc region (the arena's handle is opened
        once per process and cached by kvstore.tiers.gpu_arena)."""
        if region.kind != "cuda_ipc":
            raise InvalidRequest(f"region kind {region.kind!r} is not a CUDA region")
        if not _cuda_ready():
            raise KVStoreError("this object lives in the daemon's GPU tier but CUDA is not available in this process")
        from kvstore.tiers.gpu_arena import open_cuda_region

        return open_cuda_region(region)

    def close(self) -> None:
        """This client is done with its arenas: each is dropped once no client uses it."""
        with self._lock:
            for path, users in list(self._table.users.items()):
                users.discard(id(self))
                if not users:
                    del self._table.users[path]
                    if path in self._table.arenas:
                        self._drop(path)

