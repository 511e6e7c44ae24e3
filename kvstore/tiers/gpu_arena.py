"""The GPU tier: one daemon-owned CUDA allocation split into slots by ExtentAllocator,
shared with clients on the same GPU through CUDA IPC.

The arena is a single `torch.empty(capacity, dtype=uint8, device=cuda)`. Its IPC handle
(`torch.multiprocessing.reductions.reduce_tensor`, pickled) is computed once; every
Region of this tier carries it, and a client calls `open_cuda_region(region)` once per
arena (cache the base tensor by handle) and slices [offset, offset + length). The daemon
keeps the allocation alive until close, so the handle stays valid for its lifetime.
Only created when torch.cuda.is_available(); the allocator logic is the same tested
ExtentAllocator the CPU arena uses.
"""

from __future__ import annotations

import pickle
from typing import Any, Optional

import torch

from kvstore.errors import InvalidRequest, StorageError
from kvstore.format import checksum as blob_checksum
from kvstore.objheader import ObjectHeader
from kvstore.records import Region
from kvstore.tiers.arena import ArenaTier
from kvstore.tiers.base import Slot, check_tensor_arg


class GpuArena(ArenaTier):
    """CUDA arena tier; see the module docstring."""

    name = "gpu"

    def __init__(self, capacity: int, device: int | str | torch.device = 0) -> None:
        super().__init__(capacity)
        self.device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        self._handle = b""

    def open(self) -> None:
        if not torch.cuda.is_available():
            raise StorageError("gpu tier requested but CUDA is not available (set gpu capacity to 0)")
        try:
            self._base = torch.empty(self._alloc.capacity, dtype=torch.uint8, device=self.device)
        except RuntimeError as exc:  # pragma: no cover - GPU only
            raise StorageError(f"cannot allocate a {self._alloc.capacity}-byte gpu arena on {self.device}: {exc}") from exc
        self._handle = ipc_handle(self._base)  # pragma: no cover - GPU only

    def close(self) -> None:
        self._base = None
        self._handle = b""

    def _require_open(self) -> torch.Tensor:
        if self._base is None:
            raise StorageError("gpu arena is not open")
        return self._base

    def seal(self, slot: Slot, name: str, header: Optional[ObjectHeader] = None) -> Slot:
        torch.cuda.synchronize(self.device)  # pragma: no cover - GPU only
        return slot

    def region(self, slot: Slot) -> Region:
        return Region("cuda_ipc", "", slot.offset, slot.size, self._handle)

    def read_into(self, slot: Slot, dst: torch.Tensor) -> None:  # pragma: no cover - GPU only
        check_tensor_arg(self.name, "read_into", dst, slot.size)
        try:
            dst[: slot.size].copy_(self.view(slot))
            torch.cuda.synchronize(self.device)
        except RuntimeError as exc:
            raise StorageError(f"gpu arena read of {slot} failed: {exc}") from exc

    def write_from(self, slot: Slot, src: torch.Tensor) -> None:  # pragma: no cover - GPU only
        check_tensor_arg(self.name, "write_from", src, slot.size)
        try:
            self.view(slot).copy_(src[: slot.size])
            torch.cuda.synchronize(self.device)
        except RuntimeError as exc:
            raise StorageError(f"gpu arena write of {slot} failed: {exc}") from exc

    def checksum(self, slot: Slot) -> int:  # pragma: no cover - GPU only
        # Clients write through their own IPC mapping, on their own streams: make sure
        # their kernels are done before hashing (the client syncs before commit too).
        torch.cuda.synchronize(self.device)
        return blob_checksum(self.view(slot))

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "device": str(self.device)}


def ipc_handle(base: torch.Tensor) -> bytes:
    """Pickled CUDA IPC handle of `base` (a whole CUDA allocation)."""
    from torch.multiprocessing.reductions import reduce_tensor

    rebuild, args = reduce_tensor(base)
    return pickle.dumps((rebuild, args))


_OPENED: dict[bytes, torch.Tensor] = {}


def open_cuda_region(region: Region) -> torch.Tensor:
    """Client side: map the daemon's GPU arena (once per handle, cached) and return a
    uint8 CUDA tensor aliasing [region.offset, region.offset + region.length).

    Must run in a process other than the daemon's (CUDA IPC cannot open a handle in the
    process that exported it).
    """
    if region.kind != "cuda_ipc" or not region.handle:
        raise InvalidRequest(f"not a cuda_ipc region: kind {region.kind!r}")
    base = _OPENED.get(region.handle)
    if base is None:
        rebuild, args = pickle.loads(region.handle)
        base = rebuild(*args)
        _OPENED[region.handle] = base
    return base[region.offset : region.offset + region.length]
