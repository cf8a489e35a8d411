"""Drafters beside the model: n-gram / suffix trees, hybrid trees, the cost model that sizes rounds.

Pins: every drafter's greedy output equals HF ``generate()`` in float32 (with and without a draft
model, on the eager and the static path, in batches); seeded sampling gives the same tokens with
any drafter (position-keyed draws); the suffix cache drafts from earlier generations; the cost
model, with injected costs, picks the arm with the best tokens per second, turns speculation off
when it does not pay and probes the model's tree ever less often while it loses.
"""

from __future__ import annotations

import pytest
import torch

from specsplit import SpecSplitConfig, SpecSplitGenerator, TreeConfig
from specsplit.config import DraftConfig, EngineTuning, TargetConfig
from specsplit.engines.cost_model import CostModel, FixedCosts, RoundPlan
from specsplit.engines.drafters import TREE_SIZES, merge_trees, proposal_tree, tree_size, tree_sizes

# A prompt that repeats itself, and a tiny target whose greedy continuation loops: n-gram lookup
# finds matches in both.
PROMPT = [5, 17, 33, 81, 9, 100, 5, 17, 33, 81]
MODES = ["ngram", "suffix", "hybrid", "auto"]


def _hf(model, ids, n, mask=None):
    return model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("tree", ["chain", "dynamic"])
def test_every_drafter_is_exact(llama_target, llama_draft_random, flat_costs, mode, tree):
    """Greedy output equals HF's for every drafter and tree, and n-gram trees get verified (costs
    priced as on a GPU: this machine's load must not turn speculation off)."""
    ids = torch.tensor([PROMPT])
    ref = _hf(llama_target, ids, 60)
    shape = TreeConfig(shape=tree, budget=12, max_depth=4, topk=3, width=3)
    with SpecSplitGenerator(
        llama_target, llama_draft_random, config=SpecSplitConfig(drafter=mode, tree=shape)
    ) as gen:
        outs = [gen.generate(ids, max_new_tokens=60, return_dict_in_generate=True) for _ in range(2)]
    for out in outs:
        assert torch.equal(out.sequences, ref)
    by = outs[-1].spec_stats.rounds_by_drafter()
    assert by.get("ngram", 0) + by.get("hybrid", 0) > 0, by  # n-gram trees were verified
    if mode == "hybrid":
        assert set(by) <= {"model", "hybrid"}  # hybrid always drafts with the model too


def test_ngram_needs_no_draft_model(llama_target, qwen_target):
    """``SpecSplitGenerator(target, None, config=SpecSplitConfig(drafter="ngram"))``: exact, and it drafts."""
    for target in (llama_target, qwen_target):
        ids = torch.tensor([PROMPT])
        ref = _hf(target, ids, 80)
        with SpecSplitGenerator(target, None, config=SpecSplitConfig(drafter="ngram")) as gen:
            assert gen.draft_engine is None
            out = gen.generate(ids, max_new_tokens=80, return_dict_in_generate=True)
        assert torch.equal(out.sequences, ref)
        assert out.spec_stats.rounds_by_drafter().get("ngram", 0) > 0, out.spec_stats.summary()
        if target is llama_target:  # its greedy continuation loops: n-gram trees get accepted
            assert out.spec_stats.tau > 1.3, out.spec_stats.summary()


def test_ngram_batch_and_static_path_are_exact(llama_target):
    """Left-padded batches, and the CUDA-graph (static) path, where n-gram trees are padded to a few
    sizes so a target replays a bounded set of round graphs."""
    prompts = [PROMPT, [7, 7, 12, 7, 7], [44, 3, 19, 250, 61, 62, 63, 64, 9]]
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = torch.tensor(p), 1
    ref = _hf(llama_target, ids, 48, mask)
    for graphs in (False, True):
        cfg = SpecSplitConfig(
            drafter="ngram",
            max_batch=0,  # rows one after another: the single-row round graphs (batching: test_batching)
            target=TargetConfig(cuda_graphs=graphs, tuning=EngineTuning(graph_capacity=512)),
            draft=DraftConfig(cuda_graphs=graphs),
        )
        with SpecSplitGenerator(llama_target, None, config=cfg) as gen:
            out = gen.generate(ids, attention_mask=mask, max_new_tokens=48, return_dict_in_generate=True)
            rounds = gen.target_engine._rounds if gen.target_engine is not None else {}
        assert torch.equal(out.sequences, ref)
        if graphs:  # one-graph greedy rounds, keyed by tree size: only a few sizes
            assert rounds and {key[0] for key in rounds} <= {0, *TREE_SIZES, 32}


def test_seeded_sampling_gives_the_same_tokens_with_any_drafter(llama_target, llama_draft_random):
    """Position-keyed draws: the committed tokens do not depend on what a round drafted, so the same
    seed gives the same tokens target-only, with n-gram trees, merged trees or the cost model's mix."""
    ids = torch.tensor([PROMPT])
    kw = dict(max_new_tokens=40, do_sample=True, temperature=0.8, top_p=0.95, return_dict_in_generate=True)
    outs = {}
    for mode, draft in (("model", None), ("ngram", None), ("suffix", None), ("hybrid", llama_draft_random),
                        ("auto", llama_draft_random)):  # fmt: skip
        shape = TreeConfig(shape="dynamic", budget=8, max_depth=3, topk=2, width=2)
        with SpecSplitGenerator(llama_target, draft, config=SpecSplitConfig(drafter=mode, tree=shape)) as gen:
            outs[mode] = [
                gen.generate(ids, generator=torch.Generator().manual_seed(s), **kw) for s in (3, 3, 4)
            ]
    ref = outs["model"][0].sequences  # no draft model: plain sampled target steps
    for mode, (a, b, c) in outs.items():
        assert torch.equal(a.sequences, ref), mode
        assert torch.equal(b.sequences, ref), mode  # reproducible, also after the cost model learned
        assert not torch.equal(c.sequences, ref), mode
    assert outs["suffix"][1].spec_stats.tau > 2.0  # the first generation is in the suffix cache: it drafts


def test_suffix_cache_drafts_from_earlier_generations(llama_target):
    ids = torch.tensor([[9, 8, 7, 6]])
    ref = _hf(llama_target, ids, 64)
    with SpecSplitGenerator(llama_target, None, config=SpecSplitConfig(drafter="suffix")) as gen:
        first = gen.generate(ids, max_new_tokens=64, return_dict_in_generate=True)
        second = gen.generate(ids, max_new_tokens=64, return_dict_in_generate=True)
    assert torch.equal(first.sequences, ref) and torch.equal(second.sequences, ref)
    assert second.spec_stats.tau > 2 * first.spec_stats.tau  # the first generation's text repeats


# ---------------------------------------------------------------------- trees
def test_proposal_trees_pad_to_fixed_sizes_and_merge():
    from specsplit.core.ngram import Proposal

    prop = Proposal([4, 5, 6, 7], [-1, 0, 1, -1], [1, 2, 3, 1], [0.9, 0.8, 0.7, 0.1])
    assert [tree_size(k) for k in (0, 1, 5, 7, 33, 1000)] == [0, 2, 8, 8, 64, 64]
    assert tree_sizes(20, padded=True) == (2, 4, 8, 16, 20) and tree_sizes(3, padded=False) == (1, 2, 3)
    tree, scores = proposal_tree(prop, 6, depth_bound=16, fixed_bounds=True)
    assert tree.num_nodes == 6 and tree.bounds() == (6, 6)  # no deeper than its node count
    assert tree.token_ids.tolist()[:4] == [4, 5, 6, 7] and scores == [0.9, 0.8, 0.7, 0.1, 0.0, 0.0]
    tree.validate(vocab_size=100)
    small, _ = proposal_tree(prop, 2, depth_bound=16, fixed_bounds=False)
    assert small.token_ids.tolist() == [4, 5] and small.bounds() == (1, 2)
    merged = merge_trees(small, tree)
    merged.validate(vocab_size=100)
    assert merged.parents.tolist() == [-1, 0, -1, 2, 3, -1, -1, -1]
    assert merged.num_nodes == 8 and merged.bounds() == (7, 6)


def test_drafted_host_trees_skip_the_checks_meant_for_trees_from_outside(llama_target, monkeypatch):
    """n-gram trees are built from committed tokens (``trusted``): the engine neither validates them
    nor does the in-process transport move them (a graph-replayed round stages host ids in one
    copy). A host tree from anywhere else is still checked fully and a bad one refused."""
    from specsplit.core.ngram import Proposal
    from specsplit.core.tree import TokenTree
    from specsplit.engines.target import TargetEngine
    from specsplit.errors import InvalidRequest
    from specsplit.messages import VerifyRequest
    from specsplit.remote.convert import verify_request_from_proto, verify_request_to_proto

    tree, _ = proposal_tree(Proposal([4, 5], [-1, 0], [1, 2], [0.9, 0.8]), 4, 16, True)
    assert tree.trusted and tree.to("cpu").trusted
    assert not TokenTree(tree.token_ids, tree.parents, tree.depths, tree.log_probs).trusted
    # the flag never crosses gRPC: a worker checks every tree it receives
    wire = verify_request_to_proto(VerifyRequest("s", tree, [5], 0))
    assert not verify_request_from_proto(wire).tree.trusted
    calls = {"validate": 0}
    orig = TokenTree.validate

    def spy(self, *a, **kw):
        calls["validate"] += 1
        return orig(self, *a, **kw)

    monkeypatch.setattr(TokenTree, "validate", spy)
    seen: list[bool] = []  # trusted, for every tree the target engine is handed
    verify = TargetEngine.verify
    monkeypatch.setattr(
        TargetEngine, "verify", lambda self, req: seen.append(req.tree.trusted) or verify(self, req)
    )
    ids = torch.tensor([PROMPT])
    ref = _hf(llama_target, ids, 40)
    with SpecSplitGenerator(llama_target, None, config=SpecSplitConfig(drafter="ngram")) as gen:
        out = gen.generate(ids, max_new_tokens=40, return_dict_in_generate=True)
        assert torch.equal(out.sequences, ref)
        assert out.spec_stats.rounds_by_drafter().get("ngram", 0) > 0
        assert calls["validate"] == 0 and all(seen) and len(seen) == len(out.spec_stats.rounds)
        bad = TokenTree(torch.tensor([4, 5]), torch.tensor([-1, 5]), torch.tensor([1, 2]), torch.zeros(2))
        with pytest.raises(InvalidRequest, match="parents"):
            gen.transport.verify(VerifyRequest("outside", bad, [5, 17], 0))
        assert calls["validate"] == 1
        fine = TokenTree(bad.token_ids, torch.tensor([-1, 0]), bad.depths, bad.log_probs)
        assert gen.transport.verify(VerifyRequest("outside", fine, [5, 17], 0)).prefix_length >= 2
        assert calls["validate"] == 2


# ---------------------------------------------------------------------- cost model
FLAT = FixedCosts(fixed=0.001, verify=lambda n: 0.010 + 0.0001 * n, model=0.030)  # a GPU-like profile
STEEP = FixedCosts(fixed=0.001, verify=lambda n: 0.010 * (1 + 0.25 * n), model=0.030)  # a CPU-like profile


def test_cost_model_sizes_the_tree_by_expected_tokens_per_second():
    scores = [0.95, 0.9, 0.85, 0.8, 0.6, 0.5, 0.3, 0.2, 0.1, 0.05]
    flat = CostModel("ngram", costs=FLAT, padded=False).plan(scores, model_available=False)
    assert flat.ngram_size >= 8 and not flat.model  # verifying more is nearly free
    steep = CostModel("ngram", costs=STEEP, padded=False).plan(scores, model_available=False)
    assert 0 < steep.ngram_size < flat.ngram_size  # each node costs a step: only the likely ones
    weak = CostModel("ngram", costs=STEEP).plan([0.05, 0.04], model_available=False)
    assert weak == RoundPlan(False, 0, weak.expected, weak.seconds)  # nothing pays: a plain step


def test_cost_model_learns_that_proposals_fail():
    cm = CostModel("ngram", costs=STEEP)
    scores = [0.9, 0.8, 0.7]
    assert cm.plan(scores, False).ngram_size > 0
    for _ in range(60):  # the proposals' scores were wrong: nothing was ever accepted
        cm.observe(RoundPlan(False, 3), 3, 0.04, 0.041, 0.0, 1, scores, [False] * 3)
    assert cm.plan(scores, False).ngram_size == 0


def test_auto_probes_the_model_ever_less_often_while_it_loses():
    cm = CostModel("auto", model_nodes=8, costs=FLAT, probe_every=4)
    arms = []
    for _ in range(200):
        plan = cm.plan([0.9, 0.9, 0.9, 0.8], model_available=True)
        arms.append(plan.arm)
        committed = 2 if plan.model else 4
        scores = [0.9, 0.9, 0.9, 0.8][: plan.ngram_size]
        flags = [i < 3 for i in range(len(scores))]
        cm.observe(plan, plan.ngram_size + 8 * plan.model, 0.01, 0.02, 0.03 if plan.model else 0.0, committed,
                   scores, flags)  # fmt: skip
    probes = [i for i, a in enumerate(arms) if a == "model"]
    assert probes[:3] == [0, 1, 2]  # measured first
    gaps = [b - a for a, b in zip(probes[3:], probes[4:], strict=False)]
    assert gaps and all(b >= a for a, b in zip(gaps, gaps[1:], strict=False)) and gaps[-1] > gaps[0]
    assert arms[-1] == "ngram" and len(probes) < 15


def test_auto_looks_at_the_model_again_at_every_generation():
    """A model that lost on one text (probes spaced ever wider) is probed once at the next
    generation, and a good round there moves the shared estimate until the model wins again."""
    cm = CostModel("auto", model_nodes=4, costs=FixedCosts(fixed=0.0, verify=lambda n: 0.25 + 0.01 * n, model=0.05),
                   probe_every=64)  # fmt: skip
    for _ in range(10):  # a chat-like text: the model's rounds commit one token
        plan = cm.plan([], model_available=True)
        cm.observe(plan, 4 if plan.model else 0, 0.29, 0.3, 0.05 if plan.model else 0.0, 1)
    assert not cm.plan([], model_available=True).model  # it lost: plain steps, next probe far away
    cm.new_generation(5)
    probe = cm.plan([], model_available=True)
    assert probe.model and probe.probe
    cm.observe(probe, 4, 0.29, 0.35, 0.05, 5)  # new code: the whole chain is accepted
    for _ in range(3):
        plan = cm.plan([], model_available=True)
        assert plan.model and not plan.probe
        cm.observe(plan, 4, 0.29, 0.35, 0.05, 5)
    # A draft round that costs several target steps (a GPU): even a whole tree would not pay clearly.
    verify = lambda n: 2e-3 * (1 + 0.02 * n)  # noqa: E731
    dear = CostModel("auto", model_nodes=24, costs=FixedCosts(fixed=0.0, verify=verify, model=7e-3))
    for _ in range(3):
        dear.observe(dear.plan([], model_available=True), 24, 3e-3, 1e-2, 7e-3, 2)
    dear.new_generation(7)  # 7 tokens in 10 ms: less than 1.5 x a plain step's 1 token in 2 ms
    assert not dear.plan([], model_available=True).model


def test_a_model_round_that_ran_the_drafts_prompt_forward_prices_no_model_round():
    """The first model round of a generation that opened with n-gram or plain rounds also runs the
    draft's prompt forward: its tokens count, its seconds do not become the model's cost."""
    cm = CostModel("auto", model_nodes=4)
    probe = RoundPlan(True, 0, probe=True)
    cm.observe(probe, 4, 0.3, 2.5, 2.0, 4, draft_cold=True)  # 2 s of draft: the prompt's forward
    assert cm.model_s is None and cm.model_tau == 4.0
    for _ in range(2):
        cm.observe(probe, 4, 0.3, 0.55, 0.2, 4)
    assert cm.model_s == pytest.approx(0.2)


def test_a_chain_that_stops_early_is_priced_at_the_nodes_it_drafts():
    """A chain with a confidence floor drafts fewer nodes than its budget where the draft is unsure
    (chat): such a round verifies those few, and is priced so, not as the whole chain."""
    steep = FixedCosts(fixed=0.0, verify=lambda n: 1.0 + 0.1 * n, model=0.3)  # a CPU: a node costs
    cm = CostModel("auto", model_nodes=8, costs=steep)
    for _ in range(4):  # one- or two-node chains that commit two tokens a round
        cm.observe(cm.plan([], model_available=True), 1, 1.1, 1.4, 0.3, 2)
    assert cm.model_drafted == pytest.approx(1.0)
    plan = cm.plan([], model_available=True)  # 2 tokens in 0.3 + 1.1 s beat a plain step's 1 in 1 s
    assert plan.model and not plan.probe
    assert plan.seconds == pytest.approx(0.3 + 1.1)  # priced at one node, not eight (1.8 s: a loss)


def test_the_planner_measures_a_plain_step_before_it_prices_trees():
    """Measured costs: with no plain step measured yet the planner runs one, so that a tree is never
    judged against a plain step guessed from tree rounds; one size known, others grow 5% a node."""
    cm = CostModel("ngram", padded=False)
    strong = [0.9, 0.9, 0.8, 0.8]
    first = cm.plan(strong, model_available=False)
    assert first.ngram_size == 0 and first.probe
    cm.observe(first, 0, 0.2, 0.2, 0.0, 1)
    assert cm.verify.estimate(8) == pytest.approx(0.2 * (1 + 8 * 0.05))
    assert cm.plan(strong, model_available=False).ngram_size > 0  # measured: the tree pays
    cm.observe(RoundPlan(False, 32), 32, 2.0, 2.0, 0.0, 1, [0.5] * 32, [False] * 32)  # a CPU: 32 nodes, 10x
    assert cm.plan([0.5] * 32, model_available=False).ngram_size < 32  # such nodes failed, and cost


def test_hybrid_always_drafts_with_the_model_and_model_mode_never_plans_ngram():
    hybrid = CostModel("hybrid", model_nodes=8, costs=FLAT)
    assert hybrid.plan([0.9, 0.8], model_available=True).model
    assert hybrid.plan([], model_available=True) == RoundPlan(True, 0, 1.0, hybrid.plan([], True).seconds)
    assert CostModel("model").plan([0.9], model_available=True) == RoundPlan(True, 0)
    with pytest.raises(ValueError, match="drafter"):
        CostModel("magic")
