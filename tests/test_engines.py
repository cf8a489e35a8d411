"""Engine behaviour: one target forward per round, desync, sessions (end/LRU/TTL), typed errors."""

from __future__ import annotations

import time

import pytest
import torch

from specsplit import (
    CacheDesyncError,
    DraftEngine,
    DraftRequest,
    InvalidRequest,
    LocalTransport,
    ResourceExhausted,
    SessionNotFound,
    SpecSplitConfig,
    SpecSplitGenerator,
    TargetEngine,
    TokenTree,
    TreeConfig,
    VerifyRequest,
)
from specsplit.config import DraftConfig, TargetConfig
from specsplit.pipeline import DecodeParams, decode

PROMPT = [5, 17, 33, 81, 9]


@pytest.mark.parametrize("shape", ["chain", "static", "dynamic"])
def test_exactly_one_target_forward_per_round(llama_target, llama_draft_random, shape):
    gen = SpecSplitGenerator(
        llama_target, llama_draft_random, config=SpecSplitConfig(tree=TreeConfig(shape=shape))
    )
    before = gen.target_engine.forward_count
    res = gen.generate(torch.tensor([PROMPT]), max_new_tokens=20, return_dict_in_generate=True)
    assert gen.target_engine.forward_count - before == len(res.spec_stats.rounds)
    gen.close()


def _engines(target, draft=None, **tcfg):
    return TargetEngine(target, TargetConfig(**tcfg)), DraftEngine(draft or target)


def test_verify_desync_raises_and_changes_nothing(llama_target):
    te, _ = _engines(llama_target)
    r = te.verify(VerifyRequest("s", TokenTree.empty(), PROMPT, 0))
    assert r.prefix_length == len(PROMPT)
    with pytest.raises(CacheDesyncError) as ei:
        te.verify(VerifyRequest("s", TokenTree.empty(), [r.next_token_id], 3))
    assert ei.value.expected == 3 and ei.value.actual == len(PROMPT)
    r2 = te.verify(VerifyRequest("s", TokenTree.empty(), [r.next_token_id], len(PROMPT)))
    ref = llama_target.generate(torch.tensor([PROMPT]), max_new_tokens=2, do_sample=False)[0, -2:].tolist()
    assert [r.next_token_id, r2.next_token_id] == ref
    te.shutdown()


def test_unknown_session_is_not_found(llama_target):
    te, de = _engines(llama_target)
    with pytest.raises(SessionNotFound):
        te.verify(VerifyRequest("nope", TokenTree.empty(), [5], 7))
    with pytest.raises(SessionNotFound):
        de.generate(DraftRequest("nope", [5], 7))
    assert te.active_sessions == 0 and de.active_sessions == 0


def test_draft_desync_and_prefix_reuse(llama_target):
    _, de = _engines(llama_target)
    r = de.generate(DraftRequest("s", PROMPT, 0))
    assert r.prefix_length == len(PROMPT) and not r.cache_hit
    with pytest.raises(CacheDesyncError):
        de.generate(DraftRequest("s", [7], 2))
    # full context resent: the matching prefix is reused, only the new tail is computed
    r2 = de.generate(DraftRequest("s", PROMPT + [7, 8], 0))
    assert r2.cache_hit and r2.stats.tokens_processed == 2 + r2.tree.num_nodes - 1
    assert r2.prefix_length == len(PROMPT) + 2


class _FlakyTransport(LocalTransport):
    """Drops the target session once, mid-generation (like a restarted or evicting worker)."""

    def __init__(self, *a, drop_at: int = 3):
        super().__init__(*a)
        self.calls, self.drop_at = 0, drop_at

    def verify(self, request):
        self.calls += 1
        if self.calls == self.drop_at:
            self.target_engine.end_session(request.session_id)
        if self.calls == self.drop_at + 2:
            self.draft_engine.end_session(request.session_id)
        return super().verify(request)


def test_lost_sessions_are_recovered_with_unchanged_output(llama_target, llama_draft_random):
    ref = llama_target.generate(torch.tensor([PROMPT]), max_new_tokens=30, do_sample=False)[0, len(PROMPT) :]
    t = _FlakyTransport(DraftEngine(llama_draft_random), TargetEngine(llama_target))
    out, stats = decode(t, PROMPT, DecodeParams(max_new_tokens=30, tree=TreeConfig(shape="static")))
    assert out == ref.tolist()
    assert stats.recoveries == 2
    assert t.target_engine.active_sessions == 0 and t.draft_engine.active_sessions == 0


def test_sessions_end_lru_and_ttl(llama_target):
    # A TTL long enough that a loaded CI machine cannot expire sessions during the LRU checks.
    te = TargetEngine(llama_target, TargetConfig(max_sessions=2, session_ttl_s=3.0))
    for sid in ("a", "b", "c"):
        te.verify(VerifyRequest(sid, TokenTree.empty(), PROMPT, 0))
    assert te.active_sessions == 2 and not te.has_session("a")  # LRU evicted
    assert te.has_usable_session("c")
    assert te.end_session("c") and not te.end_session("c")
    deadline = time.monotonic() + 15
    while te.active_sessions and time.monotonic() < deadline:  # background purger
        time.sleep(0.05)
    assert te.active_sessions == 0
    te.verify(VerifyRequest("d", TokenTree.empty(), PROMPT, 0))
    assert te.purge_stale_sessions(ttl_seconds=0.0) == 1
    te.shutdown()


def test_ending_a_session_waits_for_its_running_request():
    """A session ended (or evicted, or expired) while one of its requests runs hands its state on only
    after that request: the hook lends engine resources (the graph workspace) to the next session. A
    request that was waiting for the session's lock when it ended gets SessionNotFound."""
    import threading

    from specsplit.engines.sessions import SessionStore

    handed: list[tuple[str, float]] = []
    store: SessionStore[str] = SessionStore(4, 60.0, lambda sid, st: handed.append((sid, time.monotonic())))
    store.get_or_create("a", lambda: "state-a")
    inside, release, waiting_done = threading.Event(), threading.Event(), threading.Event()
    finished: list[float] = []
    errors: list[BaseException] = []

    def running() -> None:
        with store.locked("a"):
            inside.set()
            release.wait(5.0)
            finished.append(time.monotonic())

    def waiting() -> None:
        try:
            with store.locked("a"):
                pass
        except SessionNotFound as e:
            errors.append(e)
        waiting_done.set()

    t1 = threading.Thread(target=running)
    t1.start()
    assert inside.wait(5.0)
    t2 = threading.Thread(target=waiting)
    t2.start()
    ender = threading.Thread(target=lambda: store.pop("a"))
    ender.start()
    deadline = time.monotonic() + 5.0
    while "a" in store and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)  # the ender is now waiting for the running request
    assert handed == [] and "a" not in store  # gone from the store at once, handed on later
    release.set()
    for t in (t1, t2, ender):
        t.join(5.0)
    assert waiting_done.is_set() and len(errors) == 1, errors
    assert [sid for sid, _ in handed] == ["a"] and handed[0][1] >= finished[0]
    with pytest.raises(SessionNotFound):
        with store.locked("a"):
            pass


def test_generate_leaves_no_sessions(llama_target, llama_draft_random):
    gen = SpecSplitGenerator(llama_target, llama_draft_random)
    gen.generate(torch.tensor([PROMPT, PROMPT]), max_new_tokens=8)
    assert gen.target_engine.active_sessions == 0 and gen.draft_engine.active_sessions == 0
    gen.close()


def test_bad_requests_get_typed_errors_and_change_nothing(llama_target):
    te, de = _engines(llama_target, max_tree_nodes=8, max_context=64)
    good = te.verify(VerifyRequest("s", TokenTree.empty(), PROMPT, 0))
    length = good.prefix_length
    pend = [good.next_token_id]

    def tree(tokens, parents):
        par = torch.tensor(parents)
        dep = torch.ones(len(parents), dtype=torch.long)
        for i, p in enumerate(parents):
            if 0 <= p < i:
                dep[i] = dep[p] + 1
        return TokenTree(torch.tensor(tokens), par, dep, torch.zeros(len(tokens)))

    bad = [
        (VerifyRequest("s", TokenTree.empty(), [10_000], length), InvalidRequest),
        (VerifyRequest("s", TokenTree.empty(), [], length), InvalidRequest),
        (VerifyRequest("s", tree([5, 400], [-1, 0]), pend, length), InvalidRequest),
        (VerifyRequest("s", tree([5, 6], [1, 0]), pend, length), InvalidRequest),  # cycle
        (VerifyRequest("s", tree([5, 6], [-1, 5]), pend, length), InvalidRequest),  # out of range
        (VerifyRequest("s", tree(list(range(9)), [-1] * 9), pend, length), InvalidRequest),  # too big
        (VerifyRequest("s", TokenTree.empty(), list(range(5, 70)), length), ResourceExhausted),
        (VerifyRequest("s", TokenTree.empty(), pend, length + 1), CacheDesyncError),
        (VerifyRequest("zz", TokenTree.empty(), pend, 4), SessionNotFound),
    ]
    for req, err in bad:
        with pytest.raises(err):
            te.verify(req)
    ok = te.verify(VerifyRequest("s", TokenTree.empty(), pend, length))  # state untouched
    assert ok.prefix_length == length + 1
    with pytest.raises(InvalidRequest):
        de.generate(DraftRequest("s", [-1], 0))
    with pytest.raises(InvalidRequest):
        de.generate(DraftRequest("s", [], 0))


def test_stateless_target(llama_target):
    te = TargetEngine(llama_target, TargetConfig(stateless=True))
    r = te.verify(VerifyRequest("s", TokenTree.empty(), PROMPT, 0))
    assert te.active_sessions == 0
    with pytest.raises(CacheDesyncError):
        te.verify(VerifyRequest("s", TokenTree.empty(), [r.next_token_id], r.prefix_length))
    ref = llama_target.generate(torch.tensor([PROMPT]), max_new_tokens=1, do_sample=False)[0, -1]
    assert r.next_token_id == int(ref)


def test_legacy_generate_draft_tree_and_info(llama_target):
    de = DraftEngine(llama_target, DraftConfig())
    tree = de.generate_draft_tree(PROMPT, k=3, num_beams=2)
    assert tree.num_nodes == 4 and tree.bounds() == (2, 3)
    chain = de.generate_draft_tree(PROMPT, k=4)
    greedy = llama_target.generate(torch.tensor([PROMPT]), max_new_tokens=4, do_sample=False)[0, -4:]
    assert chain.token_ids.tolist() == greedy.tolist()  # the draft IS the target here
    info = de.info()
    assert info.worker_type == "draft" and info.vocab_size == 256 and info.active_sessions == 1
    de.reset_cache()
    assert de.active_sessions == 0
