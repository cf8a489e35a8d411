"""Start a worker: the gRPC server around a servicer of :mod:`specsplit.remote.server`.

:func:`serve_draft` and :func:`serve_target` bind the port, put the worker's gate in front of
every call (:mod:`specsplit.remote.admission`), size the thread pool to the admission bounds,
apply the worker's memory limits to its engine, register the standard gRPC health service and
return a running :class:`WorkerServer`. A target worker that runs rounds checks its draft worker
at start: a wrong token fails at once instead of leaving every generation target-only.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import torch

from specsplit.config import BATCH_LIMIT, NgramConfig
from specsplit.core.pinned import mark_serving
from specsplit.engines.batched import BatchedTarget, batch_bucket
from specsplit.engines.batched_sessions import DraftBatcher, SessionBatcher
from specsplit.errors import ConfigError, TransportError
from specsplit.pipeline.batch import BatchScheduler
from specsplit.remote._generated import spec_decoding_pb2_grpc as pb_grpc
from specsplit.remote.admission import Admission, AdmissionLimits, WorkerGate
from specsplit.remote.client import AuthenticationError, GrpcTransport
from specsplit.remote.clients import ClientTokens
from specsplit.remote.server import (
    DraftServicer,
    ServerLimits,
    TargetServicer,
    default_kv_budget,
    max_streams,
)
from specsplit.remote.target_loop import WorkerDrafting

logger = logging.getLogger(__name__)

_DRAFT_CHECK_S = 5.0  # how long a starting target worker waits for its draft worker's first answer


class WorkerServer:
    """A running worker: the gRPC server, its bound port and the engine it serves.

    Use as a context manager or call :meth:`stop`; the engine is NOT shut down (the caller owns
    it) unless ``stop(shutdown_engine=True)``.
    """

    def __init__(
        self,
        server: grpc.Server,
        port: int,
        host: str,
        engine: Any,
        worker_type: str,
        health: Any,
        admission: Admission | None = None,
    ):
        self.server = server
        self.port = port
        self.host = host
        self.engine = engine
        self.worker_type = worker_type
        self.admission = admission
        self.batch: BatchScheduler | None = None  # a target worker's shared batched rounds, if on
        # ... and its client-loop sessions' shared forwards (a draft worker's: their shared chain drafts)
        self.sessions: SessionBatcher | DraftBatcher | None = None
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
        logger.warning(
            "grpcio-health-checking is not installed: no gRPC health service (pip install 'specsplit[grpc]')"
        )
        return None
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    for name in ("", service):
        servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return servicer


def _tokens(auth_token: str | ClientTokens | None) -> ClientTokens | None:
    if auth_token is None or isinstance(auth_token, ClientTokens):
        return auth_token
    return ClientTokens.single(auth_token.strip()) if auth_token.strip() else None


def _admission(
    max_workers: int, admission: AdmissionLimits | None, tokens: ClientTokens | None, engine: Any
) -> Admission:
    lim = admission or AdmissionLimits(max_calls=max_workers, max_queued=max_workers)
    device = str(getattr(engine, "device", "cpu"))
    return Admission(lim.resolved(len(tokens.names) if tokens is not None else 0, device))


def _limit_engine(engine: Any, handler: Any, limits: ServerLimits, tokens: ClientTokens | None) -> None:
    """Apply the worker's memory and session limits to its engine (engines that have them)."""
    limit = getattr(engine, "limit_memory", None)
    if limit is None or not getattr(engine, "is_loaded", False):
        return
    budget = limits.kv_budget_bytes
    if budget is None:
        budget = default_kv_budget(engine.device)
    limit(budget, limits.evict_idle_s)
    max_sessions = int(getattr(engine.config, "max_sessions", 0)) or None
    cap = limits.max_sessions_per_client
    if cap is None and max_sessions is not None and tokens is not None and len(tokens.names) > 1:
        cap = max(1, max_sessions // 2)
    handler.session_cap = cap
    logger.info("KV budget %.0f MiB (%d bytes a token); sessions per client: %s", budget / 2**20,
                engine.kv_bytes_per_token, cap if cap is not None else "no cap")  # fmt: skip


def _serve(
    worker_type: str,
    servicer: Any,
    add: Callable[[Any, grpc.Server], None],
    engine: Any,
    port: int,
    host: str,
    admission: Admission,
    tls: tuple[str | Path, str | Path] | None,
    tokens: ClientTokens | None,
    limits: ServerLimits,
) -> WorkerServer:
    options = [
        ("grpc.max_receive_message_length", limits.max_message_bytes),
        ("grpc.max_send_message_length", limits.max_message_bytes),
        ("grpc.so_reuseport", 0),  # a second worker on a busy port must fail, not share it
    ]
    threads = admission.limits.threads
    server = grpc.server(
        ThreadPoolExecutor(max_workers=threads, thread_name_prefix=f"specsplit-{worker_type}"),
        interceptors=[WorkerGate(admission, tokens)],
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
    mark_serving()  # a graph captured from now on stalls calls: logged as a warning
    lim = admission.limits
    logger.info(
        "%s worker serving on %s:%d (%s%s; %d calls + %d queued, %d compute slots)",
        worker_type,
        host,
        bound,
        "TLS" if tls else "plaintext",
        f", {len(tokens.names)} client token(s)" if tokens is not None else "",
        lim.max_calls,
        lim.max_queued,
        lim.compute_slots,
    )
    return WorkerServer(server, bound, host, engine, worker_type, health, admission)


def serve_draft(
    engine: Any,
    port: int = 0,
    host: str = "127.0.0.1",
    max_workers: int = 8,
    tls: tuple[str | Path, str | Path] | None = None,
    auth_token: str | ClientTokens | None = None,
    limits: ServerLimits | None = None,
    admission: AdmissionLimits | None = None,
    tree_slots: bool = True,
    max_batch: int = 0,
    batch_capacity: int = 4096,
) -> WorkerServer:
    """Serve a :class:`~specsplit.engines.draft.DraftEngine` (loaded) over gRPC and return at once.

    Args:
        engine: the engine; the caller keeps ownership.
        port: TCP port; 0 picks a free one (read it from ``.port``).
        host: interface to bind (``"0.0.0.0"`` for every interface).
        max_workers: calls open at once, and as many queued, when ``admission`` is not given. An
            open stream (``GenerateDraftsStream`` / ``VerifyDraftsStream``) counts for its whole
            length; at most half of them (at least 1) may be streams.
        tls: ``(certificate chain PEM file, private key PEM file)`` to serve TLS.
        auth_token: the bearer token every call must carry, or the named clients'
            (:class:`~specsplit.remote.clients.ClientTokens`).
        limits: request and memory limits (defaults: :class:`~specsplit.remote.server.ServerLimits`).
        admission: bounds on calls, queues and compute (see :mod:`specsplit.remote.admission`).
        tree_slots: grant co-located target workers tree slots (:mod:`specsplit.remote.tree_slots`).
        max_batch: concurrent greedy sessions asking for chain drafts are drafted together, up to
            this many a forward (:class:`~specsplit.engines.batched_sessions.DraftBatcher`); ``0``:
            each call drafts on its own.
        batch_capacity: positions (prompt + new tokens) a batched session may need; the pool holds
            ``max_batch`` of them. Longer sessions draft on their own.

    Returns:
        The running :class:`WorkerServer`.
    """
    limits = limits or ServerLimits()
    tokens = _tokens(auth_token)
    adm = _admission(max_workers, admission, tokens, engine)
    sessions = None
    if max_batch >= 2:
        graphs = _graphs(engine)
        pool = _pool(engine, max_batch, batch_capacity, graphs)
        _capture_session_prompts(pool)
        sessions = DraftBatcher(pool, engine.runner.vocab_size, engine.config.session_ttl_s)
    servicer = DraftServicer(engine, limits, max_streams(adm.limits.max_calls), adm, tree_slots, sessions)
    _limit_engine(engine, servicer._h, limits, tokens)
    server = _serve("draft", servicer, pb_grpc.add_DraftServiceServicer_to_server, engine, port, host, adm, tls,
                    tokens, limits)  # fmt: skip
    server.sessions = sessions
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
    auth_token: str | ClientTokens | None = None,
    limits: ServerLimits | None = None,
    admission: AdmissionLimits | None = None,
    *,
    draft_address: str | None = None,
    draft_auth_token: str | None = None,
    draft_tls_ca_file: str | Path | None = None,
    draft_timeout_s: float = 60.0,
    draft_streams: bool = True,
    tree_slots: bool = True,
    drafter: str = "model",
    ngram: NgramConfig | None = None,
    check_draft: bool = True,
    max_batch: int = 0,
    batch_capacity: int = 4096,
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
        check_draft: ping the draft worker before serving.
        max_batch: concurrent ``Generate`` calls share batched rounds, up to this many rows a
            round (continuous batching, :mod:`specsplit.pipeline.batch`; with ``draft_address``, a
            greedy model-drafted call drafts on the draft worker only while it is the worker's only
            generation, see :class:`~specsplit.remote.server.TargetServicer`), and greedy
            client-loop sessions' ``VerifyDrafts`` calls
            are verified together, up to this many sessions a forward
            (:mod:`specsplit.engines.batched_sessions`); ``0``: each call runs its own rounds.
        batch_capacity: positions (prompt + new tokens) a batched row may need; the pool holds
            ``max_batch`` of them. Longer generations run their own rounds.

    Raises:
        ConfigError: the draft worker refused this worker's token or TLS settings (with
            ``check_draft``); a draft worker that is only unreachable is logged and probed later.

    Each running ``Generate`` holds one of the open-call slots for its whole length.
    """
    limits = limits or ServerLimits()
    tokens = _tokens(auth_token)
    adm = _admission(max_workers, admission, tokens, engine)
    draft = None
    if draft_address:
        draft = GrpcTransport(None, draft_address, timeout_s=draft_timeout_s, auth_token=draft_auth_token,
                              tls_ca_file=draft_tls_ca_file, streams=draft_streams)  # fmt: skip
        if check_draft:
            _check_draft(draft, draft_address)
    graphs = _graphs(engine)
    drafting = WorkerDrafting(drafter, ngram, padded=graphs)
    batch = _batch_scheduler(engine, max_batch, batch_capacity, graphs, adm.limits.max_calls)
    sessions = _session_batcher(engine, max_batch, batch_capacity, graphs)
    servicer = TargetServicer(
        engine, limits, draft, max_streams(adm.limits.max_calls), tree_slots, drafting, adm, batch, sessions
    )
    _limit_engine(engine, servicer._h, limits, tokens)
    try:
        server = _serve("target", servicer, pb_grpc.add_TargetServiceServicer_to_server, engine, port, host, adm,
                        tls, tokens, limits)  # fmt: skip
    except BaseException:
        servicer.loop.close()
        raise
    server.on_stop.append(servicer.loop.close)
    if batch is not None:  # the rounds run on their own thread: the streams only send
        batch.drive_in_background()
        server.on_stop.append(batch.close)
    server.batch = batch
    server.sessions = sessions
    return server


def _batch_scheduler(
    engine: Any, max_batch: int, capacity: int, graphs: bool, max_calls: int
) -> BatchScheduler | None:
    """The shared batched rounds of a target worker (None when ``max_batch`` < 2)."""
    if max_batch < 2:
        return None
    pool = _pool(engine, max_batch, capacity, graphs)
    logger.info("batched rounds: %d rows of %d positions (%.2f GB of KV)", pool.slots, capacity,
                pool.cache.memory_bytes() / 1e9)  # fmt: skip
    # Rows past the open calls cannot wait: each waiting row is a call holding a request thread.
    scheduler = BatchScheduler(pool, min(max_batch, pool.slots), max_waiting=max(max_calls, 1))
    # Every shape captured now: one first met while serving would stop every row for its capture.
    t0 = time.perf_counter()
    if captured := pool.capture_prefills() + pool.capture_rounds(scheduler.planner.sizes):
        logger.info("captured %d batched graphs (prompt forwards and rounds) in %.1f s", captured,
                    time.perf_counter() - t0)  # fmt: skip
    return scheduler


def _graphs(engine: Any) -> bool:
    """Whether the engine replays CUDA graphs (:attr:`~specsplit.engines.base.EngineBase.replays_graphs`;
    a stand-in engine without it does not)."""
    return bool(getattr(engine, "replays_graphs", False))


def _pool(engine: Any, max_batch: int, capacity: int, graphs: bool) -> BatchedTarget:
    """A batched-rounds KV pool for ``max_batch`` rows on the worker's target (compiled as its engine is)."""
    slots = batch_bucket(max_batch, BATCH_LIMIT)
    return BatchedTarget(engine.runner, slots, capacity, use_graphs=graphs, compile=engine.config.compile)


def _capture_session_prompts(pool: BatchedTarget) -> None:
    """Capture the one-row prompt forwards a session pool writes new sessions' prompts with: one
    first met while serving would stop every session's rounds for its capture."""
    t0 = time.perf_counter()
    if captured := pool.capture_prefills(max_rows=1):
        logger.info("captured %d prompt-forward graphs in %.1f s", captured, time.perf_counter() - t0)


def _session_batcher(engine: Any, max_batch: int, capacity: int, graphs: bool) -> SessionBatcher | None:
    """The pool where concurrent client-loop sessions' verifications share forwards (``max_batch`` >= 2)."""
    if max_batch < 2:
        return None
    pool = _pool(engine, max_batch, capacity, graphs)
    _capture_session_prompts(pool)
    cfg = engine.config
    return SessionBatcher(
        pool, engine.model_vocab_size, cfg.max_tree_nodes, cfg.max_tree_depth, cfg.session_ttl_s
    )


def _check_draft(draft: GrpcTransport, address: str) -> None:
    """Ping the draft worker once: a refused token or certificate fails the start with a clear error."""
    try:
        draft.check_draft(_DRAFT_CHECK_S)
    except AuthenticationError as e:
        draft.close()
        raise ConfigError(
            f"the draft worker at {address} refused this target worker's token: set "
            f"--draft-auth-token-file (or SPECSPLIT_DRAFT_AUTH_TOKEN) to a token it accepts ({e})"
        ) from None
    except TransportError as e:
        if "SSL" in str(e) or "certificate" in str(e).lower() or "handshake" in str(e).lower():
            draft.close()
            raise ConfigError(f"TLS to the draft worker at {address} failed (--draft-tls-ca?): {e}") from None
        logger.warning(
            "draft worker at %s does not answer yet (%s); generations run target-only until it does "
            "(it is probed in the background)",
            address,
            e,
        )
