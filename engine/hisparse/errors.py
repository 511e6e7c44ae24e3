"""Exceptions of HiSparse offload (engine/hisparse/), under the engine's EngineError."""
from __future__ import annotations

from engine.errors import ConfigError, EngineError


class HiSparseError(EngineError):
    """Base class of HiSparse errors."""


class HiSparseConfigError(HiSparseError, ConfigError):
    """A HiSparse setting is out of range (the message names it)."""


class BlocksLost(HiSparseError):
    """Blocks a sequence needs are gone from the block store (the daemon restarted, or it
    cannot be reached). The engine recomputes the sequences of the failed step from their
    tokens; nothing is served from a block that could not be read."""

    def __init__(self, keys: list[bytes], reason: str) -> None:
        self.keys = list(keys)
        self.reason = reason
        super().__init__(f"{len(self.keys)} HiSparse block(s) could not be read: {reason}")
