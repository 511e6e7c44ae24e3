"""Errors of the store connector (engine/connector/). They extend the engine's one
hierarchy (`engine.errors.EngineError`); messages name the bad value or the daemon.

None of them ever fails a request: the connector turns each into a recomputation and a
counted metric. They surface only from configuration (bad option values) and from
calls a caller makes on purpose (`StoreLink.call` when the daemon is away).
"""
from __future__ import annotations

from engine.errors import EngineError


class ConnectorError(EngineError):
    """Base class of every error raised by engine/connector/."""


class ConnectorConfigError(ConnectorError, ValueError):
    """A connector option is invalid (negative timeout, empty socket path...)."""


class StoreUnavailable(ConnectorError):
    """The kvstore daemon cannot be reached now (not running, restarting, or too slow);
    the connector serves by recomputation and reconnects in the background."""
