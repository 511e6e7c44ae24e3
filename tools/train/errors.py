"""The training package's exception hierarchy. Every error tools.train raises on purpose is
a `TrainError`; messages name the bad value."""
from __future__ import annotations


class TrainError(Exception):
    """Base class of all training errors."""


class TrainConfigError(TrainError, ValueError):
    """A training option is out of range or inconsistent (named in the message)."""


class DataError(TrainError):
    """A training example or batch could not be built (bad task, prompt that does not fit)."""
