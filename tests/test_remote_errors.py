"""Error -> status code -> exception, end to end through an in-process server with a scripted engine.

Each SpecSplit error the engine raises must reach the client as the same exception type (through
its gRPC status code), and an unexpected one must become INTERNAL while the worker keeps serving.
"""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("grpc")

import grpc  # noqa: E402

from specsplit.core.tree import TokenTree  # noqa: E402
from specsplit.errors import (  # noqa: E402
    CacheDesyncError,
    ConfigError,
    InvalidRequest,
    ResourceExhausted,
    SessionNotFound,
    TransportError,
)
from specsplit.messages import DraftRequest, VerifyRequest, VerifyResult, WorkerInfo, WorkerStats  # noqa: E402
from specsplit.remote import GrpcTransport, serve_draft, serve_target  # noqa: E402
from specsplit.remote.protocol import PROTOCOL_VERSION  # noqa: E402
from specsplit.remote.server import _SessionLocks  # noqa: E402


class ScriptedEngine:
    """Raises whatever ``self.error`` holds, else answers a fixed result."""

    def __init__(self, worker_type: str):
        self.worker_type = worker_type
        self.error: BaseException | None = None
        self.calls = 0

    def verify(self, req: VerifyRequest) -> VerifyResult:
        self.calls += 1
        if self.error is not None:
            raise self.error
        return VerifyResult([], 7, [], len(req.pending_token_ids), 0, 0, WorkerStats(device="cpu"))

    generate = verify  # the draft side is not exercised beyond raising

    def end_session(self, session_id: str) -> bool:
        if self.error is not None:
            raise self.error
        return True

    def info(self) -> WorkerInfo:
        return WorkerInfo(self.worker_type, "scripted", 100, "float32", "cpu", PROTOCOL_VERSION, 0)

    def shutdown(self) -> None:
        pass


@pytest.fixture(scope="module")
def target():
    engine = ScriptedEngine("target")
    server = serve_target(engine)
    yield engine, server
    server.stop(0)


REQ = VerifyRequest("s", TokenTree.empty(), [1, 2], 0)


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (InvalidRequest("bad ids"), InvalidRequest),
        (ConfigError("bad sampling"), InvalidRequest),
        (SessionNotFound("no such session"), SessionNotFound),
        (CacheDesyncError("desync", expected=3, actual=5), CacheDesyncError),
        (ResourceExhausted("too long"), ResourceExhausted),
        (MemoryError(), ResourceExhausted),
        (RuntimeError("boom"), TransportError),
        (KeyError("oops"), TransportError),
    ],
)
def test_engine_errors_map_to_the_same_exception(target, error: BaseException, expected: type) -> None:
    engine, server = target
    engine.error = error
    with GrpcTransport(f"127.0.0.1:{server.port}", timeout_s=10) as client:
        with pytest.raises(expected) as ei:
            client.verify(REQ)
        assert ei.value.__cause__ is None and ei.value.__suppress_context__  # raise ... from None
        if isinstance(error, CacheDesyncError):
            assert (ei.value.expected, ei.value.actual) == (3, 5)
        if expected is TransportError:
            assert "INTERNAL" in str(ei.value)
        engine.error = None
        assert client.verify(REQ).next_token_id == 7  # the worker kept serving
        assert client.info()["target"].worker_type == "target"


def test_end_session_never_raises(target) -> None:
    engine, server = target
    engine.error = RuntimeError("boom")
    try:
        with GrpcTransport(f"127.0.0.1:{server.port}", timeout_s=10) as client:
            client.end_session("s")
    finally:
        engine.error = None


def test_verify_is_not_retried_on_engine_errors(target) -> None:
    engine, server = target
    engine.error, engine.calls = RuntimeError("boom"), 0
    with GrpcTransport(f"127.0.0.1:{server.port}", timeout_s=10) as client:
        with pytest.raises(TransportError):
            client.verify(REQ)
    engine.error = None
    assert engine.calls == 1


def test_draft_internal_error_switches_to_target_only_and_logs_once(target, caplog) -> None:
    engine, server = target
    draft_engine = ScriptedEngine("draft")
    draft_engine.error = RuntimeError("draft broke")
    with serve_draft(draft_engine) as dserver:
        client = GrpcTransport(f"127.0.0.1:{server.port}", f"127.0.0.1:{dserver.port}", timeout_s=10)
        assert client.has_draft
        for _ in range(3):
            with pytest.raises(TransportError, match="INTERNAL"):
                client.draft(DraftRequest("s", [1], 0))
        assert not client.has_draft
        client.close()
    assert (
        sum(
            "decoding target-only" in r.getMessage()
            for r in caplog.records
            if r.name.startswith("specsplit.remote")
        )
        == 1
    )


def test_session_locks_serialise_one_session_and_clean_up() -> None:
    locks = _SessionLocks()
    inside, peak = 0, 0
    guard = threading.Lock()

    def work() -> None:
        nonlocal inside, peak
        with locks.hold("a"):
            with guard:
                inside += 1
                peak = max(peak, inside)
            threading.Event().wait(0.01)
            with guard:
                inside -= 1

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert peak == 1
    assert len(locks) == 0  # no lock left behind per finished session


def test_bad_request_values_fail_before_sending() -> None:
    with GrpcTransport("127.0.0.1:1", timeout_s=1) as client:
        with pytest.raises(InvalidRequest):
            client.verify(VerifyRequest("s", TokenTree.empty(), [2**70], 0))


def test_status_codes_on_the_wire(target) -> None:
    engine, server = target
    engine.error = CacheDesyncError("desync", expected=1, actual=2)
    from specsplit.remote._generated import spec_decoding_pb2 as pb
    from specsplit.remote._generated import spec_decoding_pb2_grpc as pb_grpc

    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        stub = pb_grpc.TargetServiceStub(ch)
        with pytest.raises(grpc.RpcError) as ei:
            stub.VerifyDrafts(pb.VerifyRequest(session_id="s", pending_token_ids=[1],
                                               sampling=pb.SamplingParams(top_p=1.0)), timeout=10)  # fmt: skip
    engine.error = None
    assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert dict(ei.value.trailing_metadata())["specsplit-expected"] == "1"
