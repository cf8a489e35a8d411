"""LocalTransport: both engines in this process, on one device or several.

It is also the test double for the remote transport: the same messages, the same engines.
Only token ids and draft probabilities cross devices (``TokenTree.to``).
"""

from __future__ import annotations

from specsplit.engines.draft import DraftEngine
from specsplit.engines.target import TargetEngine
from specsplit.messages import DraftRequest, DraftResult, VerifyRequest, VerifyResult, WorkerInfo


class LocalTransport:
    """In-process transport.

    Args:
        draft_engine: the draft engine, or ``None`` for target-only decoding.
        target_engine: the target engine.
    """

    def __init__(self, draft_engine: DraftEngine | None, target_engine: TargetEngine):
        self.draft_engine = draft_engine
        self.target_engine = target_engine
        self._closed = False

    @property
    def has_draft(self) -> bool:
        return self.draft_engine is not None

    def draft(self, request: DraftRequest) -> DraftResult:
        if self.draft_engine is None:
            raise RuntimeError("LocalTransport has no draft engine")
        return self.draft_engine.generate(request)

    def verify(self, request: VerifyRequest) -> VerifyResult:
        # A model draft's tree moves to the target's device (non-blocking; a device tree skips the
        # host checks meant for trees from outside). A host tree the package's n-gram drafters built
        # (``trusted``) stays on the host: a graph-replayed round stages its ids in one pinned copy.
        tree = request.tree
        if not (tree.trusted and tree.device.type == "cpu"):
            request.tree = tree.to(self.target_engine.device)
        return self.target_engine.verify(request)

    def end_session(self, session_id: str) -> None:
        if self.draft_engine is not None:
            self.draft_engine.end_session(session_id)
        self.target_engine.end_session(session_id)

    def info(self) -> dict[str, WorkerInfo]:
        out = {"target": self.target_engine.info()}
        if self.draft_engine is not None:
            out["draft"] = self.draft_engine.info()
        return out

    def close(self) -> None:
        """Stop the engines' session purgers and drop their sessions (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self.draft_engine is not None:
            self.draft_engine.shutdown()
        self.target_engine.shutdown()

    def __enter__(self) -> LocalTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
