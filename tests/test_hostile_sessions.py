"""Hostile clients against sessions: ownership, memory budgets and session counts.

A session belongs to the client (token and transport secret) that created it; capacity hints
cannot make a worker preallocate; a worker refuses sessions past its KV budget or its session
bound instead of evicting the running ones. In-process workers on tiny engines, loopback only.
"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("grpc")

import grpc  # noqa: E402
from remote_support import tiny_pair  # noqa: E402

from specsplit import DraftEngine, TargetEngine  # noqa: E402
from specsplit.config import DraftConfig, TargetConfig, TreeConfig  # noqa: E402
from specsplit.core.tree import TokenTree  # noqa: E402
from specsplit.engines.base import HINT_AHEAD  # noqa: E402
from specsplit.engines.sessions import KVBudget, SessionStore  # noqa: E402
from specsplit.errors import ConfigError, ResourceExhausted, SessionNotFound  # noqa: E402
from specsplit.messages import DraftRequest, VerifyRequest  # noqa: E402
from specsplit.remote import GrpcTransport, convert, serve_draft, serve_target  # noqa: E402
from specsplit.remote._generated import spec_decoding_pb2 as pb  # noqa: E402
from specsplit.remote._generated import spec_decoding_pb2_grpc as pb_grpc  # noqa: E402
from specsplit.remote.clients import ClientTokens  # noqa: E402
from specsplit.remote.server import ServerLimits  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

ALICE, BOB = "alice-token-0123456789", "bob-token-9876543210"


@pytest.fixture(scope="module")
def models():
    return tiny_pair()


def start(req_id: str, prompt: list[int], hint: int = 0) -> VerifyRequest:
    return VerifyRequest(req_id, TokenTree.empty(), prompt, 0, capacity_hint=hint)


def step(req_id: str, prefix: int, token: int) -> VerifyRequest:
    return VerifyRequest(req_id, TokenTree.empty(), [token], prefix)


def test_another_client_cannot_read_advance_or_end_a_session(models) -> None:
    target = TargetEngine(models[0])
    tokens = ClientTokens({"alice": ALICE, "bob": BOB})
    with serve_target(target, auth_token=tokens) as t:
        alice = GrpcTransport(t.address, timeout_s=10, auth_token=ALICE)
        bob = GrpcTransport(t.address, timeout_s=10, auth_token=BOB)
        alice2 = GrpcTransport(t.address, timeout_s=10, auth_token=ALICE)  # same token, another process
        first = alice.verify(start("chat", [5, 6, 7]))
        for other in (bob, alice2):
            with pytest.raises(SessionNotFound) as info:  # cannot advance it: no such session for them
                other.verify(step("chat", first.prefix_length, first.next_token_id))
            assert "3" not in str(info.value).replace("chat", "")  # nothing about its length
            with pytest.raises(SessionNotFound):  # a wrong length gets NOT_FOUND, not the real length
                other.verify(step("chat", 1, 9))
            other.end_session("chat")  # cannot end it
        # alice's session is untouched and goes on where it was
        again = alice.verify(step("chat", first.prefix_length, first.next_token_id))
        assert again.prefix_length == first.prefix_length + 1 and again.cache_hit
        # bob starting "chat" makes his own session; alice's stays hers
        bob.verify(start("chat", [9, 9]))
        assert alice.verify(step("chat", again.prefix_length, again.next_token_id)).cache_hit
        for c in (alice, bob, alice2):
            c.end_session("chat")
            c.close()
    assert target.active_sessions == 0
    target.shutdown()


def test_the_desync_trailer_reaches_only_the_owner(models) -> None:
    target = TargetEngine(models[0])
    with serve_target(target, auth_token=ALICE) as t, grpc.insecure_channel(t.address) as ch:
        stub = pb_grpc.TargetServiceStub(ch)
        mine = (("authorization", f"Bearer {ALICE}"), ("specsplit-client-secret", "mine"))
        theirs = (("authorization", f"Bearer {ALICE}"), ("specsplit-client-secret", "theirs"))
        stub.VerifyDrafts(convert.verify_request_to_proto(start("s", [5, 6, 7])), metadata=mine, timeout=10)
        bad = convert.verify_request_to_proto(step("s", 2, 9))
        with pytest.raises(grpc.RpcError) as own:
            stub.VerifyDrafts(bad, metadata=mine, timeout=10)
        assert own.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert dict(own.value.trailing_metadata())["specsplit-actual"] == "3"
        assert "#" not in own.value.details()  # the caller's own id, not the worker's key
        with pytest.raises(grpc.RpcError) as other:
            stub.VerifyDrafts(bad, metadata=theirs, timeout=10)
        assert other.value.code() == grpc.StatusCode.NOT_FOUND
        assert "specsplit-actual" not in dict(other.value.trailing_metadata() or ())
    target.shutdown()


def test_token_files_name_clients(tmp_path) -> None:
    single = tmp_path / "single"
    single.write_text("  plain-token\n")
    assert ClientTokens.from_file(single).identify("Bearer plain-token") == "default"
    named = tmp_path / "named"
    named.write_text("# clients\nalice:tok-a\n\nbob:tok-b\n")
    tokens = ClientTokens.from_file(named)
    assert (tokens.identify("Bearer tok-a"), tokens.identify("Bearer tok-b")) == ("alice", "bob")
    assert tokens.identify("Bearer tok-c") is None and tokens.identify("") is None
    for text in ("alice:a\nbob\n", "alice:a\nalice:b\n", "\n# only a comment\n"):
        (tmp_path / "bad").write_text(text)
        with pytest.raises(ConfigError):
            ClientTokens.from_file(tmp_path / "bad")


def test_capacity_hints_do_not_preallocate(models) -> None:
    target = TargetEngine(models[0])
    draft = DraftEngine(models[1])
    target.verify(start("t", [5, 6, 7], hint=10**9))
    draft.generate(DraftRequest("d", [5, 6, 7], 0, tree=TreeConfig(), capacity_hint=10**9))
    assert target._store.get("t").cache.capacity <= 3 + 8 + HINT_AHEAD
    assert draft._store.get("d").kv_cache.capacity <= 3 + 8 + 64 + HINT_AHEAD
    target.shutdown()
    draft.shutdown()


def test_a_worker_refuses_sessions_past_its_kv_budget_and_keeps_the_running_ones(models) -> None:
    target = TargetEngine(models[0], TargetConfig(max_sessions=1000))
    per_token = target.kv_bytes_per_token
    hinted = -(-(3 + 8 + HINT_AHEAD) // 256) * 256  # what a session with a huge hint may allocate
    limits = ServerLimits(kv_budget_bytes=per_token * (256 + 3 * hinted))  # the running one + 3
    with serve_target(target, limits=limits) as t, GrpcTransport(t.address, timeout_s=10) as client:
        running = client.verify(start("running", [5, 6, 7]))
        refused = 0
        for i in range(30):
            try:
                client.verify(start(f"s{i}", [5, 6, 7], hint=10**9))
            except ResourceExhausted as e:
                assert "budget" in str(e)
                refused += 1
        assert refused == 30 - 3
        assert target.kv_budget is not None and target.kv_budget.used_bytes <= limits.kv_budget_bytes
        # the running session was not evicted
        assert client.verify(step("running", running.prefix_length, running.next_token_id)).cache_hit
        for i in range(30):
            client.end_session(f"s{i}")
        client.end_session("running")
        assert target.kv_budget.used_bytes == 0
    target.shutdown()


def test_a_full_worker_refuses_new_sessions_instead_of_evicting_active_ones(models) -> None:
    draft = DraftEngine(models[1], DraftConfig(max_sessions=4))
    with (
        serve_draft(draft, limits=ServerLimits(evict_idle_s=60.0)) as d,
        GrpcTransport(None, d.address, timeout_s=10) as client,
    ):
        for i in range(4):
            client.draft(DraftRequest(f"s{i}", [5, 6, 7], 0, tree=TreeConfig()))
        with pytest.raises(ResourceExhausted, match="in use"):
            client.draft(DraftRequest("one-more", [5, 6, 7], 0, tree=TreeConfig()))
        assert draft.active_sessions == 4
    draft.shutdown()


@pytest.mark.parametrize("max_batch", [0, 8], ids=["sessions", "batched-sessions"])
def test_a_named_client_has_a_session_cap(models, max_batch) -> None:
    """Also for sessions a batching worker verifies in shared forwards (``max_batch``)."""
    target = TargetEngine(models[0], TargetConfig(max_sessions=8))
    tokens = ClientTokens({"alice": ALICE, "bob": BOB})  # two clients: 4 sessions each by default
    with serve_target(target, auth_token=tokens, max_batch=max_batch, batch_capacity=128) as t:
        with (
            GrpcTransport(t.address, timeout_s=10, auth_token=ALICE) as alice,
            GrpcTransport(t.address, timeout_s=10, auth_token=BOB) as bob,
        ):
            for i in range(4):
                alice.verify(start(f"a{i}", [5, 6]))
            with pytest.raises(ResourceExhausted, match="sessions"):
                alice.verify(start("a4", [5, 6]))
            bob.verify(start("b0", [5, 6]))  # bob still gets his
            alice.end_session("a0")
            alice.verify(start("a4", [5, 6]))  # and alice again once she ended one
            if max_batch:
                assert (
                    t.sessions is not None and t.sessions.live_sessions == 5 and target.active_sessions == 0
                )
    target.shutdown()


def test_session_store_evicts_only_idle_sessions() -> None:
    store: SessionStore[int] = SessionStore(2, ttl_s=600, evict_idle_s=0.2)
    store.get_or_create("a", lambda: 1)
    store.get_or_create("b", lambda: 2)
    with pytest.raises(ResourceExhausted):
        store.get_or_create("c", lambda: 3)
    time.sleep(0.25)
    store.get_or_create("c", lambda: 3)  # "a" was idle long enough
    assert store.ids() == ["b", "c"]


def test_kv_budget_reserves_and_releases() -> None:
    budget = KVBudget(1000, bytes_per_token=10)
    budget.reserve("a", 60)
    budget.reserve("a", 40)  # never shrinks
    with pytest.raises(ResourceExhausted):
        budget.reserve("b", 50)
    budget.reserve("b", 40)
    assert budget.used_bytes == 1000
    budget.release("a")
    assert budget.used_bytes == 400 and budget.reserved("a") == 0


def test_ping_is_answered_for_a_worker_with_named_clients(models) -> None:
    target = TargetEngine(models[0])
    with (
        serve_target(target, auth_token=ClientTokens({"alice": ALICE})) as t,
        grpc.insecure_channel(t.address) as ch,
    ):
        stub = pb_grpc.TargetServiceStub(ch)
        with pytest.raises(grpc.RpcError) as info:
            stub.Ping(pb.PingRequest(), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert stub.Ping(
            pb.PingRequest(), timeout=5, metadata=(("authorization", f"Bearer {ALICE}"),)
        ).vocab_size
    target.shutdown()
