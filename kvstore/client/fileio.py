"""Copying an NVMe object file (a "file" region) into host memory or a CUDA tensor: the
client's read path for objects served without promotion (`ObjectView.copy_to`,
`ObjectView.read_into`). Zero-copy views (`.array`, `.tensor()`) keep mapping the file
(kvstore.client.regions); only the copies come here.

Owns: `FileReadSettings`, `read_file` (host destination), `read_file_to_cuda`,
`aligned_empty` (host destinations O_DIRECT can fill in place), the reader thread pools,
the per-thread aligned bounce buffers and the pinned staging rings.

A region is split into pieces of up to `piece_bytes` (smaller for a small object, so
every thread gets one) read over a pool of `threads` threads (preadv releases the GIL,
and an NVMe drive wants several large requests in flight). Each piece is read

- buffered, straight into the destination, when its pages are already in the page cache
  (the daemon checksummed the object for this get: verify_nvme=always): mincore() on the
  client's mapping of the file says so without starting any I/O;
- else with O_DIRECT when the file offset is 4 KiB aligned (the NVMe tier's objects start
  at offset 0): straight into the destination when its address is 4 KiB aligned too,
  else into a per-thread aligned bounce buffer and copied from there; a ragged tail
  (the last < 4 KiB) is read rounded up into the bounce buffer (reading up to the end of
  the file, or past the region into bytes that are not copied);
- buffered where the file system refuses O_DIRECT (tmpfs, some overlays).

A hashing read feeds the pieces to the hasher (kvstore.checksums: the algorithm the
bytes call for) in order, on the calling thread, as each lands, while later pieces are
still being read.

CUDA destinations: each piece lands in a slot of a pinned, 2 MiB aligned staging ring (two
slots per thread, so a slot's DMA runs while the next piece is read into the other) and
goes to the device as a non_blocking copy on the given stream once it and the pieces
before it landed; a slot is read into again only after its copy's CUDA event completed.
Rings are allocated once per process per size and reused (2 x threads x piece_bytes of
pinned memory each; 64 MiB at the defaults).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from kvstore.checksums import PREFIX_BYTES, new_hasher
from kvstore.errors import BadObject, InvalidRequest, KVStoreError, StorageError

ALIGN = 4096  # O_DIRECT alignment of file offsets, lengths and buffer addresses (safe for 512 B drives too)
MIN_PIECE = 256 << 10  # a small object is split into pieces no smaller than this
CACHED_FRACTION = 0.5  # a piece with at least this share of its pages cached is read buffered
HUGE_PAGE = 2 << 20


@dataclass(frozen=True)
class FileReadSettings:
    """How file regions are read: `threads` preads in flight, each up to `piece_bytes`
    (a multiple of 4 KiB); `direct=False` turns O_DIRECT off (buffered reads only)."""

    threads: int = 4
    piece_bytes: int = 8 << 20
    direct: bool = True

    def __post_init__(self) -> None:
        if self.threads < 1:
            raise InvalidRequest(f"file reads need >= 1 thread, got {self.threads}")
        if self.piece_bytes < ALIGN or self.piece_bytes % ALIGN:
            raise InvalidRequest(f"file read pieces must be a positive multiple of {ALIGN} bytes, "
                                 f"got {self.piece_bytes}")


DEFAULT_SETTINGS = FileReadSettings()


def settings_for_chunk(chunk: Optional[int]) -> FileReadSettings:
    """The settings for a copy asked to move `chunk` bytes per piece (None: the defaults)."""
    return DEFAULT_SETTINGS if chunk is None else FileReadSettings(piece_bytes=align_up(max(chunk, 1)))


def align_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def plan_pieces(length: int, settings: FileReadSettings = DEFAULT_SETTINGS) -> list[tuple[int, int]]:
    """(offset, length) pieces covering [0, length): at most piece_bytes each, and split
    across the threads when the object is small (down to MIN_PIECE); offsets 4 KiB aligned."""
    per_thread = align_up(-(-length // settings.threads))
    piece = min(settings.piece_bytes, max(MIN_PIECE, per_thread))
    return [(o, min(piece, length - o)) for o in range(0, length, piece)]


# ---------------------------------------------------------------------------- shared state

_POOLS: dict[int, ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()
_LOCAL = threading.local()  # each reader thread's bounce buffer


def _pool(threads: int) -> ThreadPoolExecutor:
    with _POOLS_LOCK:
        pool = _POOLS.get(threads)
        if pool is None:
            pool = _POOLS[threads] = ThreadPoolExecutor(threads, thread_name_prefix="kvstore-fileio")
        return pool


def _bounce(nbytes: int) -> np.ndarray:
    """This thread's page-aligned scratch buffer of >= nbytes (anonymous mmap; grown on demand)."""
    buf = getattr(_LOCAL, "bounce", None)
    if buf is None or buf.size < nbytes:
        _LOCAL.bounce = buf = aligned_empty(align_up(max(nbytes, 1)))
    return buf


def _address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def aligned_empty(nbytes: int) -> np.ndarray:
    """A page-aligned, writable uint8 array of nbytes (an anonymous mapping): a destination
    that lets O_DIRECT reads land in place (`torch.from_numpy` makes it a tensor). From
    2 MiB up it is 2 MiB aligned and asks for transparent huge pages: physically contiguous
    memory lets the block layer build a few large requests out of one read instead of many
    small ones (measured on the dev VM's virtio disk: ~1.8x)."""
    if nbytes <= 0:
        raise InvalidRequest(f"an aligned buffer needs >= 1 byte, got {nbytes}")
    if nbytes < HUGE_PAGE:
        return np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8)
    mm = mmap.mmap(-1, nbytes + HUGE_PAGE)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mm.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # THP off in this kernel: plain pages
            pass
    whole = np.frombuffer(mm, dtype=np.uint8)
    start = (-_address(whole)) % HUGE_PAGE
    return whole[start: start + nbytes]


_MINCORE: Any = None


def cached_fraction(mapping: Optional[np.ndarray], start: int, length: int) -> float:
    """Share of the pages of mapping[start: start + length] (a file mapping) that are in the
    page cache, by mincore(2), which starts no I/O. 0.0 where it cannot tell (no mapping,
    no mincore, or a file this process may not write, for which Linux reports only the
    pages this process has mapped)."""
    global _MINCORE
    if mapping is None or length <= 0:
        return 0.0
    if _MINCORE is None:
        try:
            fn = ctypes.CDLL(None, use_errno=True).mincore
            fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
            fn.restype = ctypes.c_int
            _MINCORE = fn
        except (OSError, AttributeError):
            _MINCORE = False
    if _MINCORE is False:
        return 0.0
    page = mmap.PAGESIZE
    addr = _address(mapping) + start
    first = addr - addr % page
    span = addr + length - first
    vec = np.zeros((span + page - 1) // page, dtype=np.uint8)
    if _MINCORE(first, span, _address(vec)) != 0:
        return 0.0
    return float(np.count_nonzero(vec & 1)) / vec.size


# ---------------------------------------------------------------------------- one piece


class _OpenFile:
    """A region's file opened for buffered and (where the file system allows) direct reads."""

    def __init__(self, path: str, settings: FileReadSettings) -> None:
        self.path = path
        try:
            self.fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise KVStoreError(f"object file {path} is gone (evicted or deleted under the lease?)") from None
        except OSError as exc:
            raise StorageError(f"opening object file {path} failed: {exc}") from exc
        self.dfd: Optional[int] = None
        if settings.direct and hasattr(os, "O_DIRECT"):
            try:
                self.dfd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            except OSError:  # tmpfs and some overlays refuse O_DIRECT: buffered reads only
                self.dfd = None

    def close(self) -> None:
        os.close(self.fd)
        if self.dfd is not None:
            os.close(self.dfd)

    def read(self, dst: np.ndarray, off: int, cached: bool) -> None:
        """Fill dst (uint8, contiguous) with the file's bytes at [off, off + dst.size)."""
        try:
            if cached or self.dfd is None or off % ALIGN:
                self._buffered(dst, off)
                return
            try:
                self._direct(dst, off)
            except OSError as exc:
                if exc.errno != getattr(os, "EINVAL", 22):
                    raise
                self.dfd = None  # the file system took the open but refuses the reads
                self._buffered(dst, off)
        except OSError as exc:
            raise StorageError(f"reading object file {self.path} at {off} failed: {exc}") from exc

    def _buffered(self, dst: np.ndarray, off: int) -> None:
        done = 0
        while done < dst.size:
            got = os.preadv(self.fd, [dst[done:]], off + done)
            if got <= 0:
                raise self._short(off + done, off + dst.size)
            done += got

    def _direct(self, dst: np.ndarray, off: int) -> None:
        n = dst.size
        body = n - n % ALIGN if _address(dst) % ALIGN == 0 else 0
        done = 0
        while done < body:  # straight into the destination
            got = os.preadv(self.dfd, [dst[done:body]], off + done)
            if got <= 0 or got % ALIGN:  # the end of the file came first
                raise self._short(off + done + max(got, 0), off + n)
            done += got
        rest = n - done
        if not rest:
            return
        span = align_up(rest)  # an unaligned destination or a ragged tail: through the bounce buffer
        buf = _bounce(span)
        got = 0
        while got < rest:
            r = os.preadv(self.dfd, [buf[got:span]], off + done + got)
            got += max(r, 0)
            if r <= 0 or (got < rest and got % ALIGN):
                raise self._short(off + done + got, off + n)
        np.copyto(dst[done:], buf[:rest])

    def _short(self, ends: int, region_end: int) -> BadObject:
        return BadObject(f"object file {self.path} is short: it ends at byte {ends}, the region at {region_end}")


# ---------------------------------------------------------------------------- whole regions


def _cached_flags(mapping: Optional[np.ndarray], pieces: list[tuple[int, int]]) -> list[bool]:
    return [cached_fraction(mapping, o, n) >= CACHED_FRACTION for o, n in pieces]


def _drain(futs: Any) -> None:
    """On the way out (also on error): no read may outlive the file or the buffers."""
    for f in futs:
        f.cancel() or f.exception()


class _Hash:
    """The object's streaming hasher, made from its first piece."""

    def __init__(self) -> None:
        self.h: Any = None

    def update(self, piece: np.ndarray) -> None:
        if self.h is None:
            self.h = new_hasher(memoryview(piece[:PREFIX_BYTES]))
        self.h.update(piece)

    def digest(self) -> int:
        return self.h.intdigest()


def read_file(path: str, offset: int, length: int, dst: np.ndarray, *, hash_bytes: bool = False,
              mapping: Optional[np.ndarray] = None, settings: FileReadSettings = DEFAULT_SETTINGS) -> Optional[int]:
    """Copy the file's bytes [offset, offset + length) into dst[:length] (a contiguous,
    writable uint8 array). `mapping`: the client's mapping of those bytes (used only to
    ask which pages are cached). Returns the checksum of the bytes when `hash_bytes`,
    else None. Raises BadObject when the file is shorter than the region, StorageError
    on an I/O error."""
    if length <= 0:
        raise InvalidRequest(f"reading {length} bytes of {path}: a region holds at least 1 byte")
    if dst.dtype != np.uint8 or dst.ndim != 1 or not dst.flags.c_contiguous or not dst.flags.writeable \
            or dst.size < length:
        raise InvalidRequest(f"reading {length} bytes of {path} needs a writable contiguous uint8 array of "
                             f">= {length} bytes, got {dst.dtype} {dst.shape}")
    pieces = plan_pieces(length, settings)
    cached = _cached_flags(mapping, pieces)
    h = _Hash() if hash_bytes else None
    f = _OpenFile(path, settings)
    try:
        if len(pieces) == 1:
            f.read(dst[:length], offset, cached[0])
            if h is not None:
                h.update(dst[:length])
            return h.digest() if h is not None else None
        pool = _pool(settings.threads)
        futs = [pool.submit(f.read, dst[o: o + n], offset + o, c) for (o, n), c in zip(pieces, cached)]
        try:
            for fut, (o, n) in zip(futs, pieces):
                fut.result()
                if h is not None:  # later pieces are still being read meanwhile
                    h.update(dst[o: o + n])
        finally:
            _drain(futs)
        return h.digest() if h is not None else None
    finally:
        f.close()


class _PinnedRing:
    """Pinned, 2 MiB aligned staging slots for reads bound for a GPU (`aligned_empty`
    memory registered with cudaHostRegister; torch's pinned allocator where registering
    fails), and the CUDA event of the last copy out of each slot."""

    def __init__(self, slots: int, piece: int) -> None:
        import torch

        host = aligned_empty(slots * piece)
        if _cuda_host_register(host):
            base = torch.from_numpy(host)
        else:  # pragma: no cover - GPU only
            pinned = torch.empty(slots * piece + ALIGN, dtype=torch.uint8, pin_memory=True)
            start = (-pinned.data_ptr()) % ALIGN
            base = pinned[start: start + slots * piece]
        self.base = base
        self.tensors = [base[k * piece: (k + 1) * piece] for k in range(slots)]
        self.arrays = [t.numpy() for t in self.tensors]
        self.events: list[Any] = [None] * slots


def _cuda_host_register(array: np.ndarray) -> bool:  # pragma: no cover - GPU only
    """Page-lock `array` for the process's lifetime (the rings are never freed)."""
    try:
        import torch

        rc = torch.cuda.cudart().cudaHostRegister(_address(array), array.nbytes, 0)
        return (rc.value if hasattr(rc, "value") else int(rc)) == 0
    except Exception:
        return False


_RINGS: dict[tuple[int, int], list[_PinnedRing]] = {}
_RINGS_LOCK = threading.Lock()


def _take_ring(slots: int, piece: int) -> _PinnedRing:
    with _RINGS_LOCK:
        free = _RINGS.get((slots, piece))
        if free:
            return free.pop()
    return _PinnedRing(slots, piece)


def _give_ring(ring: _PinnedRing, slots: int, piece: int) -> None:
    with _RINGS_LOCK:
        _RINGS.setdefault((slots, piece), []).append(ring)


def _read_slot(f: _OpenFile, ring: _PinnedRing, k: int, n: int, off: int, cached: bool, wait: Any) -> None:
    if wait is not None:
        wait.synchronize()  # the previous copy out of this slot has finished
    f.read(ring.arrays[k][:n], off, cached)


def read_file_to_cuda(path: str, offset: int, length: int, dst: Any, stream: Any, *, hash_bytes: bool = False,
                      mapping: Optional[np.ndarray] = None,
                      settings: FileReadSettings = DEFAULT_SETTINGS) -> Optional[int]:
    """Copy the file's bytes [offset, offset + length) into dst[:length] (a contiguous
    CUDA uint8 tensor) through the pinned staging ring: each piece's copy is issued
    non_blocking on `stream` as soon as it landed. When this returns every piece was read
    and its copy issued (not completed: wait on `stream`). Returns the checksum of the
    bytes when `hash_bytes` (hashed on the host, overlapping the copies), else None."""
    import torch

    if length <= 0:
        raise InvalidRequest(f"reading {length} bytes of {path}: a region holds at least 1 byte")
    pieces = plan_pieces(length, settings)
    piece, slots = settings.piece_bytes, 2 * settings.threads  # one ring size per settings, whatever the object
    cached = _cached_flags(mapping, pieces)
    h = _Hash() if hash_bytes else None
    ring = _take_ring(slots, piece)
    pool = _pool(settings.threads)
    futs: dict[int, Future] = {}
    try:
        f = _OpenFile(path, settings)
        try:
            def submit(i: int) -> None:
                o, n = pieces[i]
                k = i % slots
                futs[i] = pool.submit(_read_slot, f, ring, k, n, offset + o, cached[i], ring.events[k])

            for i in range(min(slots, len(pieces))):
                submit(i)
            for i, (o, n) in enumerate(pieces):
                futs.pop(i).result()
                k = i % slots
                with torch.cuda.stream(stream):
                    dst[o: o + n].copy_(ring.tensors[k][:n], non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(stream)
                ring.events[k] = ev
                if h is not None:  # the copy of this piece runs meanwhile
                    h.update(ring.arrays[k][:n])
                if i + slots < len(pieces):  # the slot again, once this copy is done
                    submit(i + slots)
        finally:
            _drain(futs.values())
            f.close()
    finally:
        _give_ring(ring, slots, piece)
    return h.digest() if h is not None else None
