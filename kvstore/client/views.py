"""What a get returns: a leased object's bytes, in place, and its decoded tensors.

Owns: `ObjectView` (one lease: memoryview / numpy / torch views aliasing the daemon's
arena, `release()`, context manager) and `TensorsView` (an ObjectView decoded with the
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

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from kvstore.format import BlobHeader


class ObjectView:
    """A leased object: its bytes where they lie (shm arena, object file, GPU arena)."""

    def __init__(self, lease: Lease, host: Optional[np.ndarray], device: Any,
                 release: Callable[[int], None], queue_release: Callable[[int], None],
                 before_tensor: Optional[Callable[[], None]] = None) -> None:
        self.lease = lease
        self._before_tensor = before_tensor
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
            return torch.from_numpy(self._host)

    def tobytes(self) -> bytes:
        """A copy of the bytes (leaves the lease held)."""
        self._check()
        if self._device is not None:
            return self._device.cpu().numpy().tobytes()
        return self._host.tobytes()

    def verify(self) -> None:
        """Check the bytes against the checksum the daemon holds; BadObject on mismatch."""
        from kvstore.format import checksum

        self._check()
        actual = checksum(self._device if self._device is not None else memoryview(self._host))
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
