"""The batched decoding loop: many sequences, one target forward per round (continuous batching).

Each round, every live row proposes an n-gram tree from its own committed tokens; the planner
(:class:`~specsplit.engines.batch_plan.BatchPlanner`) sizes the round for the batch at hand (no tree
at all where plain steps are faster); :class:`~specsplit.engines.batched.BatchedTarget` verifies
every row's tree in one forward; each row commits its accepted tokens plus the target's own, cut
at its own stop conditions (EOS, stop strings, ``max_new_tokens``). A row that finishes leaves at
once and hands its KV slot to the last row (live rows stay packed at the front); rows waiting for a
slot join between rounds, their prompts written in batched prefills.

A :class:`BatchScheduler` is shared by every caller of one pool: the rows of one ``generate()``
call, concurrent ``generate()`` calls of one generator, the concurrent ``Generate`` calls a target
worker serves. Nobody owns a thread: whichever caller is waiting for its rows runs the next round
for everyone (the others wait on a condition), so a round serves all live rows whoever drives it.
Rows of one round share their sampling settings; rows with other settings wait until the live rows
of the current settings are done.

A row's first round has the last prompt token as its pending token (the prefill writes the KV of
the others), so every round has the same shape: one pending token and a tree per row.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Generator
from dataclasses import dataclass, field

from specsplit.core.ngram import Proposal
from specsplit.core.sampling import SamplingParams
from specsplit.engines.batch_plan import BatchPlanner
from specsplit.engines.batched import BatchedTarget, PositionNoise, RoundDriver, RowTree, batch_bucket
from specsplit.engines.drafters import NgramDrafter, NgramSession
from specsplit.errors import ResourceExhausted
from specsplit.pipeline.params import DecodeParams, generation_seeds
from specsplit.pipeline.stop import StopChecker
from specsplit.telemetry import RoundStats, SpecStats

logger = logging.getLogger(__name__)

GATHER_S = 0.002  # an idle scheduler waits this long for more rows before its first round


@dataclass
class BatchRequest:
    """One row: its prompt (no padding) and its parameters (seeds, stop conditions and
    ``max_new_tokens`` are per row)."""

    prompt: list[int]
    params: DecodeParams


@dataclass
class Ticket:
    """A submitted row: its rounds as they commit, then its result (or the error that ended it)."""

    request: BatchRequest
    ngram: NgramDrafter | None
    rounds: deque[tuple[list[int], RoundStats]] = field(default_factory=deque)
    out: list[int] = field(default_factory=list)
    stats: SpecStats = field(default_factory=SpecStats)
    done: bool = False
    cancelled: bool = False
    error: BaseException | None = None
    submitted: float = field(default_factory=time.perf_counter)
    # Set (under the scheduler's lock) when rounds are appended or the row ends / when it ends: a
    # follower sleeps on its own ticket's events, so a round wakes only the rows it served.
    ready: threading.Event = field(default_factory=threading.Event)
    ended: threading.Event = field(default_factory=threading.Event)


@dataclass
class _Row:
    ticket: Ticket
    stopper: StopChecker
    ngram: NgramSession | None
    seed: int | None
    length: int  # positions of the row's slot that hold committed KV
    pending: int  # the last committed token (its KV is written by the next round)
    started: float
    proposal: Proposal | None = None
    noise: PositionNoise | None = None  # seeded sampling: the positions' noise drawn so far

    @property
    def params(self) -> DecodeParams:
        return self.ticket.request.params

    @property
    def remaining(self) -> int:
        return self.params.max_new_tokens - len(self.ticket.out)


class BatchScheduler:
    """Continuous batching over one :class:`BatchedTarget` pool, shared by any number of threads.

    Args:
        target: the pool (its slots bound the rows of a round).
        max_batch: rows per round, at most ``target.slots``.
        planner: tree sizes per batch size (kept across calls).
        max_waiting: rows that may wait for a slot; more are refused with
            :class:`~specsplit.errors.ResourceExhausted` (a worker's admission bound).
        gather_s: an idle scheduler's wait for more rows before it starts.
    """

    def __init__(
        self,
        target: BatchedTarget,
        max_batch: int,
        planner: BatchPlanner | None = None,
        max_waiting: int = 1024,
        gather_s: float = GATHER_S,
    ):
        if not 0 < max_batch <= target.slots:
            raise ValueError(f"max_batch must be in 1..{target.slots}, got {max_batch}")
        self.target, self.max_batch = target, max_batch
        self.planner = planner or BatchPlanner(skip_first=target.use_graphs)
        self.max_waiting, self.gather_s = max_waiting, gather_s
        self._waiting: deque[Ticket] = deque()
        self._live: list[_Row] = []
        self._driver = RoundDriver()
        self._cv = self._driver.cv
        self.rounds = 0
        self._thread: threading.Thread | None = None
        self._closing = False

    def drive_in_background(self) -> None:
        """Run the rounds on a thread of the scheduler's own from now on; callers only wait for
        their rows. A worker streaming each round to its clients wants this: a caller that drove
        a round would send its own update before the next round could start, putting a network
        send (and the wake-up of every other stream) between consecutive rounds."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._drive_loop, name="specsplit-batch-rounds", daemon=True
            )
            self._thread.start()

    def close(self) -> None:
        """Stop the background thread (if any); rows still live or waiting end with an error."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30.0)
            self._thread = None
        closed = ResourceExhausted("the batch scheduler was closed")
        with self._cv:
            while self._waiting:
                t = self._waiting.popleft()
                t.error = closed
                self._finish_ticket(t)
            if self._live:
                self._fail_all(closed)

    def _drive_loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: bool(self._live or self._waiting) or self._closing)
                if self._closing:
                    return
            with self._driver.lock:
                try:
                    self._guarded_step()
                except Exception:  # every row it held ended with the error; later rows still run
                    logger.exception("a batched round failed")
            with self._cv:
                self._cv.notify_all()

    # ------------------------------------------------------------------ callers
    def submit(self, request: BatchRequest, ngram: NgramDrafter | None = None) -> Ticket:
        """Queue a row (it joins the next round that has a slot for it).

        Raises:
            ValueError: an empty prompt, or a row that does not fit the pool's positions.
            ResourceExhausted: ``max_waiting`` rows are already waiting.
        """
        p = request.params
        if not request.prompt:
            raise ValueError("the prompt must contain at least one token")
        need = len(request.prompt) + p.max_new_tokens + 1 + max(self.planner.sizes)
        if need > self.target.capacity:
            raise ValueError(f"a row needs {need} positions; the pool's slots hold {self.target.capacity}")
        ticket = Ticket(request, ngram, stats=SpecStats(prompt_tokens=len(request.prompt)))
        with self._cv:
            if len(self._waiting) >= self.max_waiting:
                raise ResourceExhausted(f"{self.max_waiting} rows are already waiting for a batch slot")
            self._waiting.append(ticket)
            self._cv.notify_all()
        return ticket

    def follow(self, ticket: Ticket) -> Generator[tuple[list[int], RoundStats], None, None]:
        """Yield the ticket's rounds (committed tokens, telemetry) as they come, driving rounds when
        no other caller is; raises what failed the row. Closing the iterator early cancels the row."""
        for chunk in self.follow_chunks(ticket):
            yield from chunk

    def follow_chunks(
        self, ticket: Ticket, every_s: float = 0.0
    ) -> Generator[list[tuple[list[int], RoundStats]], None, None]:
        """:meth:`follow`, the rounds committed since the last chunk together; with ``every_s`` at
        most one chunk per ``every_s`` seconds (the last one as soon as the row ends). A worker
        streams a chunk per message: under load that is one message per client per interval,
        not one per round."""
        try:
            last = 0.0
            while True:
                if every_s > 0 and not ticket.done:
                    left = last + every_s - time.perf_counter()
                    if left > 0:
                        ticket.ended.wait(left)
                with self._cv:
                    items, done = list(ticket.rounds), ticket.done
                    ticket.rounds.clear()
                    ticket.ready.clear()
                if items:
                    last = time.perf_counter()
                    yield items
                if done:
                    break
                if not items:
                    self._drive_or_wait(ticket)
            if ticket.error is not None:
                raise ticket.error
        finally:
            if not ticket.done:
                self.cancel(ticket)

    def wait(self, ticket: Ticket) -> tuple[list[int], SpecStats]:
        """Run (or wait for) the ticket's rows to the end; ``(new tokens, stats)``."""
        for _ in self.follow(ticket):
            pass
        return ticket.out, ticket.stats

    def cancel(self, ticket: Ticket) -> None:
        """Drop a row: a waiting one at once; a live one at once when no round is running (its slot
        goes to the last row), else at the end of the current round."""
        with self._cv:
            ticket.cancelled = True
            if ticket in self._waiting:
                self._waiting.remove(ticket)
                self._finish_ticket(ticket)
                return
        if ticket.done or not self._driver.lock.acquire(blocking=False):
            return  # the round running now drops it
        try:
            finished = [r.ticket is ticket for r in self._live]
            if any(finished):
                self._leave(finished)
        finally:
            self._driver.lock.release()

    @property
    def live_rows(self) -> int:
        return len(self._live)

    @property
    def waiting_rows(self) -> int:
        return len(self._waiting)

    # ------------------------------------------------------------------ driving
    def _drive_or_wait(self, ticket: Ticket) -> None:
        ready = lambda: ticket.done or bool(ticket.rounds)  # noqa: E731
        if self._thread is None:
            self._driver.turn(ready, self._guarded_step)
        else:
            ticket.ready.wait(0.05)

    def _guarded_step(self) -> None:
        try:
            self._step()
        except BaseException as e:  # a failed round fails every row it held
            self._fail_all(e)
            raise

    def _step(self) -> None:
        """One admission and one round for every live row (the driver lock held)."""
        with self._cv:
            if not self._live and self._waiting:
                wait = self.gather_s - (time.perf_counter() - self._waiting[0].submitted)
                if wait > 0:  # let concurrent callers' rows arrive for the first round
                    self._cv.wait(wait)
            joining = self._take_joining()
        if joining:
            self._prefill(joining)
        if not self._live:
            return
        with self.target.lock:
            finished = self._round()
        self._leave(finished)
        self.rounds += 1

    def _take_joining(self) -> list[Ticket]:
        """Waiting rows that get a slot now: in order, those whose sampling matches the live rows'."""
        free = self.max_batch - len(self._live)
        if free <= 0 or not self._waiting:
            return []
        sampling = self._live[0].params.sampling if self._live else self._waiting[0].request.params.sampling
        taken: list[Ticket] = []
        for t in list(self._waiting):
            if len(taken) == free:
                break
            if t.request.params.sampling == sampling:
                self._waiting.remove(t)
                taken.append(t)
        return taken

    def _prefill(self, joining: list[Ticket]) -> None:
        rows: list[_Row] = []
        for t in joining:
            req = t.request
            if req.params.max_new_tokens <= 0 or t.cancelled:
                with self._cv:
                    self._finish_ticket(t)
                continue
            rows.append(
                _Row(
                    ticket=t,
                    stopper=StopChecker(req.params, req.prompt),
                    ngram=t.ngram.session(req.prompt) if t.ngram is not None else None,
                    seed=generation_seeds(req.params)[1],
                    length=len(req.prompt) - 1,
                    pending=req.prompt[-1],
                    started=time.perf_counter(),
                )
            )
        if not rows:
            return
        rows.sort(key=lambda r: r.length)  # prefill groups pad little when lengths are close
        try:
            with self.target.lock:
                self.target.prefill(len(self._live), [r.ticket.request.prompt[:-1] for r in rows])
        except Exception as e:  # these rows end with the error; the live ones' slots are untouched
            logger.warning("prefill of %d joining rows failed: %s", len(rows), e)
            with self._cv:
                for r in rows:
                    r.ticket.error = e
                    self._finish_ticket(r.ticket)
            return
        self._live.extend(rows)

    def _round(self) -> list[bool]:
        """One round for every live row; returns which rows finished."""
        live, planner = self._live, self.planner
        sampling: SamplingParams = live[0].params.sampling
        t0 = time.perf_counter()
        bp = batch_bucket(len(live), self.target.slots)
        propose = planner.wants_proposals(bp)
        scores: list[list[float]] = []
        for r in live:
            r.proposal = r.ngram.propose() if propose and r.ngram is not None and r.remaining > 1 else None
            scores.append(r.proposal.scores if r.proposal is not None else [])
        size = planner.plan(bp, scores)
        trees: list[RowTree] = []
        kept_scores: list[list[float]] = []
        for r in live:
            top = r.proposal.top(size) if r.proposal is not None and size else Proposal.empty()
            kept_scores.append(top.scores)
            if sampling.do_sample and r.seed is not None and r.noise is None:
                r.noise = self.target.noise_for(r.seed, 1 + max(planner.sizes))
            trees.append(
                RowTree(r.length, r.pending, top.token_ids, top.parents, top.depths, r.seed, r.noise)
            )
        t1 = time.perf_counter()
        outcomes = self.target.round(trees, sampling, size)
        t2 = time.perf_counter()
        finished: list[bool] = []
        all_scores: list[float] = []
        all_flags: list[bool] = []
        committed: list[tuple[list[int], RoundStats]] = []
        for r, tree, o, sc in zip(live, trees, outcomes, kept_scores, strict=True):
            out = r.ticket.out
            remaining = r.remaining
            kept, stopped = r.stopper.cut(out, (o.tokens + [o.next_token])[:remaining])
            out.extend(kept)
            if r.ngram is not None:
                r.ngram.extend(kept)
            r.length += 1 + len(o.nodes)
            r.pending = o.next_token
            acc = set(o.nodes)
            all_scores.extend(sc)
            all_flags.extend(i in acc for i in range(len(sc)))
            rs = RoundStats(
                accepted=min(len(o.nodes), remaining - 1),
                committed=len(kept),
                drafted_depth=min(max(tree.depths, default=0), remaining - 1),
                tree_nodes=len(tree.tokens),
                draft_s=t1 - t0,
                verify_s=t2 - t1,
                host_s=0.0,
                drafter="ngram" if tree.tokens else "none",
            )
            committed.append((kept, rs))
            finished.append(stopped or len(out) >= r.params.max_new_tokens or r.ticket.cancelled)
        t3 = time.perf_counter()
        with self._cv:
            for r, (kept, rs) in zip(live, committed, strict=True):
                rs.host_s = t3 - t2
                r.ticket.stats.rounds.append(rs)
                r.ticket.rounds.append((kept, rs))
                r.ticket.ready.set()
        planner.observe(bp, size, t3 - t0, all_scores, all_flags)
        return finished

    def _leave(self, finished: list[bool]) -> None:
        """Finished rows leave; the last live rows move into their slots (live rows stay packed)."""
        live = self._live
        if not any(finished):
            return
        with self._cv:
            for r, done in zip(live, finished, strict=True):
                if done:
                    r.ticket.stats.wall_time_s = time.perf_counter() - r.started
                    if r.ngram is not None:
                        r.ngram.finish()
                    self._finish_ticket(r.ticket)
        keep = [not f for f in finished]
        hole, last = 0, len(live) - 1
        while True:
            while hole < len(live) and keep[hole]:
                hole += 1
            while last >= 0 and not keep[last]:
                last -= 1
            if hole >= last:
                break
            self.target.move_slot(last, hole, live[last].length)
            live[hole], keep[hole], keep[last] = live[last], True, False
        del live[sum(keep) :]

    def _finish_ticket(self, ticket: Ticket) -> None:
        ticket.done = True
        ticket.ready.set()
        ticket.ended.set()
        self._cv.notify_all()

    def _fail_all(self, error: BaseException) -> None:
        """A round failed: every live row ends with the error (the pool's rows are lost)."""
        with self._cv:
            for r in self._live:
                r.ticket.error = error
                self._finish_ticket(r.ticket)
            self._live.clear()
            logger.error("a batched round failed (%s); its rows ended with the error", error)


def decode_batch(
    target: BatchedTarget,
    requests: list[BatchRequest],
    max_batch: int,
    planner: BatchPlanner | None = None,
    ngram: NgramDrafter | None = None,
) -> list[tuple[list[int], SpecStats]]:
    """Generate every request's tokens on ``target``, at most ``max_batch`` rows per round.

    Args:
        target: the batched verifier (its slots hold the longest request's prompt +
            ``max_new_tokens`` + the largest tree).
        requests: the rows.
        max_batch: rows per round (more requests wait and join as rows finish).
        planner: tree sizes per batch (kept across calls by the caller); None: a fresh one.
        ngram: the n-gram drafter (settings, suffix cache); None: plain one-token steps.

    Returns:
        ``(new tokens, stats)`` per request, in request order.
    """
    scheduler = BatchScheduler(target, max_batch, planner, gather_s=0.0)
    return run_rows(scheduler, requests, ngram)


def run_rows(
    scheduler: BatchScheduler, requests: list[BatchRequest], ngram: NgramDrafter | None
) -> list[tuple[list[int], SpecStats]]:
    """Submit every row to ``scheduler`` and wait for all of them (driving rounds as needed)."""
    tickets: list[Ticket] = []
    try:
        for r in requests:
            tickets.append(scheduler.submit(r, ngram))
        return [scheduler.wait(t) for t in tickets]
    finally:
        for t in tickets:
            if not t.done:
                scheduler.cancel(t)
