"""Errors of position-independent caching (engine/pic/). They extend the engine's one
hierarchy (`engine.errors.EngineError`); messages name the bad value."""
from __future__ import annotations

from engine.errors import EngineError


class PicError(EngineError):
    """Base class of every error raised by engine/pic/."""


class PicConfigError(PicError, ValueError):
    """A PIC option is invalid (unknown method, negative seam, bad policy name)."""


class SignatureFormatError(PicError, ValueError):
    """A segment signature's parts do not fit together or do not fit the model (missing
    part, wrong shape, unknown format version)."""


class SplicePlacementError(PicError):
    """A splice does not fit the request's caches (wrong start position, placement that
    the signature cannot serve)."""


class AlonePassStopped(PicError):
    """An alone pass was stopped between two layers because its `should_stop` said so
    (idle work giving way to an arriving request); it computed nothing that is kept."""
