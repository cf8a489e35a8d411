"""A draft's output layer restricted to a ranked token subset (FR-Spec): what it scores, and that
generation stays exact (greedy float32 against HF generate(); sampling in test_lossless_sampling)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import EOS, noisy_copy, tiny_llama, tiny_qwen2

from specsplit import SpecSplitConfig, SpecSplitGenerator, TreeConfig
from specsplit.config import DraftConfig
from specsplit.engines.draft import DraftEngine
from specsplit.errors import ConfigError
from specsplit.runtime.packed import PackedLinear, pack_linears
from specsplit.runtime.vocab_subset import (
    FILL,
    SubsetHead,
    load_ranking,
    rank_from_texts,
    save_ranking,
    special_ids,
    subset_ids,
)

PROMPT = [5, 17, 9, 33, 17, 9, 60]


def test_subset_ids_keep_the_special_ids_then_the_ranking_then_id_order():
    assert subset_ids(10, 4, None).tolist() == [0, 1, 2, 3]
    assert subset_ids(10, 4, [7, 7, 42, 5], always=[9]).tolist() == [0, 5, 7, 9]
    assert subset_ids(10, 2, [7], always=[9, 8, 3]).tolist() == [3, 8, 9]  # the specials always stay
    assert subset_ids(10, 50, [7]).tolist() == list(range(10))
    with pytest.raises(ConfigError):
        subset_ids(10, 0, None)


def test_special_ids_come_from_both_configs():
    m = tiny_qwen2(1)
    m.generation_config.eos_token_id = [EOS, 77]
    assert sorted(special_ids(m)) == sorted({EOS, 77, m.config.bos_token_id, m.config.pad_token_id})


@pytest.mark.parametrize("pack", [False, True], ids=["dense", "packed"])
def test_subset_head_scores_its_tokens_as_the_full_head_and_fills_the_rest(pack):
    m = tiny_llama(3)
    if pack:
        pack_linears(m)
    head = m.get_output_embeddings()
    assert isinstance(head, PackedLinear) == pack
    ids = torch.tensor([0, 4, 9, 200])
    sub = SubsetHead(head, ids, pack=pack)
    h = torch.randn(2, 3, m.config.hidden_size)
    full, got = head(h), sub(h)
    assert got.shape == full.shape
    torch.testing.assert_close(got[..., ids], full[..., ids], rtol=1e-5, atol=1e-5)
    rest = torch.ones(full.shape[-1], dtype=torch.bool)
    rest[ids] = False
    assert (got[..., rest] == FILL).all()


def test_a_restricted_draft_proposes_only_subset_tokens_and_leaves_the_model_alone():
    draft = tiny_qwen2(4)
    before = draft.lm_head.weight.clone()
    eng = DraftEngine(draft, DraftConfig(vocab_subset=40))
    eng.load_model()
    from specsplit import DraftRequest

    res = eng.generate(DraftRequest("s", PROMPT, 0, TreeConfig(shape="dynamic", topk=4, width=4, budget=20)))
    allowed = set(range(40)) | set(special_ids(draft))
    assert set(res.tree.token_ids.tolist()) <= allowed
    assert draft.lm_head is not None and torch.equal(draft.lm_head.weight, before)
    eng.shutdown()


@pytest.mark.parametrize("shape", ["chain", "dynamic"])
@pytest.mark.parametrize("build", [tiny_llama, tiny_qwen2], ids=["llama", "qwen2"])
def test_greedy_output_equals_hf_generate_with_a_restricted_draft(build, shape):
    target = build(5)
    draft = noisy_copy(target, 0.002, seed=1)
    ids = torch.tensor([PROMPT])
    ref = copy.deepcopy(target).generate(ids, max_new_tokens=40, do_sample=False)
    # Half the vocabulary: acceptance drops where the target's token lies outside it, never the output.
    cfg = SpecSplitConfig(tree=TreeConfig(shape=shape), draft=DraftConfig(vocab_subset=128))
    with SpecSplitGenerator(target, draft, config=cfg) as gen:
        out = gen.generate(ids, max_new_tokens=40, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    new = ref[0, len(PROMPT) :].tolist()
    inside = sum(t < 128 or t in special_ids(target) for t in new)
    assert 0 < inside < len(new)  # the check means something: both kinds of token occur
    assert sum(out.spec_stats.accepted_counts()) > 0


def test_a_ranking_file_is_read_and_bad_ones_refused(tmp_path):
    class Tok:
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [ord(c) for c in text]}

    ranked = rank_from_texts(Tok(), ["abca", "ccb"])
    assert ranked == [ord("c"), ord("a"), ord("b")]  # c three times, a twice, b twice: ties by id
    path = tmp_path / "r.json"
    save_ranking(path, ranked, source="test")
    assert load_ranking(path) == ranked
    (tmp_path / "bare.json").write_text("[3, 1]")
    assert load_ranking(tmp_path / "bare.json") == [3, 1]
    (tmp_path / "bad.json").write_text(json.dumps({"ranked_ids": ["a"]}))
    with pytest.raises(ConfigError, match="list of token ids"):
        load_ranking(tmp_path / "bad.json")
    with pytest.raises(ConfigError, match="cannot read"):
        load_ranking(tmp_path / "missing.json")
    with pytest.raises(ConfigError, match="set vocab_subset"):
        DraftConfig(vocab_ranking=str(path))
    with pytest.raises(ConfigError, match=">= 1"):
        DraftConfig(vocab_subset=0)


def test_a_ranked_subset_reaches_the_draft_engine(tmp_path):
    path = tmp_path / "r.json"
    save_ranking(path, [250, 251, 252])
    eng = DraftEngine(tiny_llama(2), DraftConfig(vocab_subset=6, vocab_ranking=str(path)))
    eng.load_model()
    assert eng.runner.head is not None
    assert eng.runner.head.ids.tolist() == sorted({0, 1, EOS, 250, 251, 252})
    eng.shutdown()


def test_models_that_transform_their_logits_are_refused():
    m = tiny_llama(2)
    m.config.logit_scale = 0.5
    with pytest.raises(ConfigError, match="transforms its logits"):
        DraftEngine(m, DraftConfig(vocab_subset=8)).load_model()


def test_the_compiled_step_scores_through_the_restricted_layer_too(monkeypatch):
    """The step ``torch.compile`` fuses calls the same logits function as the eager one (the
    compiler is replaced by the identity here: what it would compile is what this checks)."""
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    draft = tiny_qwen2(4)
    cfg = DraftConfig(cuda_graphs=True, compile=True, vocab_subset=40)
    eng = DraftEngine(draft, cfg)
    eng.load_model()
    from specsplit import DraftRequest

    tree = TreeConfig(shape="dynamic", topk=4, width=4, budget=20)
    calls = {"n": 0}
    step = eng._workspace.static._step
    assert step is not None

    def counted(*args):
        calls["n"] += 1
        return step(*args)

    eng._workspace.static._step = counted
    for prefix, new in ((0, PROMPT), (len(PROMPT), [21, 22])):
        res = eng.generate(DraftRequest("s", new, prefix, tree))
        assert set(res.tree.token_ids.tolist()) <= set(range(40)) | set(special_ids(draft))
    assert calls["n"] > 0  # the compiled step ran
    eng.shutdown()
