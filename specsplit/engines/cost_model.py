"""A cost model that sizes every round: which drafter, how many nodes, or no speculation at all.

A round commits ``E`` tokens in expectation (the accepted ones plus the target's own) and costs
``T`` seconds; the round loop wants the largest ``E / T``. The model measures, online, on the
machine and pair at hand:

- ``t_fixed``: the loop's own time a round (host work, transport), outside the verify call;
- ``t_verify(n)``: a verification of ``n`` tree nodes, per tree size (a target step is ``n = 0``);
  sizes not seen yet are interpolated, and beyond the largest seen, extrapolated;
- ``t_model``: a model draft (the draft call plus the GPU work it leaves for the verification);
- acceptance: n-gram proposal scores are calibrated against how often nodes of that score were
  accepted; the model draft's tokens per round are an average over the rounds that used it, and so
  are its nodes (a chain that stops at a confidence floor verifies fewer than its budget).

Costs are robust to one-off stalls: the first round of a shape captures a graph or compiles, and a
stall must never become a cost that keeps an arm from being tried again.

A plain step is measured before anything is priced from tree rounds: every arm is judged against it.

Each round it evaluates the arms the drafter mode allows — no speculation, an n-gram tree of each
size, the model's tree, the model's tree with n-gram nodes merged in — and picks the best predicted
``E / T``. No speculation is an arm like the others, so when nothing pays the loop runs plain
target steps: SpecSplit is never (for long) slower than its own target-only decode. Arms with a
model draft are probed now and then (like :class:`~specsplit.pipeline.overlap.OverlapPolicy`),
ever less often while they lose.

Deterministic under test: :class:`FixedCosts` injects the costs, and nothing here is random.
"""

from __future__ import annotations

import bisect
import statistics
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from specsplit.engines.drafters import tree_sizes

MODES = ("model", "ngram", "suffix", "hybrid", "auto")
_CAL_BINS = 10
_CAL_PRIOR = 4.0  # pseudo-observations at the raw score, per calibration bin
_EMA = 0.2
_WINDOW = 5  # samples a cost estimate keeps
GENERATION_PROBE_MARGIN = 1.5  # see CostModel.new_generation


@dataclass(frozen=True)
class RoundPlan:
    """What one round drafts.

    Attributes:
        model: run the model draft.
        ngram_size: nodes of the n-gram tree (0: none); merged into the model's tree when both.
        expected: predicted tokens committed.
        seconds: predicted round time.
        probe: chosen to measure an arm, not because it looked best.
        lookahead: a fixed round (n-gram nodes, a Jacobi window and/or the target's draft-head
            guesses; chosen by the lookahead A/B policy, not by the planner).
        heads: a fixed round that carries the target's draft-head guesses.
    """

    model: bool
    ngram_size: int
    expected: float = 1.0
    seconds: float = 0.0
    probe: bool = False
    lookahead: bool = False
    heads: bool = False

    @property
    def arm(self) -> str:
        if self.lookahead:
            return "heads" if self.heads else "lookahead"
        if self.model:
            return "hybrid" if self.ngram_size else "model"
        return "ngram" if self.ngram_size else "none"


@dataclass
class FixedCosts:
    """Injected costs (tests, or a machine measured ahead of time); the model then learns acceptance only.

    Attributes:
        fixed: seconds of the loop's own work a round.
        verify: seconds of a verification of ``n`` nodes.
        model: seconds a model draft adds to a round.
    """

    fixed: float
    verify: Callable[[int], float]
    model: float = float("inf")


class _Estimate:
    """A cost measured again and again, robust to one-off stalls (a graph capture, a compile, a page
    fault): the smaller of the first two samples, then the median of the last few.

    Args:
        skip_first: drop the very first sample (the first round of a shape captures or compiles).
    """

    def __init__(self, skip_first: bool = False) -> None:
        self._skip = skip_first
        # A size whose first round may have stalled needs a second sample before it is believed.
        self._needed = 2 if skip_first else 1
        self.samples: deque[float] = deque(maxlen=_WINDOW)
        self._value: float | None = None

    def add(self, seconds: float) -> None:
        if self._skip:
            self._skip = False
            return
        self.samples.append(seconds)
        n = len(self.samples)
        self._value = min(self.samples) if n <= 2 else statistics.median(self.samples)

    @property
    def trusted(self) -> bool:
        """Enough samples that a single stall can no longer be the estimate."""
        return len(self.samples) >= self._needed

    @property
    def value(self) -> float | None:
        return self._value


class RoundCosts:
    """Verification seconds by tree size: a robust estimate per measured size, interpolated between
    sizes and extrapolated beyond them; sizes measured fewer than twice borrow from the others.

    Args:
        skip_first: drop each size's first sample (a target that replays graphs captures, and may
            compile, on a size's first round); an eager target's first round is a real cost.
        growth: with one size measured, how much a verification grows a node, as a share of that
            size's time: a forward replayed from graphs (a GPU's) hardly grows with a few more rows,
            an eager one on a CPU, bound by reading its weights once a row, about 5% a node.
    """

    def __init__(self, skip_first: bool = True, growth: float = 0.01) -> None:
        self.sizes: dict[int, _Estimate] = {}
        self._skip_first = skip_first
        self._growth = growth
        self._table: tuple[list[int], dict[int, float]] | None = None  # what interpolation reads

    def add(self, n: int, seconds: float) -> None:
        self.sizes.setdefault(n, _Estimate(skip_first=self._skip_first)).add(seconds)
        self._table = None

    def trusted(self, n: int) -> bool:
        """Size ``n`` has enough samples of its own that one stall is not its estimate."""
        est = self.sizes.get(n)
        return est is not None and est.trusted

    def estimate(self, n: int) -> float | None:
        """Seconds at size ``n`` (measured, interpolated or extrapolated; None before any sample)."""
        return self(n)

    def __call__(self, n: int) -> float | None:
        est = self.sizes.get(n)
        if est is not None and est.trusted:
            return est.value
        if self._table is None:  # rebuilt once per new sample, not once per size a plan prices
            measured = {m: e for m, e in self.sizes.items() if e.value is not None}
            trusted = {m: e for m, e in measured.items() if e.trusted}
            # nothing trusted yet: any sample beats no estimate
            table = {m: e.value for m, e in (trusted or measured).items() if e.value is not None}
            self._table = (sorted(table), table)
        xs, mean = self._table
        if not xs:
            return None
        i = bisect.bisect_left(xs, n)
        if 0 < i < len(xs):  # between two measured sizes
            a, b = xs[i - 1], xs[i]
            return mean[a] + (mean[b] - mean[a]) * (n - a) / (b - a)
        if len(xs) == 1:  # one size known: assume the growth given
            return mean[xs[0]] * (1.0 + self._growth * abs(n - xs[0]))
        a, b = (xs[0], xs[1]) if i == 0 else (xs[-2], xs[-1])
        slope = max((mean[b] - mean[a]) / (b - a), 0.0)
        return max(mean[a] + slope * (n - a), 0.0)


@dataclass
class Calibration:
    """How often n-gram nodes of a given proposal score end on the accepted path."""

    proposed: list[float] = field(default_factory=lambda: [0.0] * _CAL_BINS)
    accepted: list[float] = field(default_factory=lambda: [0.0] * _CAL_BINS)

    @staticmethod
    def _bin(score: float) -> int:
        return min(int(score * _CAL_BINS), _CAL_BINS - 1)

    def p(self, score: float) -> float:
        b = self._bin(score)
        return (self.accepted[b] + _CAL_PRIOR * score) / (self.proposed[b] + _CAL_PRIOR)

    def add(self, scores: Sequence[float], accepted: Sequence[bool]) -> None:
        for s, ok in zip(scores, accepted, strict=True):
            if s > 0.0:  # padding nodes carry no score
                b = self._bin(s)
                self.proposed[b] += 1.0
                self.accepted[b] += float(ok)


class CostModel:
    """Chooses each round's drafting for one drafter mode (see the module docstring).

    One instance serves a generator (or a worker) across generations, for one mode, tree shape and
    sampling setting: what it measured on earlier prompts holds for the next ones. Thread-safe.

    Args:
        mode: ``"model"``, ``"ngram"``, ``"suffix"``, ``"hybrid"`` or ``"auto"``.
        model_nodes: nodes of the model draft's tree (its shape's budget).
        max_ngram: most n-gram nodes a round may verify.
        padded: n-gram trees are padded to a few sizes (a target on the CUDA-graph path) rather
            than verified at exactly the size a round needs.
        costs: injected costs (tests); measured online when None.
        probe_every: rounds between probes of an arm with a model draft while another arm wins
            (doubling up to ``max_probe_every`` each time the probe confirms it loses).
    """

    def __init__(
        self,
        mode: str,
        model_nodes: int = 0,
        max_ngram: int = 32,
        padded: bool = True,
        costs: FixedCosts | None = None,
        probe_every: int = 32,
        max_probe_every: int = 1024,
    ):
        if mode not in MODES:
            raise ValueError(f"drafter must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self.model_nodes = model_nodes
        self.padded = padded
        self.sizes = tree_sizes(max_ngram, padded) if max_ngram > 0 else ()
        self.costs = costs
        # Padded trees: a target that replays graphs (a GPU); exact sizes: an eager one (a CPU).
        self.verify = RoundCosts(skip_first=padded, growth=0.01 if padded else 0.05)
        self._fixed = _Estimate()
        self._model_cost = _Estimate()
        self.model_tau: float | None = None  # tokens a round with the model's tree alone
        # nodes a model tree has (a chain that stops at a confidence floor drafts fewer than its budget)
        self.model_drafted: float | None = None
        self.merge_gain = 0.5  # share of the n-gram nodes' expected gain a merged tree keeps
        self.cal = Calibration()
        self.rounds = 0
        self.probe_every, self.max_probe_every = probe_every, max_probe_every
        self._next_probe = 0
        self._probe_left = 3  # model rounds measured first (when a model is there)
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ costs
    @property
    def fixed(self) -> float | None:
        """The loop's own seconds a round outside the verify call (measured)."""
        return self._fixed.value

    def _t_fixed(self) -> float:
        if self.costs is not None:
            return self.costs.fixed
        return self.fixed if self.fixed is not None else 0.0

    def _t_verify(self, n: int) -> float:
        if self.costs is not None:
            return self.costs.verify(n)
        t = self.verify(n)
        return t if t is not None else 1.0

    @property
    def model_s(self) -> float | None:
        """Seconds a model draft adds to a round (measured; None before any model round)."""
        return self._model_cost.value

    def _t_model(self) -> float | None:
        if self.costs is not None:
            return self.costs.model
        return self.model_s

    # ------------------------------------------------------------------ planning
    def expected_curve(self, scores: Sequence[float]) -> list[float]:
        """``curve[k]``: calibrated expected tokens of a round verifying the ``k`` best-scored nodes."""
        out = [1.0]
        p = self.cal.p
        for s in sorted(scores, reverse=True):
            out.append(out[-1] + p(s))
        return out

    def plan(self, scores: Sequence[float], model_available: bool) -> RoundPlan:
        """This round's drafting, from the n-gram proposal's scores (empty: no match).

        Args:
            scores: scores of the n-gram proposal's nodes (any order).
            model_available: a model draft can run this round.
        """
        with self._lock:
            return self._plan(scores, model_available)

    def _plan(self, scores: Sequence[float], model_available: bool) -> RoundPlan:
        mode = self.mode
        if mode == "model":
            return RoundPlan(model=model_available, ngram_size=0)
        curve = self.expected_curve(scores)
        fixed = self._t_fixed()
        arms = [RoundPlan(False, 0, 1.0, fixed + self._t_verify(0))]
        if self.costs is None and not self.verify.trusted(0):
            # Every arm is judged against a plain step: measure one before pricing the others from
            # tree rounds (a forward's growth with its nodes differs between machines by 10x).
            return RoundPlan(False, 0, 1.0, arms[0].seconds, probe=True)
        arms += [
            RoundPlan(False, size, curve[min(size, len(curve) - 1)], fixed + self._t_verify(size))
            for size in self._sizes(len(curve) - 1)
        ]
        if not model_available or mode in ("ngram", "suffix"):
            return max(arms, key=_rate)
        # Arms with the model's tree: its tokens a round are measured on rounds that use it alone.
        t_model = self._t_model()
        measured = t_model is not None and self.model_tau is not None
        tau = self.model_tau if self.model_tau is not None else 1.0
        base = fixed + (t_model or 0.0)
        nodes = round(self.model_drafted) if self.model_drafted is not None else self.model_nodes
        alone = RoundPlan(True, 0, tau, base + self._t_verify(nodes))
        merged = [
            RoundPlan(
                True,
                size,
                tau + self.merge_gain * (curve[min(size, len(curve) - 1)] - 1.0),
                base + self._t_verify(nodes + size),
            )
            for size in self._sizes(len(curve) - 1)
        ]
        if mode == "hybrid":
            return max([alone, *merged], key=_rate)
        if not measured or self._probe_left > 0 or self.rounds >= self._next_probe:
            return RoundPlan(True, 0, alone.expected, alone.seconds, probe=True)
        return max([*arms, alone, *merged], key=_rate)

    def _sizes(self, proposed: int) -> list[int]:
        """Tree sizes worth pricing for a proposal of ``proposed`` nodes (larger ones only pad)."""
        out = []
        for size in self.sizes:
            if proposed <= 0:
                break
            out.append(size)
            if size >= proposed:
                break
        return out

    def new_generation(self, best_tokens: int) -> None:
        """A generation starts: its first measured round probes the model's tree (``auto``), where
        that tree could pay clearly.

        The model's tokens a round follow the text: a chat answer accepts a couple, new code nearly a
        whole chain. One estimate shared across generations would carry the last text's verdict into
        the next one for as long as the probes are spaced, so each generation gets one look at the
        model of its own, which moves the shared estimate toward the new text. Only where a round
        whose tree is accepted whole (``best_tokens``: its depth plus the target's token) would
        commit at least :data:`GENERATION_PROBE_MARGIN` times a plain step's rate: with a draft
        nearly as costly as its target (a GPU) the look would cost more than it finds.
        """
        with self._lock:
            t_model = self._t_model()
            if self.mode != "auto" or t_model is None or self.model_tau is None:
                return  # the first probes are still to come
            fixed = self._t_fixed()
            full = fixed + t_model + self._t_verify(self.model_nodes)
            if best_tokens * (fixed + self._t_verify(0)) >= GENERATION_PROBE_MARGIN * full:
                self._probe_left = max(self._probe_left, 1)

    # ------------------------------------------------------------------ learning
    def observe(
        self,
        plan: RoundPlan,
        nodes: int,
        verify_s: float,
        round_s: float,
        draft_s: float,
        committed: int,
        ngram_scores: Sequence[float] = (),
        ngram_accepted: Sequence[bool] = (),
        draft_cold: bool = False,
    ) -> None:
        """One finished round.

        Args:
            plan: what the round did.
            nodes: tree nodes verified.
            verify_s / draft_s / round_s: wall seconds of the verify call, the draft call and the
                whole round.
            committed: tokens the round committed (accepted + 1, before stop conditions).
            ngram_scores / ngram_accepted: the n-gram nodes' scores and whether each was accepted
                (pure n-gram rounds calibrate the scores).
            draft_cold: the model draft also ran the prompt's forward: its tokens count, its time
                does not price a model round.
        """
        with self._lock:
            self.rounds += 1
            if plan.model:
                self._observe_model(plan, nodes, draft_s, verify_s, committed, ngram_scores, draft_cold)
            else:
                self.verify.add(nodes, verify_s)
                self._fixed.add(max(round_s - verify_s, 0.0))
                if plan.ngram_size:
                    self.cal.add(ngram_scores, ngram_accepted)

    def _observe_model(
        self,
        plan: RoundPlan,
        nodes: int,
        draft_s: float,
        verify_s: float,
        committed: int,
        scores: Sequence[float],
        cold: bool = False,
    ) -> None:
        if self._probe_left > 0:
            self._probe_left -= 1
        # A model draft's cost is its call plus what its GPU work adds to the verify call (which
        # waits for it); with no plain verification of this size measured yet, the call alone.
        t_v = self.verify(nodes)
        if not cold:
            self._model_cost.add(draft_s + (max(verify_s - t_v, 0.0) if t_v is not None else 0.0))
        if plan.ngram_size == 0:
            self.model_tau = _ema(self.model_tau, float(committed))
            self.model_drafted = _ema(self.model_drafted, float(nodes))
        elif self.model_tau is not None:
            gain = sum(self.cal.p(s) for s in scores if s > 0.0)
            if gain > 0:
                share = min(max((committed - self.model_tau) / gain, 0.0), 1.0)
                self.merge_gain += _EMA * (share - self.merge_gain)
        if plan.probe and self._probe_left == 0 and self.rounds >= self._next_probe:
            # Look at the model's tree again later, ever later: a probe costs a round at its rate.
            self._next_probe = self.rounds + self.probe_every
            self.probe_every = min(self.probe_every * 2, self.max_probe_every)


def _ema(old: float | None, sample: float) -> float:
    return sample if old is None else old + _EMA * (sample - old)


def _rate(p: RoundPlan) -> float:
    return p.expected / p.seconds if p.seconds > 0 else p.expected * 1e12


class CostModels:
    """One :class:`CostModel` per (drafter mode, tree shape, sampling or greedy), kept across generations.

    What a model measured on earlier prompts holds for the next ones on the same machine and pair,
    so a generator (and a target worker running rounds for its clients) keeps them here.
    """

    def __init__(self) -> None:
        self._models: dict[tuple[str, str, bool, int, bool], CostModel] = {}
        self._lock = threading.Lock()

    def get(
        self, mode: str, tree_key: str, model_nodes: int, do_sample: bool, max_ngram: int, padded: bool
    ) -> CostModel:
        key = (mode, tree_key, do_sample, max_ngram, padded)
        with self._lock:
            model = self._models.get(key)
            if model is None:
                model = self._models[key] = CostModel(mode, model_nodes, max_ngram, padded)
            return model
