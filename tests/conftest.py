"""Test-wide setup.

Triton decides when `triton.jit` runs (at import of a kernel module) whether to build
interpreted kernels, so TRITON_INTERPRET must be in the environment before torch or triton
is first imported. This file therefore imports neither: it detects a GPU from the driver's
device node or `nvidia-smi` on PATH, and on a machine without one sets TRITON_INTERPRET=1,
so Triton kernels run on the CPU under the interpreter.

Override: an explicit TRITON_INTERPRET in the environment is always kept as it is
(TRITON_INTERPRET=1 forces the interpreter even on a GPU box; TRITON_INTERPRET=0 on a CPU
machine makes the kernels fall back to their torch references).
"""
import os
import shutil

import pytest


def _gpu_present() -> bool:
    return os.path.exists("/dev/nvidiactl") or shutil.which("nvidia-smi") is not None


if "TRITON_INTERPRET" not in os.environ and not _gpu_present():
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(scope="module")
def one_torch_thread():
    """torch on one thread for a module's tests (tiny matmuls run fastest so, and the test
    machine is shared); the thread count before it is restored after. Imports torch lazily:
    this file must not (module docstring)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
