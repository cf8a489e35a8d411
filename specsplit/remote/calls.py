"""One call to a worker: its peer, the stream of a generation the worker runs, and how a gRPC
failure becomes a SpecSplit exception (see :mod:`specsplit.remote.client` for the policy)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import grpc

from specsplit.errors import (
    CacheDesyncError,
    InvalidRequest,
    ResourceExhausted,
    SessionNotFound,
    SpecSplitError,
    TransportError,
)
from specsplit.messages import GenerateUpdate
from specsplit.remote import convert
from specsplit.remote._generated import spec_decoding_pb2 as pb

logger = logging.getLogger(__name__)

_RETRY_AFTER_KEY = "retry-after-ms"  # as specsplit.remote.admission.RETRY_AFTER_KEY


class AuthenticationError(TransportError):
    """A worker refused this client's credentials (``UNAUTHENTICATED``)."""


class Peer:
    """One worker: its address, channel and stub."""

    def __init__(self, role: str, address: str, channel: grpc.Channel, stub: Any):
        self.role = role
        self.address = address
        self.channel = channel
        self.stub = stub


class GenerateStream:
    """The updates of a generation the target worker runs (:meth:`GrpcTransport.generate_on_target`).

    Iterating yields :class:`~specsplit.transport.GenerateUpdate` s; :meth:`cancel` stops the
    generation on the worker (which then frees the session on both workers). A watchdog cancels the
    call when no update arrives for ``timeout_s`` seconds, which surfaces as :class:`TransportError`.
    A stream that breaks with ``UNAVAILABLE`` is started again from the tokens received so far
    (see the module docstring), for up to ``timeout_s`` seconds of the worker being away.
    """

    def __init__(self, start: Any, request: pb.GenerateRequest, peer: Peer, timeout_s: float):
        self._start, self._request, self._peer, self._timeout_s = start, request, peer, timeout_s
        self._received: list[int] = []
        self._recoveries = 0
        self._last = time.monotonic()
        self._done = threading.Event()
        self._timed_out = False
        self._call = start(request, False)
        threading.Thread(target=self._watch, name="specsplit-generate-watchdog", daemon=True).start()

    def _watch(self) -> None:
        while not self._done.wait(min(self._timeout_s, 1.0)):
            if time.monotonic() - self._last > self._timeout_s:
                self._timed_out = True
                self._call.cancel()
                return

    def __iter__(self) -> GenerateStream:
        return self

    def __next__(self) -> GenerateUpdate:
        while True:
            try:
                msg = next(self._call)
                break
            except StopIteration:
                self._done.set()
                raise
            except grpc.RpcError as e:
                code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
                if self._timed_out:
                    self._done.set()
                    raise TransportError(
                        f"target worker at {self._peer.address}: Generate sent nothing for "
                        f"{self._timeout_s:g}s (timeout_s); cancelled"
                    ) from None
                if code != grpc.StatusCode.UNAVAILABLE or self._done.is_set():
                    self._done.set()
                    raise to_error(self._peer, "Generate", e) from None
                self._resume(e)
        self._last = time.monotonic()
        update = convert.generate_update_from_proto(msg)
        for tokens, _ in update.rounds:
            self._received.extend(tokens)
        if msg.done:  # the last message: the watchdog can go
            self._done.set()
            update.recoveries += self._recoveries
        return update

    def _resume(self, error: grpc.RpcError) -> None:
        """Send the generation again from where the broken stream left it (the worker waited for)."""
        req = pb.GenerateRequest()
        req.CopyFrom(self._request)
        req.prompt_token_ids.extend(self._received)
        req.max_new_tokens = max(0, self._request.max_new_tokens - len(self._received))
        self._recoveries += 1
        logger.info("target worker at %s: Generate stream broke (%s); resending %d tokens of context",
                    self._peer.address, error_details(error), len(req.prompt_token_ids))  # fmt: skip
        self._last = time.monotonic()  # the watchdog gives the worker timeout_s to come back
        self._call = self._start(req, True)

    def cancel(self) -> None:
        """Stop the generation (idempotent)."""
        self._done.set()
        self._call.cancel()


def retry_after(md: dict[str, Any]) -> float | None:
    """Seconds a worker's ``retry-after-ms`` asks to wait, or None when it sent none."""
    value = md.get(_RETRY_AFTER_KEY)
    if isinstance(value, str) and value.isdigit():
        return min(int(value), 10_000) / 1000.0
    return None


def error_details(e: grpc.RpcError) -> str:
    d = e.details() if hasattr(e, "details") else None
    return d or str(e)


def to_error(peer: Peer, method: str, e: grpc.RpcError) -> SpecSplitError:
    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
    details = error_details(e)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidRequest(details)
    if code == grpc.StatusCode.NOT_FOUND:
        return SessionNotFound(details)
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        md = dict(e.trailing_metadata() or ()) if hasattr(e, "trailing_metadata") else {}
        exp, act = md.get("specsplit-expected"), md.get("specsplit-actual")
        return CacheDesyncError(
            details,
            expected=int(exp) if isinstance(exp, str) and exp.isdigit() else None,
            actual=int(act) if isinstance(act, str) and act.isdigit() else None,
        )
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return ResourceExhausted(details)
    hint = ""
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return AuthenticationError(
            f"{peer.role} worker at {peer.address}: {method} failed: {code.name}: {details} "
            "(set auth_token / SPECSPLIT_AUTH_TOKEN to the worker's token)"
        )
    elif code == grpc.StatusCode.UNAVAILABLE:
        hint = " (is the worker running? for TLS, is tls_ca_file right?)"
    elif code == grpc.StatusCode.UNIMPLEMENTED:
        hint = f" (is {peer.address} a {peer.role} worker of this SpecSplit version? grpc_loop='target' needs one)"
    return TransportError(
        f"{peer.role} worker at {peer.address}: {method} failed: {code.name}: {details}{hint}"
    )
