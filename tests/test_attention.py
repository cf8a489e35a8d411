"""SpecSplit's attention function: GQA folded into the query rows equals transformers' SDPA path."""

from __future__ import annotations

import pytest
import torch
from conftest import sharpen, tiny_llama

from specsplit import SpecSplitConfig, SpecSplitGenerator, TargetConfig, TreeConfig
from specsplit.config import DraftConfig, EngineTuning
from specsplit.core.tree_attention import build_verify_attention
from specsplit.runtime import attention as attn
from specsplit.runtime.runner import ModelRunner


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


class _Calls(list):
    kernels: list[str]


def _spy(monkeypatch, fold_all: bool = True) -> _Calls:
    if fold_all:
        monkeypatch.setattr(attn, "FOLD_MIN_KV", 0)  # tiny contexts: fold every tree forward
    calls = _Calls()
    kernels: list[str] = []
    calls.kernels = kernels
    real = attn.folded_attention

    def spy(q, k, v, mask, scaling=None, kernel="auto"):
        calls.append((q.shape[2], k.shape[2]))
        kernels.append(kernel)
        return real(q, k, v, mask, scaling, kernel)

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


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))],
)
def test_the_largest_padded_round_folds_on_the_static_path(monkeypatch, device):
    """A lookahead round with draft-head guesses verifies the largest padded tree (64 nodes) and the
    pending token: 65 rows. Past the fold limit such a round fell back to the memory-efficient
    kernel, 1.37 ms of a 4.0 ms compiled round on an H200 (benchmarks/RESULTS.md, "Rounds of 64
    nodes fold again"). Every row of it must fold (the limit follows the largest padded tree), and
    the round still decides what the target decides."""
    from specsplit.core.tree import TokenTree
    from specsplit.engines.drafters import TREE_SIZES
    from specsplit.engines.target import TargetEngine
    from specsplit.messages import VerifyRequest

    target = sharpen(tiny_llama(0)).to(device)  # on a GPU the round is a captured graph
    prompt = torch.randint(3, 200, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    calls = _spy(monkeypatch, fold_all=False)  # the static path's "math" kernel folds at any length
    eng = TargetEngine(target, TargetConfig(cuda_graphs=True))
    n = TREE_SIZES[-1]
    parents = torch.tensor([-1] + list(range(n // 2 - 1)) + [-1] * (n - n // 2))
    depths = torch.tensor(list(range(1, n // 2 + 1)) + [1] * (n - n // 2))
    tree = TokenTree(torch.randint(3, 200, (n,)), parents, depths, torch.zeros(n))
    res = eng.verify(VerifyRequest("s", TokenTree.empty(), prompt, 0, capacity_hint=256))
    calls.clear()
    res = eng.verify(VerifyRequest("s", tree, [res.next_token_id], len(prompt), capacity_hint=256))
    assert calls and {rows for rows, _ in calls} == {n + 1}  # every layer of the round folded
    assert n + 1 <= attn.FOLD_MAX_ROWS
    ids = torch.tensor([prompt], device=device)
    ref = target.generate(ids, max_new_tokens=2 + len(res.accepted_token_ids), do_sample=False)
    assert res.accepted_token_ids + [res.next_token_id] == ref[0, len(prompt) + 1 :].tolist()


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
        target=TargetConfig(tuning=EngineTuning(fold_gqa=False)),
        draft=DraftConfig(tuning=EngineTuning(fold_gqa=False)),
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
        attn.ENGINE_KWARG: True,
        attn.FOLD_KWARG: True,
    }


def _kernel_config(tree: TreeConfig, kernel: str, graphs: bool) -> SpecSplitConfig:
    """Both engines on ``attention_kernel=kernel``, with or without the static (graph) path."""
    return SpecSplitConfig(
        tree=tree,
        target=TargetConfig(cuda_graphs=graphs, tuning=EngineTuning(attention_kernel=kernel)),
        draft=DraftConfig(cuda_graphs=graphs, tuning=EngineTuning(attention_kernel=kernel)),
    )


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("shape", ["chain", "dynamic"])
def test_math_kernel_at_every_length_matches_hf_generate(monkeypatch, graphs, shape):
    """attention_kernel="math": every tree forward (short prefixes included, default thresholds)
    goes through the folded matmul kernel, eagerly and on the static path; tokens equal HF's."""
    target, draft = sharpen(tiny_llama(0)), sharpen(tiny_llama(1, layers=1))
    ids = torch.randint(3, 200, (1, 12), generator=torch.Generator().manual_seed(5))
    want = target.generate(ids, max_new_tokens=24, do_sample=False)
    calls = _spy(monkeypatch, fold_all=False)
    tree = TreeConfig(shape=shape, num_draft_tokens=3, topk=3, width=3, budget=10, max_depth=4)
    cfg = _kernel_config(tree, "math", graphs)
    with SpecSplitGenerator(target, draft, config=cfg) as gen:
        assert torch.equal(gen.generate(ids, max_new_tokens=24, do_sample=False), want)
    assert calls and max(kv for _, kv in calls) < attn.FOLD_MIN_KV  # short prefixes were folded
    assert set(calls.kernels) == {"math"}


def test_math_kernel_also_folds_models_without_gqa():
    mha = tiny_llama(0)
    mha.config.num_key_value_heads = mha.config.num_attention_heads
    runner = ModelRunner(mha, None, "cpu", None, "float32", fold_gqa=True, attention_kernel="math")
    assert runner.attention_kwargs == {attn.ENGINE_KWARG: True, attn.FOLD_KWARG: "math"}


def test_attention_kernel_auto_is_math_on_the_static_path_only():
    from specsplit.config import resolved_attention_kernel

    assert resolved_attention_kernel("auto", cuda_graphs=True) == "math"
    assert resolved_attention_kernel("auto", cuda_graphs=False) == "sdpa"
    assert resolved_attention_kernel("sdpa", cuda_graphs=True) == "sdpa"
    gqa = tiny_llama(3)
    from specsplit.engines.draft import DraftEngine

    engine = {attn.ENGINE_KWARG: True}
    assert DraftEngine(gqa, DraftConfig(cuda_graphs=True)).runner.attention_kwargs == {
        **engine,
        attn.FOLD_KWARG: "math",
    }
    assert DraftEngine(gqa, DraftConfig()).runner.attention_kwargs == {**engine, attn.FOLD_KWARG: True}
    assert DraftEngine(
        gqa, DraftConfig(cuda_graphs=True, tuning=EngineTuning(attention_kernel="sdpa"))
    ).runner.attention_kwargs == {**engine, attn.FOLD_KWARG: True}


def test_attention_kernel_is_checked():
    from specsplit.errors import ConfigError

    with pytest.raises(ConfigError, match="attention_kernel"):
        TargetConfig(tuning=EngineTuning(attention_kernel="flash"))
    with pytest.raises(ConfigError, match="attention_kernel"):
        DraftConfig(tuning=EngineTuning(attention_kernel=""))


def test_float_masks_have_aligned_rows():
    from specsplit.core.tree_attention import MASK_ALIGN, bool_mask_to_float

    allowed = torch.rand(1, 1, 7, 37, generator=torch.Generator().manual_seed(0)) > 0.5
    mask = bool_mask_to_float(allowed, torch.float32)
    assert mask.shape == (1, 1, 7, 37) and mask.stride(-2) % MASK_ALIGN == 0 and mask.stride(-1) == 1
    assert torch.equal(mask == 0, allowed) and torch.all(mask[~allowed] == torch.finfo(torch.float32).min)


@pytest.mark.parametrize("graphs", [False, True])
def test_engine_sdpa_route_off_cudnn_matches_hf_generate(monkeypatch, graphs):
    """The CUDA route of engine forwards (PyTorch's memory-efficient kernel called by name, one K/V
    head per query head, mask rows MASK_ALIGN apart) run on CPU with SDPA standing in for the CUDA
    kernel: every masked forward that does not fold takes it, and the tokens equal HF generate()."""
    from specsplit.core.tree_attention import MASK_ALIGN

    target, draft = sharpen(tiny_llama(0)), sharpen(tiny_llama(1, layers=1))
    ids = torch.randint(3, 200, (1, 21), generator=torch.Generator().manual_seed(4))
    want = target.generate(ids, max_new_tokens=24, do_sample=False)
    rows: list[int] = []

    def kernel(q, k, v, bias, compute_log_sumexp, scale=None):
        assert q.shape[1] == k.shape[1] == v.shape[1] == bias.shape[1]  # K/V repeated per query head
        assert bias.shape == (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        assert bias.stride(-2) % MASK_ALIGN == 0 and bias.stride(-1) == 1 and not compute_log_sumexp
        rows.append(q.shape[2])
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)
        return out, None, None, None

    monkeypatch.setattr(attn, "_efficient_kernel", lambda q: True)
    monkeypatch.setattr(attn, "_efficient_op", kernel)
    cfg = _kernel_config(TreeConfig(shape="dynamic", topk=3, width=3, budget=10, max_depth=4), "sdpa", graphs)
    with SpecSplitGenerator(target, draft, config=cfg) as gen:
        assert torch.equal(gen.generate(ids, max_new_tokens=24, do_sample=False), want)
    if graphs:  # prompts padded to their bucket (prefill_graphs): both first forwards are 64 rows
        assert rows.count(64) >= 2  # the draft's prefill and the target's prompt + first tree,
    else:
        assert 21 in rows  # the draft's prefill of the prompt,
        assert max(rows) > 21  # the target's first forward (the prompt and the first tree),
    assert any(r < 21 for r in rows)  # and the later tree forwards all took the route


def test_engine_sdpa_route_falls_back_when_the_kernel_refuses(monkeypatch, caplog):
    """A head size or dtype the memory-efficient kernel refuses (an argument check, before any
    launch) falls back to SDPA's own choice, is remembered, and the tokens stay HF's."""
    target, draft = sharpen(tiny_llama(0)), sharpen(tiny_llama(1, layers=1))
    ids = torch.randint(3, 200, (1, 9), generator=torch.Generator().manual_seed(6))
    want = target.generate(ids, max_new_tokens=12, do_sample=False)
    calls: list[int] = []

    def refuse(q, k, v, bias, compute_log_sumexp, scale=None):
        calls.append(q.shape[-1])
        raise RuntimeError("head_dim not supported (test)")

    monkeypatch.setattr(attn, "AVOID_CUDNN", True)
    monkeypatch.setattr(attn, "_UNSUPPORTED", set())
    # the real check without its is_cuda part (this runs on CPU)
    monkeypatch.setattr(attn, "_efficient_kernel", lambda q: (q.shape[-1], q.dtype) not in attn._UNSUPPORTED)
    monkeypatch.setattr(attn, "_efficient_op", refuse)
    cfg = _kernel_config(TreeConfig(shape="chain", num_draft_tokens=3), "sdpa", False)
    with caplog.at_level("WARNING", logger="specsplit.runtime.attention"):
        with SpecSplitGenerator(target, draft, config=cfg) as gen:
            assert torch.equal(gen.generate(ids, max_new_tokens=12, do_sample=False), want)
    assert calls == [16]  # refused once, then remembered: no further attempt
    assert attn._UNSUPPORTED == {(16, torch.float32)}
    assert "refused head_dim 16" in caplog.text


def test_masked_sdpa_aligns_a_mask_whose_rows_are_not(monkeypatch):
    """A mask not made by bool_mask_to_float (rows 37 apart here) reaches the kernel as an aligned
    copy with the same values; the result equals SDPA's."""
    from specsplit.core.tree_attention import MASK_ALIGN

    g = torch.Generator().manual_seed(9)
    q = torch.randn(1, 4, 5, 8, generator=g)
    k, v = torch.randn(1, 4, 37, 8, generator=g), torch.randn(1, 4, 37, 8, generator=g)
    mask = torch.zeros(1, 1, 5, 37)
    mask[..., 30:] = torch.finfo(torch.float32).min
    seen = []

    def kernel(q_, k_, v_, bias, compute_log_sumexp, scale=None):
        seen.append(bias)
        return torch.nn.functional.scaled_dot_product_attention(q_, k_, v_, attn_mask=bias, scale=scale), None

    monkeypatch.setattr(attn, "_efficient_kernel", lambda q_: True)
    monkeypatch.setattr(attn, "_efficient_op", kernel)
    got = attn.masked_sdpa(q, k, v, mask, None)
    (bias,) = seen
    assert bias.stride(-2) % MASK_ALIGN == 0 and torch.equal(bias[0, 0], mask[0, 0])
    torch.testing.assert_close(got, torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask))
