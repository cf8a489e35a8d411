"""Lookahead drafting: a Jacobi window in the verify forward, an n-gram pool from its outputs.

Pins: the window's tree shape (row 0 a chain from the context, each column continued one deeper);
a Jacobi step harvests each column's n-gram and moves the rows up; the pool is bounded and proposes
its newest n-grams first; ``VerifyResult.choices`` is the target's argmax after every row (checked
against HF forwards), also through the gRPC conversion; generations with lookahead rounds equal HF
``generate()`` greedy in float32 (eager and static path, Llama and Qwen2) and target-only sampling
for the same seed; the adaptive policy turns lookahead off where its rounds lose; bad settings are
refused.
"""

from __future__ import annotations

import pytest
import torch

from specsplit import SpecSplitConfig, SpecSplitGenerator
from specsplit.config import (
    DEFAULT_LOOKAHEAD,
    DEFAULT_LOOKAHEAD_NODES,
    EngineTuning,
    NgramConfig,
    PipelineTuning,
    TargetConfig,
)
from specsplit.core.lookahead import LookaheadWindow
from specsplit.core.ngram import Proposal
from specsplit.core.tree import TokenTree
from specsplit.engines.drafters import NgramDrafter, lookahead_tree
from specsplit.errors import ConfigError
from specsplit.messages import VerifyRequest

PROMPT = [44, 3, 19, 250, 61, 62, 63, 64, 9, 3, 19]


def _config(width: int, policy: str = "always", graphs: bool = False, **kw) -> SpecSplitConfig:
    ngram = NgramConfig(lookahead=width, lookahead_levels=2, lookahead_policy=policy)
    target = TargetConfig(cuda_graphs=graphs, tuning=EngineTuning(graph_capacity=512))
    return SpecSplitConfig(drafter="ngram", tuning=PipelineTuning(ngram=ngram), target=target, **kw)


# ---------------------------------------------------------------------- the window
def test_window_nodes_are_a_chain_with_a_column_below_each_guess():
    w = LookaheadWindow(width=3, levels=3, pool_size=2, seed_tokens=list(range(100, 109)))
    tokens, parents, depths = w.nodes()
    assert tokens == list(range(100, 109))  # rows in order, seeded from the prompt's last tokens
    assert parents == [-1, 0, 1, 0, 1, 2, 3, 4, 5]  # row 0 a chain; row r column c below row r-1's
    assert depths == [1, 2, 3, 2, 3, 4, 3, 4, 5]  # row r, column c: depth r + c + 1
    assert w.num_nodes == 9 and w.depth == max(depths)
    short = LookaheadWindow(width=4, levels=2, pool_size=1, seed_tokens=[7])  # too few: repeated
    assert short.nodes()[0] == [7] * 8


def test_a_jacobi_step_harvests_column_ngrams_and_moves_the_rows_up():
    w = LookaheadWindow(width=2, levels=2, pool_size=2, seed_tokens=[1, 2, 3, 4])  # rows [1, 2], [3, 4]
    w.update([50, 51, 60, 61])  # the target's token after each node; the last row's are 60, 61
    assert w.rows == [[3, 4], [60, 61]]
    assert [c.tokens for c in w.continuations(1, 5)] == [[3, 60]]  # column 0: 1, 3, then 60
    assert [c.tokens for c in w.continuations(2, 5)] == [[4, 61]]
    w.update([0, 0, 70, 71])
    w.update([0, 0, 80, 81])
    assert [c.tokens for c in w.continuations(60, 5)] == [[70, 80]]
    with pytest.raises(ValueError, match="window outputs"):
        w.update([1, 2])


def test_the_pool_keeps_the_newest_ngrams_per_first_token():
    w = LookaheadWindow(width=1, levels=1, pool_size=2, seed_tokens=[5])
    for nxt in (6, 7, 8, 7):  # row 0 is the last output: 5->6, 6->7, 7->8, 8->7
        w.rows = [[5]]
        w.update([nxt])
    assert [c.tokens for c in w.continuations(5, 9)] == [[7], [8]]  # newest first, 6 evicted
    assert [c.tokens for c in w.continuations(5, 1)] == [[7]]
    assert w.continuations(99, 3) == []


def test_lookahead_tree_puts_the_window_after_the_proposal_and_pads():
    w = LookaheadWindow(width=2, levels=2, pool_size=2, seed_tokens=[1, 2, 3, 4])
    proposal = Proposal([9, 8], [-1, 0], [1, 2], [0.9, 0.5])
    tree, offset, _ = lookahead_tree(proposal, w, size=8, depth_bound=4, fixed_bounds=True)
    assert offset == 2
    assert tree.token_ids.tolist()[:6] == [9, 8, 1, 2, 3, 4]
    assert tree.parents.tolist() == [-1, 0, -1, 2, 2, 3, -1, -1]  # window parents shifted; padding roots
    assert tree.depths.tolist() == [1, 2, 1, 2, 2, 3, 1, 1]
    assert tree.bounds() == (8, 4)
    tree.validate(1000, 8, 8)


def test_guesses_merge_into_the_ngram_nodes_as_a_trie():
    """A guess path that starts like an n-gram path continues below the shared node (the target
    follows one child per token, so a guess below a duplicate could never be accepted), the nodes it
    saves go to more n-gram candidates, and the window still comes last."""
    from specsplit.engines.drafters import merge_guesses
    from specsplit.messages import HeadGuesses

    proposal = Proposal([9, 8, 7, 6], [-1, 0, -1, 2], [1, 2, 1, 2], [0.9, 0.5, 0.4, 0.3])
    guesses = HeadGuesses([9, 5, 4, 3], [-1, 0, 1, -1], [1, 2, 3, 1])  # 9 -> 5 -> 4, and 3
    tokens, parents, depths = merge_guesses(proposal.top(2), *vars(guesses).values())
    assert (tokens, parents, depths) == ([9, 8, 5, 4, 3], [-1, 0, 0, 2, -1], [1, 2, 2, 3, 1])
    w = LookaheadWindow(width=2, levels=1, pool_size=2, seed_tokens=[1, 2])
    tree, offset, guess_from = lookahead_tree(
        proposal, w, size=9, depth_bound=4, fixed_bounds=True, guesses=guesses
    )
    # 9 - 2 window nodes - 4 guesses = 3 n-gram nodes, +1 for the shared 9: all 4 n-gram nodes fit
    assert offset == 7 and guess_from == 4  # 5, 4 and 3 are the guesses' own nodes
    assert tree.token_ids.tolist() == [9, 8, 7, 6, 5, 4, 3, 1, 2]
    assert tree.parents.tolist() == [-1, 0, -1, 2, 0, 4, -1, -1, 7]
    assert tree.depths.tolist() == [1, 2, 1, 2, 2, 3, 1, 1, 2]
    tree.validate(1000, 9, 9)
    tree, offset, guess_from = lookahead_tree(
        proposal, None, size=6, depth_bound=4, fixed_bounds=False, guesses=guesses
    )
    assert (
        offset == -1
        and guess_from == 3
        and tree.num_nodes == 6
        and tree.token_ids.tolist() == [9, 8, 7, 5, 4, 3]
    )
    assert tree.bounds() == (3, 3)  # three roots (9, 7, 3) below the next token; depth 3
    tree.validate(1000, 6, 6)


# ---------------------------------------------------------------------- the target's choices
def test_verify_returns_the_targets_argmax_after_every_row(llama_target):
    """``return_choices``: row 0 (after the pending token) and every node, equal to HF's argmax over
    that node's own context; a plain round returns one."""
    with SpecSplitGenerator(llama_target, None, config=SpecSplitConfig(drafter="ngram")) as gen:
        engine = gen.target_engine
        assert engine is not None
        tokens, parents = [21, 22, 30, 23], [-1, 0, -1, 1]
        depths = [1, 2, 1, 3]
        tree = TokenTree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depths), torch.zeros(4))
        res = engine.verify(VerifyRequest("s", tree, PROMPT, 0, return_choices=True))
        assert res.choices is not None and len(res.choices) == 5
        paths = [[], [21], [21, 22], [30], [21, 22, 23]]
        for row, path in enumerate(paths):
            ids = torch.tensor([PROMPT + path])
            want = int(llama_target(ids).logits[0, -1].argmax())
            assert res.choices[row] == want, row
        plain = engine.verify(
            VerifyRequest("s", TokenTree.empty(), [res.next_token_id], res.prefix_length, return_choices=True)
        )
        assert plain.choices is not None and len(plain.choices) == 1
        assert engine.verify(VerifyRequest("t", TokenTree.empty(), PROMPT, 0)).choices is None  # not asked


def test_choices_survive_the_grpc_conversion():
    from specsplit.messages import VerifyResult
    from specsplit.remote.convert import (
        verify_request_from_proto,
        verify_request_to_proto,
        verify_result_from_proto,
        verify_result_to_proto,
    )

    req = VerifyRequest("s", TokenTree.empty(), [1], 0, return_choices=True)
    assert verify_request_from_proto(verify_request_to_proto(req)).return_choices
    res = VerifyResult([3], 4, [0], 9, 1, 1, choices=[5, 6])
    assert verify_result_from_proto(verify_result_to_proto(res)).choices == [5, 6]
    res.choices = None
    assert verify_result_from_proto(verify_result_to_proto(res)).choices is None


# ---------------------------------------------------------------------- generation
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "static"])
def test_lookahead_generation_equals_hf_greedy(llama_target, qwen_target, graphs):
    for target in (llama_target, qwen_target):
        ids = torch.tensor([PROMPT])
        ref = target.generate(ids, max_new_tokens=48, do_sample=False, pad_token_id=0)
        with SpecSplitGenerator(target, None, config=_config(4, graphs=graphs)) as gen:
            outs = [gen.generate(ids, max_new_tokens=48, return_dict_in_generate=True) for _ in range(2)]
        for out in outs:
            assert torch.equal(out.sequences, ref)
        by = outs[0].spec_stats.rounds_by_drafter()  # lookahead rounds run until measured, at least
        assert by.get("lookahead", 0) > 0, by


def test_lookahead_sampling_gives_target_only_tokens_for_the_same_seed(llama_target):
    ids = torch.tensor([PROMPT])
    kw = dict(max_new_tokens=40, do_sample=True, temperature=0.8, top_p=0.95, return_dict_in_generate=True)
    with SpecSplitGenerator(llama_target, None) as plain:
        ref = plain.generate(ids, generator=torch.Generator().manual_seed(5), **kw).sequences
    with SpecSplitGenerator(llama_target, None, config=_config(3)) as gen:
        outs = [gen.generate(ids, generator=torch.Generator().manual_seed(s), **kw) for s in (5, 5, 6)]
    assert torch.equal(outs[0].sequences, ref) and torch.equal(outs[1].sequences, ref)
    assert not torch.equal(outs[2].sequences, ref)
    assert outs[0].spec_stats.rounds_by_drafter().get("lookahead", 0) > 0


def test_a_lookahead_round_reads_the_device_once(llama_target, outcome_reads):
    """The target's choices after every node ride on the round's one read of its outcome: one
    ``VerifyOutcome.to_host`` a round, lookahead rounds included."""
    with SpecSplitGenerator(llama_target, None, config=_config(4)) as gen:
        out = gen.generate(torch.tensor([PROMPT]), max_new_tokens=32, return_dict_in_generate=True)
    assert out.spec_stats.rounds_by_drafter().get("lookahead", 0) > 0
    assert outcome_reads["n"] == len(out.spec_stats.rounds)


def test_the_adaptive_policy_times_lookahead_rounds_against_the_planners(llama_target):
    """``lookahead_policy="adaptive"``: probes of lookahead rounds and of the planner's rounds are
    both timed (kept by the generator across calls), and either way the output is HF's."""
    ids = torch.tensor([PROMPT])
    ref = llama_target.generate(ids, max_new_tokens=64, do_sample=False, pad_token_id=0)
    with SpecSplitGenerator(llama_target, None, config=_config(8, policy="adaptive")) as gen:
        outs = [gen.generate(ids, max_new_tokens=64, return_dict_in_generate=True) for _ in range(3)]
        policy = gen._ngram.lookahead_policy(False)
    for out in outs:
        assert torch.equal(out.sequences, ref)
    assert policy.cost[True] is not None and policy.cost[False] is not None
    assert outs[0].spec_stats.rounds_by_drafter().get("lookahead", 0) > 0


def test_lookahead_auto_is_on_only_where_the_target_replays_graphs(llama_target):
    """``lookahead="auto"`` (the default): the default window on a graph-replaying target (a local
    engine with CUDA graphs on a CUDA device, a worker's target on its graphs), none elsewhere; an
    explicit width holds everywhere."""
    from specsplit.remote.target_loop import WorkerDrafting

    assert NgramConfig().lookahead == "auto"
    assert NgramDrafter(NgramConfig(), graphs=True).lookahead_width() == DEFAULT_LOOKAHEAD
    assert NgramDrafter(NgramConfig(), graphs=False).lookahead_width() == 0
    assert NgramDrafter(NgramConfig(lookahead=5), graphs=False).lookahead_width() == 5
    assert NgramDrafter(NgramConfig(lookahead=0), graphs=True).lookahead_width() == 0
    # hybrid asks for the model's tree every round: only an explicit width gives it a window
    assert NgramDrafter(NgramConfig(), graphs=True).lookahead_width("hybrid") == 0
    assert NgramDrafter(NgramConfig(lookahead=5), graphs=True).lookahead_width("hybrid") == 5
    assert NgramConfig().lookahead_policy == "always"
    assert WorkerDrafting("ngram", padded=True).drafter("auto").lookahead_width() == DEFAULT_LOOKAHEAD
    assert WorkerDrafting("ngram", padded=False).drafter("ngram").lookahead_width() == 0
    # the static path on a CPU runs eagerly: no graphs, so no window, and no lookahead rounds
    cfg = SpecSplitConfig(drafter="ngram", target=TargetConfig(cuda_graphs=True))
    ids = torch.tensor([PROMPT])
    ref = llama_target.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=0)
    with SpecSplitGenerator(llama_target, None, config=cfg) as gen:
        assert not gen.target_engine.replays_graphs and gen._ngram.lookahead_width() == 0
        out = gen.generate(ids, max_new_tokens=24, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert "lookahead" not in out.spec_stats.rounds_by_drafter()


def test_lookahead_flag_takes_auto_and_widths():
    from specsplit.bench.cli import _lookahead
    from specsplit.cli.common import lookahead_overrides

    assert lookahead_overrides("auto") == {"lookahead": "auto"}
    assert lookahead_overrides("0") == {"lookahead": 0}
    assert lookahead_overrides("5,2") == {"lookahead": 5, "lookahead_levels": 2}
    with pytest.raises(ConfigError, match="or auto"):
        lookahead_overrides("on")
    assert _lookahead("5,2") == (5, 2, DEFAULT_LOOKAHEAD_NODES)  # the n-gram nodes: the default
    assert _lookahead("8,2,16") == (8, 2, 16)
    with pytest.raises(SystemExit, match="WIDTH"):  # the bench's -lookahead decoders need a size
        _lookahead("auto")


def test_bad_lookahead_settings_are_refused():
    with pytest.raises(ConfigError, match="lookahead must be"):
        NgramConfig(lookahead=-1)
    with pytest.raises(ConfigError, match="lookahead must be"):
        NgramConfig(lookahead="on")
    with pytest.raises(ConfigError, match="lookahead must be"):
        NgramConfig(lookahead=True)
    with pytest.raises(ConfigError, match="lookahead_levels"):
        NgramConfig(lookahead=4, lookahead_levels=0)
    with pytest.raises(ConfigError, match="lookahead_policy"):
        NgramConfig(lookahead=4, lookahead_policy="sometimes")
    with pytest.raises(ValueError, match="width"):
        LookaheadWindow(0, 2, 2, [1])
