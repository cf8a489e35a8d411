"""benchmarks/recycle_estimate.py: the static tree is best-first, and the walk over an answer counts
what the top-k table would have drafted (a text the table already knows is drafted deep)."""

from __future__ import annotations

import json

from conftest import load_benchmark


def test_template_is_best_first():
    mod = load_benchmark("recycle_estimate")
    tree = mod._template([0.5, 0.2], 4)
    # root children by rank, then the rank-0 child's rank-0 child (0.25) before the root's rank 1 (0.2)
    assert tree[:2] == [(-1, 0), (0, 0)] and tree[2] == (-1, 1) and len(tree) == 4


def _rows(top_of):  # noqa: ANN001, ANN202
    loop = [5, 6, 7, 8, 9]
    ids = loop * 6  # prompt: two loops, answer: four more
    top = [[top_of(ids, p), 99] for p in range(len(ids))]
    return [{"id": "x-01", "category": "x", "prompt": ids[:10], "new": ids[10:], "top": top}]


def test_a_known_continuation_is_drafted_deep_and_a_wrong_table_drafts_nothing(tmp_path):
    mod = load_benchmark("recycle_estimate")
    right = _rows(lambda ids, p: ids[p + 1] if p + 1 < len(ids) else 0)  # the target's top-1 is the answer
    wrong = _rows(lambda ids, p: 42)
    for rows, low, high in ((right, 4.0, 20.0), (wrong, 1.0, 1.0)):
        path = tmp_path / "top.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        tau = mod.estimate(path, [8])["tau"][8]["overall"]
        assert low <= tau <= high, tau
