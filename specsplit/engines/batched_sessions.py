"""Concurrent client-loop sessions gathered into batched forwards: verifications on a target
worker (:class:`SessionBatcher`), greedy chain drafts on a draft worker (:class:`DraftBatcher`).

With the client loop every client calls ``VerifyDrafts`` once a round, each for its own session.
:class:`SessionBatcher` keeps each such session's KV in a slot of a
:class:`~specsplit.engines.batched.BatchedTarget` pool (live sessions packed at the front) and
verifies the requests that arrive within a bounded wait of each other in ONE forward: rows of
sessions with a request carry their pending token and tree; the other live sessions ride along as
inert rows (an empty tree written past their committed length, which their next round overwrites).
Whoever waits for a result runs the gathered round for everyone (a driver lock, as
:mod:`specsplit.pipeline.batch` does).

What it takes: greedy verification of trees of at most :data:`MAX_NODES` nodes, without logits
processors or returned scores (other requests, and sessions that start otherwise or that would not
fit a slot, keep the engine's own per-session path). A session is placed when it starts
(``expected_prefix_length == 0``) and stays where it was placed; ``end`` frees its slot, and
sessions idle past the TTL give theirs up when a new one needs it. :class:`DraftBatcher` does the
same for the draft side of those sessions.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch

from specsplit.core.sampling import SamplingParams
from specsplit.core.tree import TokenTree
from specsplit.engines.base import desync_error
from specsplit.engines.batched import BatchedTarget, ChainRow, RowOutcome, RowTree
from specsplit.errors import InvalidRequest, ResourceExhausted
from specsplit.messages import DraftRequest, DraftResult, VerifyRequest, VerifyResult, WorkerStats

R = TypeVar("R")

GATHER_S = 0.002  # how long a round waits for the other live sessions' requests
# How long, in rounds of this pool, a round may wait for sessions expected back soon (see
# _SessionSlots._gathered).
EXPECT_ROUNDS = 1.5
_WAKE_S = 0.05  # longest a waiting request sleeps before it checks the driver lock again
THINK_WEIGHT = 0.3  # weight of the newest gap in a session's running average of its think time
# Most tree nodes a batched session's request may carry. Every live session rides in every round
# (inert or not), writing up to this + 1 positions past its committed length, so a session keeps
# that much of its slot free.
MAX_NODES = 64
MAX_CHAIN = 16  # longest chain a batched draft session may ask for
MAX_INGEST = 16  # newly committed tokens a chain draft writes in its shared forward (more: on their own)


@dataclass
class _Session:
    key: str
    slot: int
    length: int = 0  # positions of the slot that hold committed KV
    used: float = field(default_factory=time.monotonic)
    replied: float | None = None  # when its last call's result was ready
    think: float | None = None  # running average of the time from a result to its next request


@dataclass
class _Pending(Generic[R]):
    session: _Session
    row: Any  # what the request asks of the shared call (a RowTree, a ChainRow)
    depth: int = 0  # chain drafts: tokens asked for
    result: R | None = None
    error: BaseException | None = None
    done: bool = False
    # set when the call ran (done) or when this request is handed the next call to drive
    wake: threading.Event = field(default_factory=threading.Event)


class _SessionSlots(Generic[R]):
    """Sessions in the slots of one pool and their requests gathered into shared calls: placement
    (a session keeps its slot until it ends or, idle past the TTL, a new session needs it), the
    bounded wait, and the driving (whoever waits runs the gathered call for everyone)."""

    reserve = MAX_NODES + 1  # positions past its committed length any call of the batch may write

    def __init__(self, target: BatchedTarget, ttl_s: float, gather_s: float):
        self.target = target
        self.ttl_s, self.gather_s = ttl_s, gather_s
        self._sessions: dict[str, _Session] = {}
        self._order: list[_Session] = []  # by slot
        self._queue: list[_Pending[R]] = []
        self._queued: set[int] = set()  # id() of the sessions with a request in the queue
        # The driver lock: one shared call (or a placement, a prefill) at a time. Whoever waits
        # for a result and finds it free runs the next call for everybody.
        self._drive = threading.Lock()
        self._cv = threading.Condition()  # the sessions and the queue; the gathering driver waits on it
        self.rounds = 0
        self._run_s: float | None = None  # running average of a shared call's time

    def holds(self, key: str) -> bool:
        with self._cv:
            return key in self._sessions

    @property
    def live_sessions(self) -> int:
        return len(self._order)

    def _fits(self, capacity_hint: int, first: int) -> bool:
        """A new session of ``first`` tokens growing to ``capacity_hint`` fits a slot, and one is free."""
        need = max(capacity_hint, first) + self.reserve
        return need <= self.target.capacity and self._room()

    def _room(self) -> bool:
        """A free slot, or one held by a session idle past the TTL."""
        with self._cv:
            if len(self._order) < self.target.slots:
                return True
            now = time.monotonic()
            return any(now - s.used > self.ttl_s for s in self._order)

    def end(self, key: str) -> bool:
        """Free a session's slot (the last live session moves into it); False when not here."""
        with self._drive, self._cv:
            return self._drop(key)

    def _drop(self, key: str) -> bool:
        s = self._sessions.pop(key, None)
        if s is None:
            return False
        last = self._order.pop()
        if last is not s:
            self.target.move_slot(last.slot, s.slot, last.length)
            last.slot = s.slot
            self._order[s.slot] = last
        return True

    def _place(self, key: str) -> _Session:
        """The session's slot, new or reset (driver lock held)."""
        s = self._sessions.get(key)
        if s is not None:
            s.length = 0
            return s
        if len(self._order) >= self.target.slots:
            now = time.monotonic()
            idle = [x for x in self._order if now - x.used > self.ttl_s]
            if not idle:
                raise ResourceExhausted(f"all {self.target.slots} batched session slots are in use")
            self._drop(min(idle, key=lambda x: x.used).key)
        s = _Session(key, len(self._order))
        self._sessions[key] = s
        self._order.append(s)
        return s

    def _session_for(self, key: str, expected: int, side: str, new_tokens: int) -> _Session | None:
        """The session a request with ``expected`` committed tokens speaks for (driver lock held):
        placed anew when ``expected`` is 0 (None when no slot is free after all), else the one
        held, checked for desync and for room to grow by ``new_tokens`` and any call's writes."""
        if expected == 0:
            if key not in self._sessions and not self._room():
                return None
            return self._checked(self._place(key), expected, side, new_tokens)
        got = self._sessions.get(key)
        if got is None:
            raise InvalidRequest(f"session {key!r} is not served in batched rounds")
        return self._checked(got, expected, side, new_tokens)

    def _held(self, key: str, expected: int, side: str, new_tokens: int) -> _Session | None:
        """The session of a request that needs no placement and writes nothing before its call
        (None otherwise: the caller takes the driver lock and :meth:`_session_for`).

        This is every round of a running session, so it must not wait for the driver lock: a
        round's driver holds that lock while it gathers, and a request that waited for it could
        only join the round after."""
        if expected == 0:
            return None
        with self._cv:
            got = self._sessions.get(key)
            return None if got is None else self._checked(got, expected, side, new_tokens)

    def _checked(self, s: _Session, expected: int, side: str, new_tokens: int) -> _Session:
        """``s`` after checking it holds ``expected`` tokens and has room for ``new_tokens`` more and
        any call's writes. Its own request is the one being admitted, so no round changes it now."""
        if s.length != expected:
            raise desync_error(side, s.key, s.length, expected)
        end = s.length + new_tokens + self.reserve
        if end > self.target.capacity:
            raise ResourceExhausted(f"session would need {end} positions; a batched slot holds "
                                    f"{self.target.capacity}")  # fmt: skip
        s.used = time.monotonic()
        return s

    def _submit(self, pend: _Pending[R]) -> R:
        """Queue ``pend`` and drive or wait until its call ran; its result.

        A waiting request sleeps on its own event: set when its call ran, or when the driver of
        the last call hands it the next one. Only the gathering driver is woken by new requests,
        so a round of N sessions costs O(N) wake-ups, not a wake-up of every waiter per arrival."""
        with self._cv:
            s = pend.session
            if s.replied is not None:
                gap = time.monotonic() - s.replied
                s.think = gap if s.think is None else s.think + THINK_WEIGHT * (gap - s.think)
            self._queue.append(pend)
            self._queued.add(id(s))
            self._cv.notify()
        while not pend.done:
            if self._drive.acquire(blocking=False):
                try:
                    if not pend.done:
                        self._gathered()
                finally:
                    self._drive.release()
                    self._hand_over()
            else:
                pend.wake.wait(_WAKE_S)
                pend.wake.clear()
        if pend.error is not None:
            raise pend.error
        assert pend.result is not None
        return pend.result

    def _hand_over(self) -> None:
        """The driver lock was released: the oldest queued request drives the next call."""
        with self._cv:
            nxt = self._queue[0] if self._queue else None
        if nxt is not None:
            nxt.wake.set()

    def _gathered(self) -> None:
        """One gathered call (driver lock held): wait for the other live sessions, then run every
        queued request in one call.

        The wait is bounded. It lasts ``gather_s``, or longer for sessions expected back soon: a
        session's think time (from a result to its next request: its round on the other worker,
        the client, the network) predicts when it returns, and the round waits for those due within
        :data:`EXPECT_ROUNDS` of its own call time. A call costs about the same for one row as for
        all, so a session that just missed a round is better served by the next one with everybody
        than by a round of its own: clients of the two-worker loop stay in one convoy instead of
        splitting into groups that each pay a full round on both workers."""
        with self._cv:
            start = time.monotonic()
            cap = start + max(self.gather_s, EXPECT_ROUNDS * (self._run_s or 0.0))
            queued = self._queued
            while len(queued) < len(self._order):
                now = time.monotonic()
                due = [
                    s.replied + s.think
                    for s in self._order
                    if id(s) not in queued and s.replied is not None and s.think is not None
                ]
                soon = [d for d in due if now <= d <= cap]
                deadline = max(start + self.gather_s, max(soon, default=0.0))
                if now >= deadline:
                    break
                self._cv.wait(deadline - now)
            batch, self._queue = self._queue, []
            queued.clear()
        if not batch:
            return
        t0 = time.monotonic()
        try:
            with self.target.lock:
                results = self._run(batch)
        except BaseException as e:
            with self._cv:
                for p in batch:
                    p.error, p.done = e, True
                    p.wake.set()
            raise
        with self._cv:
            now = time.monotonic()
            took = now - t0
            self._run_s = took if self._run_s is None else self._run_s + THINK_WEIGHT * (took - self._run_s)
            for p, r in zip(batch, results, strict=True):
                p.result, p.done = r, True
                p.session.replied = now
                p.wake.set()
            self.rounds += 1

    def _run(self, batch: list[_Pending[R]]) -> list[R]:
        """The shared call for ``batch`` (every live session has a row); each request's result."""
        raise NotImplementedError


class SessionBatcher(_SessionSlots[RowOutcome]):
    """Client-loop verifications of concurrent sessions in shared forwards (module docstring).

    Args:
        target: the pool (one slot per session).
        vocab_size / max_tree_nodes / max_tree_depth: request limits (the engine's).
        ttl_s: a session idle this long may lose its slot to a new session.
        gather_s: the bounded wait for other sessions' requests before a round.
    """

    def __init__(
        self,
        target: BatchedTarget,
        vocab_size: int,
        max_tree_nodes: int,
        max_tree_depth: int,
        ttl_s: float = 600.0,
        gather_s: float = GATHER_S,
    ):
        super().__init__(target, ttl_s, gather_s)
        self.vocab_size, self.max_tree_nodes, self.max_tree_depth = vocab_size, max_tree_nodes, max_tree_depth

    def takes(self, req: VerifyRequest) -> bool:
        """Whether ``req`` is verified here: its session is here, or it starts a session this pool
        can hold (greedy, no processors, no returned scores, prompt + hint within a slot)."""
        if self.holds(req.session_id):
            return True
        if req.expected_prefix_length != 0 or req.sampling.do_sample or req.processing is not None:
            return False
        if req.return_scores or req.return_logits:
            return False
        return req.tree.num_nodes <= MAX_NODES and self._fits(req.capacity_hint, len(req.pending_token_ids))

    # ------------------------------------------------------------------ rounds
    def verify(self, req: VerifyRequest) -> VerifyResult | None:
        """One round of ``req``'s session, gathered with whatever other sessions ask meanwhile;
        None when a new session found no free slot after all (the caller verifies it elsewhere).

        Raises:
            InvalidRequest: bad ids, bad tree, empty pending, a request this pool does not verify
                for a session it holds (sampling, processors).
            CacheDesyncError: ``expected_prefix_length`` disagrees with the session (nothing changed).
            ResourceExhausted: no slot, or the session would outgrow its slot.
        """
        t0 = time.perf_counter()
        admitted = self._admit(req)
        if admitted is None:
            return None
        row, depth = admitted
        pend = _Pending[RowOutcome](self._sessions[req.session_id], row)
        o = self._submit(pend)
        n = len(row.tokens)
        stats = WorkerStats(device=str(self.target.device), forwards=1, tokens_processed=1 + n)
        stats.wall_time_s = time.perf_counter() - t0
        return VerifyResult(o.tokens, o.next_token, o.nodes, pend.session.length, depth, n, stats)

    def _admit(self, req: VerifyRequest) -> tuple[RowTree, int] | None:
        """Check ``req``, place or find its session, write the KV of all but the last pending token;
        the row it asks for."""
        pending, tree = req.pending_token_ids, req.tree
        if not pending:
            raise InvalidRequest("pending_token_ids must hold at least one token (the last committed one)")
        if req.sampling.do_sample or req.processing is not None or req.return_scores or req.return_logits:
            raise InvalidRequest("this session is verified in batched greedy rounds: sampling, processors "
                                 "and returned scores need a session started that way")  # fmt: skip
        _check_ids(pending, self.vocab_size, "pending_token_ids")
        tree.validate(self.vocab_size, min(self.max_tree_nodes, MAX_NODES), self.max_tree_depth)
        tokens, parents, depths = tree.token_ids.tolist(), tree.parents.tolist(), tree.depths.tolist()
        s = self._held(req.session_id, req.expected_prefix_length, "target", 1) if len(pending) == 1 else None
        if s is None:
            with self._drive:  # placement and prefill never run beside a round
                s = self._session_for(req.session_id, req.expected_prefix_length, "target", len(pending))
                if s is None:
                    return None
                if len(pending) > 1:
                    self.target.extend(s.slot, s.length, pending[:-1])
                    s.length += len(pending) - 1
        return RowTree(s.length, pending[-1], tokens, parents, depths), max(depths, default=0)

    def _run(self, batch: list[_Pending[RowOutcome]]) -> list[RowOutcome]:
        """Verify every queued tree in one forward; live sessions that did not ask ride along inert."""
        asked = {p.session.slot: p for p in batch}
        rows = [
            asked[s.slot].row if s.slot in asked else RowTree(s.length, 0)  # inert: nothing committed
            for s in self._order
        ]
        for p in batch:  # the row's length as the session holds it now (a placement may have run)
            p.row.length = p.session.length
        n = max(len(p.row.tokens) for p in batch)
        outcomes = self.target.round(rows, SamplingParams(), n)
        results = [outcomes[p.session.slot] for p in batch]
        for p, o in zip(batch, results, strict=True):
            p.session.length += 1 + len(o.nodes)
        return results


class DraftBatcher(_SessionSlots[list[int]]):
    """Client-loop draft requests of concurrent greedy sessions in shared forwards (a draft worker).

    Each session's draft KV lives in a slot of a :class:`~specsplit.engines.batched.BatchedTarget`
    pool over the draft model. Requests that arrive within a bounded wait of each other are drafted
    together (:meth:`~specsplit.engines.batched.BatchedTarget.chain`): one forward writes every
    session's newly committed tokens, then one forward per chain token drafts for all of them; live
    sessions that did not ask ride along as inert rows. A session's slot holds its committed tokens
    only (what ``prefix_length`` counts, as the engine's sessions do).

    What it takes: greedy ``chain`` trees of at most :data:`MAX_CHAIN` tokens, without logits
    processors or speculation; other requests, and sessions that start otherwise or find no free
    slot, keep the engine's own per-session path.

    Args:
        target: the pool over the draft model (one slot per session).
        vocab_size: request limit (the model's vocabulary).
        ttl_s / gather_s: as :class:`SessionBatcher`'s.
    """

    reserve = MAX_INGEST + MAX_CHAIN

    def __init__(
        self, target: BatchedTarget, vocab_size: int, ttl_s: float = 600.0, gather_s: float = GATHER_S
    ):
        super().__init__(target, ttl_s, gather_s)
        self.vocab_size = vocab_size

    @staticmethod
    def _shape_ok(req: DraftRequest) -> bool:
        return (
            req.tree.shape == "chain"
            and req.tree.num_draft_tokens <= MAX_CHAIN
            and not req.sampling.do_sample
            and req.processing is None
            and not req.speculate
        )

    def takes(self, req: DraftRequest) -> bool:
        """Whether ``req`` is drafted here: its session is here, or it starts a session this pool
        can hold (a greedy chain, no processors or speculation, prompt + hint within a slot)."""
        if self.holds(req.session_id):
            return True
        return (
            req.prefix_length == 0
            and self._shape_ok(req)
            and self._fits(req.capacity_hint, len(req.new_token_ids))
        )

    def draft(self, req: DraftRequest) -> DraftResult | None:
        """Ingest ``req.new_token_ids`` and draft a chain, gathered with whatever other sessions ask
        meanwhile; None when a new session found no free slot after all.

        Raises:
            InvalidRequest: bad ids, no new tokens, a request this pool does not draft for a session
                it holds (sampling, another tree shape, processors, speculation).
            CacheDesyncError: ``prefix_length`` disagrees with the session (nothing changed).
            ResourceExhausted: no slot, or the session would outgrow its slot.
        """
        t0 = time.perf_counter()
        new = req.new_token_ids
        if not new:
            raise InvalidRequest(
                "new_token_ids is empty: a draft round needs the tokens committed since the last"
            )
        if not self._shape_ok(req):
            raise InvalidRequest("this session is drafted in batched greedy chains: other trees, sampling, "
                                 "processors and speculation need a session started that way")  # fmt: skip
        _check_ids(new, self.vocab_size, "new_token_ids")
        k = (
            req.tree.num_draft_tokens
            if req.max_depth is None
            else min(req.tree.num_draft_tokens, req.max_depth)
        )
        ingest = new[-MAX_INGEST:]
        s = (
            self._held(req.session_id, req.prefix_length, "draft", len(new))
            if len(new) == len(ingest)
            else None
        )
        if s is None:
            with self._drive:  # placement and prefill never run beside a call
                s = self._session_for(req.session_id, req.prefix_length, "draft", len(new))
                if s is None:
                    return None
                if len(new) > len(ingest):  # a long context (a new session's prompt): written on its own
                    self.target.extend(s.slot, s.length, new[: -len(ingest)])
                    s.length += len(new) - len(ingest)
        pend = _Pending[list[int]](s, ChainRow(s.length, ingest), max(k, 1))
        drafted = self._submit(pend)[:k] if k > 0 else []
        n = len(drafted)
        tree = TokenTree(
            torch.tensor(drafted, dtype=torch.long),
            torch.arange(n, dtype=torch.long) - 1,
            torch.arange(1, n + 1, dtype=torch.long),
            torch.zeros(n),  # greedy: one-hot drafts (verification never reads these)
            max_branch=1 if n else 0,
            depth_bound=n,
        )
        stats = WorkerStats(device=str(self.target.device), forwards=max(k, 1), tokens_processed=len(new) + n)
        stats.wall_time_s = time.perf_counter() - t0
        return DraftResult(tree=tree, prefix_length=s.length, stats=stats, cache_hit=req.prefix_length > 0)

    def _run(self, batch: list[_Pending[list[int]]]) -> list[list[int]]:
        """Every queued session's chain in one call; live sessions that did not ask ride along inert."""
        asked = {p.session.slot: p for p in batch}
        for p in batch:  # the row's length as the session holds it now (a placement may have run)
            p.row.length = p.session.length
        rows = [asked[s.slot].row if s.slot in asked else ChainRow(s.length, [0]) for s in self._order]
        k = max(p.depth for p in batch)
        drafted = self.target.chain(rows, k)
        results = [drafted[p.session.slot] for p in batch]
        for p in batch:
            p.session.length += len(p.row.tokens)
        return results


def _check_ids(ids: list[int], vocab: int, name: str) -> None:
    if any(not isinstance(t, int) or t < 0 or t >= vocab for t in ids):
        raise InvalidRequest(f"{name}: a token id is outside the vocabulary [0, {vocab})")
