"""Remote mode: the draft and target engines behind gRPC workers.

``specsplit serve draft|target --model ... --port ...`` starts a worker (or, from Python,
:func:`serve_draft` / :func:`serve_target` wrap an engine you built); :class:`GrpcTransport` is the
client side of :class:`specsplit.transport.Transport`, selected with
``SpecSplitConfig(transport="grpc", target_address=..., draft_address=...)``. The engines, KV
caches and verification code are the same objects as in local mode; this package only moves
messages (``convert`` is the one place that maps dataclasses to protobuf and back).

Needs the ``grpc`` extra: ``pip install 'specsplit[grpc]'``.
"""

from __future__ import annotations

try:
    import grpc  # noqa: F401
    from google.protobuf import message as _message  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"specsplit remote mode needs grpcio and protobuf ({e}); install them with: "
        "pip install 'specsplit[grpc]'"
    ) from e

from specsplit.remote.client import GrpcTransport
from specsplit.remote.protocol import PROTOCOL_VERSION
from specsplit.remote.worker import WorkerServer, serve_draft, serve_target

__all__ = ["PROTOCOL_VERSION", "GrpcTransport", "WorkerServer", "serve_draft", "serve_target"]
