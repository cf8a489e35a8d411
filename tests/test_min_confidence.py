"""TreeConfig.min_confidence: a chain stops after a token its draft doubts; output still the target's."""

from __future__ import annotations

import pytest
import torch
from conftest import noisy_copy, tiny_qwen2

from specsplit import SpecSplitConfig, SpecSplitGenerator, TreeConfig
from specsplit.config import DraftConfig
from specsplit.core.growth import PlanTensors, grow_static_tree
from specsplit.core.sampling import SamplingParams
from specsplit.errors import ConfigError, InvalidRequest
from specsplit.remote import convert

PROMPT = [5, 17, 33, 81, 9, 100, 5, 17, 33, 81]
V = 16


def _logits(p_best: float, best: int) -> torch.Tensor:
    """`[V]` logits whose softmax gives ``best`` probability ``p_best``, the rest spread evenly."""
    probs = torch.full((V,), (1.0 - p_best) / (V - 1))
    probs[best] = p_best
    return probs.log()


@pytest.mark.parametrize("floor,levels", [(0.0, 6), (0.5, 3), (0.95, 1)])
def test_a_chain_stops_after_the_first_level_below_the_floor(floor, levels):
    """Level confidences 0.9, 0.8, 0.3, 0.9, ...: the floor 0.5 keeps three levels (the doubtful third
    one included: it costs a verified row, not a draft forward), 0.95 one, 0 all six."""
    conf = [0.9, 0.8, 0.3, 0.9, 0.9, 0.9]
    plan = TreeConfig(shape="chain", num_draft_tokens=6).static_plan()
    pt = PlanTensors.build(plan, torch.device("cpu"))
    forwards = []

    def level(d: int, tokens: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        forwards.append(d)
        return _logits(conf[d + 1], best=d + 2)[None]

    tree = grow_static_tree(
        _logits(conf[0], best=1), plan, pt, SamplingParams(), 1, None, level, min_confidence=floor
    )
    assert tree.num_nodes == levels and tree.bounds() == (1, levels)
    assert tree.token_ids.tolist() == list(range(1, levels + 1))
    assert tree.parents.tolist() == list(range(-1, levels - 1))
    torch.testing.assert_close(tree.log_probs.exp(), torch.tensor(conf[:levels]))
    assert forwards == list(range(levels - 1 if levels < 6 else 5))  # no forward past the stop


def test_min_confidence_is_checked_and_travels_to_a_draft_worker():
    for bad in (-0.1, 1.0):
        with pytest.raises(ConfigError, match="min_confidence"):
            TreeConfig(min_confidence=bad)
    with pytest.raises(ConfigError, match="dynamic tree"):
        TreeConfig(shape="dynamic", min_confidence=0.5)
    tree = TreeConfig(shape="chain", num_draft_tokens=8, min_confidence=0.4)
    assert convert.tree_config_from_proto(convert.tree_config_to_proto(tree)) == tree
    assert convert.tree_config_from_proto(convert.tree_config_to_proto(TreeConfig())).min_confidence == 0.0
    bad = convert.tree_config_to_proto(tree)
    bad.min_confidence = 1.5  # a worker refuses it with a typed error
    with pytest.raises(InvalidRequest, match="min_confidence"):
        convert.tree_config_from_proto(bad)


@pytest.mark.parametrize("quantize", ["none", "int8"])
def test_confident_chains_give_exactly_the_targets_output_in_rounds_of_every_length(quantize):
    target = tiny_qwen2(5, hidden=128)
    draft = noisy_copy(target, 0.01, seed=1)
    ids = torch.tensor([PROMPT])
    ref = target.generate(ids, max_new_tokens=48, do_sample=False)
    tree = TreeConfig(shape="chain", num_draft_tokens=8, min_confidence=0.6)
    cfg = SpecSplitConfig(drafter="model", tree=tree, draft=DraftConfig(quantize=quantize))
    with SpecSplitGenerator(target, draft, config=cfg) as gen:
        out = gen.generate(ids, max_new_tokens=48, return_dict_in_generate=True)
        assert torch.equal(out.sequences, ref)
        depths = {r.drafted_depth for r in out.spec_stats.rounds}
        assert len(depths) > 1 and max(depths) <= 8  # the chain's length follows the draft
        kw = dict(max_new_tokens=24, do_sample=True, temperature=0.8)
        a, b = (gen.generate(ids, generator=torch.Generator().manual_seed(5), **kw) for _ in range(2))
        assert torch.equal(a, b)
