"""How many tree nodes a batched round verifies per row, decided per batch size.

A batched round commits, in expectation, the sum over its rows of what each row's tree is expected
to yield, and costs what one forward of that batch over that tree size costs. Speculation's gain
shrinks as the batch grows (a bigger batch makes the forward less launch-bound and more
compute-bound, so extra tree tokens stop being free); at batch sizes where plain one-token steps
commit more tokens per second, the planner picks no tree at all (size 0).

Costs are measured online per (padded batch size, tree size) as whole-round wall times (the
n-gram proposals, the forward, the commit), robust to the first round of a shape capturing a graph
(:class:`~specsplit.engines.cost_model.RoundCosts`). Acceptance comes from the n-gram proposal scores,
calibrated against how often nodes of each score were accepted. Sizes without a trusted cost are
tried first. Deterministic under test: costs can be injected.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from itertools import accumulate

from specsplit.engines.cost_model import Calibration, RoundCosts

BATCH_TREE_SIZES = (0, 4, 8, 16)  # nodes per row a batched round may verify (one graph shape each)
PROBE_EVERY = 16  # while plain steps win, rounds between two that look at the n-gram proposals again


class BatchPlanner:
    """Picks each batched round's tree size (see the module docstring). Thread-safe.

    Args:
        sizes: candidate nodes per row (0 = plain one-token steps).
        skip_first: drop each shape's first sample (graph capture).
        costs: injected ``(padded batch, nodes) -> seconds`` (tests); measured when None.
    """

    def __init__(
        self,
        sizes: Sequence[int] = BATCH_TREE_SIZES,
        skip_first: bool = True,
        costs: Callable[[int, int], float] | None = None,
    ):
        self.sizes = tuple(sorted(set(sizes)))
        self._curves: dict[int, RoundCosts] = {}
        self._skip_first = skip_first
        self._costs = costs
        self.cal = Calibration()
        self._idle: dict[int, int] = {}  # batch -> rounds left without proposals
        self._lock = threading.Lock()

    def _curve(self, batch: int) -> RoundCosts:
        curve = self._curves.get(batch)
        if curve is None:
            curve = self._curves[batch] = RoundCosts(skip_first=self._skip_first)
        return curve

    def seconds(self, batch: int, nodes: int) -> float | None:
        """Predicted seconds of a round of ``batch`` padded rows verifying ``nodes`` per row."""
        if self._costs is not None:
            return self._costs(batch, nodes)
        return self._curve(batch).estimate(nodes)

    def expected(self, scores: Sequence[Sequence[float]], nodes: int) -> float:
        """Expected tokens a round commits over all rows when each verifies its ``nodes`` best."""
        return self._curve_of(scores)(nodes)

    def _curve_of(self, scores: Sequence[Sequence[float]]) -> Callable[[int], float]:
        """``k -> `` expected tokens of a round verifying each row's ``k`` best-scored nodes."""
        prefix = [
            list(accumulate((self.cal.p(s) for s in sorted(row, reverse=True)), initial=0.0))
            for row in scores
        ]
        rows = len(scores)
        return lambda k: rows + sum(p[min(k, len(p) - 1)] for p in prefix)

    def wants_proposals(self, batch: int) -> bool:
        """Whether this round needs n-gram proposals: not while plain steps win at this batch size,
        except every :data:`PROBE_EVERY` rounds (the text may start repeating)."""
        with self._lock:
            idle = self._idle.get(batch, 0)
            if idle <= 0:
                return True
            self._idle[batch] = idle - 1
            return False

    def plan(self, batch: int, scores: Sequence[Sequence[float]]) -> int:
        """Nodes per row for a round of ``batch`` padded rows whose proposals scored ``scores``."""
        with self._lock:
            longest = max((len(s) for s in scores), default=0)
            if not longest:  # nothing proposed anywhere: a plain step
                return 0
            # Sizes past the smallest one that holds every row's proposal only add padding.
            cap = next((s for s in self.sizes if s >= longest), self.sizes[-1])
            sizes = [s for s in self.sizes if s <= cap]
            if self._costs is None:
                curve = self._curve(batch)
                for s in sizes:  # measure each candidate shape before trusting the model
                    if not curve.trusted(s):
                        return s
            expected = self._curve_of(scores)
            best, best_rate = 0, -1.0
            for s in sizes:
                t = self.seconds(batch, s)
                if t is None or t <= 0:
                    continue
                rate = expected(s) / t
                if rate > best_rate:
                    best, best_rate = s, rate
            self._idle[batch] = PROBE_EVERY - 1 if best == 0 else 0
            return best

    def observe(
        self, batch: int, nodes: int, seconds: float, scores: Sequence[float], accepted: Sequence[bool]
    ) -> None:
        """A round's wall time, and which proposed nodes (by score) were accepted."""
        with self._lock:
            if self._costs is None:
                self._curve(batch).add(nodes, seconds)
            self.cal.add(scores, accepted)
