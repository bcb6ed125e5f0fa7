"""The engine's refusals, as types a front end tells apart (never by their text)."""

from __future__ import annotations

from mlxlocal.errors import MlxLocalError


class EngineDeadError(MlxLocalError):
    """The engine has stopped (a fault, or shutdown): it serves no more requests (HTTP 503)."""


class QueueFull(MlxLocalError):
    """Too many requests waiting: the caller should retry later (HTTP 429)."""


class OutOfCapacity(MlxLocalError):
    """A request that cannot fit the KV pool even when it runs alone."""


class SessionBusy(MlxLocalError, ValueError):
    """The session is already generating: a session runs one request at a time (HTTP 409)."""

    def __init__(self) -> None:
        super().__init__("this session is already generating")
