"""How a TargetEngine runs a round: the verifier strategies.

A verifier takes a session, the pending tokens and the tree, runs the round's ONE target forward,
decides what is accepted (:func:`decide`: greedy or lossless stochastic, the same for every
strategy) with one host read, and keeps the KV of the accepted path.

- :class:`FullVerifier` (the default): exact, against the session's whole cache. Greedy rounds on
  the CUDA-graph path replay as ONE graph (mask, forward, acceptance and KV commit;
  ``TargetConfig.graph_rounds``); other static rounds replay the forward alone from a graph; a
  prompt's first forward is padded to a bucket (``prefill_graphs``); the rest runs eagerly.
- :class:`SpecPVVerifier` (opt-in, lossy): SpecPV partial verification for long contexts
  (:mod:`specsplit.engines.specpv`).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch

from specsplit.config import SpecPVConfig
from specsplit.core.sampling import (
    SamplingParams,
    derive_seed,
    exponential_noise,
    fast_probs,
    logits_to_probs,
    make_generator,
    position_noise,
)
from specsplit.core.tree import TokenTree
from specsplit.core.tree_attention import ancestor_matrix
from specsplit.core.verification import (
    VerifyOutcome,
    verify_greedy,
    verify_sampled_matching,
    verify_stochastic,
)
from specsplit.engines.processing import device_scores
from specsplit.engines.specpv import PartialVerifier
from specsplit.errors import ConfigError, ResourceExhausted
from specsplit.messages import HeadGuesses, VerifyResult, WorkerStats
from specsplit.runtime.graphs import GraphedRound, StaticForward, kv_bucket
from specsplit.runtime.kv_cache import StaticKVCache
from specsplit.runtime.runner import h2d

if TYPE_CHECKING:
    from specsplit.engines.processing import TreeProcessors
    from specsplit.engines.target import KVCacheState, TargetEngine
    from specsplit.runtime.heads import Guesser


class Verifier(Protocol):
    """One round of verification for a session whose lock the caller holds.

    ``returns``: (processed scores, raw logits) of the deciding rows wanted in the result;
    ``choices``: the target's token after every row (``VerifyResult.choices``), read in the same sync;
    ``guesses``: the engine's draft-head guesses (``VerifyResult.guesses``; where it runs them)."""

    def verify(
        self,
        state: KVCacheState,
        tree: TokenTree,
        pending: list[int],
        sampling: SamplingParams,
        seed: int | None,
        stats: WorkerStats,
        returns: tuple[bool, bool] = (False, False),
        choices: bool = False,
        guesses: bool = False,
    ) -> VerifyResult: ...


def decide(
    logits: torch.Tensor,
    tree: TokenTree,
    sampling: SamplingParams,
    seed: int | None,
    position: int,
    max_depth: int,
    max_branch: int,
    exact_probs: bool = False,
) -> VerifyOutcome:
    """Accept the tree's longest agreeing path: greedy, or lossless sampling.

    Under sampling a deterministic tree (``q`` one-hot: n-gram trees, dynamic trees, none at all)
    is verified against position-keyed draws (:func:`verify_sampled_matching`), so a seeded
    generation commits the same tokens whatever was drafted; a tree drawn from ``q`` goes through
    recursive rejection sampling with this round's randomness.

    Args:
        logits: `[N + 1, V]` target logits of the context row and every node.
        tree: the verified tree, on the logits' device.
        sampling: the target's sampling parameters (greedy when ``do_sample`` is off).
        seed: the generation's verification seed (sampling only; None: the global RNG).
        position: absolute position of the token row 0 samples (tokens committed before it).
        max_depth / max_branch: host-side bounds of the tree.
        exact_probs: the full-vocabulary transform; otherwise the fast one (:func:`fast_probs`),
            whose tie-overflow flag lands in the outcome's ``guard`` (see :func:`decide_to_host`).
    """
    if not sampling.do_sample:
        return verify_greedy(logits, tree, max_depth, max_branch)
    guard = None
    if exact_probs:
        probs = logits_to_probs(logits, sampling)
    else:
        probs, guard = fast_probs(logits, sampling)
    outcome = _decide_sampled(probs, tree, seed, position, max_depth, max_branch)
    outcome.guard = guard
    return outcome


def decide_to_host(
    logits: torch.Tensor,
    tree: TokenTree,
    sampling: SamplingParams,
    seed: int | None,
    position: int,
    max_depth: int,
    max_branch: int,
    guard: torch.Tensor | None = None,
    exact_logits: Callable[[], torch.Tensor] | None = None,
    choices: bool = False,
) -> tuple[torch.Tensor, tuple[list[int], list[int], int], list[int] | None]:
    """:func:`decide` and its ONE host read: ``(the logits decided on, (nodes, tokens, next token),
    the target's token after every row or None)`` (the last only with ``choices``, and only where
    the tree is deterministic: a tree drawn from ``q`` is verified by rejection sampling instead).

    With the fast sampling transform its tie-overflow flag (and ``guard``, the same kind of flag
    of whatever produced ``logits``) rides on that read; when set (more tokens tie the k-th logit
    than the fast path holds) the round is decided again exactly: the full-sort transform on
    ``exact_logits()`` (or ``logits``), a second read, rare. The flags depend on the logits only,
    never on the draws, so redoing does not bias what is sampled; a seeded round redraws the
    same randomness."""
    outcome = decide(logits, tree, sampling, seed, position, max_depth, max_branch)
    flags = [f for f in (outcome.guard, guard) if f is not None]
    if not flags:
        host = outcome.to_host(tree.token_ids, choices=choices)
        return logits, host, outcome.choices_host
    host = outcome.to_host(tree.token_ids, extra=torch.cat(flags).amax().view(1), choices=choices)
    if outcome.extra_host[0]:
        if exact_logits is not None:
            logits = exact_logits()
        outcome = decide(logits, tree, sampling, seed, position, max_depth, max_branch, exact_probs=True)
        host = outcome.to_host(tree.token_ids, choices=choices)
    return logits, host, outcome.choices_host


def _decide_sampled(
    probs: torch.Tensor,
    tree: TokenTree,
    seed: int | None,
    position: int,
    max_depth: int,
    max_branch: int,
) -> VerifyOutcome:
    if tree.q_ids is None:
        if seed is None:
            noise = exponential_noise((max_depth + 1, probs.shape[-1]), probs.device, None)
        else:
            noise = position_noise(seed, position, max_depth + 1, probs.shape[-1], probs.device)
        return verify_sampled_matching(probs, tree, max_depth, noise)
    gen = make_generator(probs.device, None if seed is None else derive_seed(seed, position))
    return verify_stochastic(probs, tree, max_depth, max_branch, gen)


def _result(
    tokens: list[int], next_token: int, nodes: list[int], prefix: int, depth: int, n: int
) -> VerifyResult:
    return VerifyResult(
        accepted_token_ids=tokens,
        next_token_id=next_token,
        accepted_node_indices=nodes,
        prefix_length=prefix,
        num_drafted=depth,
        num_nodes=n,
    )


def one_pending_layout(
    parents: torch.Tensor, depths: torch.Tensor, ctx: int | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions and the `[1 + N, 1 + N]` visibility block of one pending token followed by a tree
    (the pending token at ``ctx``, a node at ``ctx`` + its depth, each row seeing the pending token,
    itself and its ancestors); device ops only, ``ctx`` a host int or a device scalar."""
    n = parents.shape[0]
    block = torch.zeros(1 + n, 1 + n, dtype=torch.bool, device=parents.device)
    block[:, 0] = True
    if n:
        block[1:, 1:] = ancestor_matrix(parents)
    pos = torch.cat([depths.new_zeros(1), depths]) + ctx
    return pos, block


class FullVerifier:
    """Exact verification against the session's whole KV cache.

    Args:
        engine: the TargetEngine whose runner, workspace and round graphs it uses.
    """

    def __init__(self, engine: TargetEngine):
        self.engine = engine

    def verify(
        self,
        state: KVCacheState,
        tree: TokenTree,
        pending: list[int],
        sampling: SamplingParams,
        seed: int | None,
        stats: WorkerStats,
        returns: tuple[bool, bool] = (False, False),
        choices: bool = False,
        guesses: bool = False,
    ) -> VerifyResult:
        eng = self.engine
        cache = state.cache
        length = cache.seq_len
        n, p = tree.num_nodes, len(pending)
        max_branch, max_depth = tree.bounds()
        cache.ensure_capacity(length + p + n)
        proc = state.processors
        state.follows_head = state.follows_head or guesses
        ingest = state.follows_head and eng.heads is not None and eng.heads.keeps_state
        if (
            state.static
            and p == 1
            and eng.config.tuning.graph_rounds
            and not sampling.do_sample
            and cache.single_buffer
            and (proc is None or proc.graph_key is not None)
            and not any(returns)
        ):
            return self._one_graph(
                cache, tree, pending, max_branch, max_depth, stats, proc, choices, guesses, ingest
            )
        # Per-depth processors group rows on the host (for a device tree, a read of its depths).
        host_depths = tree.depths.tolist() if proc is not None and proc.needs_depths else []
        tree = tree.to(eng.device)
        ids = torch.cat([h2d(torch.tensor(pending, dtype=torch.long), eng.device), tree.token_ids])  # [P + N]
        t = time.perf_counter()
        try:
            if state.static and p == 1:  # steady state: fixed shape, replayed from a CUDA graph
                pos, block = one_pending_layout(tree.parents, tree.depths, length)
                logits = eng._workspace.static.run(ids, pos, length, block)  # [N + 1, V]
            else:  # a prompt (padded to a graph-replayed bucket on the static path) or eager
                logits = eng._prompt_forward(state.static, cache, ids, p, tree.parents)
        except Exception:
            cache.rollback(length)
            raise
        tree = tree.to(logits.device)
        scores, guard, exact = logits, None, None
        if proc is not None:  # HF processors, each row with its own context
            ctx_len = proc.begin(length, pending)
            scores = proc.scores(logits, tree, host_depths, ctx_len)
            guard = proc.overflow()
            exact = functools.partial(proc.scores, logits, tree, host_depths, ctx_len, exact=True)
            sampling = SamplingParams(do_sample=sampling.do_sample)  # the warpers ran as processors
        scores, (nodes, tokens, next_token), chosen = decide_to_host(  # the round's one host sync
            scores, tree, sampling, seed, length + p, max_depth, max_branch, guard, exact, choices
        )
        stats.model_time_s += time.perf_counter() - t
        stats.tokens_processed += p + n
        stats.forwards += 1
        cache.keep_path(nodes, length + p)
        if proc is not None:
            proc.commit(ctx_len, tokens)
        result = _result(tokens, next_token, nodes, length + p + len(nodes), max_depth, n)
        result.choices = chosen
        if guesses and eng.heads is not None:  # a second read, off the one-graph path only
            guessed = eng.heads.eager_guesses(pending, n, nodes, tokens, next_token, length, state.static)
            if guessed is not None:
                result.guesses = HeadGuesses(*eng.heads.nodes(guessed.tolist()))
        elif ingest:  # no guesses this round, but the head's cache takes the commit
            assert eng.heads is not None
            eng.heads.eager_guesses(pending, n, nodes, tokens, next_token, length, state.static, grow=False)
        if any(returns):
            rows = h2d(torch.tensor([0] + [i + 1 for i in nodes], dtype=torch.long), scores.device)
            if returns[0]:
                result.scores = scores.index_select(0, rows).float()
            if returns[1]:
                result.logits = logits.index_select(0, rows).float()
        return result

    # ------------------------------------------------------------------ one-graph greedy round
    def _one_graph(
        self,
        cache: StaticKVCache,
        tree: TokenTree,
        pending: list[int],
        max_branch: int,
        max_depth: int,
        stats: WorkerStats,
        proc: TreeProcessors | None = None,
        choices: bool = False,
        guesses: bool = False,
        ingest: bool = False,
    ) -> VerifyResult:
        """A greedy round (mask, forward, processors with a graph key, acceptance, KV commit)
        replayed as one graph (``TargetConfig.graph_rounds``); the same tensor functions as the
        eager path."""
        eng = self.engine
        static = eng._workspace.static
        length, n = cache.seq_len, tree.num_nodes
        end = length + 1 + n
        if end > static.capacity:
            raise ResourceExhausted(
                f"a verify round needs {end} slots; the workspace holds {static.capacity}"
            )
        bucket = kv_bucket(end, static.capacity)
        # a head with a cache of its own ingests the commit in every round, growing guesses or not
        heads = eng.heads if guesses or ingest else None
        grow = guesses and heads is not None
        key = (
            n,
            max_depth,
            max_branch,
            bucket,
            None if proc is None else proc.graph_key,
            heads is not None,
            grow,
        )
        t = time.perf_counter()
        rnd = eng._round_graph(
            key, lambda: self._build_round(static, cache, n, max_depth, max_branch, bucket, proc, heads, grow)
        )
        forwards = eng.runner.forward_count
        device_args: tuple[torch.Tensor, ...] = ()
        if proc is not None:
            ctx_len = proc.begin(length, pending)
            device_args = (proc.presence(eng.runner.vocab_size, ctx_len),)
        path, count, nxt, choice, guessed = rnd(
            pending[0], tree.token_ids, tree.parents, tree.depths, length, device_args=device_args
        )
        if rnd.graph is not None:  # a replay (after a capture that ran the body 3 times): one forward
            eng.runner.forward_count = forwards + 1
        outcome = VerifyOutcome(path, count, nxt, choice=choice)
        nodes, tokens, next_token = outcome.to_host(
            rnd.inputs[1], extra=guessed, choices=choices
        )  # the one sync
        m = len(nodes)
        cache.set_length(length + 1 + m)  # the graph moved the accepted slots behind the pending one
        if proc is not None:
            proc.commit(ctx_len, tokens)
        stats.model_time_s += time.perf_counter() - t
        stats.tokens_processed += 1 + n
        stats.forwards += 1
        result = _result(tokens, next_token, nodes, length + 1 + m, max_depth, n)
        result.choices = outcome.choices_host
        if grow:
            assert heads is not None
            result.guesses = HeadGuesses(*heads.nodes(outcome.extra_host))
        return result

    def _build_round(
        self,
        static: StaticForward,
        cache: StaticKVCache,
        n: int,
        max_depth: int,
        max_branch: int,
        bucket: int,
        proc: TreeProcessors | None = None,
        heads: Guesser | None = None,
        grow: bool = True,
    ) -> GraphedRound:
        buf = static.new_buffers(1 + n, bucket)
        dev = self.engine.device
        steps = torch.arange(max_depth, device=dev)
        steps_all = torch.arange(max_depth + 1, device=dev)
        stages = None if proc is None else proc.stages

        def body(
            pend: torch.Tensor,
            tok: torch.Tensor,
            par: torch.Tensor,
            dep: torch.Tensor,
            ctx: torch.Tensor,
            *present: torch.Tensor,
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
            pos, block = one_pending_layout(par, dep, ctx)
            logits = static.forward_at(buf, torch.cat([pend, tok]), pos, ctx, block)
            tree = TokenTree(tok, par, dep, torch.zeros(n, device=dev))
            if stages is not None:  # processors with a graph key: the same for every session using it
                logits = device_scores(stages, logits, tree, present[0])
            outcome = verify_greedy(logits, tree, max_depth, max_branch)
            if max_depth:  # the accepted nodes' slots follow the pending token's (padding: beyond)
                cache.move_slots(ctx + 1 + outcome.path.clamp_min(0), ctx + 1 + steps)
            assert outcome.choice is not None  # greedy: the rows' argmax
            guesses = None
            if heads is not None:  # from the committed rows: the pending token's, each accepted node's
                path = outcome.path.clamp_min(0)
                rows = torch.cat([path.new_zeros(1), path + 1])  # [1 + D] logits rows, pending first
                nxt = outcome.next_token.view(1)
                # row i decided token i + 1: the accepted tokens, then (at the last real row) the next one
                decided = torch.cat([tok.index_select(0, path), nxt]) if max_depth else nxt
                decided = torch.where(steps_all == outcome.num_accepted, nxt, decided)
                if grow:
                    guesses = heads.round_guesses(rows, decided, outcome.num_accepted + 1, ctx)
                else:  # the head's cache still takes the committed positions
                    heads.round_ingest(rows, decided, outcome.num_accepted + 1, ctx)
            return outcome.path, outcome.num_accepted, outcome.next_token, outcome.choice, guesses

        empty = torch.zeros(n, dtype=torch.long, device=dev)
        ctx = torch.zeros((), dtype=torch.long)
        present = [torch.zeros(self.engine.runner.vocab_size, dtype=torch.bool, device=dev)] if proc else []
        return GraphedRound(
            static, body, [torch.zeros(1, dtype=torch.long), empty, empty, empty, ctx], present
        )


class SpecPVVerifier:
    """SpecPV partial verification (lossy, opt-in): each round's forward runs against the full
    cache or a partial view of it, as :class:`~specsplit.engines.specpv.PartialVerifier` decides.

    Always on the eager path (sessions of an engine with SpecPV never take the static workspace).

    Args:
        engine: the TargetEngine.
        config: SpecPV settings (``enabled``).
    """

    def __init__(self, engine: TargetEngine, config: SpecPVConfig):
        self.engine = engine
        self.config = config
        self.policy = PartialVerifier(config, engine.runner)

    def verify(
        self,
        state: KVCacheState,
        tree: TokenTree,
        pending: list[int],
        sampling: SamplingParams,
        seed: int | None,
        stats: WorkerStats,
        returns: tuple[bool, bool] = (False, False),
        choices: bool = False,
        guesses: bool = False,
    ) -> VerifyResult:
        if state.processors is not None or any(returns):
            raise ConfigError("SpecPV verification does not apply logits processors or return scores")
        n = tree.num_nodes
        max_branch, max_depth = tree.bounds()
        position = state.seq_len + len(pending)  # the token row 0 samples
        state.cache.ensure_capacity(state.cache.seq_len + len(pending) + n)
        tree = tree.to(self.engine.device)
        t = time.perf_counter()
        step = self.policy.forward(state, pending, tree)
        tree = tree.to(step.logits.device)
        outcome = decide(step.logits, tree, sampling, seed, position, max_depth, max_branch, exact_probs=True)
        margin = self.config.rectify_margin
        if step.partial and margin > 0 and not sampling.do_sample:
            # Near-tie guard: the flag rides on the round's one host read.
            flag = outcome.min_margin_below(step.logits, margin)
            nodes, tokens, next_token = outcome.to_host(tree.token_ids, extra=flag, choices=choices)
            if outcome.extra_host[0]:
                step = self.policy.rectify(state, step, pending, tree)
                outcome = verify_greedy(step.logits, tree, max_depth, max_branch)
                nodes, tokens, next_token = outcome.to_host(tree.token_ids, choices=choices)
        else:  # the round's one host sync
            nodes, tokens, next_token = outcome.to_host(tree.token_ids, choices=choices)
        stats.model_time_s += time.perf_counter() - t
        stats.tokens_processed += len(step.fed) + n
        stats.forwards += 1
        stats.verify_mode = "partial" if step.partial else "full"
        prefix = self.policy.commit(state, step, nodes, tokens)
        result = _result(tokens, next_token, nodes, prefix, max_depth, n)
        result.choices = outcome.choices_host
        return result
