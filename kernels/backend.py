"""Backend selection shared by every kernel module: whether Triton is importable, whether
the Triton interpreter is active, and the dispatch rule between a Triton kernel and its
torch reference.

Dispatch rule (the same for every public kernel function, via `use_triton`):
  * `force_triton=False` -> the torch reference;
  * `force_triton=True`  -> the Triton kernel, or `KernelUnavailableError` if it cannot run;
  * `force_triton=None`  -> the Triton kernel when the tensors are on CUDA, or when the
    Triton interpreter is active (TRITON_INTERPRET=1 set before `triton` was imported);
    otherwise the torch reference.
Under the interpreter only float32/float16 run through Triton (numpy has no bfloat16), so
with `force_triton=None` a bfloat16 input falls back to the reference there.
"""
from __future__ import annotations

import os
from typing import Iterable, Optional

import torch

from kernels.errors import KernelUnavailableError

_TRUE = {"1", "true", "yes", "on", "y"}


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in _TRUE


try:  # triton is an optional dependency (extra "kernels"); CPU installs may lack it.
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only on installs without triton
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]
    HAS_TRITON = False

# `triton.jit` decides at decoration time whether it builds an interpreted function, so the
# interpreter is "active" for this process only if the flag was set before this import.
INTERPRET: bool = HAS_TRITON and _env_flag("TRITON_INTERPRET")

_INTERPRETER_DTYPES = (torch.float32, torch.float16)


def use_triton(tensors: Iterable[Optional[torch.Tensor]], force_triton: Optional[bool],
               kernel: str) -> bool:
    """Apply the dispatch rule above to the given inputs of kernel `kernel`."""
    tensors = [t for t in tensors if t is not None]
    on_cuda = any(t.is_cuda for t in tensors)
    float_dtypes = {t.dtype for t in tensors if t.is_floating_point()}
    interpreter_ok = INTERPRET and float_dtypes <= set(_INTERPRETER_DTYPES)
    if force_triton is False:
        return False
    if force_triton is True:
        if not HAS_TRITON:
            raise KernelUnavailableError(f"{kernel}: force_triton=True but triton is not installed")
        if not on_cuda and not INTERPRET:
            raise KernelUnavailableError(
                f"{kernel}: force_triton=True with CPU tensors needs TRITON_INTERPRET=1 set "
                "before triton is imported")
        if not on_cuda and not interpreter_ok:
            raise KernelUnavailableError(
                f"{kernel}: the Triton interpreter runs float32/float16 only, got "
                f"{sorted(str(d) for d in float_dtypes)}")
        return True
    if not HAS_TRITON:
        return False
    if on_cuda:
        return True
    return interpreter_ok


def next_pow2(x: int) -> int:
    """Smallest power of two >= max(x, 1)."""
    x = max(int(x), 1)
    return 1 << (x - 1).bit_length()


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 1 for anything else (the interpreter)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1
