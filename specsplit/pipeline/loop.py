"""The decoding loop: draft, verify, commit, stop — for one sequence, over any Transport.

Stop conditions (checked on the committed tokens of each round, never overshooting): any EOS id,
any stop string (the text of the generated tokens ends with it), ``max_new_tokens``.
Recovery: a desynchronised or lost session is rebuilt by resending the full context; an
unreachable draft turns the rest of the generation into target-only steps (same output).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Generator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from specsplit.config import SamplingParams, TreeConfig
from specsplit.core.tree import TokenTree
from specsplit.errors import CacheDesyncError, ConfigError, SessionNotFound, TransportError
from specsplit.telemetry import RoundStats, SpecStats
from specsplit.transport import (
    DraftRequest,
    DraftResult,
    GenerateRequest,
    Transport,
    VerifyRequest,
    VerifyResult,
)

logger = logging.getLogger(__name__)

_SEED_HIGH = 2**62


@dataclass
class DecodeParams:
    """What the loop needs besides the prompt."""

    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    tree: TreeConfig = field(default_factory=TreeConfig)
    eos_token_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    tokenizer: Any = None  # needed for stop strings
    generator: torch.Generator | None = None  # CPU RNG the per-round seeds are drawn from
    after_draft: Callable[[], None] | None = None  # e.g. a device sync for exact timing
    overlap: bool = False  # draft round N+1 (speculatively) while round N verifies
    overlap_policy: str = "adaptive"  # or "always" (see SpecSplitConfig.overlap_policy)
    policy: OverlapPolicy | None = None  # kept across calls by the caller; None: a fresh one
    loop: str = "client"  # "target": the target worker runs the rounds (GrpcTransport.generate_on_target)


class OverlapPolicy:
    """When to speculate in overlapped mode: measure, keep the faster, re-measure less and less often.

    Speculation never changes the committed tokens, only the time they take: whether it pays depends
    on the draft/verify cost ratio and the hit rate, which vary by machine, model pair and prompt. So
    the policy times ``probe`` rounds with speculation and ``probe`` rounds without (wall seconds
    per committed token), holds the faster mode for ``hold`` rounds, then probes the other mode
    again and compares. Each re-probe that confirms the held mode doubles the hold (up to
    ``max_hold``), so a mode that keeps losing costs ever fewer rounds; a switch resets it.
    A probe's cost leaves out its stalls: rounds over ``STALL`` times the probe's median round time
    (a graph capture or a compile on a new shape, a page fault), which say nothing about the mode.
    ``always=True`` speculates every round.

    A :class:`~specsplit.generator.SpecSplitGenerator` keeps one policy per tree shape across
    ``generate()`` calls, so the probes are paid once per generator, not once per prompt; calls
    from several threads share it (``record`` takes a lock).
    """

    STALL = 4.0

    def __init__(self, always: bool = False, probe: int = 6, hold: int = 24, max_hold: int = 768):
        self.always, self.probe, self.hold, self.max_hold = always, probe, hold, max(max_hold, hold)
        self.cost: dict[bool, float | None] = {True: None, False: None}  # seconds per token
        self.mode, self.left, self.measuring = True, probe, True
        self._rounds: list[tuple[float, int]] = []  # (seconds, tokens) of the probe so far
        self._held: bool | None = None  # the mode held before the current re-probe
        self._hold_now = hold
        self._lock = threading.Lock()

    def speculate(self) -> bool:
        return self.always or self.mode

    def _probe_cost(self) -> float:
        """Seconds per committed token over the probe's rounds, stalls left out."""
        if not self._rounds:
            return float("inf")
        times = sorted(t for t, _ in self._rounds)
        limit = self.STALL * times[(len(times) - 1) // 2]
        kept = [(t, n) for t, n in self._rounds if t <= limit]
        return sum(t for t, _ in kept) / max(sum(n for _, n in kept), 1)

    def record(self, seconds: float, tokens: int) -> None:
        """One finished round: its wall time and committed tokens."""
        if self.always:
            return
        with self._lock:
            self._record(seconds, tokens)

    def _record(self, seconds: float, tokens: int) -> None:
        if self.measuring:
            self._rounds.append((seconds, tokens))
        self.left -= 1
        if self.left > 0:
            return
        if self.measuring:
            self.cost[self.mode] = self._probe_cost()
            self._rounds = []
        other = not self.mode
        if self.cost[other] is None or not self.measuring:  # measure the other mode next
            if not self.measuring:
                self._held = self.mode
            self.mode, self.left, self.measuring = other, self.probe, True
            return
        # both measured: hold the faster, longer each time a re-probe confirms it
        best = min((True, False), key=lambda m: self.cost[m] or 0.0)
        self._hold_now = min(2 * self._hold_now, self.max_hold) if best == self._held else self.hold
        if best != self._held:
            logger.debug("overlap policy: speculation %s (%.4g vs %.4g s/token)",
                         "on" if best else "off", self.cost[True], self.cost[False])  # fmt: skip
        self.mode, self.left, self.measuring = best, self._hold_now, False


class OverlapPolicies(dict):
    """``{(tree shape repr, do_sample): OverlapPolicy}``, kept across generations.

    What a policy measured on earlier prompts holds for the next ones on the same machine and
    pair, so a generator (and a target worker running rounds for its clients) keeps one per tree
    shape and sampling mode here instead of probing again on every prompt.
    """

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()

    def policy(self, tree: TreeConfig, do_sample: bool, always: bool) -> OverlapPolicy:
        key = (repr(tree), do_sample)
        with self._lock:
            policy = self.get(key)
            if policy is None or policy.always != always:
                policy = self[key] = OverlapPolicy(always=always)
            return policy


class _StopChecker:
    def __init__(self, params: DecodeParams):
        self.eos = params.eos_token_ids
        self.stops = params.stop_strings
        self.tok = params.tokenizer
        if self.stops and self.tok is None:
            raise ValueError("stop_strings need a tokenizer (pass tokenizer= to generate)")
        self.window = (max((len(s) for s in self.stops), default=0) + 8) if self.stops else 0

    def cut(self, generated: list[int], new: list[int]) -> tuple[list[int], bool]:
        """Truncate ``new`` after the first stop condition; ``(kept, stopped)``."""
        for i, t in enumerate(new):  # at most tree depth + 1 host ints
            if t in self.eos:
                return self._strings(generated, new[: i + 1], True)
        return self._strings(generated, new, False)

    def _strings(self, generated: list[int], new: list[int], stopped: bool) -> tuple[list[int], bool]:
        if not self.stops:
            return new, stopped
        tail = generated[-self.window :]
        for i in range(len(new)):  # only with stop strings: a text check per committed token
            text = self.tok.decode(tail + new[: i + 1], skip_special_tokens=False)
            if any(text.endswith(s) for s in self.stops):
                return new[: i + 1], True
        return new, stopped


def _round_seeds(params: DecodeParams) -> tuple[int | None, int | None]:
    if not params.sampling.do_sample:
        return None, None
    s = torch.randint(0, _SEED_HIGH, (2,), generator=params.generator).tolist()
    return int(s[0]), int(s[1])


def decode(
    transport: Transport,
    prompt: list[int],
    params: DecodeParams,
    on_tokens: Callable[[list[int]], None] | None = None,
    session_id: str | None = None,
) -> tuple[list[int], SpecStats]:
    """Generate up to ``params.max_new_tokens`` tokens after ``prompt``.

    With ``params.overlap`` the draft side drafts round N+1 while the target verifies round N,
    assuming round N accepts the draft's main path and the target's next token equals the draft's
    own guess (``DraftRequest.speculate``). On a hit the next tree is ready when verification
    returns; on a miss it is dropped and the next tree is drafted from the committed context as in
    sequential mode. Per-round seeds are drawn in the same order either way, so the committed
    tokens are the same as sequential mode's.

    With ``params.loop == "target"`` the target worker runs this same loop itself
    (:func:`_decode_on_target`); the result is the same.

    :func:`decode_rounds` is the same loop as a generator of rounds.

    Returns:
        ``(new token ids, stats)``; the session is ended on both sides before returning.
    """
    if not prompt:
        raise ValueError("the prompt must contain at least one token")
    if params.loop == "target":
        return _decode_on_target(transport, prompt, params, on_tokens, session_id)
    if params.loop != "client":
        raise ConfigError(f"loop must be 'client' or 'target', got {params.loop!r}")
    out: list[int] = []
    stats = SpecStats(prompt_tokens=len(prompt))
    rounds = decode_rounds(transport, prompt, params, out, stats, session_id)
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
    """
    sid = session_id or uuid.uuid4().hex
    stopper = _StopChecker(params)
    overlap = params.overlap and transport.has_draft
    extra = params.tree.depth_limit + 1 if overlap else 0  # a speculative extension's tokens
    capacity = len(prompt) + params.max_new_tokens + params.tree.draft_slots + extra + 8
    use_draft = transport.has_draft
    draft_prefix, draft_new = 0, list(prompt)
    target_prefix, pending = 0, list(prompt)
    ready: DraftResult | None = None  # next round's tree, drafted speculatively (a hit)
    pool = ThreadPoolExecutor(1, thread_name_prefix="specsplit-verify") if overlap else None
    policy = params.policy or OverlapPolicy(always=params.overlap_policy == "always")
    seeds = _round_seeds(params)
    t_start = time.perf_counter()
    deferred: tuple[list[int], RoundStats] | None = None  # the last round, not yet yielded
    try:
        while len(out) < params.max_new_tokens:
            remaining = params.max_new_tokens - len(out)
            seed_d, seed_v = seeds
            t0 = time.perf_counter()
            tree, dres = TokenTree.empty(), None
            if use_draft and remaining > 1:
                if ready is not None:
                    dres, ready = ready, None
                    tree = dres.tree
                else:
                    req = DraftRequest(sid, draft_new, draft_prefix, params.tree, params.sampling, seed_d,
                                       remaining - 1, capacity)  # fmt: skip
                    try:
                        dres = _draft(transport, req, prompt + out, stats)
                        tree, draft_prefix, draft_new = dres.tree, dres.prefix_length, []
                    except TransportError as e:
                        logger.warning(
                            "draft unreachable (%s); continuing target-only, output is unchanged", e
                        )
                        use_draft, stats.draft_fallback = False, True
                    if params.after_draft is not None:
                        params.after_draft()
            t1 = time.perf_counter()
            if deferred is not None:  # the consumer's time is no round's: shift this round's clock
                yield deferred
                deferred, gap = None, time.perf_counter() - t1
                t0, t1 = t0 + gap, t1 + gap
            vreq = VerifyRequest(sid, tree, pending, target_prefix, params.sampling, seed_v, capacity)
            seeds = _round_seeds(params)  # next round's, drawn before speculation uses them
            spec, spec_s = None, 0.0
            if pool is not None and use_draft and dres is not None and remaining > 2 and policy.speculate():
                job = pool.submit(_timed_verify, transport, vreq, prompt + out, stats)
                spec, spec_s = _speculate(
                    transport, sid, draft_prefix, params, seeds[0], remaining - 1, capacity
                )
                vres, t2 = job.result()
            else:
                vres, t2 = _timed_verify(transport, vreq, prompt + out, stats)
            new = vres.accepted_token_ids + [vres.next_token_id]
            kept, stopped = stopper.cut(out, new[:remaining])
            out.extend(kept)
            target_prefix, pending = vres.prefix_length, [vres.next_token_id]
            hit = None
            if spec is not None:
                hit = not stopped and spec.assumed_token_ids == new and len(kept) == len(new)
                stats.spec_rounds += 1
                stats.spec_hits += hit
            if hit:
                ready, draft_prefix, draft_new = spec, spec.prefix_length, []  # type: ignore[union-attr]
            else:
                draft_new = draft_new + new
            t3 = time.perf_counter()
            if pool is not None:
                policy.record(t3 - t0, len(kept))
            server = (dres.stats.busy_s if dres else 0.0) + vres.stats.busy_s
            stats.rounds.append(
                RoundStats(
                    accepted=len(vres.accepted_token_ids),
                    committed=len(kept),
                    drafted_depth=vres.num_drafted,
                    tree_nodes=vres.num_nodes,
                    draft_s=t1 - t0,
                    verify_s=t2 - t1,
                    host_s=t3 - max(t2, t1 + spec_s),
                    transport_s=max(0.0, (t2 - t0) - server) if dres is not None or not use_draft else 0.0,
                    draft_model_s=dres.stats.model_time_s if dres else 0.0,
                    verify_model_s=vres.stats.model_time_s,
                    overlap_draft_s=spec_s,
                    spec_hit=hit,
                )
            )
            if defer_updates and not stopped:
                deferred = (kept, stats.rounds[-1])
                continue
            yield kept, stats.rounds[-1]
            if stopped:
                break
        if deferred is not None:  # the last round (max_new_tokens reached)
            yield deferred
    finally:
        stats.wall_time_s = time.perf_counter() - t_start
        if pool is not None:
            pool.shutdown(wait=True)
        try:
            transport.end_session(sid)
        except Exception as e:  # cleanup must not mask the real error; TTL frees it anyway
            logger.warning("could not end session %s: %s", sid, e)


def _decode_on_target(
    transport: Transport,
    prompt: list[int],
    params: DecodeParams,
    on_tokens: Callable[[list[int]], None] | None,
    session_id: str | None,
) -> tuple[list[int], SpecStats]:
    """:func:`decode` with the round loop on the target worker: one network hop a round.

    The worker cuts at EOS and ``max_new_tokens``; stop strings are checked here on the streamed
    tokens, and the call is cancelled at the first match (the worker may have run one round
    more, which is dropped). Sampling seeds: the worker draws them from a copy of this call's
    generator state in the same order as :func:`decode`, and afterwards this generator is advanced
    by the same draws, so tokens and generator state equal client-loop mode's.
    """
    run = getattr(transport, "generate_on_target", None)
    if run is None:
        raise ConfigError(
            f"loop='target' needs a transport that runs rounds on the target worker (GrpcTransport), "
            f"got {type(transport).__name__}"
        )
    stats = SpecStats(prompt_tokens=len(prompt))
    stopper = _StopChecker(params)
    out: list[int] = []
    rng_state = b""
    if params.sampling.do_sample:
        gen = params.generator if params.generator is not None else torch.default_generator
        rng_state = gen.get_state().numpy().tobytes()
    req = GenerateRequest(
        session_id=session_id or uuid.uuid4().hex,
        prompt_token_ids=list(prompt),
        max_new_tokens=params.max_new_tokens,
        sampling=params.sampling,
        tree=params.tree,
        eos_token_ids=sorted(params.eos_token_ids),
        rng_state=rng_state,
        overlap=params.overlap,
        overlap_policy=params.overlap_policy,
    )
    t_start = time.perf_counter()
    stream = run(req)
    finished = stopped = False
    try:
        for update in stream:
            for tokens, rs in update.rounds:
                kept, stopped = stopper.cut(out, tokens)
                rs.committed = len(kept)
                out.extend(kept)
                stats.rounds.append(rs)
                if rs.spec_hit is not None:
                    stats.spec_rounds += 1
                    stats.spec_hits += rs.spec_hit
                if on_tokens is not None:
                    on_tokens(kept)
                if stopped:
                    break
            if update.done:
                stats.recoveries, stats.draft_fallback = update.recoveries, update.draft_fallback
                finished = True
            if stopped or update.done:
                break
        if not (finished or stopped):
            raise TransportError("the target worker ended the generation stream before its end")
    finally:
        if not finished:
            stream.cancel()  # a stop string, an error here, or the worker failing: stop it there too
        stats.wall_time_s = time.perf_counter() - t_start
    for _ in range(1 + len(stats.rounds)):  # the draws decode() makes (none under greedy)
        _round_seeds(params)
    return out, stats


def _timed_verify(
    transport: Transport, req: VerifyRequest, context: list[int], stats: SpecStats
) -> tuple[VerifyResult, float]:
    res = _verify(transport, req, context, stats)
    return res, time.perf_counter()


def _speculate(
    transport: Transport,
    sid: str,
    prefix: int,
    params: DecodeParams,
    seed: int | None,
    budget: int,
    capacity: int,
) -> tuple[DraftResult | None, float]:
    """Draft the next round assuming this one accepts the main path (runs beside verification).

    Any failure only costs the speculation: the next round drafts from the committed context.
    """
    t = time.perf_counter()
    req = DraftRequest(sid, [], prefix, params.tree, params.sampling, seed, budget, capacity, speculate=True)
    try:
        res: DraftResult | None = transport.draft(req)
    except (TransportError, CacheDesyncError, SessionNotFound) as e:
        logger.info("speculative draft failed (%s); the next round drafts normally", e)
        res = None
    return res, time.perf_counter() - t


def _draft(transport: Transport, req: DraftRequest, context: list[int], stats: SpecStats) -> DraftResult:
    try:
        return transport.draft(req)
    except (CacheDesyncError, SessionNotFound) as e:
        logger.info("draft session %s lost (%s); resending the full context", req.session_id, e)
        stats.recoveries += 1
        req.new_token_ids, req.prefix_length = list(context), 0
        return transport.draft(req)


def _verify(transport: Transport, req: VerifyRequest, context: list[int], stats: SpecStats) -> VerifyResult:
    try:
        return transport.verify(req)
    except (CacheDesyncError, SessionNotFound) as e:
        logger.info("target session %s lost (%s); resending the full context", req.session_id, e)
        stats.recoveries += 1
        req.pending_token_ids, req.expected_prefix_length = list(context), 0
        return transport.verify(req)
