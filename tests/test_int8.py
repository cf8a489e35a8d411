"""specsplit.runtime.int8: a draft with int8 weights on a CPU; output still exactly the target's."""

from __future__ import annotations

import argparse
import copy

import pytest
import torch
from conftest import assert_rewritten_for_good, noisy_copy, rewrite_in_place, tiny_llama, tiny_qwen2
from test_lossless_sampling import TREES, V, empirical_joint, exact_joint, tv
from test_packed import PROMPT
from test_packed import _tied_llama as tied_llama

from specsplit import SpecSplitConfig, SpecSplitGenerator, TreeConfig
from specsplit.config import DraftConfig, EngineTuning
from specsplit.errors import ConfigError
from specsplit.runtime import int8
from specsplit.runtime.int8 import Int8Linear, int8_pays, quantize_linears
from specsplit.runtime.packed import PackedLinear

pytestmark = pytest.mark.skipif(not int8.available(), reason="this torch build has no int8 weight kernel")


KERNELS = [pytest.param(k, marks=pytest.mark.skipif(k == "fbgemm" and not int8.fbgemm_available(),
                                                    reason="no FBGEMM")) for k in ("fbgemm", "int8pack")]  # fmt: skip


@pytest.mark.parametrize("kernel", KERNELS)
def test_int8_linear_is_close_to_linear(kernel):
    torch.manual_seed(0)
    lin = torch.nn.Linear(96, 200)
    ref = copy.deepcopy(lin)
    q = Int8Linear(lin, dense_rows=None, kernel=kernel)  # every call through the int8 kernel
    assert q.qweight.dtype == torch.int8 and q.qweight.shape == (200, 96)
    # every row of the weight is within half a step of its scale
    step = q.scale.float()[:, None]
    assert ((q.weight - ref.weight.detach()).abs() <= 0.5 * step * 1.01 + 1e-6).all()
    x = torch.randn(3, 7, 96)
    with torch.inference_mode():
        out = q(x)
        want = ref(x)
        assert out.shape == want.shape and out.dtype == x.dtype
        rel = (out - want).norm() / want.norm()
        assert rel < 0.02, float(rel)
        assert torch.equal(q(x), out)  # deterministic
    assert f"int8 ({kernel})" in repr(q)


def test_int8pack_rows_do_not_interact():
    torch.manual_seed(0)
    q = Int8Linear(torch.nn.Linear(96, 200), dense_rows=None, kernel="int8pack")
    x = torch.randn(3, 7, 96)
    with torch.inference_mode():
        assert torch.equal(q(x)[1, 4], q(x[1, 4:5])[0])  # a row does not depend on its neighbours


@pytest.mark.skipif(not int8.fbgemm_available(), reason="no FBGEMM")
def test_fbgemm_rows_share_an_input_scale_only_within_their_group():
    """The input is quantized with one scale per group of SCALE_ROWS consecutive rows: a long call
    (a prompt) equals its groups called one by one, and a row is not scaled by rows outside its group
    (one huge row elsewhere leaves it alone)."""
    torch.manual_seed(0)
    q = Int8Linear(torch.nn.Linear(64, 80), kernel="fbgemm")
    assert q.dense is None  # faster than the dense product at any row count: no copy kept
    g = int8.SCALE_ROWS
    x = torch.randn(2 * g + 3, 64)
    with torch.inference_mode():
        out = q(x)
        assert torch.equal(out, torch.cat([q(part) for part in x.split(g)]))
        loud = x.clone()
        loud[0] *= 1000.0  # only the first group's scale grows
        assert torch.equal(q(loud)[g:], out[g:])
        assert not torch.equal(q(loud)[1:g], out[1:g])


@pytest.mark.skipif(not int8.fbgemm_available(), reason="no FBGEMM")
def test_both_kernels_hold_the_same_int8_weight():
    torch.manual_seed(2)
    lin = torch.nn.Linear(64, 48)
    a, b = Int8Linear(lin, kernel="fbgemm"), Int8Linear(lin, kernel="int8pack")
    assert torch.equal(a.qweight, b.qweight) and torch.equal(a.scale, b.scale)
    unpacked = torch.ops.quantized.linear_unpack(a._packed)[0]
    assert torch.equal(unpacked.int_repr(), a.qweight)
    assert torch.equal(unpacked.q_per_channel_scales().float(), a.scale.float())
    twin = copy.deepcopy(a)
    x = torch.randn(5, 64)
    with torch.inference_mode():
        assert torch.equal(twin(x), a(x))


def test_a_build_whose_fbgemm_refuses_to_run_gets_the_weight_only_kernel(monkeypatch):
    def refuse(*_):
        raise RuntimeError("quantized tensors are not supported")

    monkeypatch.setattr(int8, "_fbgemm_pack", refuse)
    assert not int8.fbgemm_available.__wrapped__()  # the uncached probe
    monkeypatch.setattr(int8, "fbgemm_available", int8.fbgemm_available.__wrapped__)
    assert int8.default_kernel() == "int8pack"
    assert Int8Linear(torch.nn.Linear(8, 8)).kernel == "int8pack"


def test_many_rows_take_the_dense_weight_and_a_small_model_keeps_none():
    """The int8pack kernel's time grows with the rows: a prompt's forward (more than ``dense_rows``
    rows) takes the dense weight kept for it; ``dense_rows=None`` keeps only the int8 weight."""
    torch.manual_seed(1)
    lin = torch.nn.Linear(64, 96)
    ref = copy.deepcopy(lin)
    q = Int8Linear(lin, kernel="int8pack")
    assert q.dense_rows == int8.DENSE_ROWS
    with torch.inference_mode():
        few, many = torch.randn(4, 64), torch.randn(5, 64)
        torch.testing.assert_close(q(many), ref(many), atol=1e-5, rtol=1e-5)  # dense: the original product
        assert not torch.allclose(q(few), ref(few), atol=1e-6, rtol=0)  # int8
        assert torch.equal(q(few), Int8Linear(copy.deepcopy(ref), dense_rows=None, kernel="int8pack")(few))
    model = tiny_qwen2(2)
    ref_size = sum(t.numel() * t.element_size() for t in model.parameters())
    quantize_linears(model, dense_rows=None, kernel="int8pack")
    size = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    assert size < ref_size * 0.45
    assert all(m.dense is None for m in model.modules() if isinstance(m, Int8Linear))


@pytest.mark.parametrize("build", [tiny_llama, tiny_qwen2, tied_llama], ids=["llama", "qwen2", "tied"])
def test_quantized_model_keeps_its_greedy_choices_and_shrinks(build):
    ids = torch.tensor([PROMPT * 3])
    model, _, want, got = rewrite_in_place(build, quantize_linears, ids)
    head = model.get_output_embeddings()
    assert isinstance(head, Int8Linear)
    if model.config.tie_word_embeddings:  # the embedding keeps its dense weight, the head its int8 copy
        assert model.get_input_embeddings().weight.dtype == torch.float32
    # close logits, and the greedy choice is the same at (nearly) every position
    assert (got - want).abs().max() < 0.05 * want.abs().max()
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean()
    assert agree >= 0.9, float(agree)
    assert_rewritten_for_good(model, quantize_linears, ids, got)


def test_int8_is_refused_where_it_cannot_run_or_collides():
    with pytest.raises(ConfigError, match="draft.quantize must be one of"):
        DraftConfig(quantize="int4")
    for other in ({"pack_weights": True}, {"fuse_projections": True}):
        with pytest.raises(ConfigError, match="exclude each other"):
            DraftConfig(quantize="int8", **other)
    assert quantize_linears(tiny_llama(1).to("meta")) == 0  # not on a CPU: left alone
    with pytest.raises(ConfigError, match="needs a model on a CPU"):
        meta = tiny_llama(1).to("meta")
        SpecSplitGenerator(tiny_llama(1), meta, config=SpecSplitConfig(draft=DraftConfig(quantize="int8")))


def test_int8_pays_leaves_small_models_alone_and_times_large_ones(monkeypatch):
    assert not int8_pays(tiny_llama(2))  # every layer fits a cache: nothing to gain, nothing to time
    big = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024))
    big.get_output_embeddings = lambda: None  # type: ignore[attr-defined]
    times = iter([1.0, 3.0])  # the dense product's median, then the int8 one's
    monkeypatch.setattr(int8, "_median_ms", lambda fn, reps: next(times))
    assert not int8_pays(big)
    times = iter([3.0, 1.0])
    assert int8_pays(big)
    assert all(type(m) is torch.nn.Linear for m in big)  # timing does not rewrite the model


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("shape", ["chain", "dynamic"])
def test_an_int8_draft_gives_exactly_the_targets_output(shape, kernel, monkeypatch):
    """float32 greedy: the tokens of HF generate() on the target, as with the float32 draft, under
    either kernel (a build without FBGEMM gets the weight-only one)."""
    if kernel == "int8pack":
        monkeypatch.setattr(int8, "fbgemm_available", lambda: False)
    target = tiny_qwen2(5, hidden=128)
    draft = noisy_copy(target, 0.002, seed=1)
    ids = torch.tensor([PROMPT])
    ref = target.generate(ids, max_new_tokens=32, do_sample=False)
    cfg = SpecSplitConfig(drafter="model", tree=TreeConfig(shape=shape), draft=DraftConfig(quantize="int8"))
    with SpecSplitGenerator(target, draft, config=cfg) as gen:
        out = gen.generate(ids, max_new_tokens=32, return_dict_in_generate=True)
        assert isinstance(draft.model.layers[0].mlp.up_proj, Int8Linear)
        assert draft.model.layers[0].mlp.up_proj.kernel == kernel
        assert torch.equal(out.sequences, ref)
        assert out.spec_stats.acceptance_rate > 0.3  # the int8 draft still proposes well
        # seeded sampling reproduces (the q of a sampled tree is the int8 draft's own)
        kw = dict(max_new_tokens=24, do_sample=True, temperature=0.8, top_p=0.95)
        a, b = (gen.generate(ids, generator=torch.Generator().manual_seed(3), **kw) for _ in range(2))
        assert torch.equal(a, b)


@pytest.mark.slow
def test_output_distribution_equals_target_with_an_int8_draft_and_a_stopping_chain():
    """Sampling: the draft's q comes from its int8 weights, its chain stops where that q doubts its own
    token (TreeConfig.min_confidence), and the target's distribution still comes out. (One 20,000-run
    test for both: either breaking exactness fails it.)"""
    from test_lossless_sampling import PROMPT as PROMPT_8
    from test_lossless_sampling import SAMPLING, _model

    from specsplit import DraftEngine, DraftRequest

    target, draft = _model(0, 6.0), _model(7, 20.0)
    exact = exact_joint(target)
    cfg = DraftConfig(quantize="int8", tuning=EngineTuning(q_top_k=V))
    tree = TREES["chain-stop"]
    engine = DraftEngine(copy.deepcopy(draft), cfg)
    sizes = {
        engine.generate(DraftRequest("s", PROMPT_8, 0, tree, SAMPLING, seed, max_depth=2)).tree.num_nodes
        for seed in range(64)
    }
    engine.shutdown()
    assert sizes == {1, 2}  # rounds cut after the first token and rounds of full depth
    emp = empirical_joint(target, draft, tree, draft_config=cfg)
    assert isinstance(draft.lm_head, Int8Linear)
    assert tv(emp, exact) < 0.04, f"TV={tv(emp, exact):.4f}"
    assert tv(emp.sum(1), exact.sum(1)) < 0.02


def test_loaded_drafts_are_quantized_where_it_pays_and_served_ones_too(tmp_path, monkeypatch):
    """``quantize="auto"``: a draft the engine (or ``specsplit serve draft``) loads itself becomes int8
    where the int8 kernel pays; a model passed in, a compiled engine or ``"none"`` keep theirs."""
    import specsplit.runtime.int8 as int8_mod
    from specsplit.cli.serve import _load

    target = tiny_llama(7)
    target.save_pretrained(tmp_path / "tiny")
    pays = {"v": True}
    monkeypatch.setattr(int8_mod, "int8_pays", lambda m: pays["v"])  # the one rule: wants_int8
    draft = tiny_llama(7)
    with SpecSplitGenerator(target, draft, config=SpecSplitConfig(drafter="model")):
        assert type(draft.model.layers[0].mlp.up_proj) is torch.nn.Linear  # passed in: left alone

    def draft_layer(**kw) -> type:
        cfg = SpecSplitConfig(
            drafter="model", draft=DraftConfig(model=str(tmp_path / "tiny"), device="cpu", **kw)
        )
        with SpecSplitGenerator(copy.deepcopy(target), None, config=cfg) as gen:
            out = gen.generate(torch.tensor([PROMPT]), max_new_tokens=12)
            assert torch.equal(
                out, target.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False)
            )
            return type(gen.draft_engine.runner.require().model.layers[0].mlp.up_proj)

    assert draft_layer() is Int8Linear
    assert draft_layer(quantize="none") is PackedLinear  # float32 on a CPU: packed instead
    assert draft_layer(compile=True) is torch.nn.Linear
    pays["v"] = False
    assert draft_layer() is PackedLinear

    args = argparse.Namespace(model=str(tmp_path / "tiny"), device="cpu", dtype=None)
    for paid, given, want, packed in ((True, "auto", "int8", False), (False, "auto", "none", True),
                                      (False, "int8", "int8", False)):  # fmt: skip
        monkeypatch.setattr(int8_mod, "int8_pays", lambda m, paid=paid: paid)
        cfg = DraftConfig(quantize=given)
        _load(args, cfg)
        assert (cfg.quantize, cfg.pack_weights) == (want, packed)
