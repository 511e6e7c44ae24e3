"""The engine package's exception hierarchy. Every error the engine raises on purpose is an
`EngineError`; messages name the bad value."""
from __future__ import annotations


class EngineError(Exception):
    """Base class of all engine errors."""


class ConfigError(EngineError, ValueError):
    """A model or cache configuration is invalid (bad field, inconsistent shapes)."""


class PresetNotFoundError(ConfigError, KeyError):
    """No preset has the requested name."""


class WeightsError(EngineError):
    """Weights are missing, do not match the config, or cannot be read."""


class CacheError(EngineError):
    """Misuse of the cache (unknown sequence, double free, out-of-range position)."""


class CacheFullError(CacheError):
    """The cache has no free block or slot left for a request."""


class TokenizerError(EngineError, ValueError):
    """Text or token ids that the tokenizer cannot handle."""


class RuntimeStateError(EngineError):
    """A runtime call that does not fit a sequence's state (e.g. a prefill chunk that does not
    start where the sequence's computed tokens end)."""
