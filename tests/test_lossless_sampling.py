"""Lossless sampling: the output distribution equals the target's, for chains and branching trees.

Statistical bound: with n = 20,000 seeded runs over the 2-token joint (at most 64 cells), the
expected total-variation distance between the empirical and the exact distribution is below
~0.023 even for a uniform joint; we require TV < 0.04. The negative control shows that a
verifier that skips the residual correction fails the same bound by a wide margin.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specsplit import (
    DraftEngine,
    DraftRequest,
    SpecSplitConfig,
    SpecSplitGenerator,
    TargetEngine,
    TreeConfig,
    VerifyRequest,
)
from specsplit.config import DraftConfig, EngineTuning, SamplingParams
from specsplit.core.sampling import logits_to_probs

V = 8
RUNS = 20_000
PROMPT = [3, 1, 4, 1, 5]
SAMPLING = SamplingParams(do_sample=True, temperature=0.8, top_k=0, top_p=0.95)


def _model(seed: int, scale: float) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(scale)
    return m


@pytest.fixture(scope="module")
def pair():
    target = _model(0, 6.0)  # a spread-out p
    draft = _model(7, 20.0)  # a peaked, unrelated q: far from p
    return target, draft


def exact_joint(target: LlamaForCausalLM) -> torch.Tensor:
    """`[V, V]` exact target probability of the first two sampled tokens."""
    with torch.no_grad():
        p1 = logits_to_probs(target(torch.tensor([PROMPT])).logits[0, -1], SAMPLING)
        ctx = torch.tensor([PROMPT + [x] for x in range(V)])
        p2 = logits_to_probs(target(ctx).logits[:, -1], SAMPLING)
    return p1[:, None] * p2


def empirical_joint(
    target, draft, tree: TreeConfig, runs: int = RUNS, draft_config: DraftConfig | None = None
) -> torch.Tensor:
    """Joint of the first two committed tokens over ``runs`` seeded speculative rounds.

    Each run is one real draft + verify round through the engines (sessions reused: the draft
    hits its prefix cache, the target re-verifies from the prompt). When the round commits only
    one token (everything rejected), the second comes from the next round, which is a target
    step from the exact conditional — itself the first-token case this test also checks.
    """
    draft_engine = DraftEngine(draft, draft_config or DraftConfig(tuning=EngineTuning(q_top_k=V)))
    target_engine = TargetEngine(target)
    exact2 = exact_joint(target)
    cond2 = exact2 / exact2.sum(1, keepdim=True).clamp_min(1e-30)
    counts = torch.zeros(V, V)
    g = torch.Generator().manual_seed(1234)
    with torch.inference_mode():
        for _ in range(runs):
            s_draft, s_verify, s_next = torch.randint(0, 2**62, (3,), generator=g).tolist()
            tr = draft_engine.generate(
                DraftRequest("s", PROMPT, 0, tree, SAMPLING, s_draft, max_depth=2)
            ).tree
            res = target_engine.verify(VerifyRequest("s", tr, PROMPT, 0, SAMPLING, s_verify))
            toks = res.accepted_token_ids + [res.next_token_id]
            if len(toks) < 2:
                gg = torch.Generator().manual_seed(s_next)
                toks.append(int(torch.multinomial(cond2[toks[0]], 1, generator=gg)))
            counts[toks[0], toks[1]] += 1
    draft_engine.shutdown()
    target_engine.shutdown()
    return counts / runs


def tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a - b).abs().sum())


def _q_far_from_p(target, draft) -> float:
    with torch.no_grad():
        p = logits_to_probs(target(torch.tensor([PROMPT])).logits[0, -1], SAMPLING)
        q = logits_to_probs(draft(torch.tensor([PROMPT])).logits[0, -1], SAMPLING)
    return tv(p, q)


TREES = {
    "chain": TreeConfig(shape="chain", num_draft_tokens=3),
    # a chain cut short where the draft doubts its own token (TreeConfig.min_confidence)
    "chain-stop": TreeConfig(shape="chain", num_draft_tokens=3, min_confidence=0.3),
    # 3 roots sampled without replacement, children under the first two: a branching tree
    "tree": TreeConfig(shape="static", paths=[[0], [1], [2], [0, 0], [0, 1], [1, 0]]),
    "dynamic": TreeConfig(shape="dynamic", topk=3, width=2, budget=6, max_depth=2),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["chain", "tree", "dynamic"])  # chain-stop: tests/test_int8.py
def test_output_distribution_equals_target(pair, name):
    target, draft = pair
    assert _q_far_from_p(target, draft) > 0.3  # the draft really is a poor proposal
    exact = exact_joint(target)
    emp = empirical_joint(target, draft, TREES[name])
    assert tv(emp, exact) < 0.04, f"TV={tv(emp, exact):.4f}"
    # the first-token marginal converges too
    assert tv(emp.sum(1), exact.sum(1)) < 0.02


@pytest.mark.slow
def test_output_distribution_equals_target_with_a_restricted_draft_vocabulary(pair):
    """A draft whose output layer scores 3 of the 8 tokens (FR-Spec): its q is zero elsewhere, and
    the target's distribution still comes out exactly, tokens outside the subset included."""
    target, draft = pair
    exact = exact_joint(target)
    assert exact.sum(1)[3:].sum() > 0.3  # the target often samples tokens the draft cannot propose
    cfg = DraftConfig(vocab_subset=3, tuning=EngineTuning(q_top_k=V))
    emp = empirical_joint(target, draft, TREES["chain"], draft_config=cfg)
    assert tv(emp, exact) < 0.04, f"TV={tv(emp, exact):.4f}"
    assert tv(emp.sum(1), exact.sum(1)) < 0.02


def test_negative_control_detects_a_lossy_verifier(pair, monkeypatch):
    """Accepting every drafted token (no rejection step) must fail the same statistical bound."""
    import specsplit.engines.verifiers as target_mod
    from specsplit.core.verification import verify_greedy

    target, draft = pair

    def accept_all(probs, tree, max_depth, max_branch, gen):
        # pretend the target agrees with the draft's first choice everywhere
        fake = torch.zeros(probs.shape[0], probs.shape[1])
        fake[1:, 0] = 1.0
        fake[0, tree.token_ids[0]] = 10.0
        return verify_greedy(fake, tree, max_depth, max_branch)

    monkeypatch.setattr(target_mod, "verify_stochastic", accept_all)
    exact = exact_joint(target)
    emp = empirical_joint(target, draft, TREES["chain"], runs=2000)
    assert tv(emp, exact) > 0.1


def test_seeded_sampling_is_reproducible(llama_target, llama_draft_random):
    ids = torch.tensor([[5, 17, 33, 81]])
    cfg = SpecSplitConfig(tree=TreeConfig(shape="static"))
    with SpecSplitGenerator(llama_target, llama_draft_random, config=cfg) as gen:
        kw = dict(max_new_tokens=24, do_sample=True, temperature=0.9, top_p=0.9, top_k=50)
        a = gen.generate(ids, generator=torch.Generator().manual_seed(0), return_dict_in_generate=True, **kw)
        b = gen.generate(ids, generator=torch.Generator().manual_seed(0), return_dict_in_generate=True, **kw)
        c = gen.generate(ids, generator=torch.Generator().manual_seed(1), **kw)
        torch.manual_seed(5)
        d = gen.generate(ids, **kw)
        torch.manual_seed(5)
        e = gen.generate(ids, **kw)
    assert torch.equal(a.sequences, b.sequences)
    assert a.spec_stats.accepted_counts() == b.spec_stats.accepted_counts()
    assert not torch.equal(a.sequences, c)
    assert torch.equal(d, e)


def _context_probs(
    model, sampling: SamplingParams | None, depth: int = 2
) -> dict[tuple[int, ...], torch.Tensor]:
    """The model's next-token distribution (or raw logits) after the prompt and after every path of
    up to ``depth`` tokens: every context a tree that deep can reach."""
    ctxs: list[tuple[int, ...]] = [()]
    for _ in range(depth):
        ctxs += [c + (t,) for c in ctxs if len(c) == len(ctxs[-1]) for t in range(V)]
    with torch.no_grad():
        out = {}
        for c in ctxs:
            logits = model(torch.tensor([PROMPT + list(c)])).logits[0, -1]
            out[c] = logits_to_probs(logits, sampling) if sampling is not None else logits
    return out


def empirical_joint_ngram(
    target, draft, merged: bool, runs: int = RUNS, lookahead: bool = False
) -> torch.Tensor:
    """The same joint when each round verifies a deterministic n-gram tree (``q`` one-hot, siblings
    that branch) — alone, or merged behind a sampled model tree (:func:`merge_trees`), or with a
    lookahead window beside it whose guesses move with the target's choices round after round
    (:func:`~specsplit.engines.drafters.lookahead_tree`).

    The engines' forwards are exact (tested elsewhere) and deterministic given a tree, so the rounds
    here run the tree algorithms themselves: the model tree grows by :func:`grow_static_tree` from
    the draft's logits, and the target's acceptance (:func:`~specsplit.engines.verifiers.decide`,
    as the engine calls it) gets the target's logits at every node's own context — 20,000 rounds in
    seconds instead of minutes. A deterministic tree goes through position-keyed draws, a tree
    with a sampled part through recursive rejection sampling.
    """
    from specsplit.core.growth import PlanTensors, grow_static_tree
    from specsplit.core.lookahead import LookaheadWindow
    from specsplit.core.ngram import Proposal
    from specsplit.engines.drafters import lookahead_tree, merge_trees, proposal_tree
    from specsplit.engines.verifiers import decide

    # Three roots, two with children, one child a duplicate of another's token: a branching tree of
    # the kind prompt lookup proposes (ranked by frequency), padded to 8 nodes.
    prop = Proposal(
        [2, 5, 1, 4, 6, 2], [-1, -1, -1, 0, 0, 1], [1, 1, 1, 2, 2, 2], [0.5, 0.3, 0.2, 0.3, 0.2, 0.1]
    )
    extra, _ = proposal_tree(prop, 8, depth_bound=2, fixed_bounds=False)
    window = LookaheadWindow(2, 2, 2, seed_tokens=[5, 2, 2, 7])  # a chain of 2, a row below: depth 3
    p = _context_probs(target, SAMPLING)
    p_logits = _context_probs(target, None, depth=3 if lookahead else 2)
    q_logits = _context_probs(draft, None)
    plan = TREES["tree"].static_plan()
    pt = PlanTensors.build(plan, torch.device("cpu"))
    counts = torch.zeros(V, V)
    g = torch.Generator().manual_seed(4321)
    for _ in range(runs):
        tree, offset = extra, -1
        if lookahead:
            tree, offset, _ = lookahead_tree(prop, window, 12, depth_bound=2, fixed_bounds=False)
        if merged:
            tree = merge_trees(
                grow_static_tree(q_logits[()], plan, pt, SAMPLING, V, g,
                                 lambda d, tok, allowed: torch.stack([q_logits[(int(t),)] for t in tok])),
                extra,
            )  # fmt: skip
        par, tok = tree.parents.tolist(), tree.token_ids.tolist()
        paths: list[tuple[int, ...]] = []
        for i, pa in enumerate(par):
            paths.append((paths[pa] if pa >= 0 else ()) + (tok[i],))
        logits = torch.stack([p_logits[()]] + [p_logits[c] for c in paths])  # [N + 1, V]
        branch, depth = tree.bounds()
        seed = int(torch.randint(0, 2**62, (1,), generator=g))
        out = decide(logits, tree, SAMPLING, seed, len(PROMPT), depth, branch)
        nodes, toks, nxt = out.to_host(tree.token_ids, choices=lookahead)
        if lookahead:  # the next round's window: this round's draws after its nodes
            assert out.choices_host is not None
            window.update(out.choices_host[1 + offset : 1 + offset + window.num_nodes])
        toks = toks + [nxt]
        if len(toks) < 2:
            toks.append(int(torch.multinomial(p[(toks[0],)], 1, generator=g)))
        counts[toks[0], toks[1]] += 1
    return counts / runs


@pytest.mark.parametrize(
    "merged, lookahead",
    [(False, False), (True, False), (False, True)],
    ids=["ngram-tree", "model-tree-merged-with-ngram", "ngram-tree-with-lookahead-window"],
)
def test_output_distribution_equals_target_with_ngram_trees(pair, merged, lookahead):
    target, draft = pair
    exact = exact_joint(target)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # thousands of tiny ops: a thread pool only adds its hand-offs
    try:
        emp = empirical_joint_ngram(target, draft, merged, lookahead=lookahead)
    finally:
        torch.set_num_threads(threads)
    assert tv(emp, exact) < 0.04, f"TV={tv(emp, exact):.4f}"
    assert tv(emp.sum(1), exact.sum(1)) < 0.02
