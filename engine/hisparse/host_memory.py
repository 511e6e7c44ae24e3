"""Host memory of HiSparse block mirrors: `mirror_empty(shape, dtype, device)` allocates the
host tensor that mirrors a layer's sealed blocks. On CUDA it is page-locked in place with
`cudaHostRegister` (the mapped, portable default under unified addressing, so a kernel can
read it through its address; no power-of-two rounding as the caching pinned allocator
does, which would double a mirror of tens of GiB), falling back to `pin_memory=True` where
registering fails; on the CPU it is plain memory."""
from __future__ import annotations

import logging
import weakref

import torch

log = logging.getLogger("engine.hisparse")


def _register(t: torch.Tensor) -> bool:
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return False
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(t.data_ptr(), nbytes, 0)
    if int(err) != 0 or not t.is_pinned():
        if int(err) == 0:
            cudart.cudaHostUnregister(t.data_ptr())
        return False
    weakref.finalize(t, cudart.cudaHostUnregister, t.data_ptr())
    return True


def mirror_empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised host tensor for a mirror of `device` blocks (see the module docstring)."""
    if torch.device(device).type != "cuda":
        return torch.empty(shape, dtype=dtype)
    t = torch.empty(shape, dtype=dtype)
    try:
        if _register(t):
            return t
    except (RuntimeError, AttributeError) as exc:
        log.debug("hisparse: cudaHostRegister unavailable (%s)", exc)
    log.info("hisparse: registering a %d-byte mirror failed; using the pinned allocator", t.numel() * t.element_size())
    return torch.empty(shape, dtype=dtype, pin_memory=True)
