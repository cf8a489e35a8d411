"""sampling.py against HF's logits warpers, and verification on hand-built cases."""

from __future__ import annotations

import random

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from specsplit import TokenTree
from specsplit.config import SamplingParams
from specsplit.core.sampling import (
    fast_probs,
    logits_to_probs,
    sample,
    sample_without_replacement,
    truncate_top_k,
)
from specsplit.core.verification import _follow_path, children_table, verify_greedy, verify_stochastic


@pytest.mark.parametrize("fast", [False, True], ids=["exact", "fast"])
@pytest.mark.parametrize(
    "temperature, top_k, top_p",
    [(1.0, 0, 1.0), (0.7, 50, 1.0), (1.3, 0, 0.8), (0.5, 20, 0.9), (0.7, 20, 0.8)],
)
def test_logits_to_probs_matches_hf_warpers(temperature, top_k, top_p, fast):
    torch.manual_seed(0)
    logits = torch.randn(4, 300) * 3
    procs = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_k:
        procs.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        procs.append(TopPLogitsWarper(top_p))
    ref = torch.softmax(procs(None, logits.clone()), dim=-1)
    params = SamplingParams(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p)
    if fast:
        ours, overflow = fast_probs(logits, params)
        assert (overflow is not None) == bool(top_k and top_p < 1.0)  # the fast path ran where it applies
        assert overflow is None or overflow.item() == 0
    else:
        ours = logits_to_probs(logits, params)
    torch.testing.assert_close(ours, ref, atol=1e-6, rtol=1e-5)


def test_fast_top_k_top_p_flags_ties_beyond_its_candidates_and_the_round_is_redone_exactly():
    """More tokens tying the k-th logit than the fast path holds: the flag is set, and a round
    decided through decide_to_host then equals the exact transform's decision."""
    from specsplit.core.sampling import TIE_SLACK
    from specsplit.engines.verifiers import decide, decide_to_host

    params = SamplingParams(do_sample=True, top_k=10, top_p=0.999)
    logits = torch.zeros(1, 400)
    logits[0, :5] = torch.tensor([3.0, 2.5, 2.0, 1.5, 1.0])  # 395 tokens tie the 10th value (0.0)
    probs, overflow = fast_probs(logits, params)
    assert overflow is not None and overflow.item() == 1
    exact = logits_to_probs(logits, params)
    assert (exact > 0).sum() > 10 + TIE_SLACK >= (probs > 0).sum()  # the fast path alone is off here
    tree = _tree([], [])
    for seed in range(10):  # without the redo, most of these seeds pick another token
        _, (_, _, nxt), _ = decide_to_host(logits, tree, params, seed, 7, 0, 0)
        ref = decide(logits, tree, params, seed, 7, 0, 0, exact_probs=True)
        assert nxt == int(ref.next_token)
    no_tie = torch.randn(3, 400)
    assert fast_probs(no_tie, params)[1].item() == 0


def test_sampling_helpers():
    g = torch.Generator().manual_seed(0)
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5]]).expand(4000, 4)
    draws = sample(probs, g)
    assert set(draws.tolist()) == {1, 3}
    assert abs((draws == 1).float().mean().item() - 0.5) < 0.05
    order = sample_without_replacement(torch.tensor([[0.1, 0.6, 0.3]]), 3, g)
    assert sorted(order[0].tolist()) == [0, 1, 2]
    ids, vals = truncate_top_k(torch.tensor([[0.1, 0.6, 0.3]]), 2)
    assert ids.tolist() == [[1, 2]] and torch.allclose(vals, torch.tensor([[2 / 3, 1 / 3]]))


def _tree(tokens, parents, q_ids=None, q_probs=None):
    par = torch.tensor(parents)
    dep = torch.ones(len(parents), dtype=torch.long)
    for i, p in enumerate(parents):
        if p >= 0:
            dep[i] = dep[p] + 1
    return TokenTree(torch.tensor(tokens), par, dep, torch.zeros(len(tokens)), q_ids, q_probs)


def _onehot_logits(argmaxes, vocab=10):
    x = torch.zeros(len(argmaxes), vocab)
    x[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 5.0
    return x


def test_children_table():
    t = children_table(torch.tensor([-1, -1, 0, 0, 0, 1]), 3)
    assert t.tolist() == [[0, 1, -1], [2, 3, 4], [5, -1, -1]] + [[-1, -1, -1]] * 4


def test_greedy_picks_the_longest_matching_path():
    # rows: 0=context, 1..6 = nodes 0..5
    tree = _tree([3, 4, 7, 8, 9, 1], [-1, -1, 0, 1, 1, 4])
    # target argmax: context->4 (node 1), node1 ->9 (node 4), node4 -> 1 (node 5), node5 -> 6
    logits = _onehot_logits([4, 0, 9, 0, 0, 1, 6])  # row r = node r - 1
    nodes, toks, nxt = verify_greedy(logits, tree, 3, 2).to_host(tree.token_ids)
    assert nodes == [1, 4, 5] and toks == [4, 9, 1] and nxt == 6


def test_greedy_correction_when_nothing_matches():
    tree = _tree([3, 4], [-1, 0])
    nodes, toks, nxt = verify_greedy(_onehot_logits([5, 0, 0]), tree, 2, 1).to_host(tree.token_ids)
    assert nodes == [] and toks == [] and nxt == 5


def test_stochastic_accepts_everything_when_q_equals_p():
    vocab = 6
    p = torch.softmax(torch.randn(4, vocab), -1)
    tree = _tree([2, 3, 1], [-1, 0, 1])
    # q of node i = the target row of its parent: p/q = 1, so every node is accepted
    q_ids = torch.arange(vocab).expand(3, vocab).clone()
    q_probs = torch.stack([p[0], p[1], p[2]])
    tree.q_ids, tree.q_probs = q_ids, q_probs
    for seed in range(20):
        out = verify_stochastic(p, tree, 3, 1, torch.Generator().manual_seed(seed))
        nodes, _, _ = out.to_host(tree.token_ids)
        assert nodes == [0, 1, 2]


def test_stochastic_never_accepts_zero_probability_or_padding():
    p = torch.tensor([[0.0, 1.0, 0.0], [0.3, 0.3, 0.4]])
    tree = _tree([0], [-1])  # p(0) = 0 at the context row
    for seed in range(20):
        nodes, _, nxt = verify_stochastic(p, tree, 1, 1, torch.Generator().manual_seed(seed)).to_host(
            tree.token_ids
        )
        assert nodes == [] and nxt == 1
    pad = _tree([1], [-1], torch.tensor([[1, 2]]), torch.tensor([[0.0, 0.0]]))  # never drawn
    nodes, _, nxt = verify_stochastic(p, pad, 1, 1, torch.Generator().manual_seed(0)).to_host(pad.token_ids)
    assert nodes == [] and nxt == 1


def test_a_set_guard_decides_the_round_on_the_exact_scores():
    """A flag from whatever produced the scores (the processors' fused top-k + top-p) makes the
    round be decided on ``exact_logits()``; a clear flag never calls it."""
    from specsplit.engines.verifiers import decide_to_host

    tree = _tree([], [])
    fast, exact = torch.tensor([[5.0, 0.0, 0.0]]), torch.tensor([[0.0, 5.0, 0.0]])
    calls: list[int] = []

    def exact_logits() -> torch.Tensor:
        calls.append(1)
        return exact

    for flag, want in ((1, 1), (0, 0)):
        guard = torch.tensor([flag])
        used, (_, _, nxt), _ = decide_to_host(
            fast, tree, SamplingParams(), None, 0, 0, 0, guard, exact_logits
        )
        assert nxt == want and (used is exact) == bool(flag)
    assert calls == [1]


def test_fused_top_k_top_p_processor_equals_hf_and_flags_ties():
    """The processor path's fused top-k + top-p equals HF's pair (the -inf filter included), and
    with more ties at the k-th score than it holds it raises its flag; ``scores(exact=True)``
    is HF's pair itself."""
    from transformers.generation.logits_process import LogitsProcessorList

    from specsplit.engines.processing import FastTopKTopP

    fused = FastTopKTopP(TopKLogitsWarper(20), TopPLogitsWarper(0.8))
    hf = LogitsProcessorList([TopKLogitsWarper(20), TopPLogitsWarper(0.8)])
    x = torch.randn(6, 500, generator=torch.Generator().manual_seed(2)) * 3
    torch.testing.assert_close(fused(None, x.clone()), hf(None, x.clone()))
    assert fused.overflow is not None and fused.overflow.item() == 0
    ties = torch.zeros(2, 500)
    ties[:, :3] = torch.tensor([2.0, 1.0, 0.5])
    fused(None, ties.clone())
    assert fused.overflow is not None and fused.overflow.item() == 1


def test_follow_path_walks_the_accepted_children_at_any_depth_bound():
    """The pointer-doubling walk equals a level-by-level walk, for depth bounds below, at and past
    the accepted path's length (padded n-gram trees are verified with bounds up to their size)."""
    rng = random.Random(0)
    for _ in range(500):
        n = rng.randint(0, 40)
        parents = [-1 if i == 0 or rng.random() < 0.3 else rng.randrange(i) for i in range(n)]
        accepted_child = [-1] * (n + 1)
        for row in range(n + 1):
            kids = [i for i in range(n) if parents[i] + 1 == row]
            if kids and rng.random() < 0.7:
                accepted_child[row] = rng.choice(kids)
        depth = rng.randint(0, 45)
        want, row, count = [-1] * depth, 0, 0
        for d in range(depth):
            child = accepted_child[row]
            if child >= 0:
                want[d], count, row = child, count + 1, child + 1
        path, num, last = _follow_path(torch.tensor(accepted_child, dtype=torch.long), depth)
        assert path.tolist() == want and int(num) == count and int(last) == row
        assert path.dtype == num.dtype == last.dtype == torch.long and num.dim() == last.dim() == 0
    # no read of device values on the host: the walk runs on meta tensors, which hold none
    path, num, last = _follow_path(torch.empty(17, dtype=torch.long, device="meta"), 16)
    assert path.shape == (16,) and num.shape == last.shape == ()
