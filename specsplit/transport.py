"""The Transport protocol: how the round loop reaches the draft and target engines.

``LocalTransport`` (:mod:`specsplit.local`) calls the engines in-process; ``GrpcTransport``
(:mod:`specsplit.remote`) sends the same :mod:`specsplit.messages` to remote workers. Nothing above
this module knows which one is in use.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from specsplit.messages import DraftRequest, DraftResult, VerifyRequest, VerifyResult, WorkerInfo


@runtime_checkable
class Transport(Protocol):
    """Moves requests to the engines. Implementations: ``LocalTransport``, ``GrpcTransport``."""

    @property
    def has_draft(self) -> bool:
        """False when no draft is reachable; the pipeline then decodes target-only."""
        ...

    def draft(self, request: DraftRequest) -> DraftResult: ...

    def verify(self, request: VerifyRequest) -> VerifyResult: ...

    def end_session(self, session_id: str) -> None:
        """Free the session on both sides (idempotent, never raises for unknown ids)."""
        ...

    def info(self) -> dict[str, WorkerInfo]:
        """``{"draft": ..., "target": ...}`` (draft omitted when there is none)."""
        ...

    def close(self) -> None:
        """Release resources (idempotent)."""
        ...
