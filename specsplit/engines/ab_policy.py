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
