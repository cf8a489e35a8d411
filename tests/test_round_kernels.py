"""benchmarks/round_kernels.py runs its rounds through a target engine's static path (on a CPU
without capture or profiling): plain steps and padded n-gram-shaped trees verify without error, and
``--strided`` names the operators that read rows with gaps."""

from __future__ import annotations

from types import ModuleType

import pytest
from conftest import load_benchmark


def _script() -> ModuleType:
    """The script with a tiny model of the same family (the timing code runs unchanged)."""
    mod = load_benchmark("round_kernels")
    mod.QWEN_1_5B = dict(mod.QWEN_1_5B, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=1000)  # fmt: skip
    return mod


def test_round_kernels_runs_plain_and_tree_rounds_on_cpu(capsys):
    assert _script().main(["--device", "cpu", "--sizes", "4,16", "--rounds", "2", "--context", "16"]) == 0
    out = capsys.readouterr().out
    assert "0:" in out and "16:" in out  # ms a round of each kind


def test_fold_max_rows_sets_the_limit_for_the_run(capsys, monkeypatch):
    """``--fold-max-rows N``: the run's tree forwards fold GQA up to N rows (an A/B of the limit)."""
    from specsplit.runtime import attention

    monkeypatch.setattr(attention, "FOLD_MAX_ROWS", attention.FOLD_MAX_ROWS)  # restored afterwards
    assert _script().main(["--device", "cpu", "--sizes", "4", "--rounds", "2", "--context", "16",
                           "--fold-max-rows", "3"]) == 0  # fmt: skip
    assert attention.FOLD_MAX_ROWS == 3 and "4:" in capsys.readouterr().out


def test_strided_lists_the_operators_that_read_gapped_rows(capsys):
    """With several rows, the fused MLP's activation reads the gate half of the fused GEMM's output:
    a tensor with gaps between its rows; a one-row step has no such read there."""
    assert _script().main(["--device", "cpu", "--sizes", "8", "--context", "16", "--strided"]) == 0
    plain, tree = capsys.readouterr().out.split("8 nodes:")
    assert "silu  (fused.py" not in plain and "silu  (fused.py" in tree


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_round_kernels_runs_rounds_with_draft_heads_on_cpu(capsys, monkeypatch, kind):
    """``--heads N``: the target verifies with random draft heads (``--heads-kind``: Medusa's or an
    EAGLE head), and every round runs them."""
    from specsplit.engines.target import TargetEngine

    ran: list[bool] = []
    real = TargetEngine.verify

    def spy(self, req):
        res = real(self, req)
        ran.append(res.guesses is not None)
        return res

    monkeypatch.setattr(TargetEngine, "verify", spy)
    args = ["--device", "cpu", "--sizes", "16", "--rounds", "2", "--context", "16", "--heads", "8"]
    args += ["--heads-kind", kind]
    assert _script().main(args) == 0
    assert "16:" in capsys.readouterr().out
    assert ran and all(ran)


def test_timeline_splits_rounds_at_their_read_into_busy_inside_and_between():
    """Two complete rounds after the first read: overlapping kernels count once as busy, a gap
    between a round's kernels is idle inside it, and the wait from a read to the next round's first
    kernel is idle between rounds."""
    split = _script().timeline([
        (0, 10, "Memcpy DtoH (Device -> Pageable)"),  # the end of a round before the profile's first
        (30, 50, "kernel a"), (40, 60, "kernel b"), (70, 80, "kernel c"), (80, 90, "Memcpy DtoH"),
        (100, 150, "Memcpy HtoD"), (150, 160, "Memcpy DtoH"),
        (170, 175, "kernel d"),  # a round without its read: not counted
    ])  # fmt: skip
    assert split["rounds"] == 2
    # round 1: busy 30 (30-60) + 20 (70-90) = 50, span 60, idle inside 10, between 20 (10 -> 30)
    # round 2: busy 60 (100-160), idle inside 0, between 10 (90 -> 100)
    assert split == {"busy": 55.0, "inside": 5.0, "between": 15.0, "rounds": 2}
