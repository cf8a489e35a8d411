"""The decoding loop: draft, verify, commit, stop — for one sequence, over any Transport.

Each round:

1. **draft**: the round's drafting is planned (:class:`~specsplit.engines.cost_model.CostModel`: the
   model draft, an n-gram tree from the committed tokens, both merged, or none when nothing pays);
   a model draft extends its session by the tokens committed since its last call and grows a tree
   (or the tree drafted speculatively during the last verification is used);
2. **verify**: the target runs ONE forward over its pending token and the tree and accepts the
   longest agreeing path plus one token of its own; in overlapped mode the draft side drafts the
   next round meanwhile, assuming this one accepts the draft's main path;
3. **commit**: the accepted tokens and the target's token join the output, cut at the first stop
   condition (an EOS id, a stop string, ``max_new_tokens``: never overshooting);
4. **record**: the round's telemetry;
5. **stop** or loop.

Recovery: a desynchronised or lost session is rebuilt by resending the full context; an
unreachable draft turns the rest of the generation into target-only rounds (same output).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Generator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from specsplit.core.sampling import SamplingParams
from specsplit.core.tree import TokenTree
from specsplit.engines.ab_policy import GuessPolicy
from specsplit.engines.cost_model import CostModel, RoundPlan
from specsplit.engines.drafters import (
    TREE_SIZES,
    NgramDrafter,
    NgramSession,
    lookahead_tree,
    merge_trees,
    proposal_tree,
    tree_size,
)
from specsplit.errors import CacheDesyncError, ConfigError, SessionNotFound, TransportError
from specsplit.messages import DraftRequest, DraftResult, HeadGuesses, VerifyRequest, VerifyResult
from specsplit.pipeline.on_target import decode_on_target
from specsplit.pipeline.overlap import OverlapPolicy, speculate
from specsplit.pipeline.params import DecodeOutputs, DecodeParams, generation_seeds
from specsplit.pipeline.stop import StopChecker
from specsplit.telemetry import RoundStats, SpecStats
from specsplit.transport import Transport

logger = logging.getLogger(__name__)


def decode(
    transport: Transport,
    prompt: list[int],
    params: DecodeParams,
    on_tokens: Callable[[list[int]], None] | None = None,
    session_id: str | None = None,
    outputs: DecodeOutputs | None = None,
) -> tuple[list[int], SpecStats]:
    """Generate up to ``params.max_new_tokens`` tokens after ``prompt``.

    With ``params.overlap`` the draft side drafts round N+1 while the target verifies round N
    (:mod:`specsplit.pipeline.overlap`); the engines draw by position, not by round, so
    the committed tokens are the same as sequential mode's. With ``params.loop == "target"`` the
    target worker runs this same loop itself (:func:`~specsplit.pipeline.on_target.decode_on_target`);
    the result is the same. :func:`decode_rounds` is the same loop as a generator of rounds.
    ``outputs`` collects the scores / logits of every committed token when ``params`` asks for them.

    Returns:
        ``(new token ids, stats)``; the session is ended on both sides before returning.
    """
    if not prompt:
        raise ValueError("the prompt must contain at least one token")
    if params.loop == "target":
        if outputs is not None and (params.return_scores or params.return_logits):
            raise ConfigError("output_scores / output_logits need grpc_loop='client'")
        return decode_on_target(transport, prompt, params, on_tokens, session_id)
    if params.loop != "client":
        raise ConfigError(f"loop must be 'client' or 'target', got {params.loop!r}")
    out: list[int] = []
    stats = SpecStats(prompt_tokens=len(prompt))
    rounds = decode_rounds(transport, prompt, params, out, stats, session_id, outputs=outputs)
    try:
        for kept, _ in rounds:
            if on_tokens is not None:
                on_tokens(kept)
    finally:
        rounds.close()  # a callback raised: end the session now
    return out, stats


def decode_rounds(
    transport: Transport,
    prompt: list[int],
    params: DecodeParams,
    out: list[int],
    stats: SpecStats,
    session_id: str | None = None,
    defer_updates: bool = False,
    outputs: DecodeOutputs | None = None,
    leave: Callable[[], bool] | None = None,
) -> Generator[tuple[list[int], RoundStats], None, None]:
    """:func:`decode`'s loop as a generator: yields each round's committed tokens and telemetry.

    ``out`` and ``stats`` fill up as it runs. The session is ended on both sides when the generator
    finishes or is closed, so a consumer that stops early (a cancelled stream) frees it at once.
    Checks nothing :func:`decode` checks first (empty prompt, ``loop``).

    ``defer_updates``: yield a round only once the next round's draft call has returned (a round
    that ends the generation at once). A draft call that returns before its GPU work ends (tree
    slots, or an in-process draft) leaves the GPU busy for milliseconds, and the consumer's work
    (a target worker handing the round to gRPC for its client) then runs in that shadow instead
    of between the verification and the next draft. The same rounds and tokens, one round later.

    ``leave``: asked each time a round's draft call has returned (and the round before it was
    yielded), before the verification. True ends the generation there: that draft is dropped, and
    ``out`` holds everything committed so far. A target worker moves a call to its batched rounds
    this way before its next verification, the first one included, which would otherwise share
    the worker's GPU and host with the batch (a prompt's verification most of all).
    """
    g = _Generation(transport, prompt, params, out, stats, session_id, outputs)
    deferred: tuple[list[int], RoundStats] | None = None  # the last round, not yet yielded
    try:
        while len(out) < params.max_new_tokens:
            remaining = params.max_new_tokens - len(out)
            t0 = time.perf_counter()
            tree, dres = g.draft(remaining)  # 1. draft
            t1 = time.perf_counter()
            if deferred is not None:  # the consumer's time is no round's: shift this round's clock
                yield deferred
                deferred, gap = None, time.perf_counter() - t1
                t0, t1 = t0 + gap, t1 + gap
            if leave is not None and leave():
                break
            vres, t2, spec, spec_s = g.verify(tree, dres, remaining)  # 2. verify (+ speculate N+1)
            kept, stopped, hit = g.commit(vres, spec, remaining)  # 3. commit
            rs = g.record(vres, dres, kept, hit, t0, t1, t2, spec_s, remaining)  # 4. record
            if defer_updates and not stopped:
                deferred = (kept, rs)
                continue
            stats.stopped = stats.stopped or stopped
            yield kept, rs
            if stopped:  # 5. stop
                break
        if deferred is not None:  # the last round (max_new_tokens reached)
            yield deferred
    finally:
        g.close()


class _Generation:
    """One generation's round state: what each side holds and what is sent next."""

    def __init__(
        self,
        transport: Transport,
        prompt: list[int],
        params: DecodeParams,
        out: list[int],
        stats: SpecStats,
        session_id: str | None,
        outputs: DecodeOutputs | None = None,
    ):
        self.transport, self.prompt, self.params, self.out, self.stats = transport, prompt, params, out, stats
        self.outputs = outputs if outputs is not None else DecodeOutputs()
        self.sid = session_id or uuid.uuid4().hex
        self.stopper = StopChecker(params, prompt)
        self.mode = params.drafter
        overlap = params.overlap and transport.has_draft and self.mode == "model"
        extra = params.tree.depth_limit + 1 if overlap else 0  # a speculative extension's tokens
        self.ngram: NgramSession | None = None
        max_ngram = 0
        self.lookahead_size = 0  # nodes of a lookahead round's tree (0: no lookahead)
        self.lookahead: OverlapPolicy | None = None  # lookahead rounds or the planner's
        if self.mode != "model":  # an n-gram index of the committed tokens
            drafter = params.ngram or NgramDrafter(suffix=self.mode in ("suffix", "auto"))
            self.ngram = drafter.session(prompt, drafter.lookahead_width(self.mode))
            max_ngram = drafter.settings.max_nodes
        self.cost = params.cost or CostModel(self.mode, params.tree.max_nodes, max_ngram)
        self.guesses: HeadGuesses | None = None  # the target's draft heads' guesses for this round
        self.guess_nodes = 0  # nodes they take in a fixed round (0: the target has no heads)
        # n-gram modes verify them in their fixed rounds; hybrid keeps the model's rounds
        self.wants_guesses = self.ngram is not None and self.mode != "hybrid"
        self.guess_policy: GuessPolicy | None = None  # which rounds grow them (the first ones do)
        if self.wants_guesses and self.ngram is not None:
            self.guess_policy = self.ngram.drafter.guess_policy(params.sampling.do_sample)
        self.grow = True  # this round grows guesses for the next one
        self.grown_in: int | None = None  # the context this round's guesses were grown in (None: none)
        self.run_context = 0  # how far the last round's nodes other than guesses reached (a context)
        self.guess_from = -1  # this round's first guess-only node (-1: no guesses in its tree)
        self.grow_context = 0  # the context this round decided to grow in
        if self.ngram is not None and self.ngram.window is not None:
            self._size_fixed_rounds()
        self.capacity = (
            len(prompt) + params.max_new_tokens + params.tree.draft_slots + extra
            + max(max_ngram, self.lookahead_size) + 8
        )  # fmt: skip
        if transport.has_draft:
            self.cost.new_generation(params.tree.depth_limit + 1)
        self.plan = RoundPlan(model=transport.has_draft, ngram_size=0)
        self.ngram_scores: list[float] = []
        self.ngram_offset = 0  # index of the first n-gram node in the round's tree
        self.window_offset = -1  # index of the lookahead window's first node (-1: not in this round)
        self.use_draft = transport.has_draft
        self.pending_len = 0  # pending tokens of the round being verified
        self.draft_prefix, self.draft_new = 0, list(prompt)  # what the draft holds / has not seen
        self.draft_cold = False  # this round's model draft took the prompt's forward
        self.target_prefix, self.pending = 0, list(prompt)  # what the target holds / has not seen
        self.ready: DraftResult | None = None  # next round's tree, drafted speculatively (a hit)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="specsplit-verify") if overlap else None
        self.policy = params.policy or OverlapPolicy(always=params.overlap_policy == "always")
        self.seeds = generation_seeds(params)
        self.t_start = time.perf_counter()

    # ------------------------------------------------------------------ 1. draft
    def draft(self, remaining: int) -> tuple[TokenTree, DraftResult | None]:
        """This round's tree: as planned (a model draft, an n-gram tree, both merged, or none: a
        plain target step), or the one drafted speculatively if it held."""
        self.window_offset = self.guess_from = -1
        # whether this round grows guesses for the next one, in the context the last round left
        policy, self.grow_context = self.guess_policy, self.run_context
        self.grow = policy is None or not self.guess_nodes or policy.grow(self.run_context)
        if remaining <= 1 or not (self.use_draft or self.ngram is not None):
            self.plan = RoundPlan(False, 0)
            return TokenTree.empty(), None
        if self.ready is not None:
            spec, self.ready = self.ready, None
            return spec.tree, spec
        if self.lookahead is not None and self.lookahead_size and self.lookahead.speculate():
            return self._lookahead_round(), None
        proposal = None
        if self.ngram is None:
            self.plan = RoundPlan(model=self.use_draft, ngram_size=0)
        else:
            proposal = self.ngram.propose()
            self.plan = self.cost.plan(proposal.scores, self.use_draft)
        tree, dres = TokenTree.empty(), None
        if self.plan.model:
            dres = self._model_draft(remaining)
            if dres is not None:
                tree = dres.tree
        self.ngram_scores, self.ngram_offset = [], tree.num_nodes
        if proposal is not None and self.plan.ngram_size:
            depth = self.ngram.drafter.settings.max_depth if self.ngram is not None else 0
            padded = self.cost.padded  # for graphs: bounds that depend on the size only (greedy rounds)
            extra, self.ngram_scores = proposal_tree(
                proposal,
                self.plan.ngram_size,
                depth,
                fixed_bounds=padded and not self.params.sampling.do_sample,
            )
            tree = merge_trees(tree, extra) if dres is not None else extra
        return tree, dres

    def _size_fixed_rounds(self) -> None:
        """Fixed-size rounds (lookahead rounds): n-gram nodes, the heads' guesses, the window; under
        the A/B policy that weighs them against the planner's rounds."""
        assert self.ngram is not None
        window = self.ngram.window
        self.lookahead = self.ngram.drafter.lookahead_policy(self.params.sampling.do_sample)
        wanted = self.ngram.drafter.settings.lookahead_nodes + self.guess_nodes
        wanted += window.num_nodes if window is not None else 0
        # padded for a graph-replaying target, as the planner's n-gram trees are
        self.lookahead_size = tree_size(wanted, TREE_SIZES + (wanted,)) if self.cost.padded else wanted

    def _lookahead_round(self) -> TokenTree:
        """A fixed round's tree: prompt matches and pool n-grams, the target's draft-head guesses
        and the Jacobi window."""
        assert self.ngram is not None
        proposal = self.ngram.propose(lookahead=True)
        s = self.ngram.drafter.settings
        tree, self.window_offset, guess_from = lookahead_tree(
            proposal,
            self.ngram.window,
            self.lookahead_size,
            s.max_depth,
            fixed_bounds=self.cost.padded and not self.params.sampling.do_sample,
            guesses=self.guesses,
        )
        self.plan = RoundPlan(False, self.lookahead_size, lookahead=True, heads=self.guesses is not None)
        self.ngram_scores, self.ngram_offset = [], 0
        if self.guesses is not None:
            self.guess_from = guess_from
        return tree

    def _model_draft(self, remaining: int) -> DraftResult | None:
        """The draft model's tree for this round (None when the draft became unreachable)."""
        # Beside n-gram trees the model drafts deterministically (top-k expansion, q one-hot): every tree
        # of the generation is then verified against position-keyed draws, so seeded sampling commits
        # the same tokens whatever the planner chose each round.
        # The tree keeps its usual depth near max_new_tokens (the commit is cut instead), so a round's
        # tree, and under sampling its draws, are the same on every engine path and with or without
        # speculation.
        sampling = self.params.sampling if self.mode == "model" else SamplingParams()
        self.draft_cold = self.draft_prefix == 0
        req = DraftRequest(self.sid, self.draft_new, self.draft_prefix, self.params.tree, sampling,
                           self.seeds[0], None, self.capacity, processing=self.params.draft_processing)  # fmt: skip
        dres: DraftResult | None = None
        try:
            dres = _with_recovery(self.transport.draft, req, self._full_context, self.stats)
            self.draft_prefix, self.draft_new = dres.prefix_length, []
        except TransportError as e:
            logger.warning("draft unreachable (%s); continuing target-only, output is unchanged", e)
            self.use_draft, self.stats.draft_fallback = False, True
        if self.params.after_draft is not None:
            self.params.after_draft()
        return dres

    # ------------------------------------------------------------------ 2. verify
    def verify(
        self, tree: TokenTree, dres: DraftResult | None, remaining: int
    ) -> tuple[VerifyResult, float, DraftResult | None, float]:
        """One target forward over the pending token and the tree; in overlapped mode the next
        round is drafted meanwhile. Returns ``(result, end time, speculative draft, its seconds)``."""
        p = self.params
        self.pending_len = len(self.pending)
        vreq = VerifyRequest(
            self.sid, tree, self.pending, self.target_prefix, p.sampling, self.seeds[1], self.capacity,
            p.processing, p.return_scores, p.return_logits, return_choices=self.window_offset >= 0,
            return_guesses=self.wants_guesses and self.grow,
        )  # fmt: skip
        spec, spec_s = None, 0.0
        if (
            self.pool is not None
            and self.use_draft
            and dres is not None
            and remaining > 2
            and self.policy.speculate()
        ):
            job = self.pool.submit(self._timed_verify, vreq)
            spec, spec_s = speculate(self.transport, self.sid, self.draft_prefix, p, self.seeds[0], None,
                                     self.capacity)  # fmt: skip
            vres, t2 = job.result()
        else:
            vres, t2 = self._timed_verify(vreq)
        return vres, t2, spec, spec_s

    def _timed_verify(self, req: VerifyRequest) -> tuple[VerifyResult, float]:
        res = _with_recovery(self.transport.verify, req, self._full_context, self.stats)
        return res, time.perf_counter()

    def _full_context(self) -> list[int]:
        return self.prompt + self.out

    # ------------------------------------------------------------------ 3. commit
    def commit(
        self, vres: VerifyResult, spec: DraftResult | None, remaining: int
    ) -> tuple[list[int], bool, bool | None]:
        """Commit the accepted tokens and the target's own, cut at a stop condition.

        Returns:
            ``(kept tokens, stopped, speculation hit or None when none ran)``.
        """
        new = vres.accepted_token_ids + [vres.next_token_id]
        kept, stopped = self.stopper.cut(self.out, new[:remaining], vres.scores)
        self.out.extend(kept)
        if vres.scores is not None:
            self.outputs.scores.extend(vres.scores[: len(kept)].unbind(0))
        if vres.logits is not None:
            self.outputs.logits.extend(vres.logits[: len(kept)].unbind(0))
        if self.ngram is not None:
            self.ngram.extend(kept)
            if self.window_offset >= 0:
                self._learn(vres)
            self._weigh_guesses(vres)
            self._take_guesses(vres)
        self.target_prefix, self.pending = vres.prefix_length, [vres.next_token_id]
        hit = None
        finished = stopped or len(self.out) >= self.params.max_new_tokens
        if spec is not None and not finished:  # a speculation for a round that never comes is no miss
            hit = spec.assumed_token_ids == new and len(kept) == len(new)
            self.stats.spec_rounds += 1
            self.stats.spec_hits += hit
        if hit:
            assert spec is not None
            self.ready, self.draft_prefix, self.draft_new = spec, spec.prefix_length, []
        else:
            self.draft_new = self.draft_new + new
        return kept, stopped, hit

    def _weigh_guesses(self, vres: VerifyResult) -> None:
        """What this round's guesses added (to the context they were grown in), and how far its
        other nodes reached alone (the next round's context)."""
        if self.guess_policy is None:
            return
        path = vres.accepted_node_indices
        run = len(path)
        if self.guess_from >= 0:  # guess-only nodes: from guess_from up to the window's first node
            end = self.window_offset if self.window_offset >= 0 else vres.num_nodes
            run = next((i for i, node in enumerate(path) if self.guess_from <= node < end), len(path))
            if self.grown_in is not None:  # the guesses the last round grew
                self.guess_policy.record_gain(self.grown_in, len(path) - run)
        self.grown_in = self.grow_context if self.grow else None
        self.run_context = self.guess_policy.context(run)

    def _take_guesses(self, vres: VerifyResult) -> None:
        """The target's draft-head guesses for the next round; the first ones turn fixed rounds on
        (sized for them)."""
        if not self.wants_guesses:
            return
        self.guesses = vres.guesses
        if vres.guesses is not None and not self.guess_nodes:
            self.guess_nodes = len(vres.guesses.token_ids)
            self._size_fixed_rounds()

    def _learn(self, vres: VerifyResult) -> None:
        """A lookahead round's Jacobi step: the target's tokens after the window's nodes."""
        assert self.ngram is not None
        window = self.ngram.window
        if window is None:
            return
        if vres.choices is None:  # a target that cannot return them (batched rounds): no lookahead
            logger.debug("the target returned no choices; lookahead is off for this generation")
            self.lookahead_size = 0
            return
        start = 1 + self.window_offset  # choices[0]: after the pending token
        window.update(vres.choices[start : start + window.num_nodes])

    # ------------------------------------------------------------------ 4. record
    def record(
        self,
        vres: VerifyResult,
        dres: DraftResult | None,
        kept: list[int],
        hit: bool | None,
        t0: float,
        t1: float,
        t2: float,
        spec_s: float,
        remaining: int,
    ) -> RoundStats:
        t3 = time.perf_counter()
        if self.pool is not None:
            self.policy.record(t3 - t0, len(kept))
        if self.lookahead is not None and self.lookahead_size and self.pending_len == 1:
            # (a prompt's round would time the prompt's forward)
            self.lookahead.record(t3 - t0, len(kept))
        if (
            self.guess_policy is not None
            and self.guess_nodes
            and self.plan.lookahead
            and self.pending_len == 1
        ):
            # fixed rounds, one size: with and without growing guesses they differ by the growth alone
            self.guess_policy.record_round(self.grow, t3 - t0, len(kept))
        server = (dres.stats.busy_s if dres else 0.0) + vres.stats.busy_s
        # A tree keeps its usual depth near max_new_tokens: drafted and accepted tokens past the
        # end do not count (the same statistics as a draft cut to the tokens still wanted).
        rs = RoundStats(
            accepted=min(len(vres.accepted_token_ids), remaining - 1),
            committed=len(kept),
            drafted_depth=min(vres.num_drafted, remaining - 1),
            tree_nodes=vres.num_nodes,
            draft_s=t1 - t0,
            verify_s=t2 - t1,
            host_s=t3 - max(t2, t1 + spec_s),
            transport_s=max(0.0, (t2 - t0) - server) if dres is not None or not self.use_draft else 0.0,
            draft_model_s=dres.stats.model_time_s if dres else 0.0,
            verify_model_s=vres.stats.model_time_s,
            overlap_draft_s=spec_s,
            spec_hit=hit,
            drafter=self.plan.arm if vres.num_nodes or self.plan.arm == "none" else "none",
        )
        self.stats.rounds.append(rs)
        if self.mode != "model" and self.pending_len == 1 and not self.plan.lookahead:
            # a prompt's first round is no round's cost; a lookahead round is priced by its A/B
            # policy (its pool n-grams are scored unlike the planner's matches)
            start = self.ngram_offset
            acc = set(vres.accepted_node_indices)
            flags = [start + i in acc for i in range(len(self.ngram_scores))]
            # Nor is the draft's: the first model round of a generation that opened with n-gram or
            # plain rounds pays the draft's prompt forward, which would price every model round.
            cold = self.plan.model and self.draft_cold
            self.cost.observe(self.plan, vres.num_nodes, rs.verify_s, t3 - t0, rs.draft_s,
                              len(vres.accepted_token_ids) + 1, self.ngram_scores, flags,
                              draft_cold=cold)  # fmt: skip
        return rs

    def close(self) -> None:
        """End the session on both sides (a failure here only logs: the TTL frees it anyway)."""
        self.stats.wall_time_s = time.perf_counter() - self.t_start
        if self.ngram is not None:
            self.ngram.finish()
        if self.pool is not None:
            self.pool.shutdown(wait=True)
        try:
            self.transport.end_session(self.sid)
        except Exception as e:  # cleanup must not mask the real error
            logger.warning("could not end session %s: %s", self.sid, e)


R = TypeVar("R")
Q = TypeVar("Q", DraftRequest, VerifyRequest)


def _with_recovery(call: Callable[[Q], R], req: Q, context: Callable[[], list[int]], stats: SpecStats) -> R:
    """``call(req)``; a lost or desynchronised session is rebuilt once by resending the full context."""
    try:
        return call(req)
    except (CacheDesyncError, SessionNotFound) as e:
        side = "draft" if isinstance(req, DraftRequest) else "target"
        logger.info("%s session %s lost (%s); resending the full context", side, req.session_id, e)
        stats.recoveries += 1
        if isinstance(req, DraftRequest):
            req.new_token_ids, req.prefix_length = context(), 0
        else:
            req.pending_token_ids, req.expected_prefix_length = context(), 0
        return call(req)
