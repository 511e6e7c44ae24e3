"""Test-wide setup. TRITON_INTERPRET must be set before triton is first imported, so
Triton kernels run on the CPU under the interpreter when no GPU is present."""
import os

try:
    import torch

    _has_cuda = torch.cuda.is_available()
except Exception:  # pragma: no cover - torch is a hard dependency
    _has_cuda = False
if not _has_cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")
