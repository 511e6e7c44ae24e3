"""The NVMe tier: one file per object under `<dir>/objects/`.

Layout::

    <dir>/objects/tmp/<name>-<rand>.part   a slot being written (client or daemon)
    <dir>/objects/<nn>/<name>.<rand>.obj   a sealed object (nn = first two chars of name)
    <dir>/objects/quarantine/              files found at open that no header describes

A sealed file is the object's bytes followed by its header record (kvstore.objheader:
key, size, checksum, meta), written by `seal`. One file per object (rather than slab
files) keeps deletion and crash recovery trivial: freeing is an unlink, and a file is
visible at its final path only after its bytes and header were fsync'ed and it was
renamed there (then the parent directory is fsync'ed). The Store commits the LMDB index
record only after `seal` returns, so a crash at any point leaves either a `.part` file
(discarded at the next open) or an unindexed `.obj` file that its header lets the next
open adopt (kvstore.recovery): a torn object is never visible, a committed one never
lost. `tmp/` is recreated when it was removed. Every open of an object file uses
O_NOFOLLOW, and the directories must belong to the daemon's user (check_private_dir).

A client writing a put directly gets Region("file", <tmp path>, 0, size) and pwrites
there; a client reading gets the final path. The daemon moves bytes with POSIX
pread/pwrite, split into chunks over a small thread pool (the syscalls release the GIL,
and NVMe drives want several requests in flight); reads into a CUDA tensor go through
kvikio (GPUDirect Storage where the machine has it) when kvikio is importable, and
through a host bounce buffer otherwise. I/O is buffered (page cache) and made durable by
fsync at seal.

Capacity counts each object's size rounded up to 4 KiB (file-system blocks); the header
record after the bytes (kvstore.objheader, well under 2 KiB) is not counted. The file
system's real free space bounds the tier too (`disk_free`): an allocation that the disk
cannot hold returns None, so the Store evicts NVMe objects to make room, and a slot's
blocks are allocated when it is created (posix_fallocate), so a full disk shows at
reserve, in the daemon, not as ENOSPC in a client's write.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import stat
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

import torch

from kvstore.allocator import PAGE_SIZE
from kvstore.checksums import new_hasher
from kvstore.errors import InvalidRequest, StorageError
from kvstore.objheader import ObjectHeader, mark_dead
from kvstore.records import Region
from kvstore.tiers.base import Slot, Tier, check_tensor_arg

log = logging.getLogger(__name__)

try:  # kvikio is optional: GPU boxes may have it; CPU machines use POSIX I/O
    import kvikio  # type: ignore[import-not-found]
except Exception:  # pragma: no cover - depends on the machine
    kvikio = None

CHUNK = 8 << 20  # bytes per pread/pwrite request when splitting large I/O
HASH_CHUNK = 8 << 20  # bytes per read when hashing a file
READ_AHEAD = 2  # reads in flight ahead of the chunk being hashed
MIN_DISK_FREE = 1 << 20  # bytes of the file system the tier leaves free (index growth, directories)


def _rounded(n: int) -> int:
    return (n + PAGE_SIZE - 1) // PAGE_SIZE * PAGE_SIZE


def check_private_dir(path: Path, what: str, *, follow: bool = False, make_private: bool = True) -> None:
    """StorageError unless `path` is a directory owned by this process's user (with
    `follow`, a symlink to one is accepted: an operator may link the cache elsewhere);
    `make_private` then chmods it 0700. Another user who owns the cache's directories
    could plant files or links the daemon would then trust."""
    st = os.stat(path) if follow else os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise StorageError(f"{what} {path} is not a directory (a symlink or a file is refused)")
    if st.st_uid != os.geteuid():
        raise StorageError(f"{what} {path} belongs to uid {st.st_uid}, not this daemon's uid {os.geteuid()}; "
                           f"refusing to use it")
    if make_private and st.st_mode & 0o077:
        os.chmod(path, 0o700)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class NvmeTier(Tier):
    """File-per-object tier on a local file system; see the module docstring."""

    name = "nvme"
    durable = True

    def __init__(self, root: Path, capacity: int, io_threads: int = 4, min_disk_free: int = MIN_DISK_FREE) -> None:
        if capacity <= 0:
            raise InvalidRequest(f"nvme tier capacity must be > 0 bytes, got {capacity}")
        self.root = Path(root)
        self.tmp = self.root / "tmp"
        self.quarantine = self.root / "quarantine"
        self._capacity = capacity
        self._min_disk_free = min_disk_free
        self._used = 0
        self._used_lock = threading.Lock()
        self._io_threads = max(1, io_threads)
        self._pool: Optional[ThreadPoolExecutor] = None
        self.counters: Counter[str] = Counter()  # disk_full, tmp_recreated

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def used_bytes(self) -> int:
        return self._used

    def open(self) -> None:
        try:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            check_private_dir(self.root, "nvme tier directory", follow=True)
            self.tmp.mkdir(mode=0o700, exist_ok=True)
        except OSError as exc:
            raise StorageError(f"cannot create the nvme tier directory {self.root}: {exc}") from exc
        self._pool = ThreadPoolExecutor(self._io_threads, thread_name_prefix="kvstore-nvme")

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    # -- space -----------------------------------------------------------------------
    def disk_free(self) -> int:
        """Bytes the file system under the tier still offers (less the headroom kept for
        the index and directories); capacity's bound when the disk is the smaller."""
        for path in (self.root, self.root.parent):  # the root itself may have been removed
            try:
                st = os.statvfs(path)
                break
            except OSError:
                continue
        else:
            return 0
        return max(0, st.f_bavail * st.f_frsize - self._min_disk_free)

    def free_bytes(self) -> int:
        return max(0, min(self._capacity - self._used, self.disk_free()))

    def _create_part(self, path: Path, size: int) -> None:
        """Create a slot's file with its blocks allocated (so a full disk shows here, as
        ENOSPC, not in a client's write); tmp/ is recreated when it was removed."""
        for attempt in (0, 1):
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                break
            except FileNotFoundError:
                if attempt:
                    raise
                log.warning("nvme: working directory %s is gone; recreating it", self.tmp)
                self.root.mkdir(mode=0o700, exist_ok=True)
                self.tmp.mkdir(mode=0o700, exist_ok=True)
                self.counters["tmp_recreated"] += 1
        try:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                os.ftruncate(fd, size)  # a file system without fallocate: sparse
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)

    def allocate(self, size: int, name: str) -> Optional[Slot]:
        if size <= 0:
            raise InvalidRequest(f"allocation size must be > 0, got {size}")
        need = _rounded(size)
        if need > self.disk_free():
            self.counters["disk_full"] += 1
            return None  # the caller makes room (evicting NVMe objects frees disk) or gives up
        with self._used_lock:
            if self._used + need > self._capacity:
                return None
            self._used += need
        path = self.tmp / f"{name}-{secrets.token_hex(8)}.part"
        try:
            self._create_part(path, size)
        except OSError as exc:
            with self._used_lock:
                self._used -= need
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                self.counters["disk_full"] += 1
                return None
            raise StorageError(f"nvme: cannot create {path} ({size} bytes): {exc.strerror}") from exc
        return Slot(self.name, 0, need, size, str(path))

    def adopt(self, slot: Slot) -> None:
        with self._used_lock:
            self._used += slot.length

    def free(self, slot: Slot) -> None:
        with self._used_lock:
            self._used -= slot.length
        try:
            os.unlink(slot.path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("nvme: cannot unlink %s: %s (garbage-collected at next open)", slot.path, exc)

    def retire(self, slot: Slot) -> None:
        try:
            mark_dead(slot.path)
        except OSError as exc:
            log.warning("nvme: cannot mark %s as dropped: %s", slot.path, exc)

    def final_path(self, name: str) -> Path:
        """A fresh final path for an object named `name`. Unique per seal, so a file still
        pinned by a reader of a dropped object is never replaced by a newer put's file."""
        return self.root / name[:2] / f"{name}.{secrets.token_hex(8)}.obj"

    def seal(self, slot: Slot, name: str, header: Optional[ObjectHeader] = None) -> Slot:
        final = self.final_path(name)
        trailer = b""
        if header is not None:
            if header.size != slot.size:
                raise InvalidRequest(f"nvme: header of {header.size} bytes for a slot of {slot.size}")
            trailer = header.encode_trailer()
        try:
            fd = os.open(slot.path, os.O_RDWR | os.O_NOFOLLOW)
            try:
                if os.fstat(fd).st_size != slot.size:
                    os.ftruncate(fd, slot.size)  # a writer went past its reservation
                done = 0
                while done < len(trailer):
                    done += os.pwrite(fd, trailer[done:], slot.size + done)
                os.fsync(fd)
            finally:
                os.close(fd)
            new_dir = not final.parent.exists()
            final.parent.mkdir(mode=0o700, exist_ok=True)
            if new_dir:
                _fsync_dir(self.root)
            os.rename(slot.path, final)
            _fsync_dir(final.parent)
        except OSError as exc:
            full = " (the disk is full)" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else ""
            raise StorageError(f"nvme: sealing {slot.path} as {final} failed: {exc.strerror or exc}{full}") from exc
        return Slot(self.name, 0, slot.length, slot.size, str(final))

    def region(self, slot: Slot) -> Region:
        return Region("file", slot.path, 0, slot.size)

    # -- data ------------------------------------------------------------------------
    def _chunks(self, size: int) -> list[tuple[int, int]]:
        return [(o, min(CHUNK, size - o)) for o in range(0, size, CHUNK)]

    def _run(self, fn: Any, spans: list[tuple[int, int]]) -> None:
        if len(spans) == 1 or self._pool is None:
            for span in spans:
                fn(span)
        else:
            for fut in [self._pool.submit(fn, span) for span in spans]:
                fut.result()

    def read_into(self, slot: Slot, dst: torch.Tensor) -> None:
        check_tensor_arg(self.name, "read_into", dst, slot.size)
        dst = dst[: slot.size]
        try:
            if dst.device.type == "cuda":
                self._read_into_cuda(slot, dst)
                return
            mv = memoryview(dst.numpy())
            fd = os.open(slot.path, os.O_RDONLY | os.O_NOFOLLOW)
            try:
                def read_span(span: tuple[int, int]) -> None:
                    off, n = span
                    got = os.preadv(fd, [mv[off : off + n]], off)
                    if got != n:
                        raise StorageError(f"nvme: short read of {slot.path}: {got} of {n} bytes at {off}")
                self._run(read_span, self._chunks(slot.size))
            finally:
                os.close(fd)
        except OSError as exc:
            raise StorageError(f"nvme: reading {slot.path} failed: {exc}") from exc

    def _read_into_cuda(self, slot: Slot, dst: torch.Tensor) -> None:  # pragma: no cover - GPU only
        if kvikio is not None:
            try:
                with kvikio.CuFile(slot.path, "r") as f:
                    got = f.pread(dst, slot.size, 0).get()
                if got == slot.size:
                    return
                log.warning("kvikio short read of %s (%d of %d); retrying through the host", slot.path, got, slot.size)
            except Exception as exc:
                log.warning("kvikio read of %s failed (%s); retrying through the host", slot.path, exc)
        host = torch.empty(slot.size, dtype=torch.uint8, pin_memory=True)
        self.read_into(slot, host)
        dst.copy_(host)

    def write_from(self, slot: Slot, src: torch.Tensor) -> None:
        check_tensor_arg(self.name, "write_from", src, slot.size)
        src = src[: slot.size]
        if src.device.type != "cpu":
            src = src.cpu()
        mv = memoryview(src.numpy())
        try:
            fd = os.open(slot.path, os.O_WRONLY | os.O_NOFOLLOW)
            try:
                def write_span(span: tuple[int, int]) -> None:
                    off, n = span
                    done = 0
                    while done < n:
                        done += os.pwritev(fd, [mv[off + done : off + n]], off + done)
                self._run(write_span, self._chunks(slot.size))
            finally:
                os.close(fd)
        except OSError as exc:
            raise StorageError(f"nvme: writing {slot.path} failed: {exc.strerror or exc}") from exc

    def _hash_pipelined(self, fd: int, slot: Slot, bufs: list[memoryview]) -> int:
        """The checksum of the file's `size` bytes (kvstore.checksums: the algorithm the
        bytes call for), read in chunks into `bufs` (round robin):
        up to len(bufs) - 1 preads run on the pool ahead of the chunk being hashed, so a
        cold read keeps the drive busy while the CPU hashes."""
        h: Any = None  # made from the first chunk (a blob's preamble names its algorithm)
        size = slot.size
        step = len(bufs[0])
        spans = [(o, min(step, size - o)) for o in range(0, size, step)]

        def read(i: int) -> None:
            off, n = spans[i]
            mv = bufs[i % len(bufs)][:n]
            got = os.preadv(fd, [mv], off)
            if got != n:
                raise StorageError(f"nvme: {slot.path} is short: {off + got} of {size} bytes")

        if self._pool is None or len(spans) == 1 or len(bufs) == 1:
            for i, (off, n) in enumerate(spans):
                read(i)
                if h is None:
                    h = new_hasher(bufs[i % len(bufs)][:n])
                h.update(bufs[i % len(bufs)][:n])
            return h.intdigest()
        ahead = len(bufs) - 1
        futs = {i: self._pool.submit(read, i) for i in range(min(ahead, len(spans)))}
        try:
            for i, (off, n) in enumerate(spans):
                futs.pop(i).result()
                if i + ahead < len(spans):  # its buffer was hashed in the previous step
                    futs[i + ahead] = self._pool.submit(read, i + ahead)
                if h is None:
                    h = new_hasher(bufs[i % len(bufs)][:n])
                h.update(bufs[i % len(bufs)][:n])
        finally:
            for f in futs.values():  # on error: wait for reads still using the buffers
                f.cancel() or f.exception()
        return h.intdigest()

    def checksum(self, slot: Slot) -> int:
        """Hash the object file, reading ahead over the pool. For a slot still being
        committed (under tmp/), its writeback is started (fdatasync on the pool) while it
        is hashed: the file is not visible until `seal` renames it, so this makes nothing
        durable early, but `seal`'s fsync then has little left to do."""
        step = min(HASH_CHUNK, max(slot.size, 1))
        depth = 1 if slot.size <= step else READ_AHEAD + 1
        bufs = [memoryview(bytearray(step)) for _ in range(depth)]
        try:
            fd = os.open(slot.path, os.O_RDONLY | os.O_NOFOLLOW)
            flush = None
            try:
                if self._pool is not None and os.path.dirname(slot.path) == str(self.tmp):
                    flush = self._pool.submit(os.fdatasync, fd)
                try:
                    os.posix_fadvise(fd, 0, slot.size, os.POSIX_FADV_SEQUENTIAL)
                except OSError:
                    pass
                return self._hash_pipelined(fd, slot, bufs)
            finally:
                if flush is not None:
                    flush.exception()  # wait (the fd must stay open); seal's fsync reports errors
                os.close(fd)
        except OSError as exc:
            raise StorageError(f"nvme: reading {slot.path} failed: {exc}") from exc

    def read_into_hashed(self, slot: Slot, dst: torch.Tensor) -> int:
        """Parallel chunked preads into `dst` (as `read_into`), hashing each chunk in
        order as soon as it has landed, while later chunks are still being read."""
        check_tensor_arg(self.name, "read_into_hashed", dst, slot.size)
        if dst.device.type != "cpu":
            raise InvalidRequest(f"nvme read_into_hashed needs a host tensor, got device {dst.device}")
        mv = memoryview(dst[: slot.size].numpy())
        spans = self._chunks(slot.size)
        h: Any = None  # made from the first chunk (a blob's preamble names its algorithm)
        try:
            fd = os.open(slot.path, os.O_RDONLY | os.O_NOFOLLOW)
            try:
                def read_span(span: tuple[int, int]) -> None:
                    off, n = span
                    got = os.preadv(fd, [mv[off : off + n]], off)
                    if got != n:
                        raise StorageError(f"nvme: short read of {slot.path}: {got} of {n} bytes at {off}")

                if self._pool is None or len(spans) == 1:
                    for span in spans:
                        read_span(span)
                        if h is None:
                            h = new_hasher(mv[span[0] : span[0] + span[1]])
                        h.update(mv[span[0] : span[0] + span[1]])
                    return h.intdigest()
                futs = [self._pool.submit(read_span, span) for span in spans]
                try:
                    for fut, (off, n) in zip(futs, spans):
                        fut.result()
                        if h is None:
                            h = new_hasher(mv[off : off + n])
                        h.update(mv[off : off + n])
                finally:
                    for f in futs:  # on error: no read may outlive the fd
                        f.cancel() or f.exception()
                return h.intdigest()
            finally:
                os.close(fd)
        except OSError as exc:
            raise StorageError(f"nvme: reading {slot.path} failed: {exc}") from exc

    # -- recovery --------------------------------------------------------------------
    def list_sealed(self) -> list[Slot]:
        """Every `.obj` file under the object directories, as a Slot whose size is the
        file's size (trailer included: kvstore.recovery reads the trailers)."""
        out = []
        for sub in sorted(self.root.iterdir()) if self.root.exists() else []:
            if len(sub.name) != 2 or sub.is_symlink() or not sub.is_dir():
                continue
            for f in sub.glob("*.obj"):
                try:
                    st = f.lstat()
                except FileNotFoundError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    out.append(Slot(self.name, 0, _rounded(st.st_size), st.st_size, str(f)))
        return out

    def set_aside(self, path: str) -> str:
        """Move a file the tier cannot account for into `quarantine/` (never deleted:
        an operator decides); returns its new path."""
        self.quarantine.mkdir(mode=0o700, exist_ok=True)
        dst = self.quarantine / f"{Path(path).name}.{secrets.token_hex(4)}"
        os.rename(path, dst)
        return str(dst)

    def discard_unsealed(self) -> int:
        n = 0
        for f in self.tmp.glob("*") if self.tmp.exists() else []:
            try:
                f.unlink()
                n += 1
            except OSError as exc:
                log.warning("nvme: cannot remove leftover %s: %s", f, exc)
        return n

    def stats(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "capacity_bytes": self._capacity,
            "used_bytes": self._used,
            "disk_free_bytes": self.disk_free(),
            "disk_full": self.counters["disk_full"],
            "tmp_recreated": self.counters["tmp_recreated"],
            "path": str(self.root),
            "kvikio": kvikio is not None,
        }
