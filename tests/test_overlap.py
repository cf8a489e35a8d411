"""Overlapped pipeline: the draft drafts round N+1 while round N verifies; the committed tokens must
be identical to sequential mode (greedy and seeded sampling), speculation must actually hit and miss,
and a wrong guess must leave the draft session consistent."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import noisy_copy

from specsplit import SpecSplitConfig, SpecSplitGenerator, TreeConfig
from specsplit.config import PipelineTuning, SamplingParams
from specsplit.core.tree import TokenTree
from specsplit.engines.draft import DraftEngine, main_path
from specsplit.errors import CacheDesyncError, InvalidRequest
from specsplit.messages import DraftRequest

SHAPES = {
    "chain": TreeConfig(shape="chain", num_draft_tokens=4),
    "static": TreeConfig(shape="static"),
    "dynamic": TreeConfig(shape="dynamic", topk=3, width=3, budget=12, max_depth=5),
}
PROMPTS = [[5, 17, 33, 81, 9, 100], [7, 7, 12], [44, 3, 19, 250, 61, 62, 63, 64, 9]]


@pytest.fixture(scope="module")
def noisy_draft(llama_target):
    """The target plus noise: accepts often but not always (speculation both hits and misses)."""
    return noisy_copy(llama_target, 0.001, seed=3)


def _generate(target, draft, tree, overlap, ids, n=48, **kw):
    cfg = SpecSplitConfig(
        tree=copy.deepcopy(tree), overlap=overlap, tuning=PipelineTuning(overlap_policy="always")
    )
    with SpecSplitGenerator(target, draft, config=cfg) as gen:
        return gen.generate(ids, max_new_tokens=n, return_dict_in_generate=True, **kw)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("draft_kind", ["noisy", "same", "random"])
def test_greedy_overlap_equals_sequential_and_hf(request, llama_target, shape, draft_kind):
    draft = {
        "noisy": request.getfixturevalue("noisy_draft"),
        "same": llama_target,
        "random": request.getfixturevalue("llama_draft_random"),
    }[draft_kind]
    ids = torch.tensor([PROMPTS[0]])
    ref = llama_target.generate(ids, max_new_tokens=48, do_sample=False, pad_token_id=0)
    seq = _generate(llama_target, draft, SHAPES[shape], False, ids)
    ovl = _generate(llama_target, draft, SHAPES[shape], True, ids)
    assert torch.equal(seq.sequences, ref)
    assert torch.equal(ovl.sequences, ref)
    st = ovl.spec_stats
    assert st.spec_rounds > 0 and seq.spec_stats.spec_rounds == 0
    hits = [r.spec_hit for r in st.rounds]
    if draft_kind == "same":  # every guess is right: after the first round no draft call blocks
        assert st.spec_hits == st.spec_rounds
    elif draft_kind == "noisy":  # both outcomes exercised
        assert 0 < st.spec_hits < st.spec_rounds, hits
    else:
        assert st.spec_hits < st.spec_rounds
    # A hit round's tree was ready: its blocking draft time is only the hand-over.
    assert st.acceptance_rate == pytest.approx(
        sum(r.accepted for r in st.rounds) / sum(r.drafted_depth for r in st.rounds)
    )


@pytest.mark.parametrize("shape", ["chain", "static"])
@pytest.mark.parametrize("same_draft", [False, True], ids=["noisy", "same"])
def test_seeded_sampling_overlap_equals_sequential(llama_target, noisy_draft, shape, same_draft):
    draft = llama_target if same_draft else noisy_draft
    ids = torch.tensor([PROMPTS[2]])
    kw = {"do_sample": True, "temperature": 0.8, "top_p": 0.95, "top_k": 20}  # within q_top_k: q == p
    seq = _generate(llama_target, draft, SHAPES[shape], False, ids,
                    generator=torch.Generator().manual_seed(11), **kw)  # fmt: skip
    ovl = _generate(llama_target, draft, SHAPES[shape], True, ids,
                    generator=torch.Generator().manual_seed(11), **kw)  # fmt: skip
    assert torch.equal(ovl.sequences, seq.sequences)
    a = [(r.accepted, r.drafted_depth) for r in seq.spec_stats.rounds]
    b = [(r.accepted, r.drafted_depth) for r in ovl.spec_stats.rounds]
    assert a == b
    st = ovl.spec_stats
    if same_draft:  # q == p: the main path is always accepted; hits when the bonus is the argmax
        assert 0 < st.spec_hits
    else:
        assert st.spec_hits < st.spec_rounds


def test_overlap_batch_and_eos_stop(llama_target, noisy_draft):
    width = max(len(p) for p in PROMPTS)
    ids = torch.zeros(len(PROMPTS), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(PROMPTS):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    ref = llama_target.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=0)
    # An EOS that the target emits mid-sequence: the overlapped run must stop exactly there too.
    row = ref[0, width:].tolist()
    eos = row[len(row) // 2]
    seq = _generate(llama_target, noisy_draft, SHAPES["chain"], False, ids, n=30, attention_mask=mask,
                    eos_token_id=eos, pad_token_id=0)  # fmt: skip
    ovl = _generate(llama_target, noisy_draft, SHAPES["chain"], True, ids, n=30, attention_mask=mask,
                    eos_token_id=eos, pad_token_id=0)  # fmt: skip
    assert torch.equal(ovl.sequences, seq.sequences)
    first = ovl.sequences[0, width:].tolist()
    assert eos in first and first.index(eos) == row.index(eos)


# ------------------------------------------------------------------------------ draft engine


def _tree(tokens, parents):
    t = torch.tensor(tokens)
    par = torch.tensor(parents)
    depth = torch.zeros_like(par)
    for i, p in enumerate(parents):
        depth[i] = 1 if p < 0 else depth[p] + 1
    return TokenTree(t, par, depth, torch.zeros(len(tokens)))


def test_main_path_follows_first_children():
    assert main_path(TokenTree.empty()) == []
    assert main_path(_tree([9, 8, 7], [-1, 0, 1])) == [9, 8, 7]
    #      roots 10, 11; 10 -> 12, 13; 11 -> 14; 12 -> 15
    assert main_path(_tree([10, 11, 12, 13, 14, 15], [-1, -1, 0, 0, 1, 2])) == [10, 12, 15]


def test_speculation_miss_rolls_back_and_reuses_the_matching_part(llama_target):
    eng = DraftEngine(copy.deepcopy(llama_target))
    tree = TreeConfig(shape="chain", num_draft_tokens=3)
    prompt = PROMPTS[0]
    first = eng.generate(DraftRequest("s", list(prompt), 0, tree))
    drafted = first.tree.token_ids.tolist()
    spec = eng.generate(DraftRequest("s", [], first.prefix_length, tree, speculate=True))
    assert spec.assumed_token_ids[:3] == drafted and len(spec.assumed_token_ids) == 4
    assert spec.prefix_length == len(prompt) + 4
    # A miss: the target accepted one token and corrected the second.
    fixed = [drafted[0], (drafted[1] + 1) % 256]
    again = eng.generate(DraftRequest("s", fixed, first.prefix_length, tree))
    assert again.prefix_length == len(prompt) + 2
    fresh = DraftEngine(copy.deepcopy(llama_target)).generate(DraftRequest("t", prompt + fixed, 0, tree))
    assert again.tree.token_ids.tolist() == fresh.tree.token_ids.tolist()
    # The stale speculative base is gone: the same short prefix is now a desync.
    with pytest.raises(CacheDesyncError):
        eng.generate(DraftRequest("s", fixed, first.prefix_length, tree))


def test_speculation_hit_chain_matches_a_fresh_draft(llama_target):
    eng = DraftEngine(copy.deepcopy(llama_target))
    tree = SHAPES["static"]
    first = eng.generate(DraftRequest("s", PROMPTS[1], 0, tree))
    spec = eng.generate(DraftRequest("s", [], first.prefix_length, tree, speculate=True))
    fresh = DraftEngine(copy.deepcopy(llama_target)).generate(
        DraftRequest("t", PROMPTS[1] + spec.assumed_token_ids, 0, tree)
    )
    assert torch.equal(spec.tree.token_ids, fresh.tree.token_ids)
    assert torch.equal(spec.tree.parents, fresh.tree.parents)
    # Chained speculation from a hit.
    spec2 = eng.generate(DraftRequest("s", [], spec.prefix_length, tree, speculate=True))
    assert spec2.prefix_length == spec.prefix_length + len(spec2.assumed_token_ids)


def test_speculation_depth_budget_and_bad_requests(llama_target):
    eng = DraftEngine(copy.deepcopy(llama_target))
    tree = TreeConfig(shape="chain", num_draft_tokens=4)
    first = eng.generate(DraftRequest("s", PROMPTS[0], 0, tree))
    with pytest.raises(InvalidRequest):
        eng.generate(DraftRequest("s", [5], first.prefix_length, tree, speculate=True))
    with pytest.raises(InvalidRequest):
        eng.generate(DraftRequest("s", [], 0, tree, speculate=True))
    with pytest.raises(CacheDesyncError):
        eng.generate(DraftRequest("s", [], first.prefix_length + 1, tree, speculate=True))
    # The failed requests changed nothing; max_depth counts the assumed tokens.
    spec = eng.generate(DraftRequest("s", [], first.prefix_length, tree, max_depth=7, speculate=True))
    assert len(spec.assumed_token_ids) == 5 and spec.tree.num_nodes == 2
    spec = eng.generate(
        DraftRequest("s", [], spec.prefix_length, tree, SamplingParams(), max_depth=3, speculate=True)
    )
    assert spec.tree.num_nodes == 0


# ------------------------------------------------------------------------------ adaptive policy


def test_overlap_policy_keeps_the_faster_mode():
    from specsplit.pipeline import OverlapPolicy

    def run(policy, spec_cost, plain_cost, rounds):
        modes = []
        for _ in range(rounds):
            on = policy.speculate()
            modes.append(on)
            policy.record(spec_cost if on else plain_cost, 1)
        return modes

    slow = run(OverlapPolicy(probe=3, hold=10), spec_cost=2.0, plain_cost=1.0, rounds=3 + 3 + 10 + 3 + 10)
    assert slow == [True] * 3 + [False] * 3 + [False] * 10 + [True] * 3 + [False] * 10
    fast = run(OverlapPolicy(probe=3, hold=10), spec_cost=0.5, plain_cost=1.0, rounds=3 + 3 + 10 + 3)
    assert fast == [True] * 3 + [False] * 3 + [True] * 10 + [False] * 3
    assert all(run(OverlapPolicy(always=True), 9.0, 1.0, 30))


def test_overlap_policy_reprobes_less_often_while_its_choice_holds():
    from specsplit.pipeline import OverlapPolicy

    policy, modes = OverlapPolicy(probe=2, hold=4, max_hold=16), []
    for _ in range(2 + 2 + 4 + 2 + 8 + 2 + 16 + 2 + 16 + 2):
        on = policy.speculate()
        modes.append(on)
        policy.record(2.0 if on else 1.0, 1)
    # speculation loses every probe: holds of 4, 8, 16, then capped at 16
    expect = [True] * 2 + [False] * 2 + [False] * 4 + [True] * 2 + [False] * 8 + [True] * 2
    expect += [False] * 16 + [True] * 2 + [False] * 16 + [True] * 2
    assert modes == expect
    # when the other mode wins a re-probe, the policy switches and the hold starts over
    policy = OverlapPolicy(probe=2, hold=4)
    costs = {True: 2.0, False: 1.0}
    modes = []
    for i in range(2 + 2 + 4 + 2 + 4):
        if i == 8:
            costs = {True: 0.5, False: 1.0}  # speculation became the faster mode
        on = policy.speculate()
        modes.append(on)
        policy.record(costs[on], 1)
    assert modes == [True] * 2 + [False] * 2 + [False] * 4 + [True] * 2 + [True] * 4


class _SlowSpeculation:
    """A LocalTransport whose speculative drafts are slow: speculation cannot pay."""

    def __init__(self, inner, delay_s):
        self.inner, self.delay_s = inner, delay_s

    def __getattr__(self, name):
        return getattr(self.inner, name)

    @property
    def has_draft(self):
        return self.inner.has_draft

    def draft(self, req):
        if req.speculate:
            import time

            time.sleep(self.delay_s)
        return self.inner.draft(req)


def test_adaptive_policy_turns_slow_speculation_off(llama_target, noisy_draft):
    from specsplit.engines.draft import DraftEngine
    from specsplit.engines.target import TargetEngine
    from specsplit.local import LocalTransport
    from specsplit.pipeline import DecodeParams, decode

    tree = TreeConfig(shape="chain", num_draft_tokens=2)
    outs = {}
    for policy in ("always", "adaptive"):
        transport = _SlowSpeculation(
            LocalTransport(DraftEngine(noisy_draft), TargetEngine(llama_target)), 0.05
        )
        params = DecodeParams(max_new_tokens=120, tree=tree, overlap=True, overlap_policy=policy)
        outs[policy] = decode(transport, PROMPTS[0], params)
    assert outs["always"][0] == outs["adaptive"][0]
    always, adaptive = outs["always"][1], outs["adaptive"][1]
    assert always.spec_rounds >= len(always.rounds) - 2
    # 6 probe rounds, 6 without, then mostly without (a 6-round re-probe every 24 rounds).
    assert 6 <= adaptive.spec_rounds <= len(adaptive.rounds) // 2


def test_generator_keeps_its_overlap_policy_across_calls(llama_target, noisy_draft):
    """Probes are paid once per generator and tree shape, not once per prompt."""
    cfg = SpecSplitConfig(tree=TreeConfig(shape="chain", num_draft_tokens=2), overlap=True)
    with SpecSplitGenerator(llama_target, noisy_draft, config=cfg) as gen:
        gen.transport = _SlowSpeculation(gen.transport, 0.05)
        ids = torch.tensor([PROMPTS[0]])
        first = gen.generate(ids, max_new_tokens=40, return_dict_in_generate=True).spec_stats
        policy = gen._overlap_policies[(repr(cfg.tree), False)]
        assert policy.cost[True] is not None and policy.cost[False] is not None
        assert policy.cost[True] > policy.cost[False]
        later = [
            gen.generate(ids, max_new_tokens=40, return_dict_in_generate=True).spec_stats for _ in range(3)
        ]
        assert list(gen._overlap_policies) == [(repr(cfg.tree), False)]
        assert gen._overlap_policies[(repr(cfg.tree), False)] is policy
        # the first call probed both modes; the later ones mostly hold speculation off
        assert first.spec_rounds >= 6
        assert sum(s.spec_rounds for s in later) < sum(len(s.rounds) for s in later) // 3
        sampled = gen.generate(ids, max_new_tokens=8, do_sample=True, return_dict_in_generate=True)
        assert sampled.sequences.shape[1] <= ids.shape[1] + 8
        assert (repr(cfg.tree), True) in gen._overlap_policies  # sampling has its own measurements


def test_overlap_policy_leaves_a_probes_stalls_out():
    """A one-off stall (a graph capture, a compile) in a probe must not decide the mode."""
    from specsplit.pipeline import OverlapPolicy

    policy, modes = OverlapPolicy(probe=4, hold=8), []
    for i in range(4 + 4 + 8):
        on = policy.speculate()
        modes.append(on)
        seconds = 0.5 if on else 1.0
        if i == 0:
            seconds = 30.0  # the first speculative round compiles a new shape
        policy.record(seconds, 1)
    assert policy.cost[True] == pytest.approx(0.5) and policy.cost[False] == pytest.approx(1.0)
    assert modes == [True] * 4 + [False] * 4 + [True] * 8
    # ordinary spread is not a stall: every round counts
    policy = OverlapPolicy(probe=4, hold=8)
    for t in (1.0, 2.0, 3.0, 3.9):
        policy.record(t, 1)
    assert policy.cost[True] == pytest.approx((1.0 + 2.0 + 3.0 + 3.9) / 4)
