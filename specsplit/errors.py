"""SpecSplit exception hierarchy.

Every error a user or a remote peer can trigger is one of these types, so callers can catch
``SpecSplitError`` and the gRPC layer can map each type to one status code
(see ``specsplit.remote``).
"""

from __future__ import annotations


class SpecSplitError(Exception):
    """Base class of every error raised by SpecSplit."""


class ConfigError(SpecSplitError, ValueError):
    """A configuration value is invalid; the message says which one and what is allowed."""


class InvalidRequest(SpecSplitError, ValueError):
    """A request is malformed (bad token ids, bad tree, bad probabilities). Nothing was changed."""


class SessionNotFound(SpecSplitError, KeyError):
    """The session id is unknown to the engine (never created, ended, evicted or expired)."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else "session not found"


class CacheDesyncError(SpecSplitError, RuntimeError):
    """The caller's idea of the cached prefix length disagrees with the engine's.

    Recover by resending the full context with ``expected_prefix_length=0``.
    """

    def __init__(self, message: str, *, expected: int | None = None, actual: int | None = None):
        super().__init__(message)
        self.expected = expected
        self.actual = actual


class ResourceExhausted(SpecSplitError, RuntimeError):
    """A request would exceed a configured limit (tree budget, context capacity, sessions)."""


class TransportError(SpecSplitError, ConnectionError):
    """A transport could not deliver a message (peer unreachable, deadline exceeded)."""


class ModelLoadError(SpecSplitError, RuntimeError):
    """A model could not be found, fetched, verified or loaded."""
