"""SpecSplit's attention function: GQA folded into the query rows equals transformers' SDPA path."""

from __future__ import annotations

import pytest
import torch
from conftest import sharpen, tiny_llama

from specsplit import SpecSplitConfig, SpecSplitGenerator, TargetConfig, TreeConfig
from specsplit import attention as attn
from specsplit.config import DraftConfig
from specsplit.engine_common import ModelRunner
from specsplit.tree_attention import build_verify_attention


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """What transformers' SDPA integration computes for a masked GQA forward (repeat_kv + SDPA)."""
    group = q.shape[1] // k.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), attn_mask=mask
    )
    return out.transpose(1, 2)


@pytest.mark.parametrize("kernel", ["sdpa", "math"])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "rows", "kv"), [(12, 2, 17, 300), (14, 2, 5, 97), (4, 1, 1, 40)]
)
def test_folded_attention_equals_repeat_kv(monkeypatch, kernel, heads, kv_heads, rows, kv):
    monkeypatch.setattr(attn, "MATH_MIN_KV", 1 if kernel == "math" else 1 << 30)
    g = torch.Generator().manual_seed(heads * kv + rows)
    q = torch.randn(1, heads, rows, 32, generator=g)
    k = torch.randn(1, kv_heads, kv, 32, generator=g)
    v = torch.randn(1, kv_heads, kv, 32, generator=g)
    parents = torch.arange(-1, rows - 1)  # a chain below the prefix
    mask, _ = build_verify_attention(parents, cache_length=kv - rows, num_pending=0)
    got = attn.folded_attention(q, k, v, mask)
    assert got.shape == (1, rows, heads, 32) and got.is_contiguous()
    torch.testing.assert_close(got, _reference(q, k, v, mask), rtol=1e-5, atol=1e-5)


def test_folded_attention_respects_the_scale_and_every_mask_row():
    g = torch.Generator().manual_seed(3)
    q, k, v = (
        torch.randn(1, 4, 3, 8, generator=g),
        torch.randn(1, 2, 6, 8, generator=g),
        torch.randn(1, 2, 6, 8, generator=g),
    )
    mask = torch.zeros(1, 1, 3, 6)
    mask[0, 0, 0, 1:] = torch.finfo(torch.float32).min  # row 0 sees only token 0
    got = attn.folded_attention(q, k, v, mask, scaling=0.5)
    group = 2
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), attn_mask=mask, scale=0.5
    ).transpose(1, 2)
    torch.testing.assert_close(got, want)
    # row 0 of every head is exactly V of token 0 of its KV head (head h reads KV head h // group)
    for h in range(4):
        torch.testing.assert_close(got[0, 0, h], v[0, h // group, 0])


def _spy(monkeypatch) -> list[tuple[int, int]]:
    monkeypatch.setattr(attn, "FOLD_MIN_KV", 0)  # tiny contexts: fold every tree forward
    calls: list[tuple[int, int]] = []
    real = attn.folded_attention

    def spy(q, k, v, mask, scaling=None):
        calls.append((q.shape[2], k.shape[2]))
        return real(q, k, v, mask, scaling)

    monkeypatch.setattr(attn, "folded_attention", spy)
    return calls


def test_engines_fold_tree_forwards_and_match_hf_generate(monkeypatch):
    target, draft = sharpen(tiny_llama(0)), sharpen(tiny_llama(1, layers=1))
    ids = torch.randint(3, 200, (1, 24), generator=torch.Generator().manual_seed(0))
    want = target.generate(ids, max_new_tokens=20, do_sample=False)  # before the switch: plain SDPA
    calls = _spy(monkeypatch)
    gen = SpecSplitGenerator(
        target,
        draft,
        config=SpecSplitConfig(tree=TreeConfig(shape="dynamic", topk=3, width=3, budget=12, max_depth=4)),
    )
    got = gen.generate(ids, max_new_tokens=20, do_sample=False)
    assert torch.equal(got, want)
    assert target.config._attn_implementation == attn.ATTENTION_NAME
    assert calls, "no tree forward went through the folded kernel"
    assert all(rows <= attn.FOLD_MAX_ROWS for rows, _ in calls)
    # HF generate() on the switched model still takes transformers' SDPA path (no fold kwarg)
    calls.clear()
    assert torch.equal(target.generate(ids, max_new_tokens=20, do_sample=False), want)
    assert calls == []


def _chain_matches_hf(prompt_len: int, new: int, seed: int) -> None:
    """Greedy chain decoding on fresh tiny models equals HF generate()."""
    target, draft = sharpen(tiny_llama(0)), sharpen(tiny_llama(1, layers=1))
    ids = torch.randint(3, 200, (1, prompt_len), generator=torch.Generator().manual_seed(seed))
    want = target.generate(ids, max_new_tokens=new, do_sample=False)
    cfg = SpecSplitConfig(tree=TreeConfig(shape="chain", num_draft_tokens=3))
    assert torch.equal(SpecSplitGenerator(target, draft, config=cfg).generate(ids, max_new_tokens=new), want)


def test_prefill_longer_than_the_fold_limit_keeps_sdpa(monkeypatch):
    monkeypatch.setattr(attn, "FOLD_MAX_ROWS", 4)
    calls = _spy(monkeypatch)
    _chain_matches_hf(prompt_len=12, new=8, seed=1)
    assert calls and all(rows <= 4 for rows, _ in calls)  # the 12-row prefill was not folded


def test_fold_off_leaves_the_model_alone():
    target, draft = sharpen(tiny_llama(0)), sharpen(tiny_llama(1, layers=1))
    before = target.config._attn_implementation
    cfg = SpecSplitConfig(
        tree=TreeConfig(shape="chain", num_draft_tokens=3),
        target=TargetConfig(fold_gqa=False),
        draft=DraftConfig(fold_gqa=False),
    )
    ids = torch.randint(3, 200, (1, 10), generator=torch.Generator().manual_seed(2))
    want = target.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(SpecSplitGenerator(target, draft, config=cfg).generate(ids, max_new_tokens=8), want)
    assert target.config._attn_implementation == before


def test_short_prefixes_keep_transformers_path(monkeypatch):
    calls = _spy(monkeypatch)
    monkeypatch.setattr(attn, "FOLD_MIN_KV", 30)
    _chain_matches_hf(prompt_len=8, new=40, seed=3)
    assert calls and min(kv for _, kv in calls) >= 30  # folded only once 30 tokens were cached


def test_only_gqa_models_on_sdpa_are_switched():
    mha = tiny_llama(0)
    mha.config.num_key_value_heads = mha.config.num_attention_heads  # the config is what is read
    assert attn.gqa_group(mha) == 1
    assert ModelRunner(mha, None, "cpu", None, "float32", fold_gqa=True).attention_kwargs == {}
    eager = tiny_llama(1)
    eager.set_attn_implementation("eager")
    assert ModelRunner(eager, None, "cpu", None, "float32", fold_gqa=True).attention_kwargs == {}
    assert eager.config._attn_implementation == "eager"
    gqa = tiny_llama(2)
    assert ModelRunner(gqa, None, "cpu", None, "float32", fold_gqa=True).attention_kwargs == {
        attn.FOLD_KWARG: True
    }
