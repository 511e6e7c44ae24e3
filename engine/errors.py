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


# ---- serving: requests, scheduling, the HTTP API ---------------------------------------


class InvalidRequestError(EngineError, ValueError):
    """A request (prompt, segments or sampling parameters) is malformed.

    `field` names the offending input (for example ``"temperature"`` or
    ``"segments[1].text"``) so an API layer can point the caller at it (HTTP 400).
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class CapacityError(CacheFullError):
    """A request needs more cache than the engine owns at all (not merely more than is
    free right now: that case waits in the queue). HTTP 503."""


class RequestNotFoundError(EngineError, KeyError):
    """No live request has this id."""

    def __init__(self, request_id: str) -> None:
        super().__init__(f"no such request: {request_id!r}")
        self.request_id = request_id

    def __str__(self) -> str:  # KeyError would quote the whole message again
        return self.args[0]


class PlanError(EngineError):
    """A prefill planner returned a plan that does not cover the prompt correctly."""


class EngineStoppedError(EngineError):
    """The engine loop has stopped (shutdown or a fatal error) and takes no requests."""


class UnsupportedConfigError(ConfigError):
    """A checkpoint's config asks for a feature the engine does not implement (the message
    names the field)."""
