"""specsplit.runtime.packed: linear weights packed once for the CPU's matmul, same model otherwise."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import assert_rewritten_for_good, noisy_copy, rewrite_in_place, tiny_llama, tiny_qwen2
from transformers import LlamaConfig, LlamaForCausalLM

from specsplit import SpecSplitConfig, SpecSplitGenerator, TreeConfig
from specsplit.bench.batch import left_padded
from specsplit.config import DraftConfig, TargetConfig
from specsplit.errors import ConfigError
from specsplit.runtime import packed
from specsplit.runtime.packed import PackedLinear, pack_linears

pytestmark = pytest.mark.skipif(not packed.available(), reason="this torch build has no oneDNN")

PROMPT = [5, 17, 33, 81, 9, 100, 5, 17, 33, 81]


def _tied_llama(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        tie_word_embeddings=True,
    )  # fmt: skip
    return LlamaForCausalLM(cfg).eval()


def test_packed_linear_computes_what_linear_does_row_by_row():
    torch.manual_seed(0)
    lin = torch.nn.Linear(96, 200)
    ref = copy.deepcopy(lin)
    p = PackedLinear(lin)
    x = torch.randn(3, 7, 96)
    with torch.inference_mode():
        out = p(x)
        torch.testing.assert_close(out, ref(x), atol=1e-5, rtol=1e-5)
        # A row's result does not depend on the other rows of its call (trees, batches).
        assert torch.equal(out[1, 4], p(x[1, 4:5])[0])
        assert torch.equal(out[:, 2], p(x[:, 2]))
    assert torch.equal(p.weight, ref.weight.detach())  # unpacked on access
    assert "packed" in repr(p)


@pytest.mark.parametrize("build", [tiny_llama, tiny_qwen2, _tied_llama], ids=["llama", "qwen2", "tied"])
def test_packed_model_computes_the_same_logits(build):
    ids = torch.tensor([PROMPT * 3])
    model, ref, want, got = rewrite_in_place(build, pack_linears, ids)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    head = model.get_output_embeddings()
    assert isinstance(head, PackedLinear)
    if model.config.tie_word_embeddings:  # the head keeps the embedding's weight (the lookup reads it)
        assert head.weight is model.get_input_embeddings().weight
    else:  # the dense weights are gone: only the embeddings and norms remain as parameters
        assert sum(p.numel() for p in model.parameters()) < sum(p.numel() for p in ref.parameters()) / 2
    twin = assert_rewritten_for_good(model, pack_linears, ids, got)  # a copy is packed too
    assert isinstance(twin.get_output_embeddings(), PackedLinear)


def test_models_that_are_not_float32_on_a_cpu_are_left_alone():
    model = tiny_llama(4).to(torch.bfloat16)
    assert pack_linears(model) == 0
    with pytest.raises(ConfigError, match="float32 model on a CPU"):
        SpecSplitGenerator(model, None, config=SpecSplitConfig(target=TargetConfig(pack_weights=True)))


def test_pack_weights_and_fused_projections_exclude_each_other():
    with pytest.raises(ConfigError, match="exclude each other"):
        TargetConfig(pack_weights=True, fuse_projections=True)


def test_compiled_engines_and_benches_keep_their_weights_unpacked():
    """torch.compile cannot lower packed oneDNN weights: asking for both is refused, and a compiled
    engine (or a bench with a compiled decoder) leaves even a loaded float32 CPU model unpacked."""
    from specsplit.bench.run import pack_copies

    with pytest.raises(ConfigError, match="compile exclude each other"):
        TargetConfig(pack_weights=True, compile=True)
    assert pack_copies(None, False, ("specsplit-ngram",))
    assert not pack_copies(None, False, ("specsplit-ngram", "specsplit-ngram-compiled"))
    assert not pack_copies(None, True, ("specsplit-ngram",)) and not pack_copies(False, False, ())
    with pytest.raises(ValueError, match="exclude each other"):
        pack_copies(True, False, ("specsplit-target-only-compiled",))


@pytest.mark.parametrize(
    "drafter,shape", [("model", "chain"), ("model", "dynamic"), ("ngram", "chain")], ids=str
)
def test_packed_engines_equal_hf_generate_of_the_unpacked_model(drafter, shape):
    """float32 greedy: packed target and draft give HF generate()'s tokens on the original model."""
    target = tiny_qwen2(5)
    draft = noisy_copy(target, 0.002, seed=1) if drafter == "model" else None
    ids = torch.tensor([PROMPT])
    ref = copy.deepcopy(target).generate(ids, max_new_tokens=32, do_sample=False)
    cfg = SpecSplitConfig(
        drafter=drafter,
        tree=TreeConfig(shape=shape),
        draft=DraftConfig(pack_weights=True),
        target=TargetConfig(pack_weights=True),
    )
    with SpecSplitGenerator(target, draft, config=cfg) as gen:
        out = gen.generate(ids, max_new_tokens=32, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert isinstance(target.model.layers[0].mlp.up_proj, PackedLinear)
    if draft is not None:
        assert isinstance(draft.model.layers[0].self_attn.q_proj, PackedLinear)
        assert out.spec_stats.acceptance_rate > 0.3


def test_packed_batched_rows_equal_hf_alone():
    target = tiny_llama(6)
    ref = copy.deepcopy(target)
    prompts = [PROMPT, [7, 7, 12], [44, 3, 19, 250, 61, 62, 63, 64, 9], [90]]
    ids, mask = left_padded(prompts)
    cfg = SpecSplitConfig(drafter="ngram", max_batch=4, target=TargetConfig(pack_weights=True))
    with SpecSplitGenerator(target, None, config=cfg) as gen:
        out = gen.generate(ids, attention_mask=mask, max_new_tokens=20)
    for b, p in enumerate(prompts):
        want = ref.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False, pad_token_id=0)
        got = out[b, ids.shape[1] :].tolist()
        new = want[0, len(p) :].tolist()
        assert got[: len(new)] == new, f"row {b}"


def test_models_passed_in_are_packed_only_when_asked_and_loaded_ones_by_default(tmp_path):
    target = tiny_llama(7)
    with SpecSplitGenerator(target, None, config=SpecSplitConfig(drafter="ngram")):
        assert type(target.model.layers[0].mlp.up_proj) is torch.nn.Linear
    target.save_pretrained(tmp_path / "tiny")
    cfg = SpecSplitConfig(drafter="ngram", target=TargetConfig(model=str(tmp_path / "tiny"), device="cpu"))
    with SpecSplitGenerator(None, None, config=cfg) as gen:
        loaded = gen.target_engine.runner.require()
        assert isinstance(loaded.model.layers[0].mlp.up_proj, PackedLinear)
        out = gen.generate(torch.tensor([PROMPT]), max_new_tokens=16)
    want = target.generate(torch.tensor([PROMPT]), max_new_tokens=16, do_sample=False)
    assert torch.equal(out, want)
    cfg.target.pack_weights = False
    with SpecSplitGenerator(None, None, config=cfg) as gen:
        assert type(gen.target_engine.runner.require().model.layers[0].mlp.up_proj) is torch.nn.Linear
    cfg.target.pack_weights, cfg.target.compile = None, True  # compiled: left unpacked
    with SpecSplitGenerator(None, None, config=cfg) as gen:
        assert type(gen.target_engine.runner.require().model.layers[0].mlp.up_proj) is torch.nn.Linear


def test_a_served_model_is_packed_by_default(tmp_path):
    """`specsplit serve` loads its model itself: packed on a float32 CPU unless told otherwise."""
    import argparse

    from specsplit.cli.serve import _load

    tiny_llama(8).save_pretrained(tmp_path / "tiny")
    args = argparse.Namespace(model=str(tmp_path / "tiny"), device="cpu", dtype=None)
    for given, fused, compiled, want in ((None, False, False, True), (False, False, False, False),
                                         (None, True, False, None), (None, False, True, None)):  # fmt: skip
        cfg = TargetConfig(pack_weights=given, fuse_projections=fused, compile=compiled)
        _load(args, cfg)
        assert cfg.pack_weights is want
