"""Golden masks/positions, and tree-forward logits equal to per-path logits on a real HF model."""

from __future__ import annotations

import torch

from specsplit import StaticKVCache, bool_mask_to_float, build_tree_attention
from specsplit.core.tree_attention import ancestor_matrix, build_verify_attention

NEG = torch.finfo(torch.float32).min


def test_golden_mask_and_positions():
    parents = torch.tensor([-1, -1, 0, 0, 2])  # two roots; node 4 under node 2 under node 0
    mask, pos = build_verify_attention(parents, cache_length=3, num_pending=0)
    allowed = mask[0, 0] == 0
    expect = torch.tensor(
        [
            [1, 1, 1, 1, 0, 0, 0, 0],
            [1, 1, 1, 0, 1, 0, 0, 0],
            [1, 1, 1, 1, 0, 1, 0, 0],
            [1, 1, 1, 1, 0, 0, 1, 0],
            [1, 1, 1, 1, 0, 1, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(allowed, expect)
    assert pos.tolist() == [[3, 3, 4, 4, 5]]
    assert mask.dtype == torch.float32 and set(mask.unique().tolist()) == {0.0, NEG}
    assert mask.shape == (1, 1, 5, 8)


def test_tree_rows_only_and_full_variant_agree():
    parents = torch.tensor([-1, 0, 0, 1])
    rows, pos_rows = build_tree_attention(parents, 2, tree_rows_only=True)
    full, pos_full = build_tree_attention(parents, 2)
    assert rows.shape == (1, 1, 4, 6) and full.shape == (1, 1, 6, 6)
    assert torch.equal(full[:, :, 2:], rows)
    assert torch.equal(full[0, 0, :2, :2] == 0, torch.ones(2, 2, dtype=torch.bool).tril())
    assert pos_full.tolist() == [[0, 1, 2, 3, 3, 4]] and pos_rows.tolist() == [[2, 3, 3, 4]]


def test_pending_rows_are_causal_and_tree_hangs_below_last_pending():
    mask, pos = build_verify_attention(torch.tensor([-1, 0]), cache_length=2, num_pending=3)
    allowed = mask[0, 0] == 0  # [5, 7]
    assert allowed[:3, :5].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert not allowed[:3, 5:].any()
    assert allowed[3].tolist() == [1, 1, 1, 1, 1, 1, 0]
    assert pos.tolist() == [[2, 3, 4, 5, 6]]


def test_ancestor_matrix_deep_chain():
    n = 37
    anc = ancestor_matrix(torch.arange(-1, n - 1))
    assert torch.equal(anc, torch.ones(n, n, dtype=torch.bool).tril())


def test_bool_mask_to_float():
    m = bool_mask_to_float(torch.tensor([[True, False]]), torch.bfloat16)
    assert m.dtype == torch.bfloat16
    assert m[0, 0] == 0 and m[0, 1] == torch.finfo(torch.bfloat16).min


def _logits_of_sequence(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def test_tree_forward_equals_per_path_forward(llama_target):
    model = llama_target
    prefix = [5, 17, 33, 81]
    tokens = [10, 11, 12, 13, 14, 15]
    parents = torch.tensor([-1, -1, 0, 0, 1, 2])
    cache = StaticKVCache.for_model(model, 32)
    with torch.no_grad():
        model(torch.tensor([prefix]), past_key_values=cache)
        mask, pos = build_verify_attention(parents, len(prefix), 0)
        tree_logits = model(
            torch.tensor([tokens]), attention_mask=mask, position_ids=pos, past_key_values=cache
        ).logits[0]
    for i in range(len(tokens)):
        path, j = [], i
        while j >= 0:
            path.append(tokens[j])
            j = int(parents[j])
        ref = _logits_of_sequence(model, prefix + path[::-1])[-1]
        torch.testing.assert_close(tree_logits[i], ref, atol=1e-4, rtol=1e-4)
