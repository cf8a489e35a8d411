"""TokenTree arrays, validation errors, nested form, and static plans."""

from __future__ import annotations

import math

import pytest
import torch

from specsplit import InvalidRequest, TokenNode, TokenTree
from specsplit.core.tree import DEFAULT_STATIC_PATHS, chain_plan, static_plan_from_paths


def _tree(tokens, parents, q=False):
    par = torch.tensor(parents)
    depth = torch.ones(len(parents), dtype=torch.long)
    for i, p in enumerate(parents):
        if p >= 0:
            depth[i] = depth[p] + 1
    lp = torch.full((len(parents),), -0.5)
    qi = qp = None
    if q:
        qi = torch.tensor([[t, (t + 1) % 50] for t in tokens])
        qp = torch.tensor([[0.75, 0.25]] * len(tokens))
    return TokenTree(torch.tensor(tokens), par, depth, lp, qi, qp)


def test_valid_tree_passes_and_reports_bounds():
    t = _tree([5, 6, 7, 8], [-1, -1, 0, 2], q=True)
    t.validate(vocab_size=50, max_nodes=8, max_depth=4)
    assert t.bounds() == (2, 3)
    assert t.max_depth() == 3


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda t: t.token_ids.__setitem__(1, 50), "outside the vocabulary"),
        (lambda t: t.token_ids.__setitem__(0, -3), "outside the vocabulary"),
        (lambda t: t.parents.__setitem__(1, 1), "earlier node"),  # self loop / cycle
        (lambda t: t.parents.__setitem__(0, 3), "earlier node"),  # forward reference (cycle)
        (lambda t: t.parents.__setitem__(2, -7), "earlier node"),
        (lambda t: t.depths.__setitem__(3, 9), "depths disagree"),
        (lambda t: t.depths.__setitem__(0, 2), "depths disagree"),  # a root below depth 1
        (lambda t: t.depths.copy_(torch.tensor([1, 1, 3, 4])), "depths disagree"),  # shifted subtree
        (lambda t: t.log_probs.__setitem__(0, math.nan), "NaN"),
        (lambda t: t.log_probs.__setitem__(1, math.inf), r"\+inf"),
        (lambda t: t.parents.__setitem__(3, 4), "earlier node"),  # beyond the last node
        (lambda t: setattr(t, "q_ids", t.q_ids[:, :1]), "must both have shape"),
        (lambda t: t.q_probs.__setitem__((0, 0), math.nan), "finite"),
        (lambda t: t.q_probs.__setitem__((1, 1), -0.25), "non-negative"),
        (lambda t: t.q_probs.__setitem__((2, 0), 0.9), "sum to 1"),
        (lambda t: t.q_ids.__setitem__((0, 1), 99), "q_ids"),
    ],
)
def test_invalid_trees_raise_typed_errors(mutate, match):
    t = _tree([5, 6, 7, 8], [-1, -1, 0, 2], q=True)
    mutate(t)
    with pytest.raises(InvalidRequest, match=match):
        t.validate(vocab_size=50)


def test_depth_check_agrees_with_a_walk_from_the_roots():
    """The vectorised depth check accepts exactly the trees whose depths a root-down walk gives."""
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        n = int(torch.randint(1, 30, (1,), generator=g))
        par = [-1] + [int(torch.randint(-1, i, (1,), generator=g)) for i in range(1, n)]
        true = []
        for p in par:
            true.append(1 if p < 0 else true[p] + 1)
        dep = list(true)
        corrupt = bool(torch.rand(1, generator=g) < 0.5)
        if corrupt:
            i = int(torch.randint(0, n, (1,), generator=g))
            dep[i] += int(torch.randint(1, 3, (1,), generator=g)) * (
                1 if torch.rand(1, generator=g) < 0.5 else -1
            )
        t = TokenTree(torch.zeros(n, dtype=torch.long), torch.tensor(par), torch.tensor(dep), torch.zeros(n))
        if corrupt:
            with pytest.raises(InvalidRequest, match="depths disagree"):
                t.validate(vocab_size=5)
        else:
            t.validate(vocab_size=5)


def test_oversized_and_too_deep_trees_rejected():
    t = _tree(list(range(10)), [-1] + list(range(9)))
    with pytest.raises(InvalidRequest, match="at most 4"):
        t.validate(50, max_nodes=4)
    with pytest.raises(InvalidRequest, match="depth 10 exceeds"):
        t.validate(50, max_depth=3)


def test_shape_mismatch_rejected():
    t = _tree([5, 6], [-1, 0])
    t.parents = torch.tensor([-1, 0, 1])
    with pytest.raises(InvalidRequest, match="shape"):
        t.validate(50)


def test_nested_round_trip():
    t = _tree([5, 6, 7, 8, 9], [-1, -1, 0, 0, 3], q=True)
    roots = t.to_nodes()
    assert [r.token_id for r in roots] == [5, 6]
    assert [c.token_id for c in roots[0].children] == [7, 8]
    assert roots[0].children[1].children[0].token_id == 9
    d = roots[0].to_dict()
    assert TokenNode.from_dict(d).to_dict() == d
    back = TokenTree.from_nodes(roots)
    for name in ("token_ids", "parents", "depths"):
        assert torch.equal(getattr(back, name), getattr(t, name))
    assert torch.allclose(back.q_probs, t.q_probs)


def test_static_plan_from_paths():
    plan = static_plan_from_paths([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
    assert plan.parents == (-1, -1, 0, 0, 1, 2)
    assert plan.ranks == (0, 1, 0, 1, 0, 0)
    assert plan.depth == 3 and plan.max_branch == 2
    assert plan.truncated(2).num_nodes == 5
    assert chain_plan(4).parents == (-1, 0, 1, 2)
    default = static_plan_from_paths(DEFAULT_STATIC_PATHS)
    assert default.num_nodes == 16


@pytest.mark.parametrize(
    "paths, match",
    [([(0,), (0,)], "duplicates"), ([(0,), (0, 1)], "ranks"), ([(0, 0)], "no parent"), ([(1,)], "ranks")],
)
def test_bad_static_paths(paths, match):
    with pytest.raises(ValueError, match=match):
        static_plan_from_paths(paths)


def test_empty_tree():
    t = TokenTree.empty()
    t.validate(10)
    assert t.num_nodes == 0 and t.bounds() == (0, 0)


def test_minus_inf_log_probs_are_valid():
    """A node the draft gave probability zero has log q = -inf: allowed (only NaN and +inf are not)."""
    t = _tree([5, 6, 7, 8], [-1, -1, 0, 2], q=True)
    t.log_probs[1] = -math.inf
    t.validate(vocab_size=50)
