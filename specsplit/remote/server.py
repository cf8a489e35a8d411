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

Every call first passes the worker's gate (:mod:`specsplit.remote.admission`: tokens, bounded
calls and queues per client, fair compute, requests that do not decode); sessions live in their
caller's namespace (:mod:`specsplit.remote.clients`). Error messages are bounded in length and
name sessions by the caller's own id.

Workers hold no state apart from sessions, so several can sit behind a gRPC load balancer with
session affinity (route on the ``session_id`` field or pin a client to one backend).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Generator, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import grpc
import torch

from specsplit.engines.batched_sessions import DraftBatcher, SessionBatcher
from specsplit.errors import (
    CacheDesyncError,
    ConfigError,
    InvalidRequest,
    ResourceExhausted,
    SessionNotFound,
    SpecSplitError,
)
from specsplit.messages import DraftRequest, GenerateRequest, GenerateUpdate, VerifyRequest
from specsplit.pipeline import DecodeParams, OverlapPolicies, decode_rounds
from specsplit.pipeline.batch import BatchRequest, BatchScheduler
from specsplit.remote import convert
from specsplit.remote._generated import spec_decoding_pb2 as pb
from specsplit.remote._generated import spec_decoding_pb2_grpc as pb_grpc
from specsplit.remote.admission import Admission
from specsplit.remote.client import STREAM_FULL_KEY, GrpcTransport
from specsplit.remote.clients import (
    MAX_GENERATE_SESSION_ID_CHARS,
    check_session_id,
    current_caller,
)
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
_MAX_DETAILS = 1024  # characters of an error message sent back (never unbounded input)
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
        max_tree_work: most ``nodes x depth x width`` a requested tree shape may cost (width: the
            children drafted per node, or frontier nodes per level, whichever is larger): a dynamic
            tree's drafting cost grows with all three, not with its node count alone.
        kv_budget_bytes: KV cache all sessions of the worker may hold together; a session that would
            pass it is refused (``RESOURCE_EXHAUSTED``). ``None``: from the device's free memory
            when the worker starts (:func:`default_kv_budget`).
        max_sessions_per_client: live sessions one named client may hold (``None``: the engine's
            ``max_sessions``, or half of it when several named clients share the worker).
        evict_idle_s: a full session store makes room only by evicting sessions idle this long;
            otherwise the new session is refused.
    """

    max_message_bytes: int = convert.DEFAULT_MAX_MESSAGE_BYTES
    max_tree_nodes: int = 256
    max_tree_depth: int = 64
    max_context: int = 32768
    max_tree_work: int = 65536
    kv_budget_bytes: int | None = None
    max_sessions_per_client: int | None = None
    evict_idle_s: float = 30.0


def check_tree_spec(spec: pb.TreeSpec, lim: ServerLimits) -> None:
    """Refuse a requested tree shape beyond the worker's limits (``ResourceExhausted``).

    Checked on the raw message, before the ``TreeConfig`` is built: building a huge static or chain
    shape is itself expensive. Unset (0) dynamic fields count with their defaults.
    """
    nodes = depth = width = 0
    if spec.shape == pb.TREE_SHAPE_CHAIN:
        nodes = depth = spec.num_draft_tokens
        width = 1
    elif spec.shape == pb.TREE_SHAPE_STATIC:
        paths = spec.static_paths.paths
        nodes = len(paths)
        depth = max((len(p.ranks) for p in paths), default=0)
        width = (
            1 + max((max(p.ranks, default=0) for p in paths), default=0) if nodes <= lim.max_tree_nodes else 0
        )
    elif spec.shape == pb.TREE_SHAPE_DYNAMIC:
        t = convert.tree_defaults(spec)
        nodes, depth, width = max(t.budget, t.topk, t.width), t.max_depth, max(t.topk, t.width)
    if nodes > lim.max_tree_nodes or depth > lim.max_tree_depth:
        raise ResourceExhausted(
            f"requested tree (up to {nodes} nodes, depth {depth}) exceeds this worker's limits "
            f"({lim.max_tree_nodes} nodes, depth {lim.max_tree_depth})"
        )
    if nodes * depth * width > lim.max_tree_work:
        raise ResourceExhausted(
            f"requested tree costs {nodes} nodes x depth {depth} x width {width} = {nodes * depth * width}; "
            f"this worker accepts at most {lim.max_tree_work}"
        )


def default_kv_budget(device: torch.device) -> int:
    """Bytes of KV cache a worker on ``device`` allows by default: 80% of the GPU memory free
    after the model loaded, or half of the host's available memory for a CPU worker."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.8)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 // 2
    except OSError:
        pass
    pages = os.sysconf("SC_AVPHYS_PAGES") if hasattr(os, "sysconf") else 0
    return max(int(pages) * 4096 // 2, 1 << 30)


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
    """What both servicers share: session namespaces and locking, timing, fair compute, the
    error-to-status mapping and the count of open streams (at most ``max_streams`` at once).

    Args:
        admission: the worker's bounds; ``None``: engine calls are not gated (a servicer used
            without :func:`serve_draft` / :func:`serve_target`).
    """

    def __init__(
        self,
        engine: Any,
        worker_type: str,
        limits: ServerLimits,
        max_streams: int,
        admission: Admission | None = None,
    ):
        self.engine = engine
        self.worker_type = worker_type
        self.limits = limits
        self.locks = _SessionLocks()
        self.max_streams = max_streams
        self.admission = admission
        self._streams = 0
        self._streams_guard = threading.Lock()
        self._owned: dict[str, set[str]] = {}  # named client -> its session keys (pruned lazily)
        self._owned_guard = threading.Lock()
        self.session_cap: int | None = None  # live sessions per named client (None: no cap)
        self.also_holds: Callable[[str], bool] | None = None  # sessions held outside the engine

    def compute(self) -> AbstractContextManager[None]:
        """A turn of engine work for the current caller, shared fairly between clients."""
        if self.admission is None:
            return nullcontext()
        return self.admission.compute.hold(current_caller().fairness_key)

    def key(self, session_id: str) -> str:
        """The engine's key of the caller's session ``session_id`` (checked for length)."""
        check_session_id(session_id)
        return current_caller().session_key(session_id)

    def admit_session(self, key: str, creates: bool) -> None:
        """Count a session a named client is about to create against its cap (``ResourceExhausted``)."""
        caller = current_caller()
        engine_has = getattr(self.engine, "has_session", None)
        if engine_has is None:
            return
        also = self.also_holds

        def has(k: str) -> bool:  # the engine's sessions and those of the batched pool
            return bool(engine_has(k)) or (also is not None and also(k))

        if not creates or not caller.named or self.session_cap is None or has(key):
            return
        with self._owned_guard:
            live = {k for k in self._owned.get(caller.client, ()) if has(k)}
            if len(live) >= self.session_cap:
                self._owned[caller.client] = live
                raise ResourceExhausted(
                    f"this client already holds {len(live)} sessions on this {self.worker_type} worker "
                    f"(its limit); end some or retry later"
                )
            live.add(key)
            self._owned[caller.client] = live

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
        if self.admission is not None:
            requests = self.admission.streams.requests(requests, context)
        try:
            for request in requests:
                yield call(request, context)
        finally:
            with self._streams_guard:
                self._streams -= 1

    def run(
        self,
        context: grpc.ServicerContext,
        session_id: str | None,
        work: Callable[[float], R],
        compute: bool = False,
    ) -> R:
        """``work(t0)`` under the session's lock (and a compute turn when ``compute``); errors
        abort the call with their status code. ``session_id`` is the engine's key."""
        t0 = time.perf_counter()
        try:
            # Engines keep inference tensors in their caches; every call must run in inference
            # mode, as generate() does in local mode.
            with torch.inference_mode():
                if session_id is None:
                    return work(t0)
                with self.locks.hold(session_id), self.compute() if compute else nullcontext():
                    return work(t0)
        except Exception as e:
            self.fail(context, e, session_id)
        raise AssertionError("unreachable: context.abort raises")  # pragma: no cover

    def fail(self, context: grpc.ServicerContext, e: BaseException, session_id: str | None) -> None:
        """Abort the call with the status code of ``e`` (raises); ``session_id`` is the engine's key."""
        if isinstance(e, SpecSplitError):
            code = next((c for t, c in _STATUS if isinstance(e, t)), None)
            if code is None:
                logger.error("%s worker: unexpected %s", self.worker_type, type(e).__name__, exc_info=e)
                code = grpc.StatusCode.INTERNAL
            if isinstance(e, CacheDesyncError) and e.expected is not None and e.actual is not None:
                context.set_trailing_metadata(
                    (("specsplit-expected", str(e.expected)), ("specsplit-actual", str(e.actual)))
                )
            context.abort(code, _details(str(e), session_id))
        if isinstance(e, _OUT_OF_MEMORY):
            logger.error("%s worker: out of memory: %s", self.worker_type, _details(str(e), None))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, _details(f"worker out of memory: {e}", None))
        logger.error("%s worker: internal error", self.worker_type, exc_info=e)
        context.abort(
            grpc.StatusCode.INTERNAL, _details(f"internal error: {type(e).__name__}: {e}", session_id)
        )

    def ping(self, context: grpc.ServicerContext) -> pb.PingResponse:
        def work(t0: float) -> pb.PingResponse:
            resp = convert.worker_info_to_proto(self.engine.info())
            resp.telemetry.server_time_s = time.perf_counter() - t0
            return resp

        return self.run(context, None, work)

    def end_session(
        self,
        request: pb.EndSessionRequest,
        context: grpc.ServicerContext,
        pool: SessionBatcher | DraftBatcher | None = None,
    ) -> pb.EndSessionResponse:
        """End a session: in the batched pool ``pool`` (its ``end(key)``) if it holds it, else the engine's."""
        key = self.run(context, None, lambda t0: self.key(request.session_id))
        if pool is not None:
            t0 = time.perf_counter()
            if pool.end(key):
                return pb.EndSessionResponse(
                    existed=True, telemetry=pb.Telemetry(server_time_s=time.perf_counter() - t0)
                )

        def work(t0: float) -> pb.EndSessionResponse:
            existed = bool(self.engine.end_session(key))
            return pb.EndSessionResponse(
                existed=existed, telemetry=pb.Telemetry(server_time_s=time.perf_counter() - t0)
            )

        return self.run(context, key, work)

    def clamp_capacity(self, hint: int) -> int:
        return max(0, min(hint, self.limits.max_context))


class DraftServicer(pb_grpc.DraftServiceServicer):
    """``DraftService`` over a :class:`specsplit.engines.draft.DraftEngine`."""

    def __init__(
        self,
        engine: Any,
        limits: ServerLimits | None = None,
        max_streams: int = 4,
        admission: Admission | None = None,
        tree_slots: bool = True,
        sessions: DraftBatcher | None = None,
    ):
        self._h = _Handler(engine, "draft", limits or ServerLimits(), max_streams, admission)
        cfg = getattr(engine, "config", None)
        self._slots = TreeSlotExporter(
            getattr(engine, "device", torch.device("cpu")), getattr(cfg, "max_tree_nodes", 64), tree_slots
        )
        self.sessions = sessions  # concurrent greedy client-loop sessions' chains drafted together here
        if sessions is not None:
            self._h.also_holds = sessions.holds

    def _check_limits(self, m: pb.DraftRequest) -> None:
        lim = self._h.limits
        check_tree_spec(m.tree, lim)
        if m.prefix_length + len(m.new_token_ids) > lim.max_context:
            raise ResourceExhausted(
                f"draft session would hold {m.prefix_length + len(m.new_token_ids)} tokens; "
                f"this worker's max_context is {lim.max_context}"
            )

    def GenerateDrafts(self, request: pb.DraftRequest, context: grpc.ServicerContext) -> pb.DraftResponse:
        key = self._h.run(context, None, lambda t0: self._h.key(request.session_id))

        def convert_request(t0: float) -> DraftRequest:
            self._check_limits(request)
            req = convert.draft_request_from_proto(request)
            req.session_id = key
            req.capacity_hint = self._h.clamp_capacity(req.capacity_hint)
            return req

        req = self._h.run(context, None, convert_request)
        # Sessions drafted in the shared chains take no compute turn: their call is everyone's.
        batched = self.sessions is not None and self.sessions.takes(req)

        def work(t0: float) -> pb.DraftResponse:
            self._h.admit_session(key, req.prefix_length == 0)
            res = self.sessions.draft(req) if batched and self.sessions is not None else None
            if res is None and batched:  # the batched slots filled up meanwhile: the session's own path
                with self._h.compute():
                    res = self._h.engine.generate(req)
            elif res is None:
                res = self._h.engine.generate(req)
            if isinstance(req, SlotDraftRequest) and not req.speculate and not batched:
                ref = self._slots.place(req.tree_channel, req.tree_slot, res.tree)
                if ref is not None:
                    res = SlotDraftResult(**vars(res), tree_in_slot=ref)
            resp = convert.draft_result_to_proto(res)
            resp.telemetry.server_time_s = time.perf_counter() - t0
            return resp

        return self._h.run(context, key, work, compute=not batched)

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
        return self._h.end_session(request, context, self.sessions)

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
        admission: Admission | None = None,
        batch: BatchScheduler | None = None,
        sessions: SessionBatcher | None = None,
    ):
        limits = limits or ServerLimits()
        cfg = getattr(engine, "config", None)
        if cfg is not None:  # the engine's own limits are the ones that matter on the target
            limits = replace(
                limits,
                max_tree_nodes=cfg.max_tree_nodes,
                max_tree_depth=cfg.max_tree_depth,
                max_context=cfg.max_context,
            )
        self._h = _Handler(engine, "target", limits, max_streams, admission)
        self.loop = TargetLoopTransport(engine, draft, self._h.clamp_capacity, tree_slots, self._h.compute)
        self._policies = OverlapPolicies()  # the overlap policy per tree shape, across clients
        self._drafting = drafting or WorkerDrafting()
        self._draft_worker = draft is not None
        self.batch = batch  # concurrent Generate calls' rows share rounds here (None: each runs its own)
        self._solo, self._solo_lock = 0, threading.Lock()  # Generate calls running their own rounds
        self.sessions = sessions  # concurrent client-loop sessions' VerifyDrafts share forwards here
        if sessions is not None:
            self._h.also_holds = sessions.holds

    def _batched(self, req: GenerateRequest, params: DecodeParams) -> bool:
        """Whether a ``Generate`` call's rows join the shared batched rounds; a call that does not
        counts as a generation running its own rounds until :meth:`_solo_done`.

        Rows join when batching is on and the batched rounds apply everything the call asks for.
        A greedy call the draft worker would draft for (``model``, ``hybrid``, ``auto``) runs its
        own speculative rounds only while it is the worker's only generation, and moves to the
        batched rounds before its next verification once another one starts (:meth:`_generate_solo`).
        From two at once, batched rounds serve more tokens a second to every client: one round
        costs about one row's step whatever the rows (RESULTS, "Batched generation"), while solo
        sessions' draft levels and verifications take turns on the GPU with the batch, each level
        costing a large share of a target step on the shipped pair. In the batch such a row drafts
        what the batched rounds can (its drafter's n-grams, or nothing), and the batch planner
        turns speculation down where it does not pay.
        """
        with self._solo_lock:
            batched = self._joins_batch(req, params)
            if not batched:
                self._solo += 1
            return batched

    def _joins_batch(self, req: GenerateRequest, params: DecodeParams) -> bool:
        if not self._batchable(req, params):
            return False
        if not self._drafts_on_worker(params):
            return True
        return self._movable(params) and self._busy(self._solo)

    def _batchable(self, req: GenerateRequest, params: DecodeParams) -> bool:
        """Whether the batched rounds apply everything the call asks for, and its row fits a slot."""
        if self.batch is None or params.processing is not None or params.overlap:
            return False
        need = len(req.prompt_token_ids) + params.max_new_tokens + 1 + max(self.batch.planner.sizes)
        return need <= self.batch.target.capacity

    def _drafts_on_worker(self, params: DecodeParams) -> bool:
        """Whether the call's own rounds would draft on the draft worker (a model in its drafting)."""
        return self._draft_worker and params.drafter not in ("ngram", "suffix")

    def _movable(self, params: DecodeParams) -> bool:
        """A call the draft worker drafts for that the batched rounds may take over: a greedy one.
        A seeded sampled generation draws other samples in the batched rounds than on its own (both
        exact draws from the target): it stays on its own so a seed reproduces its output."""
        return self._drafts_on_worker(params) and not params.sampling.do_sample

    def _room(self) -> bool:
        """Whether the batched rounds would take one more waiting row now (else a call keeps its own
        rounds rather than fail mid-generation)."""
        assert self.batch is not None
        return self.batch.waiting_rows < self.batch.max_waiting

    def _busy(self, solo: int) -> bool:
        """Whether another generation runs (``solo``: the calls on their own rounds to count)."""
        assert self.batch is not None
        return solo > 0 or self.batch.live_rows > 0 or self.batch.waiting_rows > 0

    def _solo_done(self) -> None:
        with self._solo_lock:
            self._solo -= 1

    def VerifyDrafts(self, request: pb.VerifyRequest, context: grpc.ServicerContext) -> pb.VerifyResponse:
        key = self._h.run(context, None, lambda t0: self._h.key(request.session_id))

        def convert_request(t0: float) -> VerifyRequest:
            req = convert.verify_request_from_proto(request)
            req.session_id = key
            lim, tree = self._h.limits, req.tree
            if (tree.depth_bound or 0) > lim.max_tree_depth or (tree.max_branch or 0) > lim.max_tree_nodes:
                raise InvalidRequest(
                    f"tree bounds (branch {tree.max_branch}, depth {tree.depth_bound}) exceed this worker's "
                    f"limits ({lim.max_tree_nodes} nodes, depth {lim.max_tree_depth})"
                )
            req.capacity_hint = self._h.clamp_capacity(req.capacity_hint)
            return req

        req = self._h.run(context, None, convert_request)
        # Sessions in the batched rounds take no compute turn: their round is everyone's.
        batched = self.sessions is not None and self.sessions.takes(req)

        def work(t0: float) -> pb.VerifyResponse:
            if batched:  # a batched session counts against its client's cap like any other
                self._h.admit_session(key, req.expected_prefix_length == 0)
            result = self.sessions.verify(req) if batched and self.sessions is not None else None
            if result is None and batched:  # the batched slots filled up meanwhile: the session's own path
                with self._h.compute():
                    self._h.admit_session(key, req.expected_prefix_length == 0)
                    result = self._h.engine.verify(req)
            elif result is None:
                self._h.admit_session(key, req.expected_prefix_length == 0)
                result = self._h.engine.verify(req)
            resp = convert.verify_result_to_proto(result)
            resp.telemetry.server_time_s = time.perf_counter() - t0
            return resp

        return self._h.run(context, key, work, compute=not batched)

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
            check_session_id(request.session_id, MAX_GENERATE_SESSION_ID_CHARS)
            check_tree_spec(request.tree, self._h.limits)
            req = convert.generate_request_from_proto(request)
            vocab = self._h.engine.model_vocab_size
            params = decode_params(req, vocab, self._h.limits, self._policies, self._drafting)
            req.session_id = self._h.key(req.session_id)
            self._h.admit_session(req.session_id, True)
            return req, params

        req, params = self._h.run(context, None, check)
        if self._batched(req, params):
            yield from self._generate_batched(req, params, context)
            return
        t0 = time.perf_counter()
        counted = [True]

        def release() -> None:  # once: the call no longer runs its own rounds
            if counted[0]:
                counted[0] = False
                self._solo_done()

        try:
            out: list[int] = []
            moved = yield from self._generate_solo(req, params, context, out, release)
        finally:
            release()
        if moved:  # the rest of the generation in the batched rounds, from what it committed so far
            rest = replace(params, max_new_tokens=params.max_new_tokens - len(out))
            yield from self._generate_batched(req, rest, context, out, t0)

    def _generate_solo(
        self,
        req: GenerateRequest,
        params: DecodeParams,
        context: grpc.ServicerContext,
        out: list[int],
        release: Callable[[], None],
    ) -> Generator[pb.GenerateResponse, None, bool]:
        """``Generate`` on rounds of its own (:func:`~specsplit.pipeline.decode_rounds`); ``out``
        collects the committed tokens. Returns True when the generation stopped early to move to
        the batched rounds (nothing final was sent then). ``release`` stops counting the call as a
        generation on its own rounds; it runs before the call's sessions end, so whoever sees them
        gone sees the worker free for the next lone call.

        A greedy call the batched rounds can take (:meth:`_movable`) moves there before its next
        verification once another generation runs, its first one included: from then on its own
        verifications and draft levels would take turns with the batched rounds, on the GPU and in
        this process's Python, slowing every row of the batch and itself most (its prompt's
        verification then spans tens of batched rounds), while in the batch it costs the others
        almost nothing.
        """
        stats = SpecStats(prompt_tokens=len(req.prompt_token_ids))
        moved = False

        def leave() -> bool:
            nonlocal moved
            moved = self._busy(self._solo - 1) and self._room()
            return moved

        movable = self._batchable(req, params) and self._movable(params)
        # Each round goes to the client once the next round's draft is under way (defer_updates): the
        # hand-off to gRPC then overlaps the draft's GPU work instead of delaying its launch.
        rounds = decode_rounds(
            self.loop, req.prompt_token_ids, params, out, stats, req.session_id, defer_updates=True,
            leave=leave if movable else None,
        )  # fmt: skip
        try:
            with torch.inference_mode(), self._h.locks.hold(req.session_id):
                try:
                    while True:
                        # A round's verification is one turn of this worker's compute, shared fairly
                        # between clients (TargetLoopTransport takes it); its draft call is a turn
                        # of the draft worker's, and sending the round to the client is neither. A
                        # client waiting here for a turn waits for one verification, not a round.
                        item = next(rounds, None)
                        if item is None:
                            break
                        yield convert.generate_update_to_proto(GenerateUpdate([item]))
                finally:
                    release()
                    rounds.close()  # ends the session on both workers, also when the client cancelled
        except Exception as e:
            self._h.fail(context, e, req.session_id)
        if moved:
            return True
        done = GenerateUpdate([], True, stats.recoveries, stats.draft_fallback, stats.wall_time_s)
        yield convert.generate_update_to_proto(done)
        return False

    def _generate_batched(
        self,
        req: GenerateRequest,
        params: DecodeParams,
        context: grpc.ServicerContext,
        history: list[int] | None = None,
        started: float | None = None,
    ) -> Iterator[pb.GenerateResponse]:
        """``Generate`` through the shared batched rounds (:mod:`specsplit.pipeline.batch`): this
        call's row joins the next round with a free slot; whichever waiting call is free runs the
        rounds for all. A cancelled call drops its row at the end of the current round.
        ``history``: tokens the call committed on its own rounds before it moved here, at
        ``started`` (``time.perf_counter()``)."""
        assert self.batch is not None
        ngram = None if params.drafter == "model" else params.ngram
        t0 = time.perf_counter() if started is None else started
        history = history or []
        try:
            with self._h.locks.hold(req.session_id):
                # Stop strings are the client's (it cancels the call): EOS ids need no history.
                ticket = self.batch.submit(BatchRequest(req.prompt_token_ids + history, params), ngram)
                # A generator: closing it cancels the row. Rounds coalesce into one message per
                # STREAM_EVERY_S: each message costs this worker's Python a send and a wake-up.
                rounds = self.batch.follow_chunks(ticket, STREAM_EVERY_S)
                try:
                    for items in rounds:
                        yield convert.generate_update_to_proto(GenerateUpdate(items))
                finally:
                    rounds.close()  # a cancelled client: the row leaves at the end of this round
        except Exception as e:
            self._h.fail(context, e, req.session_id)
        done = GenerateUpdate([], True, 0, False, time.perf_counter() - t0)
        yield convert.generate_update_to_proto(done)

    def EndSession(
        self, request: pb.EndSessionRequest, context: grpc.ServicerContext
    ) -> pb.EndSessionResponse:
        return self._h.end_session(request, context, self.sessions)

    def Ping(self, request: pb.PingRequest, context: grpc.ServicerContext) -> pb.PingResponse:
        return self._h.ping(context)


# Shortest time between two updates of one batched Generate stream (rounds in between are sent
# together; the last update leaves as soon as the row ends).
STREAM_EVERY_S = 0.01


def _details(message: str, key: str | None) -> str:
    """An error message as a caller sees it: its session named by the caller's own id, bounded."""
    if key and "#" in key:
        message = message.replace(key, key.rsplit("#", 1)[0])
    if len(message) > _MAX_DETAILS:
        message = message[: _MAX_DETAILS - 15] + " ... (truncated)"
    return message


def max_streams(max_calls: int) -> int:
    """Streams a worker with ``max_calls`` open calls accepts at once (see the client's "Streams")."""
    return max(1, max_calls // 2)
