"""Long-lived streams for the per-round calls (GenerateDraftsStream / VerifyDraftsStream).

In-process servers with scripted engines: the calls must really go over one stream, give the unary
call's results and errors, fall back to unary calls where a worker refuses or lacks streams, honour
the per-call deadline, and free the worker's thread when idle. End-to-end equality with real models
over streams is covered by the e2e and target-loop tests (streams are on by default); the unary A/B
is at the end.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

pytest.importorskip("grpc")

import grpc  # noqa: E402

from specsplit.core.tree import TokenTree  # noqa: E402
from specsplit.errors import (  # noqa: E402
    CacheDesyncError,
    InvalidRequest,
    ResourceExhausted,
    SessionNotFound,
    TransportError,
)
from specsplit.messages import DraftRequest, DraftResult, VerifyRequest, VerifyResult, WorkerInfo, WorkerStats
from specsplit.remote import GrpcTransport, serve_draft, serve_target  # noqa: E402
from specsplit.remote import client as client_mod
from specsplit.remote import server as server_mod  # noqa: E402
from specsplit.remote._generated import spec_decoding_pb2_grpc as pb_grpc  # noqa: E402
from specsplit.remote.protocol import PROTOCOL_VERSION  # noqa: E402


class Engine:
    """Answers at once (or after ``delay_s``), or raises ``error``; counts calls."""

    def __init__(self, worker_type: str):
        self.worker_type = worker_type
        self.error: BaseException | None = None
        self.delay_s = 0.0
        self.calls = 0

    def verify(self, req: VerifyRequest) -> VerifyResult:
        self.calls += 1
        if self.delay_s:
            time.sleep(self.delay_s)
        if self.error is not None:
            raise self.error
        n = len(req.pending_token_ids)
        return VerifyResult([], 7 + n, [], n, 0, 0, WorkerStats(device="cpu"))

    def generate(self, req: DraftRequest) -> DraftResult:
        self.calls += 1
        if self.error is not None:
            raise self.error
        ids = torch.tensor([len(req.new_token_ids), 5])
        tree = TokenTree(ids, torch.tensor([-1, 0]), torch.tensor([1, 2]), torch.tensor([-0.1, -0.2]))
        return DraftResult(tree, len(req.new_token_ids), WorkerStats(device="cpu"))

    def end_session(self, session_id: str) -> bool:
        return True

    def info(self) -> WorkerInfo:
        return WorkerInfo(self.worker_type, "scripted", 100, "float32", "cpu", PROTOCOL_VERSION, 0)

    def shutdown(self) -> None:
        pass


class MethodLog(grpc.ServerInterceptor):
    """Records the method of every RPC the server starts (one entry per stream, not per message)."""

    def __init__(self) -> None:
        self.methods: list[str] = []

    def intercept_service(self, continuation, details):  # noqa: ANN001, ANN201
        self.methods.append(details.method.rsplit("/", 1)[1])
        return continuation(details)


@pytest.fixture
def logged(monkeypatch):
    """Every server started in the test records its RPCs in the returned log."""
    log = MethodLog()
    real = grpc.server

    def server(pool, *args, interceptors=None, **kw):  # noqa: ANN001, ANN202
        return real(pool, *args, interceptors=[log, *(interceptors or [])], **kw)

    monkeypatch.setattr(server_mod.grpc, "server", server)
    return log


def verify_req(n: int) -> VerifyRequest:
    return VerifyRequest("s", TokenTree.empty(), list(range(1, n + 1)), 0)


def test_calls_share_one_stream_and_match_unary(logged) -> None:
    engine = Engine("target")
    d_engine = Engine("draft")
    with serve_target(engine) as t, serve_draft(d_engine) as d:
        addrs = (f"127.0.0.1:{t.port}", f"127.0.0.1:{d.port}")
        with (
            GrpcTransport(*addrs, timeout_s=10) as streamed,
            GrpcTransport(*addrs, timeout_s=10, streams=False) as unary,
        ):
            for n in range(1, 6):
                a, b = streamed.verify(verify_req(n)), unary.verify(verify_req(n))
                assert a.next_token_id == b.next_token_id == 7 + n
                da, db = (
                    streamed.draft(DraftRequest("s", [1] * n, 0)),
                    unary.draft(DraftRequest("s", [1] * n, 0)),
                )
                assert da.tree.token_ids.tolist() == db.tree.token_ids.tolist() == [n, 5]
    assert (
        logged.methods.count("VerifyDraftsStream") == 1 and logged.methods.count("GenerateDraftsStream") == 1
    )
    assert logged.methods.count("VerifyDrafts") == 5 and logged.methods.count("GenerateDrafts") == 5
    assert engine.calls == d_engine.calls == 10


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (InvalidRequest("bad ids"), InvalidRequest),
        (SessionNotFound("no such session"), SessionNotFound),
        (CacheDesyncError("desync", expected=3, actual=5), CacheDesyncError),
        (ResourceExhausted("too long"), ResourceExhausted),
        (RuntimeError("boom"), TransportError),
    ],
)
def test_errors_end_the_stream_and_the_next_call_opens_a_new_one(logged, error, expected) -> None:
    engine = Engine("target")
    with serve_target(engine) as t, GrpcTransport(f"127.0.0.1:{t.port}", timeout_s=10) as client:
        assert client.verify(verify_req(1)).next_token_id == 8
        engine.error = error
        with pytest.raises(expected) as ei:
            client.verify(verify_req(1))
        assert ei.value.__cause__ is None and ei.value.__suppress_context__
        if isinstance(error, CacheDesyncError):
            assert (ei.value.expected, ei.value.actual) == (3, 5)
        engine.error = None
        assert client.verify(verify_req(2)).next_token_id == 9  # the worker kept serving
    assert engine.calls == 3  # the failed request was not retried as a unary call
    assert logged.methods == ["VerifyDraftsStream", "VerifyDraftsStream"]


def test_a_worker_at_its_stream_limit_gets_unary_calls(logged) -> None:
    engine = Engine("target")
    with serve_target(engine, max_workers=2) as t:  # at most one stream
        addr = f"127.0.0.1:{t.port}"
        with GrpcTransport(addr, timeout_s=10) as first, GrpcTransport(addr, timeout_s=10) as second:
            assert first.verify(verify_req(1)).next_token_id == 8  # holds the worker's one stream
            for n in (1, 2):
                assert second.verify(verify_req(n)).next_token_id == 7 + n
            assert second._verify_stream.retry_at > time.monotonic() + 20  # no new stream for a while
            assert first.verify(verify_req(3)).next_token_id == 10
    # the refused stream carried no request: the refusal and two unary calls, nothing twice
    assert logged.methods == ["VerifyDraftsStream", "VerifyDraftsStream", "VerifyDrafts", "VerifyDrafts"]
    assert engine.calls == 4


class OldTargetServicer(server_mod.TargetServicer):
    """A worker of a version without streams: the generated base answers UNIMPLEMENTED."""

    VerifyDraftsStream = pb_grpc.TargetServiceServicer.VerifyDraftsStream


def test_an_older_worker_without_streams_gets_unary_calls(logged) -> None:
    engine = Engine("target")
    server = grpc.server(ThreadPoolExecutor(4))
    pb_grpc.add_TargetServiceServicer_to_server(OldTargetServicer(engine), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with GrpcTransport(f"127.0.0.1:{port}", timeout_s=10) as client:
            for n in (1, 2, 3):
                assert client.verify(verify_req(n)).next_token_id == 7 + n
            assert client._verify_stream.retry_at == math.inf
    finally:
        server.stop(0)
    assert logged.methods == ["VerifyDraftsStream", "VerifyDrafts", "VerifyDrafts", "VerifyDrafts"]
    assert engine.calls == 3


def test_a_late_reply_fails_the_call_within_its_deadline_and_the_stream_recovers() -> None:
    engine = Engine("target")
    with serve_target(engine) as t, GrpcTransport(f"127.0.0.1:{t.port}", timeout_s=1.0) as client:
        assert client.verify(verify_req(1)).next_token_id == 8
        engine.delay_s = 3.0
        t0 = time.monotonic()
        with pytest.raises(TransportError, match="DEADLINE_EXCEEDED"):
            client.verify(verify_req(1))
        assert time.monotonic() - t0 < 2.5  # timeout_s plus the watchdog's period
        engine.delay_s = 0.0
        time.sleep(2.5)  # the slow call finishes on the worker
        assert client.verify(verify_req(4)).next_token_id == 11


def gets_a_stream_soon(addr: str, n: int, within_s: float = 5.0) -> bool:
    """A new client's calls (right answers every time) get a stream within ``within_s``: the worker
    has a free stream slot (it learns of a closed stream asynchronously)."""
    deadline = time.monotonic() + within_s
    with GrpcTransport(addr, timeout_s=10) as c:
        while True:
            assert c.verify(verify_req(n)).next_token_id == 7 + n
            if c._verify_stream.call is not None:
                return True
            if time.monotonic() > deadline:
                return False
            c._verify_stream.retry_at = 0.0  # ask again at once instead of in 30 s
            time.sleep(0.1)


def test_idle_streams_are_closed_and_free_the_worker_thread(monkeypatch) -> None:
    monkeypatch.setattr(client_mod, "_STREAM_IDLE_S", 0.3)
    with serve_target(Engine("target"), max_workers=2) as t:  # one stream slot
        addr = f"127.0.0.1:{t.port}"
        with GrpcTransport(addr, timeout_s=10) as first:
            assert first.verify(verify_req(1)).next_token_id == 8
            assert first._verify_stream.call is not None
            deadline = time.monotonic() + 5
            while first._verify_stream.call is not None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert first._verify_stream.call is None, "the idle stream was not closed"
            assert gets_a_stream_soon(addr, 2)  # first is still open, but its stream is gone


def test_closed_transports_leave_no_stream_behind() -> None:
    engine = Engine("target")
    with serve_target(engine, max_workers=2) as t:  # one stream slot
        addr = f"127.0.0.1:{t.port}"
        for _ in range(10):
            with GrpcTransport(addr, timeout_s=10) as c:
                assert c.verify(verify_req(1)).next_token_id == 8
        assert gets_a_stream_soon(addr, 3)
    assert engine.calls >= 11


def test_concurrent_calls_on_one_transport_all_get_their_own_reply() -> None:
    engine = Engine("target")
    engine.delay_s = 0.01
    with serve_target(engine) as t, GrpcTransport(f"127.0.0.1:{t.port}", timeout_s=10) as client:
        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda n: client.verify(verify_req(n)).next_token_id, range(1, 41)))
    assert got == [7 + n for n in range(1, 41)]
    assert engine.calls == 40


def test_draft_stream_failure_switches_to_target_only(monkeypatch) -> None:
    d_engine = Engine("draft")
    with serve_target(Engine("target")) as t, serve_draft(d_engine) as d:
        client = GrpcTransport(f"127.0.0.1:{t.port}", f"127.0.0.1:{d.port}", timeout_s=10)
        assert client.draft(DraftRequest("s", [1], 0)).tree.token_ids.tolist() == [1, 5]
        d_engine.error = RuntimeError("draft broke")
        with pytest.raises(TransportError, match="INTERNAL"):
            client.draft(DraftRequest("s", [1], 0))
        assert not client.has_draft
        client.close()


def test_a_closed_transport_raises_and_stops_its_watchdog() -> None:
    with serve_target(Engine("target")) as t:
        client = GrpcTransport(f"127.0.0.1:{t.port}", timeout_s=10)
        client.verify(verify_req(1))
        watchdog = client._watchdog
        client.close()
        with pytest.raises(TransportError, match="closed"):
            client.verify(verify_req(1))
        watchdog.join(timeout=2)
        assert not watchdog.is_alive()


def test_streams_need_the_token_too() -> None:
    with serve_target(Engine("target"), auth_token="s3cret") as t:
        addr = f"127.0.0.1:{t.port}"
        with GrpcTransport(addr, timeout_s=10, auth_token="wrong") as bad:
            with pytest.raises(TransportError, match="UNAUTHENTICATED"):
                bad.verify(verify_req(1))
        with GrpcTransport(addr, timeout_s=10, auth_token="s3cret") as good:
            assert good.verify(verify_req(1)).next_token_id == 8
            assert good._verify_stream.call is not None
