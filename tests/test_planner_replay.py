"""benchmarks/planner_replay.py: the real round loop over recorded answers reproduces them, and the
oracle planner (which knows each tree's outcome) never projects less than the real one."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import load_benchmark

LOOP = [5, 17, 33, 81, 9, 100, 12]
COPY = {"id": "copy-01", "category": "copy", "prompt": LOOP * 4, "new": (LOOP * 12)[:64]}
FREE = {
    "id": "free-01",
    "category": "free",
    "prompt": LOOP * 2,
    "new": [200 + (i * 37) % 500 for i in range(64)],
}


def _answers(tmp_path: Path, answers: list[dict]) -> Path:
    path = tmp_path / "answers.jsonl"
    path.write_text("".join(json.dumps(a) + "\n" for a in answers))
    return path


def test_replay_reproduces_answers_and_the_oracle_bounds_the_planner(tmp_path):
    path = _answers(tmp_path, [COPY, FREE])
    mod = load_benchmark("planner_replay")
    real = mod.replay("ngram", 3.85, 0.023, 0.5, False, path)
    best = mod.replay("ngram", 3.85, 0.023, 0.5, True, path)
    assert real["categories"]["copy"]["x"] > 2.0  # the answer repeats the prompt: long trees hold
    assert real["categories"]["copy"]["tree_rounds"] > 0
    assert 0.9 < real["categories"]["free"]["x"] <= 1.0 + 1e-9  # nothing to copy: plain steps, no gain
    assert best["overall"] >= real["overall"]
    assert best["categories"]["free"]["tree_rounds"] == 0  # the oracle never verifies a tree that fails


def test_accepted_counts_the_nodes_on_the_answers_path():
    from specsplit.core.ngram import Proposal

    # roots 7 and 8; 7 -> 9 -> 11 and 7 -> 10; 8 -> 9
    p = Proposal(
        [7, 8, 9, 10, 9, 11], [-1, -1, 0, 0, 1, 2], [1, 1, 2, 2, 2, 3], [0.9, 0.5, 0.6, 0.3, 0.4, 0.5]
    )
    mod = load_benchmark("planner_replay")
    assert mod.accepted(p, [7, 9, 11, 4]) == 3
    assert mod.accepted(p, [7, 9]) == 2  # the depth-3 node is not covered yet
    assert mod.accepted(p, [8, 9, 11]) == 2  # a wrong parent fails its whole subtree
    assert mod.accepted(p, [5]) == 0 and mod.accepted(p, []) == 0


def test_proposal_host_time_is_charged_on_every_round_that_proposes(tmp_path):
    path = _answers(tmp_path, [FREE])
    mod = load_benchmark("planner_replay")
    free = mod.replay("ngram", 3.85, 0.023, 0.5, False, path)["categories"]["free"]
    charged = mod.replay("ngram", 3.85, 0.023, 0.5, False, path, propose_ms=0.07)["categories"]["free"]
    assert charged["tree_rounds"] == free["tree_rounds"]  # the same rounds, each proposal now costs
    assert charged["x"] < free["x"] - 0.01


def test_replay_with_a_draft_model_drafts_free_text_and_copies_with_ngrams(tmp_path):
    """The model arm: a chain holds as far as the draft's recorded hits say and stops below its floor;
    the planner measures every cost on the replay's clock."""
    answers = _answers(tmp_path, [COPY, FREE])
    drafted = tmp_path / "drafted.json"
    sure = {"hit": [1] * 64, "p": [0.95] * 64}  # the draft knows the free text
    drafted.write_text(json.dumps({"rows": [{"id": "copy-01", **sure}, {"id": "free-01", **sure}]}))
    mod = load_benchmark("planner_replay")
    model = mod.replay_model("model", drafted, answers)
    suffix = mod.replay_model("suffix", drafted, answers)
    auto = mod.replay_model("auto", drafted, answers)
    assert model["categories"]["free"]["x"] > 2.0 > suffix["categories"]["free"]["x"]
    assert suffix["categories"]["free"]["model_rounds"] == 0
    assert auto["categories"]["free"]["x"] > 1.5 and auto["categories"]["free"]["model_rounds"] > 0
    unsure = {"hit": [1] * 64, "p": [0.3] * 64}  # every chain stops after one token: cheap, short rounds
    drafted.write_text(json.dumps({"rows": [{"id": "copy-01", **unsure}, {"id": "free-01", **unsure}]}))
    short = mod.replay_model("model", drafted, answers)["categories"]["free"]
    assert short["rounds"] >= 30 and 1.0 < short["x"] < model["categories"]["free"]["x"]
