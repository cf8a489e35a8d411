"""specsplit.runtime.fused: q/k/v and gate/up as one GEMM each, same model otherwise."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import noisy_copy, tiny_llama, tiny_qwen2

from specsplit import SpecSplitConfig, SpecSplitGenerator, TreeConfig
from specsplit.config import DraftConfig, EngineTuning, TargetConfig
from specsplit.runtime.fused import fuse_projections

PROMPT = [5, 17, 33, 81, 9, 100]


@pytest.mark.parametrize("build", [tiny_llama, tiny_qwen2], ids=["llama", "qwen2"])
def test_fused_model_computes_the_same_logits(build):
    model = build(3)
    ref_model = copy.deepcopy(model)
    keys = list(model.state_dict())
    n_params = sum(p.numel() for p in model.parameters())
    ids = torch.tensor([PROMPT * 3])
    with torch.no_grad():
        ref = ref_model(ids).logits
        assert fuse_projections(model) == 2 * model.config.num_hidden_layers  # attention + MLP per layer
        out = model(ids).logits
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert list(model.state_dict()) == keys  # the fused weights are non-persistent buffers
    assert sum(p.numel() for p in model.parameters()) == n_params
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    # The projections' parameters are views of the fused weights: no extra memory, one source of truth.
    assert attn.q_proj.weight.data_ptr() == attn.qkv_weight.data_ptr()
    assert attn.v_proj.weight.untyped_storage().data_ptr() == attn.qkv_weight.untyped_storage().data_ptr()
    assert mlp.up_proj.weight.untyped_storage().data_ptr() == mlp.gate_up_weight.untyped_storage().data_ptr()
    if isinstance(attn.q_proj.bias, torch.Tensor):  # Qwen2 has q/k/v biases
        assert attn.qkv_bias is not None and attn.qkv_bias.numel() == sum(
            p.out_features for p in (attn.q_proj, attn.k_proj, attn.v_proj)
        )
    assert fuse_projections(model) == 0  # idempotent


def test_hooked_modules_are_left_alone():
    """Modules accelerate has hooked (their forward is wrapped for device alignment) keep it."""
    model = tiny_llama(4)
    model.model.layers[0].self_attn._hf_hook = object()  # what accelerate's add_hook_to_module sets
    assert fuse_projections(model) == 2 * model.config.num_hidden_layers - 1
    assert not hasattr(model.model.layers[0].self_attn, "qkv_weight")


def test_unsupported_modules_are_left_alone():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert fuse_projections(model) == 0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("shape", ["chain", "dynamic"])
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "static"])
def test_engines_with_fused_projections_equal_hf_generate(shape, graphs):
    target = tiny_qwen2(5)
    draft = noisy_copy(target, 0.002, seed=1)
    ids = torch.tensor([PROMPT])
    ref = copy.deepcopy(target).generate(ids, max_new_tokens=32, do_sample=False)
    cfg = SpecSplitConfig(
        tree=TreeConfig(shape=shape),
        draft=DraftConfig(cuda_graphs=graphs, fuse_projections=True, tuning=EngineTuning(graph_capacity=256)),
        target=TargetConfig(
            cuda_graphs=graphs, fuse_projections=True, tuning=EngineTuning(graph_capacity=256)
        ),
    )
    with SpecSplitGenerator(target, draft, config=cfg) as gen:
        out = gen.generate(ids, max_new_tokens=32, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert getattr(target.model.layers[0].mlp, "_specsplit_fused", False)
    assert getattr(draft.model.layers[0].self_attn, "_specsplit_fused", False)
    assert out.spec_stats.acceptance_rate > 0.3  # the draft still agrees with the target
