"""GuessPolicy: which rounds grow the target's draft-head guesses (specsplit.engines.ab_policy)."""

from __future__ import annotations

import pytest

from specsplit.config import NgramConfig
from specsplit.engines.ab_policy import GrowthCost, GuessPolicy
from specsplit.errors import ConfigError


def test_contexts_are_how_far_the_other_nodes_reached():
    p = GuessPolicy()
    assert [p.context(r) for r in range(7)] == [0, 0, 1, 1, 2, 2, 2]


def test_a_context_grows_while_its_gain_beats_the_cost_and_probes_when_it_does_not():
    p = GuessPolicy(cost_tokens=0.5, probe=4, decay=0.5)
    assert p.grow(0) and p.grow(2)  # nothing measured: grow
    p.record_gain(0, 2)  # free text: the guesses add tokens
    p.record_gain(2, 0)  # copying: the n-gram nodes found them already
    assert all(p.grow(0) for _ in range(10))
    decisions = [p.grow(2) for _ in range(8)]
    assert decisions == [False, False, False, True] * 2  # one probe in four rounds
    p.record_gain(2, 3)  # a probe finds the guesses paying again: 0.5 * 0 + 0.5 * 3 = 1.5 > 0.5
    assert p.grow(2) and p.grow(2)


def test_the_cost_is_the_round_time_growing_adds_over_a_tokens_time():
    timing = GrowthCost(decay=0.5)
    p = GuessPolicy(probe=4, timing=timing)
    assert p.cost() is None
    for grew, seconds in [(True, 9.0), (True, 3.0), (True, 3.0), (False, 7.0), (False, 2.0), (False, 2.0)]:
        p.record_round(grew, seconds, tokens=2)  # each mode's first round (a compile) is not timed
    assert timing.round_s == {True: 3.0, False: 2.0}
    assert timing.token_s is not None and p.cost() == pytest.approx(1.0 / timing.token_s)
    p.record_round(True, 100.0, tokens=2)  # a stall (over 4x the average) is not timed either
    assert timing.round_s[True] == 3.0
    other = GuessPolicy(timing=timing)  # the next generation: its own gains, the machine's cost
    assert other.gain == [None, None, None] and other.cost() == p.cost()


def test_until_the_growth_is_timed_one_round_in_probe_grows_none():
    p = GuessPolicy(probe=4)
    assert all(p.grow(0) for _ in range(6))  # no grown round timed yet: grow
    p.record_round(True, 1.0, 3)
    p.record_round(True, 1.0, 3)
    assert [p.grow(0) for _ in range(8)] == [True, True, True, False] * 2


def test_always_grows_every_round_and_records_nothing():
    p = GuessPolicy(always=True, cost_tokens=99.0)
    p.record_gain(0, 0)
    p.record_round(False, 1.0, 1)
    assert p.gain == [None, None, None] and p.timing.round_s == {True: None, False: None}
    assert all(p.grow(0) for _ in range(20))


def test_each_generation_gets_its_own_gains_and_shares_the_growths_timing():
    from specsplit.engines.drafters import NgramDrafter

    d = NgramDrafter(NgramConfig(guess_policy="adaptive"))
    a, b = d.guess_policy(False), d.guess_policy(False)
    a.record_gain(0, 3)
    assert b.gain[0] is None and a.timing is b.timing is not d.guess_policy(True).timing
    assert not a.always and NgramDrafter().guess_policy(False).always


def test_the_ngram_config_names_the_policy_and_refuses_others():
    assert NgramConfig().guess_policy == "always"
    with pytest.raises(ConfigError, match="guess_policy"):
        NgramConfig(guess_policy="sometimes")
    with pytest.raises(ConfigError, match="guess_cost_tokens"):
        NgramConfig(guess_cost_tokens=-1.0)
