"""StaticKVCache inside real HF forwards (GQA), rollback, branch compaction, sizing."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from specsplit import SpecSplitConfig, SpecSplitGenerator, StaticKVCache, TreeConfig
from specsplit.core.tree_attention import build_verify_attention


@pytest.mark.parametrize("family", ["llama", "qwen"])
def test_static_cache_matches_dynamic_cache(request, family):
    model = request.getfixturevalue(f"{family}_target")
    ids = torch.tensor([[5, 17, 33, 81, 9, 100, 4, 8]])
    static = StaticKVCache.for_model(model, 16)
    dyn = DynamicCache(config=model.config)
    with torch.no_grad():
        a = model(ids[:, :5], past_key_values=static).logits
        b = model(ids[:, :5], past_key_values=dyn).logits
        torch.testing.assert_close(a, b)
        a = model(ids[:, 5:], past_key_values=static).logits
        b = model(ids[:, 5:], past_key_values=dyn).logits
        torch.testing.assert_close(a, b)
    assert static.get_seq_length() == static.seq_len == 8
    k, v = static.get_kv_for_layer(0)
    assert k.shape == dyn.layers[0].keys.shape  # [1, kv_heads=2, 8, head_dim]
    assert k.shape[1] == model.config.num_key_value_heads
    torch.testing.assert_close(k, dyn.layers[0].keys)


def test_rollback_is_length_only_and_rewrites(llama_target):
    model = llama_target
    cache = StaticKVCache.for_model(model, 16)
    with torch.no_grad():
        model(torch.tensor([[5, 17, 33]]), past_key_values=cache)
        buf = cache.layers[0].keys
        model(torch.tensor([[99, 98]]), past_key_values=cache)
        cache.rollback(3)
        assert cache.seq_len == 3 and cache.layers[0].keys is buf  # no reallocation
        out = model(torch.tensor([[81]]), past_key_values=cache).logits[0, -1]
    ref = model(torch.tensor([[5, 17, 33, 81]])).logits[0, -1]
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError):
        cache.rollback(10)
    cache.crop(-2)
    assert cache.seq_len == 2


def test_compact_keeps_accepted_branch(llama_target):
    model = llama_target
    prefix = [5, 17, 33]
    tokens = [10, 11, 12, 13]  # nodes: 0 root, 1 root, 2 child of 1, 3 child of 2
    parents = torch.tensor([-1, -1, 1, 2])
    cache = StaticKVCache.for_model(model, 32)
    with torch.no_grad():
        model(torch.tensor([prefix]), past_key_values=cache)
        mask, pos = build_verify_attention(parents, 3, 0)
        model(torch.tensor([tokens]), attention_mask=mask, position_ids=pos, past_key_values=cache)
        cache.compact(torch.tensor([4, 5, 6]), start=3)  # accept nodes 1, 2, 3
        assert cache.seq_len == 6
        nxt = model(torch.tensor([[7]]), past_key_values=cache).logits[0, -1]
        ref = model(torch.tensor([prefix + [11, 12, 13, 7]])).logits[0, -1]
    torch.testing.assert_close(nxt, ref, atol=1e-5, rtol=1e-5)


def test_allocated_cache_is_one_buffer_and_compacts_like_per_layer(llama_target):
    """``allocate`` (the static workspace) makes every layer a view of one buffer; compaction then
    moves all layers at once and must equal the per-layer path."""
    model = llama_target
    parents = torch.tensor([-1, -1, 1, 2])
    caches = []
    for shared in (False, True):
        cache = StaticKVCache.for_model(model, 32)
        if shared:
            cache.allocate(1, 2, 16, torch.float32, torch.device("cpu"))
            assert cache._kv is not None and cache._kv.shape == (2, 2, 1, 2, 32, 16)
        with torch.no_grad():
            model(torch.tensor([[5, 17, 33]]), past_key_values=cache)
            mask, pos = build_verify_attention(parents, 3, 0)
            model(
                torch.tensor([[10, 11, 12, 13]]), attention_mask=mask, position_ids=pos, past_key_values=cache
            )
        cache.compact(torch.tensor([4, 5, 6]), start=3)
        caches.append(cache)
    assert caches[1].seq_len == caches[0].seq_len == 6
    for i in range(2):
        for a, b in zip(caches[0].get_kv_for_layer(i), caches[1].get_kv_for_layer(i), strict=True):
            torch.testing.assert_close(a, b)


def test_cache_grows_in_chunks_when_estimate_is_exceeded(llama_target):
    cache = StaticKVCache.for_model(llama_target, 4)
    with torch.no_grad():
        llama_target(torch.tensor([list(range(5, 15))]), past_key_values=cache)
    assert cache.seq_len == 10 and cache.capacity >= 10
    assert cache.remaining_capacity == cache.capacity - 10 and not cache.is_full


def test_session_cache_sized_to_need_not_max_positions(llama_target):
    tree = TreeConfig(shape="static")
    gen = SpecSplitGenerator(llama_target, llama_target, config=SpecSplitConfig(tree=tree))
    seen = {}
    engine = gen.target_engine
    orig = engine._verifier.verify

    def spy(state, *a, **k):
        seen["cap"] = state.cache.capacity
        return orig(state, *a, **k)

    engine._verifier.verify = spy  # type: ignore[method-assign]
    prompt = [5, 17, 33, 81, 9]
    gen.generate(torch.tensor([prompt]), max_new_tokens=20)
    need = len(prompt) + 20 + tree.max_nodes
    assert need <= seen["cap"] <= need + 16
    assert seen["cap"] < llama_target.config.max_position_embeddings
    gen.close()
