"""GrpcTransport: the :class:`~specsplit.transport.Transport` that talks to remote workers.

Every call carries a deadline (``timeout_s``). Failures become SpecSplit exceptions
(``raise ... from None``, so users never see a ``grpc.RpcError``):

===========================  ===========================================================
INVALID_ARGUMENT             :class:`InvalidRequest`
NOT_FOUND                    :class:`SessionNotFound`    (pipeline resends the full context)
FAILED_PRECONDITION          :class:`CacheDesyncError`   (pipeline resends the full context)
RESOURCE_EXHAUSTED           :class:`ResourceExhausted`
anything else                :class:`TransportError`     (unreachable, deadline, auth, internal)
===========================  ===========================================================

Retry policy, and why it is safe:

* ``Ping`` and ``EndSession`` are idempotent: retried on ``UNAVAILABLE`` with backoff until the
  deadline.
* ``VerifyDrafts`` is not idempotent (it advances the target's session), but every request names
  the prefix length it expects. If a request reached the target and only the reply was lost, its
  replay finds a longer cache and fails with ``FAILED_PRECONDITION``; a restarted target answers
  ``NOT_FOUND``; either way the pipeline resends the full context and the output is unchanged. A
  round can therefore never be committed twice, so ``UNAVAILABLE`` (worker down, restarting, or
  connection lost) is retried until the deadline. ``DEADLINE_EXCEEDED`` is not retried: the worker
  may still be busy with the call.
* ``Generate`` (the target worker runs the rounds, ``SpecSplitConfig.grpc_loop="target"``) is a
  server stream with no overall deadline: ``timeout_s`` bounds the wait for each next message
  instead (a watchdog cancels the call). When the stream breaks with ``UNAVAILABLE`` (the target
  worker restarted, the connection dropped) the generation is sent again with the tokens received
  so far appended to the prompt and the same generator state, as the client loop resends its
  context: the output is unchanged (``recoveries`` counts it). Other failures are not retried.
* ``GenerateDrafts`` is not retried by us (gRPC's transparent retry still re-sends calls that never
  left the client). A failing draft worker costs speed, not correctness: the client marks it down
  (``has_draft`` becomes False, logged once), the pipeline continues target-only, and a background
  thread probes the draft worker (every 0.25 s at first, backing off to 2 s) and turns drafting
  back on as soon as it answers; ``has_draft`` also probes by itself once ``draft_retry_interval_s``
  passed since the last probe.
* A worker that refuses a call for being busy (``RESOURCE_EXHAUSTED`` with ``retry-after-ms``
  trailing metadata: nothing was done) is asked again after that hint while the deadline allows.

Reconnection is gRPC's: channels reconnect on their own; the backoff is capped at one second so a
restarted worker is found again quickly.

Streams (``streams=True``, the default): ``GenerateDrafts`` and ``VerifyDrafts`` go over one
long-lived bidirectional stream per method (``GenerateDraftsStream`` / ``VerifyDraftsStream``), one
request and one reply at a time, which skips a unary call's setup and the worker's hand-off to a
fresh request thread: about half of a small call's latency on loopback
(``benchmarks/grpc_hops.py``). The semantics are the unary call's: the same deadline per call (a
watchdog cancels the stream when a reply is late), the same errors, the same retry policy (a
stream that breaks with ``UNAVAILABLE`` is retried as unary calls, where the policy allows). Any
error closes the stream; the next call opens a new one. A call finds the stream busy (another
thread's call) and makes the unary call instead, as it does while a worker refuses streams
(``RESOURCE_EXHAUSTED`` with ``specsplit-stream: full``; retried after 30 s) or does not know them
(``UNIMPLEMENTED``: an older worker). A stream unused for 5 s is closed, since it holds one of
the worker's request threads; a stream the worker closed while idle is replaced by a unary call.

Every call carries ``specsplit-client-secret``, random per transport: the workers keep this
transport's sessions in a namespace of their own (:mod:`specsplit.remote.clients`).
"""

from __future__ import annotations

import ipaddress
import logging
import math
import queue
import secrets
import threading
import time
from pathlib import Path
from typing import Any

import grpc

from specsplit.config import SpecSplitConfig
from specsplit.errors import (
    ConfigError,
    InvalidRequest,
    SpecSplitError,
    TransportError,
)
from specsplit.messages import (
    DraftRequest,
    DraftResult,
    GenerateRequest,
    VerifyRequest,
    VerifyResult,
    WorkerInfo,
)
from specsplit.remote import convert
from specsplit.remote._generated import spec_decoding_pb2 as pb
from specsplit.remote._generated import spec_decoding_pb2_grpc as pb_grpc
from specsplit.remote.calls import (
    AuthenticationError,
    GenerateStream,
    Peer,
    error_details,
    retry_after,
    to_error,
)
from specsplit.remote.protocol import PROTOCOL_VERSION

__all__ = ["STREAM_FULL_KEY", "AuthenticationError", "GenerateStream", "GrpcTransport"]

# Kept in sync with specsplit.remote.clients (not imported: the client needs none of it).
_SECRET_KEY = "specsplit-client-secret"

logger = logging.getLogger(__name__)

_BACKOFF_START_S = 0.05
_BACKOFF_MAX_S = 1.0
# A probe of a failed draft waits for the channel to reconnect: longer than its reconnect backoff
# (at most _BACKOFF_MAX_S plus 20% jitter) and a loaded worker's first answer, short enough that
# a still-dead draft costs one such wait per draft_retry_interval_s.
_PROBE_TIMEOUT_S = 3.0
_END_SESSION_TIMEOUT_S = 5.0  # cleanup only: a lost EndSession is caught by the worker's TTL
# Trailing metadata of a stream a worker refused because it already serves its share of streams.
STREAM_FULL_KEY = "specsplit-stream"
_STREAM_IDLE_S = 5.0  # a stream unused this long is closed (it holds one of the worker's threads)
_STREAM_REFUSED_S = 30.0  # after a worker refused a stream, unary calls this long before trying again
_WATCH_S = 0.5  # how often the stream watchdog looks at deadlines and idle streams
_PROBE_FIRST_S = 0.25  # background probes of a failed draft worker: first wait ...
_PROBE_MAX_S = 2.0  # ... doubling up to this


class _Stream:
    """One method's long-lived bidirectional stream to a worker, used by one call at a time.

    The caller holds ``lock`` for an exchange (a caller that finds it taken makes the unary call).
    ``deadline`` is when the pending reply is due (``inf`` between calls); the transport's watchdog
    cancels the stream past it, or closes it after ``_STREAM_IDLE_S`` unused.
    """

    def __init__(self, peer: Peer, method: str):
        self.peer, self.method = peer, method
        self.lock = threading.Lock()
        self.call: Any = None
        self.requests: queue.SimpleQueue[Any] | None = None
        self.deadline = math.inf
        self.last_used = 0.0
        self.timed_out = False
        self.retry_at = 0.0  # no stream before this monotonic time (refused; inf: unimplemented)

    def exchange(self, msg: Any, timeout: float, metadata: Any) -> Any:
        """Send ``msg`` and wait for its reply; opens the stream if needed (lock held).

        Raises:
            StopIteration: the worker ended the stream without answering.
            grpc.RpcError: the stream failed (it is closed).
        """
        if self.call is None:
            self.requests = queue.SimpleQueue()
            self.call = getattr(self.peer.stub, self.method)(iter(self.requests.get, None), metadata=metadata)
            self.timed_out = False
        self.deadline = time.monotonic() + timeout
        self.requests.put(msg)  # type: ignore[union-attr]
        try:
            return next(self.call)
        except BaseException:
            self.close()
            raise
        finally:
            self.deadline = math.inf
            self.last_used = time.monotonic()

    def close(self) -> None:
        """End the stream (idempotent); the next exchange opens a new one."""
        if self.call is not None:
            self.requests.put(None)  # type: ignore[union-attr]
            self.call.cancel()
            self.call = self.requests = None


class GrpcTransport:
    """Transport to a target worker and, optionally, a draft worker.

    Args:
        target_address: ``host:port`` of the target worker (``None``: a draft-only client, as a
            target worker uses to reach its draft worker).
        draft_address: ``host:port`` of the draft worker; ``None`` decodes target-only.
        timeout_s: deadline of each call (retries of one call share it).
        auth_token: bearer token sent as ``authorization: Bearer <token>``.
        tls_ca_file: PEM file of the CA that signed the workers' certificates; enables TLS.
        max_message_bytes: largest message sent or received.
        draft_retry_interval_s: after the draft worker failed, how long ``has_draft`` waits before
            probing it itself (a background thread probes it meanwhile, every 0.25 s at first and
            at most every 2 s; a probe waits up to 3 s for the worker to answer).
        streams: send ``GenerateDrafts`` / ``VerifyDrafts`` over long-lived streams (see the
            module docstring); ``False``: unary calls only.
    """

    def __init__(
        self,
        target_address: str | None,
        draft_address: str | None = None,
        *,
        timeout_s: float = 60.0,
        auth_token: str | None = None,
        tls_ca_file: str | Path | None = None,
        max_message_bytes: int = convert.DEFAULT_MAX_MESSAGE_BYTES,
        draft_retry_interval_s: float = 30.0,
        streams: bool = True,
    ):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self.draft_retry_interval_s = draft_retry_interval_s
        auth_token = auth_token.strip() if auth_token else None  # as a token file is read
        self._metadata: tuple[tuple[str, str], ...] = ((_SECRET_KEY, secrets.token_hex(16)),)
        if auth_token:
            self._metadata += (("authorization", f"Bearer {auth_token}"),)
        creds = None
        if tls_ca_file is not None:
            creds = grpc.ssl_channel_credentials(root_certificates=Path(tls_ca_file).read_bytes())
        options = [
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", int(_BACKOFF_MAX_S * 1000)),
            ("grpc.enable_retries", 1),  # transparent retry of calls that never left the client
        ]

        def peer(role: str, address: str, stub_cls: Any) -> Peer:
            if auth_token and creds is None and not _is_loopback(address):
                logger.warning("sending the auth token to %s without TLS (set tls_ca_file)", address)
            ch = (
                grpc.secure_channel(address, creds, options=options)
                if creds is not None
                else grpc.insecure_channel(address, options=options)
            )
            return Peer(role, address, ch, stub_cls(ch))

        self._target = peer("target", target_address, pb_grpc.TargetServiceStub) if target_address else None
        self._draft = peer("draft", draft_address, pb_grpc.DraftServiceStub) if draft_address else None
        self._lock = threading.Lock()
        self._draft_down_since: float | None = None
        self._prober: threading.Thread | None = None
        self._drafted: set[str] = set()  # sessions with a draft call since their start: EndSession goes there
        self._closed = False
        self._draft_stream = _Stream(self._draft, "GenerateDraftsStream") if streams and self._draft else None
        self._verify_stream = (
            _Stream(self._target, "VerifyDraftsStream") if streams and self._target else None
        )
        self._watchdog: threading.Thread | None = None
        self._stop_watch = threading.Event()

    @classmethod
    def from_config(cls, config: SpecSplitConfig) -> GrpcTransport:
        """Build from ``SpecSplitConfig`` (``target_address``, ``draft_address``, ``timeout_s``, ...)."""
        if not config.target_address:
            raise ConfigError("transport='grpc' needs config.target_address ('host:port')")
        return cls(
            config.target_address,
            config.draft_address,
            timeout_s=config.timeout_s,
            auth_token=config.auth_token,
            tls_ca_file=config.tls_ca_file,
            streams=config.tuning.grpc_streams,
        )

    # ------------------------------------------------------------------ Transport protocol
    @property
    def has_draft(self) -> bool:
        """False without a draft address, and for ``draft_retry_interval_s`` after a draft failure."""
        if self._draft is None:
            return False
        with self._lock:
            down = self._draft_down_since
        if down is None:
            return True
        if time.monotonic() - down < self.draft_retry_interval_s:
            return False
        return self._probe_draft()

    def _probe_draft(self) -> bool:
        """Ping the failed draft worker once (see _PROBE_TIMEOUT_S); mark it up when it answers."""
        assert self._draft is not None
        try:
            self._call(self._draft, "Ping", pb.PingRequest(client_protocol_version=PROTOCOL_VERSION),
                       timeout=min(_PROBE_TIMEOUT_S, self.timeout_s), retry=False, wait=True)  # fmt: skip
        except SpecSplitError:
            with self._lock:
                if self._draft_down_since is not None:
                    self._draft_down_since = time.monotonic()
            return False
        with self._lock:
            was_down = self._draft_down_since is not None
            self._draft_down_since = None
        if was_down:
            logger.warning(
                "draft worker at %s is reachable again; speculative decoding resumes", self._draft.address
            )
        return True

    def _probe_in_background(self) -> None:
        """Probe the failed draft worker with backoff until it answers or the transport closes."""
        delay = _PROBE_FIRST_S
        while not self._stop_watch.wait(delay):
            if self._draft_up() or self._probe_draft():
                break
            delay = min(delay * 2, _PROBE_MAX_S)
        with self._lock:
            self._prober = None

    def check_draft(self, timeout_s: float) -> WorkerInfo:
        """Ping the draft worker, waiting up to ``timeout_s`` for it to come up.

        Raises:
            AuthenticationError: it refused this client's token.
            TransportError: it did not answer (unreachable, TLS failure, another protocol).
        """
        if self._draft is None:
            raise TransportError("no draft worker configured (draft_address is None)")
        msg = pb.PingRequest(client_protocol_version=PROTOCOL_VERSION)
        resp = self._call(self._draft, "Ping", msg, timeout=timeout_s, retry=True, wait=True)
        info = convert.worker_info_from_proto(resp)
        if info.worker_type != "draft":
            raise TransportError(f"{self._draft.address} is a {info.worker_type} worker, not a draft worker")
        return info

    def draft(self, request: DraftRequest) -> DraftResult:
        if self._draft is None:
            raise TransportError("no draft worker configured (draft_address is None)")
        msg = _encode(convert.draft_request_to_proto, request)
        self._drafted.add(request.session_id)  # before the call: one that fails may still have made state
        try:
            resp = self._call_or_stream(self._draft, "GenerateDrafts", self._draft_stream, msg, retry=False)
        except TransportError as e:
            self._mark_draft_down(e)
            raise
        return convert.draft_result_from_proto(resp)

    def share_tree_slots(self, host_id: str, slots: int) -> pb.ShareTreeSlotsResponse:
        """Ask the draft worker for tree slots (:mod:`specsplit.remote.tree_slots`); one unary call.

        Raises:
            TransportError: no draft worker, or the call failed (``UNIMPLEMENTED``: an older worker).
        """
        if self._draft is None:
            raise TransportError("no draft worker configured (draft_address is None)")
        msg = pb.ShareTreeSlotsRequest(host_id=host_id, slots=slots)
        resp: pb.ShareTreeSlotsResponse = self._call(
            self._draft, "ShareTreeSlots", msg, timeout=min(self.timeout_s, _PROBE_TIMEOUT_S), retry=False
        )
        return resp

    def verify(self, request: VerifyRequest) -> VerifyResult:
        msg = _encode(convert.verify_request_to_proto, request)
        resp = self._call_or_stream(self._target_peer(), "VerifyDrafts", self._verify_stream, msg, retry=True)
        return convert.verify_result_from_proto(resp)

    def generate_on_target(self, request: GenerateRequest) -> GenerateStream:
        """Start a generation whose rounds the target worker runs; iterate the returned stream.

        The target worker calls its own draft worker every round (one network hop a round instead
        of two). Each next update must arrive within ``timeout_s``; errors arrive while iterating,
        as SpecSplit exceptions.
        """
        peer = self._target_peer()
        if self._closed:
            raise TransportError("GrpcTransport is closed")
        msg = _encode(convert.generate_request_to_proto, request)

        def start(m: pb.GenerateRequest, wait: bool) -> Any:
            try:
                return peer.stub.Generate(m, metadata=self._metadata, wait_for_ready=wait)
            except ValueError as e:  # a closed channel
                raise TransportError(f"target worker at {peer.address}: {e}") from None

        return GenerateStream(start, msg, peer, self.timeout_s)

    def end_session(self, session_id: str) -> None:
        """Free the session on both workers; never raises (the workers' TTL is the backstop)."""
        msg = pb.EndSessionRequest(session_id=session_id)
        timeout = min(self.timeout_s, _END_SESSION_TIMEOUT_S)
        # The draft worker is told about the sessions it has seen, even when it is marked down (once,
        # without retries): a call that missed its deadline (a first-time compile, say) usually means
        # a slow worker, not a dead one, and the session it left open would hold its graph workspace,
        # so every later session there would run the eager path until the TTL freed it. Sessions that
        # never reached it (decoded target-only while it was down) cost it no call.
        drafted = session_id in self._drafted
        self._drafted.discard(session_id)
        peers = [(self._target, True)] if self._target is not None else []
        peers += [(self._draft, self._draft_up())] if self._draft is not None and drafted else []
        for p, retry in peers:
            try:
                self._call(p, "EndSession", msg, timeout=timeout, retry=retry)
            except SpecSplitError as e:
                logger.info("EndSession(%s) on the %s worker failed: %s", session_id, p.role, e)

    def info(self) -> dict[str, WorkerInfo]:
        """``{"target": ..., "draft": ...}`` from ``Ping`` (draft omitted when it is down or absent)."""
        msg = pb.PingRequest(client_protocol_version=PROTOCOL_VERSION)
        out = {"target": self._ping(self._target, msg)} if self._target is not None else {}
        if self._draft is not None and self.has_draft:
            try:
                out["draft"] = self._ping(self._draft, msg)
            except TransportError as e:
                self._mark_draft_down(e)
        return out

    def close(self) -> None:
        """Close both channels (idempotent); later calls raise :class:`TransportError`."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop_watch.set()
        for st in (self._draft_stream, self._verify_stream):
            if st is not None:
                st.close()
        for p in (self._target, self._draft):
            if p is not None:
                p.channel.close()

    def __enter__(self) -> GrpcTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        draft = self._draft.address if self._draft is not None else None
        target = self._target.address if self._target is not None else None
        return f"GrpcTransport(target={target!r}, draft={draft!r})"

    # ------------------------------------------------------------------ internals
    def _target_peer(self) -> Peer:
        if self._target is None:
            raise TransportError("no target worker configured (target_address is None)")
        return self._target

    def _ping(self, peer: Peer, msg: pb.PingRequest) -> WorkerInfo:
        info = convert.worker_info_from_proto(
            self._call(peer, "Ping", msg, timeout=self.timeout_s, retry=True)
        )
        if info.protocol_version != PROTOCOL_VERSION:
            raise TransportError(
                f"{peer.role} worker at {peer.address} speaks {info.protocol_version!r}, "
                f"this client {PROTOCOL_VERSION!r}: upgrade one side"
            )
        return info

    def _draft_up(self) -> bool:
        with self._lock:
            return self._draft_down_since is None

    def _mark_draft_down(self, error: Exception) -> None:
        with self._lock:
            first = self._draft_down_since is None
            self._draft_down_since = time.monotonic()
            start = self._prober is None and not self._closed
            if start:
                self._prober = threading.Thread(target=self._probe_in_background, name="specsplit-draft-probe",
                                                daemon=True)  # fmt: skip
                self._prober.start()
        if first and self._draft is not None:
            logger.warning(
                "draft worker failed (%s); decoding target-only (same output, slower) until it answers "
                "again (probed in the background)",
                error,
            )

    def _call_or_stream(
        self, peer: Peer, method: str, stream: _Stream | None, msg: Any, *, retry: bool
    ) -> Any:
        """One unary ``method`` call (``GenerateDrafts`` / ``VerifyDrafts``), over ``stream`` where it can.

        The unary call is made when streams are off, refused or unknown to the worker, when another
        thread is using the stream, when the worker ended it unanswered, and (only with ``retry``)
        when it broke with ``UNAVAILABLE``, with what is left of the call's deadline.
        """
        if self._closed:
            raise TransportError("GrpcTransport is closed")
        deadline = time.monotonic() + self.timeout_s
        if stream is None or time.monotonic() < stream.retry_at or not stream.lock.acquire(blocking=False):
            return self._call(peer, method, msg, timeout=self.timeout_s, retry=retry)
        try:
            if self._watchdog is None:
                self._watchdog = threading.Thread(target=self._watch_streams, name="specsplit-stream-watchdog",
                                                  daemon=True)  # fmt: skip
                self._watchdog.start()
            return stream.exchange(msg, self.timeout_s, self._metadata)
        except StopIteration:
            pass  # ended between messages without reading this one: send it unary
        except ValueError as e:  # a closed channel
            raise TransportError(f"{peer.role} worker at {peer.address}: {e}") from None
        except grpc.RpcError as e:
            code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
            md = dict(e.trailing_metadata() or ()) if hasattr(e, "trailing_metadata") else {}
            if code == grpc.StatusCode.UNIMPLEMENTED:
                stream.retry_at = math.inf
                logger.info("%s worker at %s has no %s (older version); unary calls", peer.role, peer.address,
                            stream.method)  # fmt: skip
            elif code == grpc.StatusCode.RESOURCE_EXHAUSTED and md.get(STREAM_FULL_KEY) == "full":
                stream.retry_at = time.monotonic() + _STREAM_REFUSED_S
                logger.info("%s worker at %s refused a stream (%s); unary calls for %.0fs", peer.role,
                            peer.address, error_details(e), _STREAM_REFUSED_S)  # fmt: skip
            elif code == grpc.StatusCode.RESOURCE_EXHAUSTED and retry_after(md) is not None:
                stream.retry_at = time.monotonic() + _STREAM_REFUSED_S  # busy: the unary call waits its turn
            elif code == grpc.StatusCode.CANCELLED and not stream.timed_out and not self._closed:
                pass  # the worker closed the stream (idle too long) before reading this call: send it unary
            elif stream.timed_out:
                raise TransportError(
                    f"{peer.role} worker at {peer.address}: {method} failed: DEADLINE_EXCEEDED: no reply "
                    f"within {self.timeout_s:g}s (timeout_s); stream cancelled"
                ) from None
            elif not (retry and code == grpc.StatusCode.UNAVAILABLE):
                raise to_error(peer, method, e) from None
        finally:
            stream.lock.release()
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TransportError(f"{peer.role} worker at {peer.address}: {method} failed: DEADLINE_EXCEEDED")
        return self._call(peer, method, msg, timeout=remaining, retry=retry)

    def _watch_streams(self) -> None:
        """Cancel streams whose reply is overdue; close streams unused for ``_STREAM_IDLE_S``."""
        streams = [st for st in (self._draft_stream, self._verify_stream) if st is not None]
        while not self._stop_watch.wait(_WATCH_S):
            now = time.monotonic()
            for st in streams:
                call = st.call
                if call is None:
                    continue
                if now > st.deadline:
                    st.timed_out = True
                    call.cancel()
                elif now - st.last_used > _STREAM_IDLE_S and st.lock.acquire(blocking=False):
                    try:
                        if st.call is not None and time.monotonic() - st.last_used > _STREAM_IDLE_S:
                            st.close()
                    finally:
                        st.lock.release()

    def _call(
        self, peer: Peer, method: str, msg: Any, *, timeout: float, retry: bool, wait: bool = False
    ) -> Any:
        """One logical call: attempts share ``timeout``; ``retry`` re-sends on UNAVAILABLE.

        The first attempt fails fast on a dead channel unless ``wait``; retries wait for the channel
        to (re)connect, which is what finds a restarted worker.
        """
        if self._closed:
            raise TransportError("GrpcTransport is closed")
        deadline = time.monotonic() + timeout
        delay = _BACKOFF_START_S
        fn = getattr(peer.stub, method)
        unavailable: grpc.RpcError | None = None
        while True:
            remaining = deadline - time.monotonic()
            try:
                return fn(msg, timeout=max(remaining, 0.001), metadata=self._metadata, wait_for_ready=wait)
            except grpc.RpcError as e:
                code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
                if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    md = dict(e.trailing_metadata() or ()) if hasattr(e, "trailing_metadata") else {}
                    after = retry_after(md)
                    if after is not None and deadline - time.monotonic() > after:
                        time.sleep(after)  # refused for being busy, nothing done: ask again
                        continue
                if retry and code == grpc.StatusCode.UNAVAILABLE and deadline - time.monotonic() > delay:
                    logger.info("%s worker at %s unavailable (%s); retrying %s", peer.role, peer.address,
                                error_details(e), method)  # fmt: skip
                    time.sleep(delay)
                    delay, wait, unavailable = min(delay * 2, _BACKOFF_MAX_S), True, e
                    continue
                if code == grpc.StatusCode.DEADLINE_EXCEEDED and unavailable is not None:
                    e = unavailable  # the deadline ran out waiting for the worker: report why
                raise to_error(peer, method, e) from None
            except ValueError as e:  # grpc raises ValueError on a closed channel
                raise TransportError(f"{peer.role} worker at {peer.address}: {e}") from None


def _encode(fn: Any, request: Any) -> Any:
    """Encode a request; values protobuf cannot carry become :class:`InvalidRequest`."""
    try:
        return fn(request)
    except (ValueError, TypeError, OverflowError) as e:
        if isinstance(e, SpecSplitError):
            raise
        raise InvalidRequest(f"request cannot be encoded for gRPC: {e}") from None


def _is_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
