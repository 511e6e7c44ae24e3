"""The engine's exception hierarchy.

Every error the engine raises on purpose derives from `EngineError`, so callers (the
HTTP server, the CLI) can tell the engine's refusals from bugs. Messages name the bad
value. The HTTP server maps `InvalidRequestError` to 400 (with its `field`),
`CapacityError` to 503 and `RequestNotFoundError` to 404.
"""
from __future__ import annotations


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class InvalidRequestError(EngineError, ValueError):
    """A request (prompt, segments or sampling parameters) is malformed.

    `field` names the offending input (for example ``"temperature"`` or
    ``"segments[1].text"``) so an API layer can point the caller at it.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class CapacityError(EngineError):
    """The engine cannot hold a request: it needs more cache than the engine owns at
    all (not merely more than is free right now; that case waits in the queue)."""


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
