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


def _gpu_present() -> bool:
    return os.path.exists("/dev/nvidiactl") or shutil.which("nvidia-smi") is not None


if "TRITON_INTERPRET" not in os.environ and not _gpu_present():
    os.environ["TRITON_INTERPRET"] = "1"
