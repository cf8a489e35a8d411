"""Which of two ways of running rounds commits tokens faster: measured, held, re-measured.

:class:`OverlapPolicy` decides whether an overlapped pipeline speculates
(:mod:`specsplit.pipeline.overlap`), and whether an n-gram generation runs lookahead rounds
(:mod:`specsplit.core.lookahead`): in both, the committed tokens do not depend on the choice, only
the time they take.
"""

from __future__ import annotations

import logging
import threading

logger = logging.getLogger(__name__)


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

    The same measurement decides lookahead: ``speculate()`` True means lookahead rounds, False the
    planner's rounds (:meth:`~specsplit.engines.drafters.NgramDrafter.lookahead_policy`, one per
    n-gram drafter and sampling mode).
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


class GrowthCost:
    """What growing draft-head guesses costs a round on this machine: rounds with and without them
    timed (moving averages), and a committed token's time. Shared by a generator's generations
    (:meth:`~specsplit.engines.drafters.NgramDrafter.guess_policy`); ``record`` takes a lock."""

    STALL = 4.0  # rounds over this many times their mode's average (a compile, a capture) are not timed

    def __init__(self, decay: float = 0.8):
        self.decay = decay
        self.round_s: dict[bool, float | None] = {True: None, False: None}  # a round, grown or not
        self.token_s: float | None = None  # a committed token
        self._seen = {True: 0, False: 0}
        self._lock = threading.Lock()

    def tokens(self) -> float | None:
        """The growth's cost in committed tokens (None until rounds of both kinds were timed)."""
        grown, bare, tok = self.round_s[True], self.round_s[False], self.token_s
        if grown is None or bare is None or not tok:
            return None
        return max(0.0, grown - bare) / tok

    def record(self, grew: bool, seconds: float, tokens: int) -> None:
        """A finished round: whether it grew guesses, its wall time and committed tokens."""
        with self._lock:
            self._seen[grew] += 1
            if self._seen[grew] == 1:  # a mode's first round compiles or captures its graph
                return
            avg = self.round_s[grew]
            if avg is not None and seconds > self.STALL * avg:
                return
            d = self.decay
            self.round_s[grew] = seconds if avg is None else d * avg + (1 - d) * seconds
            per = seconds / max(tokens, 1)
            self.token_s = per if self.token_s is None else d * self.token_s + (1 - d) * per


class GuessPolicy:
    """Whether a round grows the target's draft-head guesses for the next round (one generation's).

    An EAGLE head's tree costs a few small forwards a round, and it pays only where the round's other
    nodes would not have found the same tokens: while the text copies its context, n-gram nodes
    alone accept long runs and the guesses add little. So after each round that verified guesses,
    the loop reports their *gain* (accepted tokens past the longest accepted run of the round's other
    nodes) under the context they were grown in: how far the other nodes alone reached in the round
    before (a run below 2, below 4, or 4 or more tokens). A context grows guesses while its
    moving average gain exceeds their cost in tokens (:class:`GrowthCost`, timed on this machine
    and shared by a generator's generations, or ``cost_tokens`` where it is given: tests, a known
    machine). Gains belong to a generation (they depend on its text); a context that stops growing
    grows one round in ``probe`` to follow changes. The committed tokens never depend on the choice,
    only the time they take.
    """

    RUNS = (2, 4)  # context bucket limits: a run below 2, below 4, or longer

    def __init__(
        self, always: bool = False, cost_tokens: float | None = None, probe: int = 4, decay: float = 0.5,
        timing: GrowthCost | None = None,
    ):  # fmt: skip
        self.always, self.cost_tokens, self.probe, self.decay = always, cost_tokens, probe, decay
        self.timing = timing if timing is not None else GrowthCost()
        self.gain: list[float | None] = [None] * (len(self.RUNS) + 1)  # tokens, per context
        self._skipped = [0] * (len(self.RUNS) + 1)

    def context(self, run: int) -> int:
        """The context bucket of a round whose other nodes alone accepted ``run`` tokens."""
        return sum(run >= r for r in self.RUNS)

    def cost(self) -> float | None:
        """Tokens a round's growth costs (None until rounds of both kinds were timed)."""
        return self.cost_tokens if self.cost_tokens is not None else self.timing.tokens()

    def grow(self, context: int) -> bool:
        """Whether this round grows guesses, in ``context`` (:meth:`context`)."""
        if self.always:
            return True
        gain, cost = self.gain[context], self.cost()
        if cost is None and self.timing.round_s[True] is not None:
            # the growth's own cost is not known yet: a round without it now and then times it
            self._skipped[context] += 1
            return self._skipped[context] % self.probe != 0
        if gain is None or cost is None or gain > cost:
            self._skipped[context] = 0
            return True
        self._skipped[context] += 1
        if self._skipped[context] >= self.probe:
            self._skipped[context] = 0
            return True
        return False

    def record_gain(self, context: int, gain: int) -> None:
        """Tokens a round's guesses added, grown in ``context``."""
        if self.always:
            return
        old = self.gain[context]
        self.gain[context] = gain if old is None else self.decay * old + (1 - self.decay) * gain

    def record_round(self, grew: bool, seconds: float, tokens: int) -> None:
        """A finished round: whether it grew guesses, its wall time and committed tokens."""
        if not self.always and self.cost_tokens is None:
            self.timing.record(grew, seconds, tokens)
