"""Concurrent sessions' verifications gathered into batched forwards (a target worker, client loop).

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
fit a slot, keep the engine's own per-session path). A session is placed when it starts (``expected_prefix_length == 0``) and stays where it was
placed; ``end`` frees its slot, and sessions idle past the TTL give theirs up when a new one needs
it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from specsplit.core.sampling import SamplingParams
from specsplit.engines.base import desync_error
from specsplit.engines.batched import BatchedTarget, RoundDriver, RowOutcome, RowTree
from specsplit.errors import InvalidRequest, ResourceExhausted
from specsplit.messages import VerifyRequest, VerifyResult, WorkerStats

GATHER_S = 0.002  # how long a round waits for the other live sessions' requests
# Most tree nodes a batched session's request may carry. Every live session rides in every round
# (inert or not), writing up to this + 1 positions past its committed length, so a session keeps
# that much of its slot free.
MAX_NODES = 64


@dataclass
class _Session:
    key: str
    slot: int
    length: int = 0  # positions of the slot that hold committed KV
    used: float = field(default_factory=time.monotonic)


@dataclass
class _Pending:
    session: _Session
    row: RowTree
    depth: int
    result: RowOutcome | None = None
    error: BaseException | None = None
    done: bool = False


class SessionBatcher:
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
        self.target = target
        self.vocab_size, self.max_tree_nodes, self.max_tree_depth = vocab_size, max_tree_nodes, max_tree_depth
        self.ttl_s, self.gather_s = ttl_s, gather_s
        self._sessions: dict[str, _Session] = {}
        self._order: list[_Session] = []  # by slot
        self._queue: list[_Pending] = []
        self._driver = RoundDriver()
        self._cv = self._driver.cv
        self.rounds = 0

    # ------------------------------------------------------------------ placement
    def holds(self, key: str) -> bool:
        with self._cv:
            return key in self._sessions

    @property
    def live_sessions(self) -> int:
        return len(self._order)

    def takes(self, req: VerifyRequest) -> bool:
        """Whether ``req`` is verified here: its session is here, or it starts a session this pool
        can hold (greedy, no processors, no returned scores, prompt + hint within a slot)."""
        if self.holds(req.session_id):
            return True
        if req.expected_prefix_length != 0 or req.sampling.do_sample or req.processing is not None:
            return False
        if req.return_scores or req.return_logits:
            return False
        need = max(req.capacity_hint, len(req.pending_token_ids)) + 1 + MAX_NODES
        return req.tree.num_nodes <= MAX_NODES and need <= self.target.capacity and self._room()

    def _room(self) -> bool:
        """A free slot, or one held by a session idle past the TTL."""
        with self._cv:
            if len(self._order) < self.target.slots:
                return True
            now = time.monotonic()
            return any(now - s.used > self.ttl_s for s in self._order)

    def end(self, key: str) -> bool:
        """Free a session's slot (the last live session moves into it); False when not here."""
        with self._driver.lock, self._cv:
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
        pend = _Pending(self._sessions[req.session_id], row, depth)
        with self._cv:
            self._queue.append(pend)
            self._cv.notify_all()
        while not pend.done:
            self._driver.turn(lambda: pend.done, self._round)
        if pend.error is not None:
            raise pend.error
        assert pend.result is not None
        o = pend.result
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
        if any(not isinstance(t, int) or t < 0 or t >= self.vocab_size for t in pending):
            raise InvalidRequest(
                f"pending_token_ids: a token id is outside the vocabulary [0, {self.vocab_size})"
            )
        tree.validate(self.vocab_size, min(self.max_tree_nodes, MAX_NODES), self.max_tree_depth)
        tokens, parents, depths = tree.token_ids.tolist(), tree.parents.tolist(), tree.depths.tolist()
        with self._driver.lock:  # placement and prefill never run beside a round
            if req.expected_prefix_length == 0:
                if req.session_id not in self._sessions and not self._room():
                    return None
                s = self._place(req.session_id)
            else:
                got = self._sessions.get(req.session_id)
                if got is None:
                    raise InvalidRequest(f"session {req.session_id!r} is not verified in batched rounds")
                s = got
                if s.length != req.expected_prefix_length:
                    raise desync_error("target", req.session_id, s.length, req.expected_prefix_length)
            end = s.length + len(pending) + 1 + MAX_NODES  # what any round of the batch may write
            if end > self.target.capacity:
                raise ResourceExhausted(f"session would need {end} positions; a batched slot holds "
                                        f"{self.target.capacity}")  # fmt: skip
            if len(pending) > 1:
                self.target.extend(s.slot, s.length, pending[:-1])
                s.length += len(pending) - 1
            s.used = time.monotonic()
        return RowTree(s.length, pending[-1], tokens, parents, depths), max(depths, default=0)

    def _round(self) -> None:
        """One gathered round (driver lock held): wait a little for the other live sessions, then
        verify every queued request in one forward."""
        with self._cv:
            deadline = time.monotonic() + self.gather_s
            while len(self._queue) < len(self._order) and time.monotonic() < deadline:
                self._cv.wait(max(0.0, deadline - time.monotonic()))
            batch, self._queue = self._queue, []
        if not batch:
            return
        asked = {p.session.slot: p for p in batch}
        rows = [
            asked[s.slot].row if s.slot in asked else RowTree(s.length, 0)  # inert: nothing committed
            for s in self._order
        ]
        for p in batch:  # the row's length as the session holds it now (a placement may have run)
            p.row.length = p.session.length
        n = max(len(p.row.tokens) for p in batch)
        try:
            with self.target.lock:
                outcomes = self.target.round(rows, SamplingParams(), n)
        except BaseException as e:
            with self._cv:
                for p in batch:
                    p.error, p.done = e, True
            raise
        with self._cv:
            for p in batch:
                o = outcomes[p.session.slot]
                p.session.length += 1 + len(o.nodes)
                p.result, p.done = o, True
            self.rounds += 1
