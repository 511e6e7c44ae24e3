"""What a get returns: a leased object's bytes, in place, and its decoded tensors.

Owns: `ObjectView` (one lease: memoryview / numpy / torch views aliasing the daemon's
arena, copies out of it (`copy_to`, `read_into`; NVMe objects are copied by reading
their file, kvstore.client.fileio), `release()`, context manager) and `TensorsView` (an ObjectView decoded with the
object format: header + dict of zero-copy tensors), and the rule tying a lease to the
lifetime of its bytes' views.

Lease lifetime: a view's lease is released by `release()` (or leaving its `with`
block), or else once nothing refers to its bytes any more: the view itself, its
memoryview, numpy array or tensors (a finalizer on the buffer queues the release, which
the client's keepalive sends). After `release()` the views must not be used: the daemon
may move or overwrite those bytes.
"""

from __future__ import annotations

import warnings
import weakref
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

import numpy as np

from kvstore.errors import BadObject, InvalidRequest
from kvstore.records import Lease

COPY_CHUNK = 16 << 20  # bytes per piece of `ObjectView.copy_to` (host -> GPU: one DMA each)
_SIDE_STREAMS: dict[Any, Any] = {}


def _side_stream(device: Any) -> Any:
    """One copy stream per CUDA device, shared by every view of this process."""
    import torch

    s = _SIDE_STREAMS.get(device)
    if s is None:
        s = _SIDE_STREAMS.setdefault(device, torch.cuda.Stream(device))
    return s


if TYPE_CHECKING:  # pragma: no cover
    import torch

    from kvstore.format import BlobHeader


class ObjectView:
    """A leased object: its bytes where they lie (shm arena, object file, GPU arena)."""

    def __init__(self, lease: Lease, host: Optional[np.ndarray], device: Any,
                 release: Callable[[int], None], queue_release: Callable[[int], None],
                 before_tensor: Optional[Callable[[], None]] = None,
                 before_host: Optional[Callable[[], None]] = None) -> None:
        self.lease = lease
        self._before_tensor = before_tensor
        self._before_host = before_host
        self._host = host
        self._device = device
        self._release = release
        self._released = False
        owner: Any = host if host is not None else self
        self._finalizer = weakref.finalize(owner, queue_release, lease.lease_id)

    # ------------------------------------------------------------------ facts

    @property
    def key(self) -> bytes:
        return self.lease.key

    @property
    def tier(self) -> str:
        return self.lease.tier

    @property
    def size(self) -> int:
        return self.lease.size

    @property
    def checksum(self) -> int:
        return self.lease.checksum

    @property
    def meta(self) -> Any:
        return self.lease.meta

    @property
    def lease_id(self) -> int:
        return self.lease.lease_id

    @property
    def released(self) -> bool:
        return self._released

    def __repr__(self) -> str:
        state = "released" if self._released else "leased"
        return f"ObjectView(key={self.key!r}, tier={self.tier!r}, size={self.size}, {state})"

    # ------------------------------------------------------------------ bytes

    def _check(self) -> None:
        if self._released:
            raise InvalidRequest(f"the view of {self.key!r} was released; get the key again")

    @property
    def array(self) -> np.ndarray:
        """Read-only numpy uint8 array over the bytes in place (CPU and NVMe tiers)."""
        self._check()
        if self._host is None:
            raise InvalidRequest(f"{self.key!r} lives in the GPU tier; use .tensor() for a CUDA tensor")
        return self._mapped()

    def _mapped(self) -> np.ndarray:
        """The host bytes in place, for reading through the mapping: the first call runs
        the `before_host` hook (for an NVMe object: start reading its file into the page
        cache; not done at get, where a copy_to reading the file directly would race it)."""
        if self._before_host is not None:
            hook, self._before_host = self._before_host, None
            hook()
        return self._host

    @property
    def memoryview(self) -> memoryview:
        """Read-only memoryview over the bytes in place (CPU and NVMe tiers): zero copy."""
        return memoryview(self.array)

    def tensor(self) -> "torch.Tensor":
        """uint8 torch tensor over the bytes in place: CPU for the CPU/NVMe tiers, CUDA for
        the GPU tier. Do not write through it."""
        self._check()
        if self._device is not None:
            return self._device
        import torch

        if self._before_tensor is not None:
            self._before_tensor()  # e.g. pin the arena for fast copies to the GPU
            self._before_tensor = None

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only array: we promise not to write
            return torch.from_numpy(self._mapped())

    def copy_to(self, dst: "torch.Tensor", *, stream: Any = None, chunk: Optional[int] = None,
                verify: bool = False) -> Any:
        """Copy the object's bytes into `dst[:size]` (a contiguous uint8 tensor, any device).

        NVMe objects (file regions) are read from their file, not through the mapping:
        large preads in parallel, O_DIRECT where aligned, pages the daemon just read taken
        from the page cache (kvstore.client.fileio); into a CUDA tensor through pinned
        staging buffers, each piece's DMA overlapping the reads of the next. CPU-tier bytes
        into a CUDA tensor: the shm arena is registered as pinned memory once per client
        (kvstore.client.regions), so each piece goes out as a non_blocking DMA. GPU-tier
        bytes: one device copy (verify hashes on the device). Pieces are `chunk` bytes
        (default 16 MiB; file regions 8 MiB, rounded up to 4 KiB) and copies to a GPU run on
        `stream` (default: one side stream per device).

        `verify=True` hashes the bytes on the host as each piece lands (overlapping the
        transfer of the next) and raises BadObject on a mismatch once all pieces were
        issued; with `get_many(..., client_verifies=True)` this replaces the daemon's own
        read-back of an NVMe object. Returns a CUDA event recorded after the last piece (wait
        on it before using `dst`, and keep this view's lease until then), or None when `dst`
        is on the CPU (the copy is then complete).
        """
        import torch

        self._check()
        n = self.size
        if not isinstance(dst, torch.Tensor) or dst.dtype != torch.uint8 or dst.dim() != 1 \
                or not dst.is_contiguous() or dst.numel() < n:
            raise InvalidRequest(f"copy_to needs a contiguous 1-D uint8 tensor of >= {n} bytes, got "
                                 f"{getattr(dst, 'dtype', type(dst).__name__)} {tuple(getattr(dst, 'shape', ()))}")
        if chunk is not None and chunk <= 0:
            raise InvalidRequest(f"chunk must be > 0 bytes, got {chunk}")
        if dst.device.type != "cuda":
            if self._device is not None:  # GPU tier into host memory
                dst[:n].copy_(self._device)
                if verify:
                    self.verify()
            else:
                self._copy_host(dst[:n].numpy(), chunk, verify)
            return None
        stream = stream if stream is not None else _side_stream(dst.device)
        stream.wait_stream(torch.cuda.current_stream(dst.device))  # dst may still be in use there
        region = self.lease.region
        digest: Optional[int] = None
        try:
            with torch.cuda.stream(stream):
                if self._device is not None:  # GPU tier: one device-to-device copy
                    dst[:n].copy_(self._device, non_blocking=True)
                    if verify:
                        from kvstore.format import checksum

                        digest = checksum(dst[:n])
                elif region.kind == "file":
                    from kvstore.client.fileio import read_file_to_cuda, settings_for_chunk

                    digest = read_file_to_cuda(region.path, region.offset, n, dst[:n], stream, hash_bytes=verify,
                                               mapping=self._host, settings=settings_for_chunk(chunk))
                else:
                    chunk = chunk or COPY_CHUNK
                    src = self.tensor()
                    hasher = self._hasher() if verify else None
                    for off in range(0, n, chunk):
                        piece = src[off: off + chunk]
                        dst[off: off + piece.numel()].copy_(piece, non_blocking=True)
                        if hasher is not None:  # the DMA of this piece runs meanwhile
                            hasher.update(memoryview(self._host[off: off + piece.numel()]))
                    digest = hasher.intdigest() if hasher is not None else None
                done = torch.cuda.Event()
                done.record(stream)
        finally:
            dst.record_stream(stream)  # copies issued before an error may still be running
        if verify:
            self._check_digest(digest)
        return done

    def read_into(self, out: Any, *, verify: bool = False) -> None:
        """Copy the object's bytes into `out[:size]`, a writable, contiguous host buffer
        (bytearray, numpy array, mmap...; for tensors use `copy_to`). NVMe objects are
        read from their file in parallel (as `copy_to`); a page-aligned `out` lets those
        reads land in it directly. `verify` as for `copy_to`. CPU and NVMe tiers only."""
        self._check()
        n = self.size
        if self._host is None:
            raise InvalidRequest(f"{self.key!r} lives in the GPU tier; use copy_to() with a tensor")
        try:
            mv = memoryview(out)
        except TypeError:
            raise InvalidRequest(f"read_into needs a writable host buffer, got {type(out).__name__}") from None
        if mv.readonly or not mv.c_contiguous or mv.nbytes < n:
            raise InvalidRequest(f"read_into needs a writable contiguous buffer of >= {n} bytes, got "
                                 f"{'a read-only ' if mv.readonly else ''}{type(out).__name__} of {mv.nbytes} bytes")
        self._copy_host(np.frombuffer(mv.cast("B"), dtype=np.uint8, count=n), None, verify)

    def _copy_host(self, dst: np.ndarray, chunk: Optional[int], verify: bool) -> None:
        """CPU/NVMe bytes into the host array `dst` (exactly size bytes)."""
        region = self.lease.region
        if region.kind == "file":
            from kvstore.client.fileio import read_file, settings_for_chunk

            digest = read_file(region.path, region.offset, self.size, dst, hash_bytes=verify, mapping=self._host,
                               settings=settings_for_chunk(chunk))
            if verify:
                self._check_digest(digest)
            return
        chunk = chunk or COPY_CHUNK
        hasher = self._hasher() if verify else None
        for off in range(0, self.size, chunk):
            piece = self._host[off: off + chunk]
            np.copyto(dst[off: off + piece.size], piece)
            if hasher is not None:
                hasher.update(piece)
        if hasher is not None:
            self._check_digest(hasher.intdigest())

    def _hasher(self) -> Any:
        from kvstore.checksums import PREFIX_BYTES, new_hasher

        return new_hasher(memoryview(self._host[:PREFIX_BYTES]))

    def _check_digest(self, actual: int) -> None:
        if actual != self.checksum:
            raise BadObject(f"object {self.key!r}: bytes hash to {actual:#018x}, the daemon recorded "
                            f"{self.checksum:#018x}")

    def tobytes(self) -> bytes:
        """A copy of the bytes (leaves the lease held)."""
        self._check()
        if self._device is not None:
            return self._device.cpu().numpy().tobytes()
        return self._mapped().tobytes()

    def verify(self) -> None:
        """Check the bytes against the checksum the daemon holds; BadObject on mismatch."""
        from kvstore.format import checksum

        self._check()
        actual = checksum(self._device if self._device is not None else memoryview(self._mapped()))
        if actual != self.checksum:
            raise BadObject(f"object {self.key!r}: bytes hash to {actual:#018x}, the daemon recorded "
                            f"{self.checksum:#018x}")

    # ------------------------------------------------------------------ lease

    def detach(self) -> Optional[int]:
        """Mark released without telling the daemon; returns the lease id to release, or
        None when it was released already (for batching releases)."""
        if self._released:
            return None
        self._released = True
        self._finalizer.detach()
        self._host = None
        self._device = None
        return self.lease.lease_id

    def release(self) -> None:
        """Release the lease now (idempotent). The views must not be used afterwards."""
        lease_id = self.detach()
        if lease_id is not None:
            self._release(lease_id)

    def __enter__(self) -> "ObjectView":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


class TensorsView:
    """A leased object decoded with the object format: `header` and `tensors` (name ->
    tensor), each tensor a view over the bytes in place.

    Unpacks as `(header, tensors)`; `with client.get_tensors(k) as (header, tensors):`
    releases the lease at the end of the block. Without `with`/`release()`, the lease is
    held while any of the tensors (or this object) is alive.
    """

    def __init__(self, view: ObjectView, header: "BlobHeader", tensors: dict[str, "torch.Tensor"]) -> None:
        self.view = view
        self.header = header
        self.tensors = tensors

    def __iter__(self) -> Iterator[Any]:
        yield self.header
        yield self.tensors

    def __enter__(self) -> tuple["BlobHeader", dict[str, "torch.Tensor"]]:
        return self.header, self.tensors

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def release(self) -> None:
        self.view.release()
        self.tensors = {}


def decode_view(view: ObjectView, *, verify: bool = False) -> TensorsView:
    """Decode an ObjectView as an object-format blob without copying tensor bytes."""
    from kvstore import format as fmt

    buf = view.tensor()
    header, tensors = fmt.decode_tensors(buf, check=verify)
    return TensorsView(view, header, tensors)
