"""gRPC workers: the SAME engine classes LocalTransport calls, behind DraftService / TargetService.

A servicer only decodes a request (:mod:`specsplit.remote.convert`), calls the engine under a
per-session lock, encodes the result and maps SpecSplit errors to status codes:

=================================  ======================
``InvalidRequest``, ``ConfigError``  ``INVALID_ARGUMENT``
``SessionNotFound``                  ``NOT_FOUND``
``CacheDesyncError``                 ``FAILED_PRECONDITION`` (+ ``specsplit-expected`` /
                                     ``specsplit-actual`` trailing metadata)
``ResourceExhausted``, out of memory ``RESOURCE_EXHAUSTED``
anything else                        ``INTERNAL`` (logged; the worker keeps serving)
=================================  ======================

Workers hold no state apart from sessions, so several can sit behind a gRPC load balancer with
session affinity (route on the ``session_id`` field or pin a client to one backend).
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
import torch

from specsplit.config import NgramConfig
from specsplit.errors import (
    CacheDesyncError,
    ConfigError,
    InvalidRequest,
    ResourceExhausted,
    SessionNotFound,
    SpecSplitError,
)
from specsplit.messages import GenerateUpdate
from specsplit.pipeline import OverlapPolicies, decode_rounds
from specsplit.remote import convert
from specsplit.remote._generated import spec_decoding_pb2 as pb
from specsplit.remote._generated import spec_decoding_pb2_grpc as pb_grpc
from specsplit.remote.client import STREAM_FULL_KEY, GrpcTransport
from specsplit.remote.target_loop import TargetLoopTransport, WorkerDrafting, decode_params
from specsplit.remote.tree_slots import SlotDraftRequest, SlotDraftResult, TreeSlotExporter
from specsplit.telemetry import SpecStats

logger = logging.getLogger(__name__)

R = TypeVar("R")

_STATUS: tuple[tuple[type[Exception], grpc.StatusCode], ...] = (
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (ConfigError, grpc.StatusCode.INVALID_ARGUMENT),
    (SessionNotFound, grpc.StatusCode.NOT_FOUND),
    (CacheDesyncError, grpc.StatusCode.FAILED_PRECONDITION),
    (ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
)
_HEALTH_PREFIX = "/grpc.health.v1.Health/"
_OUT_OF_MEMORY = (MemoryError, getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError))


@dataclass
class ServerLimits:
    """Limits a worker enforces on requests before they reach the engine.

    Attributes:
        max_message_bytes: largest request/response; larger ones get ``RESOURCE_EXHAUSTED``.
        max_tree_nodes: largest tree a draft request may ask for (the target engine enforces
            its own ``TargetConfig.max_tree_nodes`` on the trees it receives).
        max_tree_depth: deepest tree a draft request may ask for.
        max_context: most tokens a draft session may hold; ``capacity_hint`` is clamped to it on
            both workers (a hint must never make a worker preallocate unbounded memory).
    """

    max_message_bytes: int = convert.DEFAULT_MAX_MESSAGE_BYTES
    max_tree_nodes: int = 256
    max_tree_depth: int = 64
    max_context: int = 32768


def check_tree_spec(spec: pb.TreeSpec, lim: ServerLimits) -> None:
    """Refuse a requested tree shape beyond the worker's limits (``ResourceExhausted``).

    Checked on the raw message, before the ``TreeConfig`` is built: building a huge static or chain
    shape is itself expensive.
    """
    depth = {
        pb.TREE_SHAPE_CHAIN: spec.num_draft_tokens,
        pb.TREE_SHAPE_STATIC: max((len(p.ranks) for p in spec.static_paths.paths), default=0),
        pb.TREE_SHAPE_DYNAMIC: spec.max_depth,
    }.get(spec.shape, 0)
    nodes = {
        pb.TREE_SHAPE_CHAIN: spec.num_draft_tokens,
        pb.TREE_SHAPE_STATIC: len(spec.static_paths.paths),
        pb.TREE_SHAPE_DYNAMIC: max(spec.budget, spec.topk, spec.width),
    }.get(spec.shape, 0)
    if nodes > lim.max_tree_nodes or depth > lim.max_tree_depth:
        raise ResourceExhausted(
            f"requested tree (up to {nodes} nodes, depth {depth}) exceeds this worker's limits "
            f"({lim.max_tree_nodes} nodes, depth {lim.max_tree_depth})"
        )


class _SessionLocks:
    """One lock per live session id, created on demand and dropped when nobody holds it."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._locks: dict[str, list[Any]] = {}  # id -> [lock, holders]

    @contextmanager
    def hold(self, session_id: str) -> Iterator[None]:
        with self._guard:
            entry = self._locks.setdefault(session_id, [threading.Lock(), 0])
            entry[1] += 1
        try:
            with entry[0]:
                yield
        finally:
            with self._guard:
                entry[1] -= 1
                if entry[1] == 0:
                    del self._locks[session_id]

    def __len__(self) -> int:
        with self._guard:
            return len(self._locks)


class _Handler:
    """What both servicers share: session locking, timing, error-to-status mapping and the count
    of open streams (each holds a request thread; at most ``max_streams`` at once)."""

    def __init__(self, engine: Any, worker_type: str, limits: ServerLimits, max_streams: int):
        self.engine = engine
        self.worker_type = worker_type
        self.limits = limits
        self.locks = _SessionLocks()
        self.max_streams = max_streams
        self._streams = 0
        self._streams_guard = threading.Lock()

    def stream(
        self, requests: Iterator[Any], context: grpc.ServicerContext, call: Callable[[Any, Any], R]
    ) -> Iterator[R]:
        """Serve a request stream: ``call(request, context)`` per message, one response each.

        ``call`` is the unary handler, so checks, errors and status codes are the unary call's; an
        error aborts (ends) the stream. Refuses the stream when ``max_streams`` are already open.
        """
        with self._streams_guard:
            full = self._streams >= self.max_streams
            if not full:
                self._streams += 1
        if full:
            context.set_trailing_metadata(((STREAM_FULL_KEY, "full"),))
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this {self.worker_type} worker already serves {self.max_streams} streams; make unary calls",
            )
        try:
            for request in requests:
                yield call(request, context)
        finally:
            with self._streams_guard:
                self._streams -= 1

    def run(self, context: grpc.ServicerContext, session_id: str | None, work: Callable[[float], R]) -> R:
        t0 = time.perf_counter()
        try:
            # Engines keep inference tensors in their caches; every call must run in inference
            # mode, as generate() does in local mode.
            with torch.inference_mode():
                if session_id is None:
                    return work(t0)
                with self.locks.hold(session_id):
                    return work(t0)
        except Exception as e:
            self.fail(context, e, session_id)
        raise AssertionError("unreachable: context.abort raises")  # pragma: no cover

    def fail(self, context: grpc.ServicerContext, e: BaseException, session_id: str | None) -> None:
        """Abort the call with the status code of ``e`` (raises)."""
        if isinstance(e, SpecSplitError):
            code = next((c for t, c in _STATUS if isinstance(e, t)), None)
            if code is None:
                logger.error("%s worker: unexpected %s", self.worker_type, type(e).__name__, exc_info=e)
                code = grpc.StatusCode.INTERNAL
            if isinstance(e, CacheDesyncError) and e.expected is not None and e.actual is not None:
                context.set_trailing_metadata(
                    (("specsplit-expected", str(e.expected)), ("specsplit-actual", str(e.actual)))
                )
            context.abort(code, str(e))
        if isinstance(e, _OUT_OF_MEMORY):
            logger.error("%s worker: out of memory serving session %r: %s", self.worker_type, session_id, e)
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"worker out of memory: {e}")
        logger.error("%s worker: internal error", self.worker_type, exc_info=e)
        context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}: {e}")

    def ping(self, context: grpc.ServicerContext) -> pb.PingResponse:
        def work(t0: float) -> pb.PingResponse:
            resp = convert.worker_info_to_proto(self.engine.info())
            resp.telemetry.server_time_s = time.perf_counter() - t0
            return resp

        return self.run(context, None, work)

    def end_session(
        self, request: pb.EndSessionRequest, context: grpc.ServicerContext
    ) -> pb.EndSessionResponse:
        def work(t0: float) -> pb.EndSessionResponse:
            existed = bool(self.engine.end_session(request.session_id))
            return pb.EndSessionResponse(
                existed=existed, telemetry=pb.Telemetry(server_time_s=time.perf_counter() - t0)
            )

        return self.run(context, request.session_id, work)

    def clamp_capacity(self, hint: int) -> int:
        return max(0, min(hint, self.limits.max_context))


class DraftServicer(pb_grpc.DraftServiceServicer):
    """``DraftService`` over a :class:`specsplit.engines.draft.DraftEngine`."""

    def __init__(self, engine: Any, limits: ServerLimits | None = None, max_streams: int = 4):
        self._h = _Handler(engine, "draft", limits or ServerLimits(), max_streams)
        cfg = getattr(engine, "config", None)
        self._slots = TreeSlotExporter(
            getattr(engine, "device", torch.device("cpu")), getattr(cfg, "max_tree_nodes", 64)
        )

    def _check_limits(self, m: pb.DraftRequest) -> None:
        lim = self._h.limits
        check_tree_spec(m.tree, lim)
        if m.prefix_length + len(m.new_token_ids) > lim.max_context:
            raise ResourceExhausted(
                f"draft session would hold {m.prefix_length + len(m.new_token_ids)} tokens; "
                f"this worker's max_context is {lim.max_context}"
            )

    def GenerateDrafts(self, request: pb.DraftRequest, context: grpc.ServicerContext) -> pb.DraftResponse:
        def work(t0: float) -> pb.DraftResponse:
            self._check_limits(request)
            req = convert.draft_request_from_proto(request)
            req.capacity_hint = self._h.clamp_capacity(req.capacity_hint)
            res = self._h.engine.generate(req)
            if isinstance(req, SlotDraftRequest) and not req.speculate:
                ref = self._slots.place(req.tree_channel, req.tree_slot, res.tree)
                if ref is not None:
                    res = SlotDraftResult(**vars(res), tree_in_slot=ref)
            resp = convert.draft_result_to_proto(res)
            resp.telemetry.server_time_s = time.perf_counter() - t0
            return resp

        return self._h.run(context, request.session_id, work)

    def ShareTreeSlots(
        self, request: pb.ShareTreeSlotsRequest, context: grpc.ServicerContext
    ) -> pb.ShareTreeSlotsResponse:
        return self._h.run(context, None, lambda t0: self._slots.share(request))

    def GenerateDraftsStream(
        self, request_iterator: Iterator[pb.DraftRequest], context: grpc.ServicerContext
    ) -> Iterator[pb.DraftResponse]:
        return self._h.stream(request_iterator, context, self.GenerateDrafts)

    def EndSession(
        self, request: pb.EndSessionRequest, context: grpc.ServicerContext
    ) -> pb.EndSessionResponse:
        return self._h.end_session(request, context)

    def Ping(self, request: pb.PingRequest, context: grpc.ServicerContext) -> pb.PingResponse:
        return self._h.ping(context)


class TargetServicer(pb_grpc.TargetServiceServicer):
    """``TargetService`` over a :class:`specsplit.engines.target.TargetEngine`.

    Args:
        engine: the target engine.
        limits: request limits (the engine's own tree and context limits take precedence).
        draft: client of the draft worker ``Generate`` calls draft on (``None``: target-only).
        max_streams: most ``VerifyDraftsStream`` streams open at once (each holds a request thread).
        tree_slots: ``Generate`` reads trees from a co-located draft worker's GPU memory where it
            can (:mod:`specsplit.remote.tree_slots`).
        drafting: what ``Generate`` drafts with (the default drafter, n-gram settings).
    """

    def __init__(
        self,
        engine: Any,
        limits: ServerLimits | None = None,
        draft: GrpcTransport | None = None,
        max_streams: int = 4,
        tree_slots: bool = True,
        drafting: WorkerDrafting | None = None,
    ):
        limits = limits or ServerLimits()
        cfg = getattr(engine, "config", None)
        if cfg is not None:  # the engine's own limits are the ones that matter on the target
            limits = ServerLimits(
                limits.max_message_bytes, cfg.max_tree_nodes, cfg.max_tree_depth, cfg.max_context
            )
        self._h = _Handler(engine, "target", limits, max_streams)
        self.loop = TargetLoopTransport(engine, draft, self._h.clamp_capacity, tree_slots)
        self._policies = OverlapPolicies()  # the overlap policy per tree shape, across clients
        self._drafting = drafting or WorkerDrafting()

    def VerifyDrafts(self, request: pb.VerifyRequest, context: grpc.ServicerContext) -> pb.VerifyResponse:
        def work(t0: float) -> pb.VerifyResponse:
            req = convert.verify_request_from_proto(request)
            lim, tree = self._h.limits, req.tree
            if (tree.depth_bound or 0) > lim.max_tree_depth or (tree.max_branch or 0) > lim.max_tree_nodes:
                raise InvalidRequest(
                    f"tree bounds (branch {tree.max_branch}, depth {tree.depth_bound}) exceed this worker's "
                    f"limits ({lim.max_tree_nodes} nodes, depth {lim.max_tree_depth})"
                )
            req.capacity_hint = self._h.clamp_capacity(req.capacity_hint)
            resp = convert.verify_result_to_proto(self._h.engine.verify(req))
            resp.telemetry.server_time_s = time.perf_counter() - t0
            return resp

        return self._h.run(context, request.session_id, work)

    def VerifyDraftsStream(
        self, request_iterator: Iterator[pb.VerifyRequest], context: grpc.ServicerContext
    ) -> Iterator[pb.VerifyResponse]:
        return self._h.stream(request_iterator, context, self.VerifyDrafts)

    def Generate(
        self, request: pb.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.GenerateResponse]:
        """Run a whole generation here (rounds draft on this worker's draft worker); stream its rounds.

        The round loop (:func:`~specsplit.pipeline.decode_rounds`) runs in this handler's thread and
        each round is sent once the next round's draft call has returned (the last one at once). A
        cancelled call stops iterating it, which ends the session on both workers (at most one
        draft call after the last round sent has run).
        """

        def check(t0: float) -> Any:
            check_tree_spec(request.tree, self._h.limits)
            req = convert.generate_request_from_proto(request)
            vocab = self._h.engine.model_vocab_size
            return req, decode_params(req, vocab, self._h.limits, self._policies, self._drafting)

        req, params = self._h.run(context, None, check)
        stats = SpecStats(prompt_tokens=len(req.prompt_token_ids))
        # Each round goes to the client once the next round's draft is under way (defer_updates): the
        # hand-off to gRPC then overlaps the draft's GPU work instead of delaying its launch.
        rounds = decode_rounds(
            self.loop, req.prompt_token_ids, params, [], stats, req.session_id, defer_updates=True
        )
        try:
            with torch.inference_mode(), self._h.locks.hold(req.session_id):
                try:
                    for tokens, round_stats in rounds:
                        yield convert.generate_update_to_proto(GenerateUpdate([(tokens, round_stats)]))
                finally:
                    rounds.close()  # ends the session on both workers, also when the client cancelled
        except Exception as e:
            self._h.fail(context, e, req.session_id)
        done = GenerateUpdate([], True, stats.recoveries, stats.draft_fallback, stats.wall_time_s)
        yield convert.generate_update_to_proto(done)

    def EndSession(
        self, request: pb.EndSessionRequest, context: grpc.ServicerContext
    ) -> pb.EndSessionResponse:
        return self._h.end_session(request, context)

    def Ping(self, request: pb.PingRequest, context: grpc.ServicerContext) -> pb.PingResponse:
        return self._h.ping(context)


class _BearerAuth(grpc.ServerInterceptor):
    """Rejects calls without ``authorization: Bearer <token>`` (the health service stays open)."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

        def deny(request: Any, context: grpc.ServicerContext) -> None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")

        # one denial per call kind, so a streaming call is refused as a stream
        self._deny = {
            (False, False): grpc.unary_unary_rpc_method_handler(deny),
            (False, True): grpc.unary_stream_rpc_method_handler(deny),
            (True, False): grpc.stream_unary_rpc_method_handler(deny),
            (True, True): grpc.stream_stream_rpc_method_handler(deny),
        }

    def intercept_service(self, continuation: Any, details: Any) -> Any:
        if details.method.startswith(_HEALTH_PREFIX):
            return continuation(details)
        got = ""
        for key, value in details.invocation_metadata or ():
            if key == "authorization":
                got = value if isinstance(value, str) else value.decode("latin-1")
                break
        handler = continuation(details)
        if handler is None or hmac.compare_digest(got.encode("latin-1", "replace"), self._expected):
            return handler
        return self._deny[(handler.request_streaming, handler.response_streaming)]


class WorkerServer:
    """A running worker: the gRPC server, its bound port and the engine it serves.

    Use as a context manager or call :meth:`stop`; the engine is NOT shut down (the caller owns
    it) unless ``stop(shutdown_engine=True)``.
    """

    def __init__(self, server: grpc.Server, port: int, host: str, engine: Any, worker_type: str, health: Any):
        self.server = server
        self.port = port
        self.host = host
        self.engine = engine
        self.worker_type = worker_type
        self._health = health
        self._stopped = threading.Event()
        self._stop_lock = threading.Lock()
        self.on_stop: list[Callable[[], None]] = []  # run once the server stopped (e.g. close clients)

    @property
    def address(self) -> str:
        host = "localhost" if self.host in ("0.0.0.0", "::", "[::]") else self.host
        return f"{host}:{self.port}"

    def stop(self, grace: float | None = 5.0, shutdown_engine: bool = False) -> None:
        """Stop accepting calls, let in-flight ones finish for ``grace`` seconds (idempotent)."""
        with self._stop_lock:
            if self._stopped.is_set():
                return
            if self._health is not None:
                self._health.enter_graceful_shutdown()
            self.server.stop(grace).wait()
            for fn in self.on_stop:
                fn()
            self._stopped.set()
        if shutdown_engine:
            self.engine.shutdown()
        logger.info("%s worker on port %d stopped", self.worker_type, self.port)

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        """Block until :meth:`stop` ran (True) or ``timeout`` passed (False)."""
        return self._stopped.wait(timeout)

    def __enter__(self) -> WorkerServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _add_health(server: grpc.Server, service: str) -> Any:
    """Register the standard gRPC health service when grpcio-health-checking is installed."""
    try:
        from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    except ImportError:
        return None
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    for name in ("", service):
        servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return servicer


def _serve(
    worker_type: str,
    servicer: Any,
    add: Callable[[Any, grpc.Server], None],
    engine: Any,
    port: int,
    host: str,
    max_workers: int,
    tls: tuple[str | Path, str | Path] | None,
    auth_token: str | None,
    limits: ServerLimits,
) -> WorkerServer:
    options = [
        ("grpc.max_receive_message_length", limits.max_message_bytes),
        ("grpc.max_send_message_length", limits.max_message_bytes),
        ("grpc.so_reuseport", 0),  # a second worker on a busy port must fail, not share it
    ]
    interceptors = [_BearerAuth(auth_token)] if auth_token else []
    server = grpc.server(
        ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=f"specsplit-{worker_type}"),
        interceptors=interceptors,
        options=options,
    )
    add(servicer, server)
    health = _add_health(server, f"specsplit.v1.{worker_type.capitalize()}Service")
    addr = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
    try:
        if tls is not None:
            cert, key = (Path(p).read_bytes() for p in tls)
            bound = server.add_secure_port(addr, grpc.ssl_server_credentials([(key, cert)]))
        else:
            bound = server.add_insecure_port(addr)
    except RuntimeError as e:  # grpcio raises on bind failure; older versions return 0
        raise OSError(f"could not bind {addr}: {e}") from None
    if not bound:
        raise OSError(f"could not bind {addr}")
    server.start()
    logger.info(
        "%s worker serving on %s:%d (%s%s)",
        worker_type,
        host,
        bound,
        "TLS" if tls else "plaintext",
        ", bearer token" if auth_token else "",
    )
    return WorkerServer(server, bound, host, engine, worker_type, health)


def serve_draft(
    engine: Any,
    port: int = 0,
    host: str = "127.0.0.1",
    max_workers: int = 8,
    tls: tuple[str | Path, str | Path] | None = None,
    auth_token: str | None = None,
    limits: ServerLimits | None = None,
) -> WorkerServer:
    """Serve a :class:`~specsplit.engines.draft.DraftEngine` (loaded) over gRPC and return at once.

    Args:
        engine: the engine; the caller keeps ownership.
        port: TCP port; 0 picks a free one (read it from ``.port``).
        host: interface to bind (``"0.0.0.0"`` for every interface).
        max_workers: request threads (concurrent calls; one session's calls are serialised). An
            open stream (``GenerateDraftsStream`` / ``VerifyDraftsStream``) holds one for its
            whole length, so at most ``max_workers // 2`` (at least 1) are accepted at once.
        tls: ``(certificate chain PEM file, private key PEM file)`` to serve TLS.
        auth_token: require ``authorization: Bearer <auth_token>`` on every call.
        limits: request limits (defaults: :class:`ServerLimits`).

    Returns:
        The running :class:`WorkerServer`.
    """
    limits = limits or ServerLimits()
    server = _serve(
        "draft", DraftServicer(engine, limits, _max_streams(max_workers)), pb_grpc.add_DraftServiceServicer_to_server,
        engine, port, host, max_workers, tls, auth_token, limits,
    )  # fmt: skip
    sync = getattr(engine, "synchronize", None)
    if sync is not None and getattr(engine, "device", torch.device("cpu")).type == "cuda":
        # A reply may leave before its tree's GPU work ends (tree slots): let that work finish, so a
        # target worker waiting on the slot's event is not left waiting by a stopped worker.
        server.on_stop.append(sync)
    return server


def serve_target(
    engine: Any,
    port: int = 0,
    host: str = "127.0.0.1",
    max_workers: int = 8,
    tls: tuple[str | Path, str | Path] | None = None,
    auth_token: str | None = None,
    limits: ServerLimits | None = None,
    *,
    draft_address: str | None = None,
    draft_auth_token: str | None = None,
    draft_tls_ca_file: str | Path | None = None,
    draft_timeout_s: float = 60.0,
    draft_streams: bool = True,
    tree_slots: bool = True,
    drafter: str = "model",
    ngram: NgramConfig | None = None,
) -> WorkerServer:
    """Serve a :class:`~specsplit.engines.target.TargetEngine` (loaded) over gRPC; see :func:`serve_draft`.

    The tree limits and ``max_context`` come from the engine's :class:`~specsplit.config.TargetConfig`.

    Args:
        draft_address: ``host:port`` of the draft worker that ``Generate`` calls (clients with
            ``SpecSplitConfig(grpc_loop="target")``); ``None``: such generations are target-only.
        draft_auth_token / draft_tls_ca_file: how this worker authenticates to the draft worker.
        draft_timeout_s: deadline of each call to the draft worker.
        draft_streams: call the draft worker over a long-lived stream (``GenerateDraftsStream``;
            ``False``: unary ``GenerateDrafts`` calls).
        tree_slots: with the draft worker on this host and both on CUDA devices, greedy rounds read
            each tree from the draft worker's GPU memory (CUDA IPC) instead of its reply, so the
            verification is queued behind the draft's GPU work (:mod:`specsplit.remote.tree_slots`).
        drafter: what ``Generate`` drafts with when a request names no drafter
            (``SpecSplitConfig.drafter``); the n-gram drafters run on this worker, with no draft worker.
        ngram: how this worker's n-gram drafters propose trees.

    Each running ``Generate`` holds one of the ``max_workers`` request threads for its whole length.
    """
    limits = limits or ServerLimits()
    draft = None
    if draft_address:
        draft = GrpcTransport(None, draft_address, timeout_s=draft_timeout_s, auth_token=draft_auth_token,
                              tls_ca_file=draft_tls_ca_file, streams=draft_streams)  # fmt: skip
    cfg = getattr(engine, "config", None)
    graphs = (
        bool(getattr(cfg, "cuda_graphs", False))
        and getattr(getattr(engine, "device", None), "type", "") == "cuda"
    )
    drafting = WorkerDrafting(drafter, ngram, padded=graphs)
    servicer = TargetServicer(engine, limits, draft, _max_streams(max_workers), tree_slots, drafting)
    server = _serve(
        "target", servicer, pb_grpc.add_TargetServiceServicer_to_server,
        engine, port, host, max_workers, tls, auth_token, limits,
    )  # fmt: skip
    server.on_stop.append(servicer.loop.close)
    return server


def _max_streams(max_workers: int) -> int:
    """Streams a worker with ``max_workers`` request threads accepts at once (see "Streams")."""
    return max(1, max_workers // 2)
