"""benchmarks/heads_trees.py: a tiny model's held-out rows through both guess trees, with the
engine's own tree functions; the acceptance walk itself on hand-made trees."""

from __future__ import annotations

import json

import torch
from conftest import load_benchmark, tiny_qwen2

from specsplit.runtime.heads import DraftHeads, HeadsInfo, save_heads


def test_accepted_follows_the_path_of_the_tokens_that_came():
    walk = load_benchmark("heads_trees").accepted
    tokens, parents = [0, 1, 0, 2, 0], [-1, -1, 0, 0, 2]  # 0 -> {0 -> 0, 2}, 1
    assert walk(tokens, parents, [0, 0, 0, 5]) == 3
    assert walk(tokens, parents, [0, 2, 0]) == 2
    assert walk(tokens, parents, [1, 0]) == 1
    assert walk(tokens, parents, [3]) == 0


def test_heads_trees_compares_static_and_dynamic_trees_on_held_out_rows(tmp_path, capsys, monkeypatch):
    mod = load_benchmark("heads_trees")
    monkeypatch.setattr(mod, "OUT", tmp_path / "results")
    model = tiny_qwen2(11, vocab=64)
    model.save_pretrained(tmp_path / "model")
    torch.manual_seed(0)
    heads = DraftHeads(2, 64)
    with torch.no_grad():
        heads.weight.normal_(0, 0.05)
    acc = [[0.5 / (r + 1) / (k + 1) for r in range(4)] for k in range(2)]
    save_heads(heads, HeadsInfo(2, 64, 64, rank_accuracy=acc), tmp_path / "heads")
    g = torch.Generator().manual_seed(2)
    lines = [json.dumps({"ids": torch.randint(3, 64, (24,), generator=g).tolist(), "answer_start": 6})]
    (tmp_path / "chats.jsonl").write_text("\n".join(lines * 40) + "\n")
    args = ["--target", str(tmp_path / "model"), "--heads", str(tmp_path / "heads"), "--chats",
            str(tmp_path / "chats.jsonl"), "--holdout", "0.1", "--nodes", "4,8", "--tag", "t"]  # fmt: skip
    assert mod.main(args) == 0
    out = json.loads((tmp_path / "results" / "heads_trees-t.json").read_text())
    assert out["chats"] == 4 and out["rows"] > 0
    for n in ("4", "8"):
        static, dynamic = out["accepted"][n]["static"], out["accepted"][n]["dynamic"]
        assert 0 <= static <= 2 and 0 <= dynamic <= 2
    assert "| 8 |" in (tmp_path / "results" / "heads_trees-t.md").read_text()
    # the static tree's count agrees with training's own held-out measure (another implementation)
    import random

    from specsplit.runtime.heads import load_heads
    from specsplit.runtime.heads_training import Chat, evaluate_heads

    chats = [Chat(**json.loads(line)) for line in lines * 40]
    random.Random(0).shuffle(chats)
    loaded, info = load_heads(tmp_path / "heads", "cpu", torch.float32)
    _, want = evaluate_heads(model, loaded, chats[:4], 4, budget=8)
    assert abs(out["accepted"]["8"]["static"] - want) < 1e-9


def test_heads_trees_measures_an_eagle_head_at_the_same_positions(tmp_path, monkeypatch):
    """``--eagle DIR``: the EAGLE head's accepted guesses at the positions the Medusa heads are scored
    on (the next token of every row whose two following tokens are answer tokens), as the inference
    code's walk counts them there."""
    from specsplit.runtime.eagle import EagleConfig, EagleLayer, save_eagle

    mod = load_benchmark("heads_trees")
    monkeypatch.setattr(mod, "OUT", tmp_path / "results")
    model = tiny_qwen2(11, vocab=64)
    model.save_pretrained(tmp_path / "model")
    heads = DraftHeads(2, 64)
    acc = [[0.5 / (r + 1) / (k + 1) for r in range(4)] for k in range(2)]
    save_heads(heads, HeadsInfo(2, 64, 64, rank_accuracy=acc), tmp_path / "heads")
    layer = EagleLayer(EagleConfig.for_target(model, topk=4, width=2, depth=3))
    layer.warm_start(model)
    save_eagle(layer, torch.arange(64), HeadsInfo(3, 64, 64), tmp_path / "eagle")
    g = torch.Generator().manual_seed(2)
    lines = [json.dumps({"ids": torch.randint(3, 64, (24,), generator=g).tolist(), "answer_start": 6})]
    (tmp_path / "chats.jsonl").write_text("\n".join(lines * 40) + "\n")
    args = ["--target", str(tmp_path / "model"), "--heads", str(tmp_path / "heads"), "--eagle",
            str(tmp_path / "eagle"), "--chats", str(tmp_path / "chats.jsonl"), "--holdout", "0.1", "--nodes",
            "4,8", "--tag", "e"]  # fmt: skip
    assert mod.main(args) == 0
    out = json.loads((tmp_path / "results" / "heads_trees-e.json").read_text())
    assert {"static", "dynamic", "eagle"} <= set(out["accepted"]["8"])
    assert "EAGLE" in (tmp_path / "results" / "heads_trees-e.md").read_text()
    import random

    from specsplit.runtime.eagle_training import accepted_at
    from specsplit.runtime.heads_training import Chat

    chats = [Chat(**json.loads(line)) for line in lines * 40]
    random.Random(0).shuffle(chats)
    held = chats[:4]
    spots = {i: list(range(6, 24 - 2)) for i in range(4)}  # 4 x 16 positions: the rows
    assert out["rows"] == sum(len(v) for v in spots.values())
    want = accepted_at(model, layer, torch.arange(64), held, spots, [4, 8])
    for n in (4, 8):
        assert abs(out["accepted"][str(n)]["eagle"] - want[n]) < 1e-9 and 0 <= want[n] <= 3
