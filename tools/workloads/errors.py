"""Exception hierarchy of the workload generators (tools.workloads).

Every error raised on bad input names the bad value, so a caller (CLI user, training
script, benchmark) can see what to fix without reading the source.
"""
from __future__ import annotations


class WorkloadError(Exception):
    """Base class of every error raised by tools.workloads."""


class UnknownTaskError(WorkloadError, ValueError):
    """A task name that is not one of the five workloads."""


class WorkloadConfigError(WorkloadError, ValueError):
    """A generator parameter out of range or inconsistent with the others."""


class RecordFormatError(WorkloadError, ValueError):
    """A request record (dict or JSON line) that does not have the documented shape."""


class GenerationError(WorkloadError, RuntimeError):
    """The generator could not build a well-formed request (a bug or an impossible config)."""
