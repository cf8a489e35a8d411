"""Admission control of a worker: what one client can make it do, and what every call gets.

Every call passes :class:`WorkerGate`, a server interceptor, and then runs in the gRPC thread
pool under these bounds (:class:`AdmissionLimits`):

* **Calls.** At most ``max_calls`` calls are open at once (a stream counts for its whole length)
  and ``max_queued`` more wait for one; each client (named by its token) has its own bounds too.
  A call past them is refused at once with ``RESOURCE_EXHAUSTED`` and the trailing metadata
  ``retry-after-ms`` (also in the message); a queued call waits at most ``queue_timeout_s``.
* **Compute.** Engine work (a verification, a draft, a round of a generation run here) runs in
  at most ``compute_slots`` calls at once, shared evenly between the clients that want it: one
  client's many streams cannot slow another client's generation below its share.
* **Light calls.** ``Ping``, ``EndSession`` and health checks have their own ``light_calls``
  threads, so a worker busy with long streams still answers them at once.
* **Idle streams.** A request stream that sends nothing for ``stream_idle_s`` is cancelled.
* **Bad bytes.** A request that does not decode is ``INVALID_ARGUMENT``, logged at most once per
  ``_LOG_EVERY_S`` (with a count), never with a traceback per request.

The thread pool has exactly the threads these bounds can hold plus a few spare ones that only
ever refuse, so a refusal never waits behind the calls it refuses.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import grpc

from specsplit.remote.clients import SECRET_KEY, Caller, ClientTokens, reset_caller, set_caller

logger = logging.getLogger(__name__)

RETRY_AFTER_KEY = "retry-after-ms"  # trailing metadata of a refusal: when to try again
_RETRY_AFTER_MS = 200
_SPARE_THREADS = 4  # threads that only refuse calls (never block)
_LOG_EVERY_S = 10.0
HEALTH_PREFIX = "/grpc.health.v1.Health/"
_LIGHT = frozenset({"Ping", "EndSession", "Check"})  # served from their own threads


@dataclass
class AdmissionLimits:
    """How many calls a worker serves and queues, in all and per client.

    Attributes:
        max_calls: calls open at once (a stream counts for its whole length).
        max_queued: calls waiting for one of ``max_calls``; more are refused at once.
        max_calls_per_client / max_queued_per_client: the same bounds for each named client
            (``None``: the worker's); callers of a worker without tokens share the worker's.
        queue_timeout_s: the longest a call waits in the queue before it is refused.
        compute_slots: engine calls (a generation's rounds count as one each) that execute at once,
            shared evenly between clients. ``None``: 2 on a GPU, where one call's host work then
            overlaps another's device work and a second client finds a slot while a first holds
            the other; 1 on a CPU, where a call already uses every core and two at once only
            split them (a second client then waits for one call, not for half the machine).
        light_calls: ``Ping`` / ``EndSession`` / health checks served at once.
        stream_idle_s: a request stream idle this long is cancelled.
    """

    max_calls: int = 8
    max_queued: int = 8
    max_calls_per_client: int | None = None
    max_queued_per_client: int | None = None
    queue_timeout_s: float = 10.0
    compute_slots: int | None = None
    light_calls: int = 4
    stream_idle_s: float = 60.0

    def __post_init__(self) -> None:
        for name in ("max_calls", "compute_slots", "light_calls"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_queued < 0 or self.queue_timeout_s < 0 or self.stream_idle_s <= 0:
            raise ValueError("max_queued and queue_timeout_s must be >= 0, stream_idle_s > 0")

    @property
    def threads(self) -> int:
        """Threads of the worker's pool: every admitted call, light call and the spare ones."""
        return self.max_calls + self.max_queued + self.light_calls + _SPARE_THREADS

    def resolved(self, clients: int, device: str = "cpu") -> AdmissionLimits:
        """These limits with the defaults filled in for a worker with ``clients`` named clients
        whose engine runs on ``device``: per-client bounds are half the worker's when several share
        it (one client's calls then leave room for another's); compute slots by device."""
        several = clients >= 2
        slots = (
            self.compute_slots if self.compute_slots is not None else (1 if device.startswith("cpu") else 2)
        )
        half_calls, half_queue = max(1, self.max_calls // 2), max(0, self.max_queued // 2)
        return replace(
            self,
            max_calls_per_client=self.max_calls_per_client
            if self.max_calls_per_client is not None or not several
            else half_calls,
            max_queued_per_client=self.max_queued_per_client
            if self.max_queued_per_client is not None or not several
            else half_queue,
            compute_slots=slots,
        )


class Refused(Exception):
    """A call the worker will not take now (``RESOURCE_EXHAUSTED`` with a retry hint)."""


class FairGate:
    """At most ``permits`` holders at once; a key holds at most ``cap`` of them.

    With ``fair`` a key also holds at most its even share of the permits among the active keys:
    those that hold or wait for one, or released one within ``recent_s``. A client whose calls
    come one after another (a generation's rounds, with network hops between them) thus keeps its
    share between calls, instead of finding every permit taken by another client's many calls.
    A freed permit goes to the waiting key that holds fewest, then was served longest ago (round
    robin between clients, however many calls each has waiting).
    """

    def __init__(
        self,
        permits: int,
        cap: Callable[[str], int] | None = None,
        fair: bool = False,
        recent_s: float = 1.0,
    ):
        self.permits = permits
        self._cap = cap or (lambda key: permits)
        self._fair = fair
        self._recent_s = recent_s
        self._held: Counter[str] = Counter()
        self._waiting: Counter[str] = Counter()
        self._seen: dict[str, float] = {}  # key -> when it last released a permit
        self._granted: dict[str, float] = {}  # key -> when it last got a permit
        self._total = 0
        self._cond = threading.Condition()

    def _allowed(self, key: str, now: float) -> bool:
        held = self._held[key]
        if self._total >= self.permits or held >= self._cap(key):
            return False
        if self._fair:
            recent = {k for k, t in self._seen.items() if now - t < self._recent_s}
            active = len(set(+self._held) | set(+self._waiting) | recent | {key})
            if held >= max(1, self.permits // active):
                return False
            # Round robin between waiting keys: the one holding fewest, then served longest ago.
            mine = (held, self._granted.get(key, 0.0))
            return all((self._held[k], self._granted.get(k, 0.0)) >= mine for k in self._waiting if k != key)
        return True

    def acquire(self, key: str, timeout: float | None = None) -> bool:
        """Wait for a permit (False when ``timeout`` seconds passed first)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._waiting[key] += 1
            try:
                while not self._allowed(key, time.monotonic()):
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        return False
                    # Shares change when a key stops being recent, which nobody signals: look again.
                    wait = self._recent_s / 2 if self._fair else None
                    self._cond.wait(wait if remaining is None else min(remaining, wait or remaining))
                self._held[key] += 1
                self._total += 1
                self._granted[key] = time.monotonic()
                return True
            finally:
                self._waiting[key] -= 1
                if self._waiting[key] <= 0:
                    del self._waiting[key]
                self._cond.notify_all()  # the set of active keys (and so the shares) changed

    def release(self, key: str) -> None:
        with self._cond:
            self._held[key] -= 1
            if self._held[key] <= 0:
                del self._held[key]
            self._total -= 1
            now = time.monotonic()
            self._seen[key] = now
            if len(self._seen) > 4 * self.permits + 64:  # forget keys long gone
                self._seen = {k: t for k, t in self._seen.items() if now - t < self._recent_s}
                self._granted = {k: t for k, t in self._granted.items() if k in self._seen or k in self._held}
            self._cond.notify_all()

    @contextmanager
    def hold(self, key: str) -> Iterator[None]:
        self.acquire(key)
        try:
            yield
        finally:
            self.release(key)

    @property
    def in_use(self) -> int:
        with self._cond:
            return self._total


class _StreamEntry:
    def __init__(self, context: grpc.ServicerContext):
        self.context = context
        self.waiting_since: float | None = None


class StreamWatch:
    """Cancels request streams that have sent nothing for ``idle_s`` (each holds a thread)."""

    def __init__(self, idle_s: float):
        self.idle_s = idle_s
        self._entries: set[_StreamEntry] = set()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.closed = 0

    def requests(self, requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
        """``requests``, watched: the stream is cancelled when the next one is too long coming."""
        entry = _StreamEntry(context)
        with self._lock:
            self._entries.add(entry)
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="specsplit-stream-idle", daemon=True)
                self._thread.start()
        try:
            while True:
                entry.waiting_since = time.monotonic()
                try:
                    request = next(requests)
                except StopIteration:
                    return
                finally:
                    entry.waiting_since = None
                yield request
        finally:
            with self._lock:
                self._entries.discard(entry)

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, self.idle_s / 4))
            now = time.monotonic()
            with self._lock:
                idle = [
                    e
                    for e in self._entries
                    if e.waiting_since is not None and now - e.waiting_since > self.idle_s
                ]
                for e in idle:
                    self._entries.discard(e)
            for e in idle:
                self.closed += 1
                logger.info("closing a request stream idle for more than %.0fs", self.idle_s)
                e.context.cancel()


class Admission:
    """The bounds of :class:`AdmissionLimits` as a worker applies them (see the module docstring)."""

    def __init__(self, limits: AdmissionLimits):
        self.limits = limits
        lim = limits

        def call_cap(key: str) -> int:
            if key.startswith("client:") and lim.max_calls_per_client is not None:
                return lim.max_calls_per_client
            return lim.max_calls

        def queue_cap(key: str) -> int:
            if key.startswith("client:") and lim.max_queued_per_client is not None:
                return lim.max_queued_per_client
            return lim.max_queued

        self._call_cap, self._queue_cap = call_cap, queue_cap
        self.calls = FairGate(lim.max_calls, call_cap)
        self.compute = FairGate(lim.compute_slots if lim.compute_slots is not None else 2, fair=True)
        self.streams = StreamWatch(lim.stream_idle_s)
        self._pending: Counter[str] = Counter()  # open + queued calls per key
        self._pending_total = 0
        self._light = 0
        self._lock = threading.Lock()
        self.refused = 0

    @contextmanager
    def call(self, key: str) -> Iterator[None]:
        """Hold one of the open-call slots for ``key`` (queued first if needed).

        Raises:
            Refused: the worker's or the key's calls and queue are full, or the queue wait ran out.
        """
        lim = self.limits
        with self._lock:
            full = self._pending_total >= lim.max_calls + lim.max_queued
            if full or self._pending[key] >= self._call_cap(key) + self._queue_cap(key):
                self.refused += 1
                raise Refused(
                    "this worker's calls and queue are full"
                    if full
                    else "this client's calls and queue are full"
                )
            self._pending[key] += 1
            self._pending_total += 1
        try:
            if not self.calls.acquire(key, lim.queue_timeout_s):
                with self._lock:
                    self.refused += 1
                raise Refused(f"no call slot freed within {lim.queue_timeout_s:g}s")
            try:
                yield
            finally:
                self.calls.release(key)
        finally:
            with self._lock:
                self._pending[key] -= 1
                if self._pending[key] <= 0:
                    del self._pending[key]
                self._pending_total -= 1

    @contextmanager
    def light(self) -> Iterator[None]:
        """Hold one of the light-call threads (refused when all are busy)."""
        with self._lock:
            if self._light >= self.limits.light_calls:
                self.refused += 1
                raise Refused("this worker's light-call threads are busy")
            self._light += 1
        try:
            yield
        finally:
            with self._lock:
                self._light -= 1


class _Undecodable:
    """What a request that does not decode becomes (gRPC's own path would answer INTERNAL)."""


_UNDECODABLE = _Undecodable()


class _RateLimitedLog:
    def __init__(self, every_s: float):
        self.every_s, self._last, self._skipped = every_s, -float("inf"), 0
        self._lock = threading.Lock()

    def warning(self, msg: str, *args: Any) -> None:
        with self._lock:
            now = time.monotonic()
            if now - self._last < self.every_s:
                self._skipped += 1
                return
            skipped, self._skipped, self._last = self._skipped, 0, now
        suffix = f" ({skipped} more since the last such message)" if skipped else ""
        logger.warning(msg + suffix, *args)


class WorkerGate(grpc.ServerInterceptor):
    """Authenticates, admits and decodes every call of a worker (see the module docstring).

    Args:
        admission: the worker's bounds.
        tokens: accepted client tokens (``None``: any caller; health checks never need one).
    """

    def __init__(self, admission: Admission, tokens: ClientTokens | None):
        self.admission = admission
        self.tokens = tokens
        self._bad_log = _RateLimitedLog(_LOG_EVERY_S)
        self._denied_log = _RateLimitedLog(_LOG_EVERY_S)

    def intercept_service(self, continuation: Any, details: Any) -> Any:
        handler = continuation(details)
        if handler is None:
            return None
        method: str = details.method
        auth = secret = ""
        for key, value in details.invocation_metadata or ():
            text = value if isinstance(value, str) else value.decode("latin-1")
            if key == "authorization":
                auth = text
            elif key == SECRET_KEY:
                secret = text[:256]
        client: str | None = ""
        if self.tokens is not None and not method.startswith(HEALTH_PREFIX):
            client = self.tokens.identify(auth)
        light = method.rsplit("/", 1)[-1] in _LIGHT
        return self._wrap(handler, method, client, secret, light)

    @contextmanager
    def _serving(
        self, context: grpc.ServicerContext, client: str | None, secret: str, light: bool
    ) -> Iterator[None]:
        if client is None:
            self._denied_log.warning("refused a call without a valid bearer token from %s", context.peer())
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")
            return
        caller = Caller(client, secret, context.peer())
        try:
            slot = self.admission.light() if light else self.admission.call(caller.fairness_key)
            with slot:
                token = set_caller(caller)
                try:
                    yield
                finally:
                    reset_caller(token)
        except Refused as e:
            ms = _RETRY_AFTER_MS
            context.set_trailing_metadata(((RETRY_AFTER_KEY, str(ms)),))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"worker busy: {e}; retry after {ms} ms")

    def _decoded(self, request: Any, context: grpc.ServicerContext, method: str) -> Any:
        if request is _UNDECODABLE:
            self._bad_log.warning(
                "%s: refused a request that does not decode (from %s)", method, context.peer()
            )
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the request is not a valid {method} message")
        return request

    def _stream(self, requests: Iterator[Any], context: grpc.ServicerContext, method: str) -> Iterator[Any]:
        for request in requests:
            yield self._decoded(request, context, method)

    def _wrap(self, h: Any, method: str, client: str | None, secret: str, light: bool) -> Any:
        deser = _safe(h.request_deserializer)
        ser = h.response_serializer
        serving = self._serving
        if not h.request_streaming and not h.response_streaming:
            fn = h.unary_unary

            def unary_unary(request: Any, context: grpc.ServicerContext) -> Any:
                with serving(context, client, secret, light):
                    return fn(self._decoded(request, context, method), context)

            return grpc.unary_unary_rpc_method_handler(unary_unary, deser, ser)
        if not h.request_streaming:
            fn = h.unary_stream

            def unary_stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
                with serving(context, client, secret, light):
                    yield from fn(self._decoded(request, context, method), context)

            return grpc.unary_stream_rpc_method_handler(unary_stream, deser, ser)
        if not h.response_streaming:
            fn = h.stream_unary

            def stream_unary(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
                with serving(context, client, secret, light):
                    return fn(self._stream(requests, context, method), context)

            return grpc.stream_unary_rpc_method_handler(stream_unary, deser, ser)
        fn = h.stream_stream

        def stream_stream(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
            with serving(context, client, secret, light):
                yield from fn(self._stream(requests, context, method), context)

        return grpc.stream_stream_rpc_method_handler(stream_stream, deser, ser)


def _safe(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def decode(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception:
            return _UNDECODABLE

    return decode
