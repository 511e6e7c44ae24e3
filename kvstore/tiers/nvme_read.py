"""Reading NVMe object bytes straight into device memory: the backend choice
(`nvme_read_backend = auto | posix | kvikio`) and the two readers.

- `posix`: O_DIRECT reads into a pinned staging ring, each piece copied to the device on a
  stream as it lands (kvstore.client.fileio.read_file_to_cuda; into host memory,
  read_file). Works everywhere.
- `kvikio`: cuFile reads into device memory (kvikio.CuFile.pread). With GPUDirect Storage
  (nvidia-fs loaded, cuFile's `is_gds_available`) the DMA goes disk -> GPU; without it
  kvikio runs in compatibility mode, a POSIX read through its own bounce buffer.

`resolve_backend(choice, status)` turns the setting into the backend used: `posix` and
`kvikio` as asked (kvikio refused with a one-line reason where it cannot run: not
importable, or no CUDA device); `auto` takes kvikio only where it reads with GDS, since
compatibility mode is a bounce through host memory like the POSIX path, and measured
slower on an H200 without GDS (1.46 GB/s vs 1.83 GB/s for O_DIRECT + H2D, cold 2 GiB).
`calibrate` times both on one file region (page cache dropped before each read where the
file allows it) for machines where the rule is not enough (tools/bench_store.py reports
both side by side).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from kvstore.errors import InvalidRequest

BACKENDS = ("auto", "posix", "kvikio")


@dataclass(frozen=True)
class KvikioStatus:
    """Whether kvikio can read into device memory here, and how."""

    importable: bool
    cuda: bool
    gds: Optional[bool]  # None: unknown (kvikio absent)
    reason: str = ""  # why it cannot run (empty when it can)

    @property
    def usable(self) -> bool:
        return self.importable and self.cuda


def kvikio_status() -> KvikioStatus:
    """Probe kvikio (import, a CUDA device, GDS or compatibility mode)."""
    try:
        import kvikio  # noqa: F401
    except Exception as exc:  # absent, or a broken install (missing libkvikio)
        return KvikioStatus(False, False, None, f"kvikio is not importable ({type(exc).__name__}: {exc})")
    try:
        import torch

        cuda = torch.cuda.is_available()
    except Exception:  # pragma: no cover - torch is a dependency
        cuda = False
    gds = _gds_available()
    return KvikioStatus(True, cuda, gds, "" if cuda else "no CUDA device for kvikio to read into")


def _gds_available() -> Optional[bool]:  # pragma: no cover - kvikio only
    try:
        import kvikio.defaults

        compat = kvikio.defaults.compat_mode()
        return not bool(compat)
    except Exception:
        return None


def resolve_backend(choice: str, status: Optional[KvikioStatus] = None) -> str:
    """'posix' or 'kvikio' for the setting `choice` (module docstring)."""
    if choice not in BACKENDS:
        raise InvalidRequest(f"nvme_read_backend={choice!r} must be one of {', '.join(BACKENDS)}")
    if choice == "posix":
        return "posix"
    status = status if status is not None else kvikio_status()
    if choice == "kvikio":
        if not status.usable:
            raise InvalidRequest(f"nvme_read_backend=kvikio: {status.reason}")
        return "kvikio"
    return "kvikio" if status.usable and status.gds else "posix"


class NvmeReader:
    """Reads file regions into a tensor with one backend ('posix' or 'kvikio')."""

    def __init__(self, backend: str) -> None:
        if backend not in ("posix", "kvikio"):
            raise InvalidRequest(f"NvmeReader backend {backend!r} must be posix or kvikio (resolve_backend first)")
        self.backend = backend
        self._kvikio: Any = None
        if backend == "kvikio":  # pragma: no cover - kvikio only
            import kvikio

            self._kvikio = kvikio

    def read(self, path: str, offset: int, length: int, dst: Any, stream: Any = None) -> Optional[Any]:
        """Bytes [offset, offset + length) of `path` into dst[:length] (contiguous uint8
        tensor). On a CUDA `dst` returns an event the bytes are complete after (posix:
        copies issued on `stream`; kvikio: complete on return, the event is recorded
        anyway), else None (complete)."""
        import torch

        if not isinstance(dst, torch.Tensor) or dst.dtype != torch.uint8 or dst.dim() != 1 \
                or not dst.is_contiguous() or dst.numel() < length:
            raise InvalidRequest(f"reading {length} bytes needs a contiguous 1-D uint8 tensor of >= {length} bytes")
        if self.backend == "kvikio":  # pragma: no cover - kvikio only
            with self._kvikio.CuFile(path, "r") as f:
                got = f.pread(dst[:length], length, offset).get()
            if got != length:
                from kvstore.errors import StorageError

                raise StorageError(f"kvikio read {got} of {length} bytes at {offset} of {path}")
            if dst.is_cuda:
                ev = torch.cuda.Event()
                ev.record(stream if stream is not None else torch.cuda.current_stream(dst.device))
                return ev
            return None
        from kvstore.client.fileio import read_file, read_file_to_cuda

        if dst.is_cuda:  # pragma: no cover - GPU only
            stream = stream if stream is not None else torch.cuda.current_stream(dst.device)
            read_file_to_cuda(path, offset, length, dst[:length], stream)
            ev = torch.cuda.Event()
            ev.record(stream)
            return ev
        read_file(path, offset, length, dst[:length].numpy())
        return None


def _drop_cache(path: str, offset: int, length: int) -> None:
    """Ask the kernel to drop the region's clean cached pages (no-op where it cannot)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
    except (OSError, AttributeError):
        pass
    finally:
        os.close(fd)


def calibrate(path: str, offset: int, length: int, device: Any, backends: Sequence[str] = ("posix", "kvikio"),
              repeats: int = 2) -> dict:
    """GB/s of each usable backend reading the region into a tensor on `device` (best of
    `repeats`, cached pages dropped before each read), and the fastest (`best`)."""
    import torch

    status = kvikio_status()
    dst = torch.empty(length, dtype=torch.uint8, device=device)
    out: dict = {"bytes": length, "gds": status.gds, "gb_per_s": {}, "skipped": {}}
    for b in backends:
        if b == "kvikio" and not status.usable:
            out["skipped"][b] = status.reason
            continue
        reader = NvmeReader(b)
        best = 0.0
        for _ in range(repeats):
            _drop_cache(path, offset, length)
            t0 = time.perf_counter()
            ev = reader.read(path, offset, length, dst)
            if ev is not None:  # pragma: no cover - GPU only
                ev.synchronize()
            best = max(best, length / (time.perf_counter() - t0) / 1e9)
        out["gb_per_s"][b] = best
    out["best"] = max(out["gb_per_s"], key=out["gb_per_s"].get) if out["gb_per_s"] else None
    return out
