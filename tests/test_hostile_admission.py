"""Hostile clients against a worker's gate: bounded calls and queues, fair compute, light calls on
their own threads, idle streams closed, undecodable and oversized requests refused with the right
codes. In-process servers on 127.0.0.1 with scripted engines; every wait is bounded.
"""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

pytest.importorskip("grpc")

import grpc  # noqa: E402

from specsplit.config import TreeConfig  # noqa: E402
from specsplit.core.tree import TokenTree  # noqa: E402
from specsplit.errors import ResourceExhausted  # noqa: E402
from specsplit.messages import DraftRequest, DraftResult, VerifyRequest, VerifyResult, WorkerInfo, WorkerStats
from specsplit.remote import GrpcTransport, convert, serve_draft, serve_target  # noqa: E402
from specsplit.remote import client as client_mod  # noqa: E402
from specsplit.remote._generated import spec_decoding_pb2 as pb  # noqa: E402
from specsplit.remote._generated import spec_decoding_pb2_grpc as pb_grpc  # noqa: E402
from specsplit.remote.admission import RETRY_AFTER_KEY, AdmissionLimits, FairGate  # noqa: E402
from specsplit.remote.clients import ClientTokens  # noqa: E402
from specsplit.remote.protocol import PROTOCOL_VERSION
from specsplit.remote.server import ServerLimits, check_tree_spec  # noqa: E402


class Engine:
    """Answers after ``delay_s``; counts calls and the most running at once."""

    def __init__(self, worker_type: str, delay_s: float = 0.0):
        self.worker_type = worker_type
        self.delay_s = delay_s
        self.running = self.most = 0
        self._lock = threading.Lock()

    def _work(self) -> None:
        with self._lock:
            self.running += 1
            self.most = max(self.most, self.running)
        time.sleep(self.delay_s)
        with self._lock:
            self.running -= 1

    def verify(self, req: VerifyRequest) -> VerifyResult:
        self._work()
        n = len(req.pending_token_ids)
        return VerifyResult([], 7 + n, [], n, 0, 0, WorkerStats(device="cpu"))

    def generate(self, req: DraftRequest) -> DraftResult:
        self._work()
        tree = TokenTree(torch.tensor([5]), torch.tensor([-1]), torch.tensor([1]), torch.tensor([-0.1]))
        return DraftResult(tree, len(req.new_token_ids), WorkerStats(device="cpu"))

    def end_session(self, session_id: str) -> bool:
        return False

    def info(self) -> WorkerInfo:
        return WorkerInfo(self.worker_type, "scripted", 100, "float32", "cpu", PROTOCOL_VERSION, 0)


def verify_msg(session: str = "s", n: int = 1) -> pb.VerifyRequest:
    return convert.verify_request_to_proto(
        VerifyRequest(session, TokenTree.empty(), list(range(1, n + 1)), 0)
    )


def call_in_thread(fn, *args, **kw) -> tuple[threading.Thread, list]:  # noqa: ANN001
    out: list = []

    def run() -> None:
        try:
            out.append(fn(*args, **kw))
        except grpc.RpcError as e:
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_excess_calls_are_refused_at_once_with_a_retry_hint_and_ping_still_answers() -> None:
    engine = Engine("target", delay_s=1.5)
    lim = AdmissionLimits(max_calls=2, max_queued=1, queue_timeout_s=5.0)
    with serve_target(engine, admission=lim) as t, grpc.insecure_channel(t.address) as ch:
        stub = pb_grpc.TargetServiceStub(ch)
        held = [call_in_thread(stub.VerifyDrafts, verify_msg(f"s{i}"), timeout=10) for i in range(3)]
        time.sleep(0.4)  # two run, one waits in the queue
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            stub.VerifyDrafts(verify_msg("late"), timeout=10)
        assert time.monotonic() - t0 < 0.5, "a refusal must not wait"
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert dict(info.value.trailing_metadata())[RETRY_AFTER_KEY].isdigit()
        assert "retry after" in info.value.details()
        t0 = time.monotonic()
        assert stub.Ping(pb.PingRequest(), timeout=5).model_name == "scripted"
        assert time.monotonic() - t0 < 0.5, "Ping must not wait behind busy calls"
        for th, out in held:
            th.join(10)
            assert isinstance(out[0], pb.VerifyResponse)  # the queued call ran once a slot freed
    assert engine.most <= 2


def test_the_client_waits_out_a_busy_refusal_within_its_deadline() -> None:
    engine = Engine("target", delay_s=0.6)
    lim = AdmissionLimits(max_calls=1, max_queued=0)
    with serve_target(engine, admission=lim) as t, grpc.insecure_channel(t.address) as ch:
        th, _ = call_in_thread(pb_grpc.TargetServiceStub(ch).VerifyDrafts, verify_msg("first"), timeout=10)
        time.sleep(0.2)
        with GrpcTransport(t.address, timeout_s=10, streams=False) as client:
            assert client.verify(VerifyRequest("second", TokenTree.empty(), [1, 2], 0)).next_token_id == 9
        th.join(10)


def test_one_named_client_cannot_take_every_call_slot(tmp_path) -> None:
    engine = Engine("target", delay_s=1.5)
    tokens = ClientTokens({"alice": "a" * 16, "bob": "b" * 16})
    lim = AdmissionLimits(max_calls=4, max_queued=2, compute_slots=4)  # per client: 2 calls + 1 queued
    with serve_target(engine, auth_token=tokens, admission=lim) as t, grpc.insecure_channel(t.address) as ch:
        stub = pb_grpc.TargetServiceStub(ch)
        alice = (("authorization", "Bearer " + "a" * 16),)
        bob = (("authorization", "Bearer " + "b" * 16),)
        held = [
            call_in_thread(stub.VerifyDrafts, verify_msg(f"a{i}"), timeout=10, metadata=alice)
            for i in range(3)
        ]
        time.sleep(0.3)
        with pytest.raises(grpc.RpcError) as info:  # alice's fourth: her calls and queue are full
            stub.VerifyDrafts(verify_msg("a4"), timeout=10, metadata=alice)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        t0 = time.monotonic()
        assert stub.VerifyDrafts(verify_msg("b"), timeout=10, metadata=bob).next_token_id == 8
        assert time.monotonic() - t0 < 2.2, "bob's call must run beside alice's, not after them"
        for th, _ in held:
            th.join(10)


def test_fair_gate_gives_a_newcomer_the_next_permit() -> None:
    gate = FairGate(2, fair=True, recent_s=0.2)
    assert gate.acquire("a", 0) and gate.acquire("a", 0)
    got: list[str] = []

    def take(key: str) -> None:
        if gate.acquire(key, 5):
            got.append(key)

    a_waiters = [threading.Thread(target=take, args=("a",)) for _ in range(3)]
    for w in a_waiters:
        w.start()
    time.sleep(0.1)
    b = threading.Thread(target=take, args=("b",))
    b.start()
    time.sleep(0.1)
    gate.release("a")  # "a" still holds its even share (1 of 2): the free permit goes to "b"
    b.join(5)
    time.sleep(0.1)
    assert got == ["b"]
    gate.release("b")
    gate.release("a")
    time.sleep(0.05)
    assert got.count("a") == 1  # "b" was served a moment ago: "a" keeps to its share a while
    time.sleep(0.5)
    assert got.count("a") == 2  # "b" is gone: "a" gets both permits
    gate.release("a")
    for w in a_waiters:
        w.join(5)
    assert got.count("a") == 3


def test_fair_gate_serves_waiting_keys_in_turn() -> None:
    gate = FairGate(1, fair=True)
    assert gate.acquire("a", 0)
    got: list[str] = []

    def take(key: str) -> None:
        assert gate.acquire(key, 5)
        got.append(key)
        gate.release(key)

    threads = [threading.Thread(target=take, args=("a",)) for _ in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.1)
    threads.append(threading.Thread(target=take, args=("b",)))
    threads[-1].start()
    time.sleep(0.1)
    gate.release("a")
    for t in threads:
        t.join(5)
    assert got[0] == "b"  # however many calls "a" has waiting


def test_compute_is_shared_between_clients() -> None:
    """Many calls of one client run at most its share of the compute slots while another client waits."""
    engine = Engine("target", delay_s=0.3)
    tokens = ClientTokens({"alice": "a" * 16, "bob": "b" * 16})
    lim = AdmissionLimits(max_calls=8, max_queued=8, compute_slots=2)
    with serve_target(engine, auth_token=tokens, admission=lim) as t, grpc.insecure_channel(t.address) as ch:
        stub = pb_grpc.TargetServiceStub(ch)
        alice = (("authorization", "Bearer " + "a" * 16),)
        bob = (("authorization", "Bearer " + "b" * 16),)
        held = [
            call_in_thread(stub.VerifyDrafts, verify_msg(f"a{i}"), timeout=20, metadata=alice)
            for i in range(4)
        ]
        time.sleep(0.1)
        t0 = time.monotonic()
        stub.VerifyDrafts(verify_msg("b"), timeout=20, metadata=bob)
        # bob waits at most for one of alice's calls (0.3 s), not for all four (0.6 s with 2 slots)
        assert time.monotonic() - t0 < 0.75
        for th, _ in held:
            th.join(10)
    assert engine.most <= 2


def test_idle_request_streams_are_closed_and_the_client_carries_on(monkeypatch) -> None:
    monkeypatch.setattr(client_mod, "_STREAM_IDLE_S", 60.0)  # the server closes it first
    lim = AdmissionLimits(stream_idle_s=0.5)
    with serve_target(Engine("target"), admission=lim) as t:
        with GrpcTransport(t.address, timeout_s=10) as client:
            assert client.verify(VerifyRequest("s", TokenTree.empty(), [1], 0)).next_token_id == 8
            assert client._verify_stream.call is not None
            time.sleep(2.0)  # the worker cancels the idle stream
            assert client.verify(VerifyRequest("s", TokenTree.empty(), [1, 2], 0)).next_token_id == 9
        assert t.admission is not None and t.admission.streams.closed >= 1


def test_undecodable_requests_are_invalid_argument_and_logged_once(caplog) -> None:
    with serve_draft(Engine("draft")) as d, grpc.insecure_channel(d.address) as ch:
        raw = ch.unary_unary("/specsplit.v1.DraftService/GenerateDrafts")
        with caplog.at_level(logging.WARNING):
            for i in range(50):
                with pytest.raises(grpc.RpcError) as info:
                    raw(b"\xff\xff\xff\xff" + bytes([i]), timeout=5)
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        stub = pb_grpc.DraftServiceStub(ch)  # and the worker still answers a valid request
        ok = stub.GenerateDrafts(
            convert.draft_request_to_proto(DraftRequest("s", [1, 2], 0, tree=TreeConfig())), timeout=5
        )
        assert list(ok.tree.token_ids) == [5]
    bad = [r for r in caplog.records if "does not decode" in r.getMessage()]
    assert 1 <= len(bad) <= 2 and not any(r.exc_info for r in caplog.records)


def test_long_session_ids_are_invalid_argument_and_never_echoed() -> None:
    with serve_target(Engine("target")) as t, grpc.insecure_channel(t.address) as ch:
        stub = pb_grpc.TargetServiceStub(ch)
        for method, msg in (
            (stub.VerifyDrafts, verify_msg("x" * 20000)),
            (stub.EndSession, pb.EndSessionRequest(session_id="y" * 20000)),
        ):
            with pytest.raises(grpc.RpcError) as info:
                method(msg, timeout=5)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert len(info.value.details()) < 200 and "xxxx" not in info.value.details()


def test_a_chain_tree_spec_needs_no_dynamic_fields() -> None:
    spec = pb.TreeSpec(shape=pb.TREE_SHAPE_CHAIN, num_draft_tokens=3)
    assert convert.tree_config_from_proto(spec) == TreeConfig(shape="chain", num_draft_tokens=3)
    with serve_draft(Engine("draft")) as d, grpc.insecure_channel(d.address) as ch:
        sampling = pb.SamplingParams(temperature=1.0, top_p=1.0)
        req = pb.DraftRequest(session_id="s", new_token_ids=[1, 2], tree=spec, sampling=sampling)
        assert list(pb_grpc.DraftServiceStub(ch).GenerateDrafts(req, timeout=5).tree.token_ids) == [5]


@pytest.mark.parametrize(
    ("spec", "ok"),
    [
        (pb.TreeSpec(shape=pb.TREE_SHAPE_DYNAMIC), True),  # the defaults
        (pb.TreeSpec(shape=pb.TREE_SHAPE_DYNAMIC, topk=8, width=8, budget=64, max_depth=8), True),
        (pb.TreeSpec(shape=pb.TREE_SHAPE_DYNAMIC, topk=256, width=256, budget=256, max_depth=64), False),
        (pb.TreeSpec(shape=pb.TREE_SHAPE_DYNAMIC, topk=64, width=64, budget=256, max_depth=16), False),
        (pb.TreeSpec(shape=pb.TREE_SHAPE_CHAIN, num_draft_tokens=64), True),
    ],
)
def test_tree_limits_bound_the_work_not_just_the_nodes(spec: pb.TreeSpec, ok: bool) -> None:
    if ok:
        check_tree_spec(spec, ServerLimits())
    else:
        with pytest.raises(ResourceExhausted, match="costs"):
            check_tree_spec(spec, ServerLimits())


def test_compute_slots_default_by_device() -> None:
    """One compute slot on a CPU worker (a call already uses every core), two on a GPU; an explicit
    value is kept."""
    assert AdmissionLimits().resolved(0, "cpu").compute_slots == 1
    assert AdmissionLimits().resolved(2, "cuda:0").compute_slots == 2
    assert AdmissionLimits(compute_slots=3).resolved(0, "cpu").compute_slots == 3
    with pytest.raises(ValueError):
        AdmissionLimits(compute_slots=0)


def test_a_graph_captured_once_the_worker_serves_is_a_warning(caplog, monkeypatch) -> None:
    """A capture holds the capture lock and stalls the process's other GPU work: at start-up it is
    logged at INFO with its time; once a worker serves calls, as a WARNING naming what was captured
    (the sign that a shape was not captured at start)."""
    import threading

    from specsplit.core import pinned

    monkeypatch.setattr(pinned, "_SERVING", threading.Event())
    with caplog.at_level(logging.INFO, logger="specsplit.core.pinned"):
        with pinned.capture_section("prefill (1 rows x 16 tokens)"):
            pass
        with serve_draft(Engine("draft")):
            with pinned.capture_section("round (4 rows x 8 nodes)"):
                assert pinned.CAPTURE_LOCK._is_owned()  # type: ignore[attr-defined]
    got = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "specsplit.core.pinned"]
    assert [lvl for lvl, _ in got] == [logging.INFO, logging.WARNING]
    assert "prefill (1 rows x 16 tokens)" in got[0][1] and "while serving" not in got[0][1]
    assert "while serving (round (4 rows x 8 nodes))" in got[1][1]
