"""HiSparse block copies with a device-side list: `copy_blocks` copies whole rows (blocks)
`src[src_rows[i]] -> dst[dst_rows[i]]` for every i with `valid[i]`, with no host read of the
list, so a decode step can bring its missing blocks in (host mirror -> hot buffer) and write
its sealed blocks out (hot buffer -> host mirror) at fixed shapes (masked entries copy
nothing; CUDA-graph-capturable).

`src` and `dst` are `[rows, ...]` tensors of one dtype and one row shape. On CUDA either of
them may be a *pinned host* tensor: the Triton kernel reads or writes it through its
unified (UVA) address, so a fetch from host memory is one kernel launch, no staging copy
and no host synchronisation. `src_rows`, `dst_rows` (int32/int64) and `valid` (bool) are
`[M]` on the device the kernel runs on (CUDA, or the CPU under TRITON_INTERPRET=1).

`copy_blocks_reference` is the torch reference (it reads the valid entries on the host);
`copy_blocks` takes the Triton kernel on CUDA and under the interpreter, else the reference.
Entries must not write one destination row twice.
"""
from __future__ import annotations

from typing import Optional

import torch

from kernels.backend import HAS_TRITON, INTERPRET, tl, triton
from kernels.errors import KernelInputError, KernelUnavailableError

__all__ = ["copy_blocks", "copy_blocks_reference"]

_INDEX_DTYPES = (torch.int32, torch.int64)
#: elements one program copies per loop iteration
_CHUNK = 1024


def _validate(src, src_rows, dst, dst_rows, valid):
    if src.dim() < 1 or dst.dim() < 1 or src.shape[1:] != dst.shape[1:]:
        raise KernelInputError(f"src and dst must be [rows, ...] of one row shape, got {tuple(src.shape)} and "
                               f"{tuple(dst.shape)}")
    if src.dtype != dst.dtype:
        raise KernelInputError(f"src and dst must share a dtype, got {src.dtype} and {dst.dtype}")
    if not src.is_contiguous() or not dst.is_contiguous():
        raise KernelInputError("src and dst must be contiguous")
    m = src_rows.shape[0] if src_rows.dim() == 1 else -1
    for name, t in (("src_rows", src_rows), ("dst_rows", dst_rows)):
        if t.dim() != 1 or t.shape[0] != m or t.dtype not in _INDEX_DTYPES:
            raise KernelInputError(f"{name} must be int32/int64 [M] (M={m}), got {t.dtype} {tuple(t.shape)}")
    if valid.shape != (m,) or valid.dtype != torch.bool:
        raise KernelInputError(f"valid must be bool [{m}], got {valid.dtype} {tuple(valid.shape)}")
    if len({src_rows.device, dst_rows.device, valid.device}) != 1:
        raise KernelInputError("src_rows, dst_rows and valid must be on one device")


def copy_blocks_reference(src: torch.Tensor, src_rows: torch.Tensor, dst: torch.Tensor, dst_rows: torch.Tensor,
                          valid: torch.Tensor) -> torch.Tensor:
    """Torch reference of `copy_blocks` (reads the valid entries on the host); returns dst."""
    _validate(src, src_rows, dst, dst_rows, valid)
    keep = valid.cpu()
    s, d = src_rows.cpu()[keep].long(), dst_rows.cpu()[keep].long()
    if s.numel():
        if int(s.min()) < 0 or int(s.max()) >= src.shape[0]:
            raise KernelInputError(f"src_rows must lie in [0, {src.shape[0]}), got {s.tolist()}")
        if int(d.min()) < 0 or int(d.max()) >= dst.shape[0]:
            raise KernelInputError(f"dst_rows must lie in [0, {dst.shape[0]}), got {d.tolist()}")
        rows = src.index_select(0, s.to(src.device))
        dst.index_copy_(0, d.to(dst.device), rows.to(dst.device))
    return dst


if HAS_TRITON:

    @triton.jit
    def _copy_rows_kernel(src_ptr, dst_ptr, src_rows_ptr, dst_rows_ptr, valid_ptr, row_elems,
                          CHUNK: tl.constexpr):
        i = tl.program_id(0)
        part = tl.program_id(1)
        ok = tl.load(valid_ptr + i)
        if ok != 0:
            s = tl.load(src_rows_ptr + i).to(tl.int64)
            d = tl.load(dst_rows_ptr + i).to(tl.int64)
            span = tl.cdiv(row_elems, tl.num_programs(1))
            lo = part * span
            for c in range(0, span, CHUNK):
                off = lo + c + tl.arange(0, CHUNK)
                mask = (off < lo + span) & (off < row_elems)
                x = tl.load(src_ptr + s * row_elems + off, mask=mask)
                tl.store(dst_ptr + d * row_elems + off, x, mask=mask)


def copy_blocks(src: torch.Tensor, src_rows: torch.Tensor, dst: torch.Tensor, dst_rows: torch.Tensor,
                valid: torch.Tensor, force_triton: Optional[bool] = None, splits: int = 4) -> torch.Tensor:
    """Copy rows `src[src_rows[i]]` to `dst[dst_rows[i]]` where `valid[i]` (module docstring);
    returns dst. `splits`: programs per row on the Triton path."""
    _validate(src, src_rows, dst, dst_rows, valid)
    dev = src_rows.device
    triton_ok = HAS_TRITON and (dev.type == "cuda" or (INTERPRET and dev.type == "cpu"))
    if force_triton is True and not triton_ok:
        raise KernelUnavailableError("copy_blocks: force_triton=True needs CUDA index tensors or TRITON_INTERPRET=1")
    if force_triton is False or not triton_ok or (INTERPRET and src.dtype == torch.bfloat16):
        return copy_blocks_reference(src, src_rows, dst, dst_rows, valid)
    # is_pinned asks the driver (cudaPointerGetAttributes); inside a CUDA-graph capture the
    # eager warm-up step has already checked these very tensors, so it is skipped there
    capturing = dev.type == "cuda" and torch.cuda.is_current_stream_capturing()
    for name, t in (("src", src), ("dst", dst)):
        if t.device != dev and not (dev.type == "cuda" and t.device.type == "cpu" and (capturing or t.is_pinned())):
            raise KernelInputError(f"{name} must be on {dev} or (with CUDA indices) pinned host memory, "
                                   f"got {t.device}{'' if t.device.type != 'cpu' else ' (not pinned)'}")
    m = src_rows.shape[0]
    row_elems = src[0].numel() if src.shape[0] else dst[0].numel()
    if m == 0 or row_elems == 0:
        return dst
    # bytes, not elements: one kernel for every dtype of one element size
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[src.element_size()]
    _copy_rows_kernel[(m, max(1, splits))](src.view(view), dst.view(view), src_rows, dst_rows,
                                           valid.view(torch.uint8), row_elems, CHUNK=_CHUNK)
    return dst
