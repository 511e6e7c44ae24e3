"""Exceptions raised by the kernels package.

Every public kernel entry point validates its inputs before launching anything and raises
`KernelInputError` (a `ValueError`) naming the argument and the bad value, so a caller
never sees an illegal-memory-access or a Triton compile error for a shape mistake.
"""
from __future__ import annotations


class KernelError(Exception):
    """Base class of every error raised by `kernels`."""


class KernelInputError(KernelError, ValueError):
    """An argument has the wrong shape, dtype, device or value."""


class KernelUnavailableError(KernelError, RuntimeError):
    """The Triton path was requested (`force_triton=True`) but cannot run here."""
