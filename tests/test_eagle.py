"""EAGLE draft heads: one decoder layer drafting a tree from the target's own features.

Pins: the training unroll computes exactly what a round's tree rows compute (same inputs, same
keys seen), so the head is trained on what it meets; every round ingests exactly the committed
positions (after a generation the head's cache equals one ingest of the whole committed text);
the grown tree is EAGLE-2's (top-k children of the best frontier nodes, the best nodes kept,
closed under parents), against a host oracle that runs each node alone; generations with the head
equal HF greedy in float32 (with and without a lookahead window, one target forward a round) and
target-only sampling for the same seed; a head trained on a tiny model's own answers guesses its
tokens better than the untrained one and its guesses are accepted; heads files round-trip, and
heads that do not fit are refused. The inference shortcuts compute what the plain layer does: the
packed q/k/v and gate/up products (training keeps reading the live weights) and the two-stage top-k
(the same top-k, the same tree).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import assert_heads_sample_as_target_only, tiny_llama, tiny_qwen2

from specsplit import SpecSplitConfig, SpecSplitGenerator
from specsplit.config import EngineTuning, NgramConfig, PipelineTuning, TargetConfig
from specsplit.errors import ConfigError
from specsplit.runtime.eagle import (
    EagleConfig,
    EagleDrafter,
    EagleLayer,
    TargetEagle,
    attend,
    chunked_topk,
    load_eagle,
    pick_tree,
    save_eagle,
)
from specsplit.runtime.eagle_training import (
    EagleTrainingOptions,
    accepted_in_tree,
    evaluate_rounds,
    train_eagle,
    unroll_mask,
    unrolled_levels,
)
from specsplit.runtime.heads import HeadsInfo, load_heads, read_info
from specsplit.runtime.heads_training import Chat, generate_batched

PROMPT = [44, 3, 19, 250, 61, 62, 63, 64, 9, 3, 19]
TREE = dict(topk=4, width=3, depth=4)


def _layer(model, seed=0, noise=0.02, **kw) -> EagleLayer:
    """A head warm-started from ``model``'s last layer, with seeded noise (guesses near its own)."""
    torch.manual_seed(seed)
    cfg = EagleConfig.for_target(model, vocab_subset=kw.pop("subset", 10**6), **{**TREE, **kw})
    layer = EagleLayer(cfg)
    layer.warm_start(model)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(noise * torch.randn_like(p))
    return layer


def _eagle_dir(model, tmp_path, seed=0, subset=None, **kw):
    layer = _layer(model, seed, **kw)
    v = layer.cfg.vocab_size
    vocab = (
        torch.arange(v)
        if subset is None
        else torch.randperm(v, generator=torch.Generator().manual_seed(seed))[:subset]
    )
    layer.cfg.vocab_subset = int(vocab.numel())
    info = HeadsInfo(num_heads=layer.cfg.depth, hidden_size=layer.cfg.hidden_size, vocab_size=v)
    return save_eagle(layer, vocab.sort().values, info, tmp_path / f"eagle{seed}-{subset}")


def _config(path, graphs=True, window=0, nodes=8, **ngram_kw) -> SpecSplitConfig:
    target = TargetConfig(
        cuda_graphs=graphs,
        draft_heads=str(path),
        draft_heads_nodes=nodes,
        tuning=EngineTuning(graph_capacity=512),
    )
    ngram = NgramConfig(lookahead=window, lookahead_policy="always", **ngram_kw)
    return SpecSplitConfig(drafter="ngram", tuning=PipelineTuning(ngram=ngram), target=target)


def _drafter(model, layer, capacity=64) -> EagleDrafter:
    return EagleDrafter(
        layer, torch.arange(layer.cfg.vocab_size), model.get_output_embeddings().weight,
        model.get_input_embeddings(), model.get_decoder().rotary_emb, capacity, 16,
    )  # fmt: skip


def _features(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model.get_decoder()(input_ids=torch.tensor([ids])).last_hidden_state[0]  # [T, H] post-norm


# ---------------------------------------------------------------------- training == inference
def test_unroll_mask_sees_what_a_tree_node_sees():
    m = unroll_mask(5, 3, "cpu")  # level 3 at position p: true keys <= p - 2, level 2 at p - 1, itself
    for p in range(5):
        assert m[p, :5].tolist() == [j <= p - 2 for j in range(5)]
        assert m[p, 5:10].tolist() == [j == p - 1 for j in range(5)]
        assert m[p, 10:].tolist() == [j == p for j in range(5)]
    assert torch.equal(unroll_mask(4, 1, "cpu"), torch.ones(4, 4).tril().bool())


@pytest.mark.parametrize("make", [tiny_llama, tiny_qwen2], ids=["llama", "qwen2"])
def test_training_unroll_computes_what_a_rounds_tree_rows_compute(make):
    """Level ``s`` of the training unroll at position ``p`` equals the round's depth-``s`` row on the
    true path: ingest positions ``< n``, then chain the true tokens through :meth:`EagleDrafter.level`."""
    model = make(1)
    layer = _layer(model, noise=0.05)
    ids = [5, 9, 14, 3, 77, 21, 8, 40, 11, 6, 90, 33]
    f = _features(model, ids)
    emb = model.get_input_embeddings()(torch.tensor([ids[1:] + [0]]))
    with torch.no_grad():
        outs = unrolled_levels(layer, f[None], emb, model.get_decoder().rotary_emb, 4)
        for n in (3, 6):  # the round's next token sits at position n
            head = _drafter(model, layer)
            zero = torch.zeros((), dtype=torch.long)
            rows = head.ingest_rows(f[:n], torch.tensor(ids[1 : n + 1]), zero, torch.tensor(n))
            assert torch.allclose(rows, outs[0][0, :n], atol=1e-5)  # level 1: true features
            hid = rows[n - 1 : n]
            anc = (head.slots < n)[None]
            for s in range(2, 5):  # depth-s row at position n + s - 2, token x_{n+s-1}
                slot = torch.tensor([head.tree_base + s - 2])
                hid, anc = head.level(hid, torch.tensor([ids[n + s - 1]]), anc, slot, torch.tensor(n + s - 2))
                assert torch.allclose(hid[0], outs[s - 1][0, n + s - 2], atol=1e-5), (n, s)


# ---------------------------------------------------------------------- the tree
def _oracle_tree(model, layer, ids: list[int], nodes: int) -> tuple[list[int], list[int], list[int]]:
    """EAGLE-2's tree on the host, every node's row computed alone over its own keys (the
    committed positions' and its ancestors')."""
    cfg = layer.cfg
    rotary = model.get_decoder().rotary_emb
    embed = model.get_input_embeddings()
    lm = model.get_output_embeddings().weight
    n = len(ids) - 1  # ids[-1] is the next token; features known for positions < n
    f = _features(model, ids[:-1])

    def row(feat, tok, pos, keys, values):
        cos, sin = rotary(feat[None, None], torch.tensor([[pos]]))
        x, q, k, v = layer.qkv(feat[None, None], embed(torch.tensor([[tok]])), cos, sin)
        kk, vv = torch.cat([keys, k], 2), torch.cat([values, v], 2)
        y = layer.out(x, attend(q, kk, vv, torch.zeros(1, 1, kk.shape[2])))[0, 0]
        return y, k, v

    with torch.no_grad():
        keys = values = torch.zeros(1, cfg.kv_heads, 0, cfg.head_dim)
        h = None
        for p in range(n):  # the committed positions, one at a time
            h, k, v = row(f[p], ids[p + 1], p, keys, values)
            keys, values = torch.cat([keys, k], 2), torch.cat([values, v], 2)
        logp = (lm @ h).log_softmax(-1).double()
        top = logp.topk(cfg.topk)
        # a candidate: (score, token, parent index, depth, its row's input feature, ancestors' k/v)
        cands = [(float(s), int(t), -1, 1) for s, t in zip(top.values, top.indices, strict=True)]
        frontier = [(i, h, keys, values) for i in range(cfg.width)]
        for level in range(1, cfg.depth):
            new = []
            for ci, hid, kk, vv in frontier:
                y, k, v = row(hid, cands[ci][1], n + level - 1, kk, vv)
                lp = (lm @ y).log_softmax(-1).double().topk(cfg.topk)
                for s, t in zip(lp.values, lp.indices, strict=True):
                    new.append((cands[ci][0] + float(s), int(t), ci, level + 1, y, torch.cat([kk, k], 2),
                                torch.cat([vv, v], 2)))  # fmt: skip
            base = len(cands)
            cands += [c[:4] for c in new]
            best = sorted(range(len(new)), key=lambda i: -new[i][0])[: cfg.width]
            frontier = [(base + i, new[i][4], new[i][5], new[i][6]) for i in best]
    keep = sorted(sorted(range(len(cands)), key=lambda i: -(cands[i][0] - 1e-4 * cands[i][3]))[:nodes])
    at = {c: j for j, c in enumerate(keep)}
    return [cands[i][1] for i in keep], [at.get(cands[i][2], -1) for i in keep], [cands[i][3] for i in keep]


def test_the_grown_tree_is_eagle2s_tree_closed_under_parents():
    model = tiny_qwen2(2)
    layer = _layer(model, noise=0.1)
    ids = PROMPT + [17]
    head = _drafter(model, layer)
    f = _features(model, ids[:-1])
    n = len(ids) - 1
    for nodes in (12, layer.cfg.candidates):  # the best nodes; every candidate (deep frontiers too)
        with torch.no_grad():
            h = head.ingest(f, torch.tensor(ids[1:]), torch.zeros((), dtype=torch.long), torch.tensor(n))
            packed = head.grow(h, torch.tensor(n), nodes).tolist()
        tokens, parents, depths = packed[:nodes], packed[nodes : 2 * nodes], packed[2 * nodes :]
        assert (tokens, parents, depths) == _oracle_tree(model, layer, ids, nodes)
        for i, p in enumerate(parents):  # parents come first, one level up
            assert p < i and (depths[i] == 1 if p < 0 else depths[p] == depths[i] - 1)
        assert max(depths) == (layer.cfg.depth if nodes > 12 else max(depths))


@pytest.mark.parametrize("chunk", [None, 8, 16, 64, 7, 2])  # 7: does not split; 2: k > chunk
def test_chunked_topk_is_topk(chunk):
    torch.manual_seed(0)
    x = torch.randn(5, 256)
    x[1, 200:] += 10.0  # a row whose best k sit in one run
    want_v, want_i = x.topk(4, dim=-1)
    vals, idx = chunked_topk(x, 4, chunk)
    assert torch.equal(vals, want_v) and torch.equal(idx, want_i)


def test_packed_projections_compute_what_the_layer_computes_and_follow_its_weights(tmp_path):
    model = tiny_qwen2(2)
    layer = _layer(model, noise=0.1)
    feats, emb = torch.randn(1, 3, layer.cfg.hidden_size), torch.randn(1, 3, layer.cfg.hidden_size)
    cos, sin = model.get_decoder().rotary_emb(feats, torch.arange(3).view(1, -1))

    def run():
        x, q, k, v = layer.qkv(feats, emb, cos, sin)
        return [x, q, k, v, layer.out(x, q.transpose(1, 2).reshape(1, 3, -1))]

    with torch.no_grad():
        live = run()
        layer.pack()
        packed = run()
    for a, b in zip(live, packed, strict=True):
        torch.testing.assert_close(a, b)
    assert layer.k.weight.untyped_storage().data_ptr() == layer.q.weight.untyped_storage().data_ptr()
    with torch.no_grad():
        layer.up.weight.mul_(2.0)  # a change after pack(): both paths read it (no stale copy)
        changed = run()[-1]
    assert not torch.allclose(changed, packed[-1])
    torch.testing.assert_close(run()[-1], changed)  # with autograd: the separate modules
    half = copy.deepcopy(layer).to(torch.bfloat16)  # .to() makes new tensors and undoes the packing
    assert half._packed is None
    half.pack()  # a packed layer (parameters that share storage) saves and loads
    info = HeadsInfo(
        num_heads=layer.cfg.depth, hidden_size=layer.cfg.hidden_size, vocab_size=layer.cfg.vocab_size
    )
    out = save_eagle(half, torch.arange(layer.cfg.vocab_size), info, tmp_path / "packed")
    loaded, _ = load_eagle(out, read_info(out), "cpu", torch.bfloat16)
    for name, t in half.named_parameters():
        assert torch.equal(loaded.get_parameter(name), t), name


def test_a_chunked_top_k_grows_the_same_tree():
    model = tiny_qwen2(2)
    layer = _layer(model, noise=0.1)
    ids = PROMPT + [17]
    f, n = _features(model, ids[:-1]), len(ids) - 1
    trees = []
    for chunk in (None, 16):
        head = _drafter(model, copy.deepcopy(layer))
        head.topk_chunk = chunk
        with torch.no_grad():
            h = head.ingest(f, torch.tensor(ids[1:]), torch.zeros((), dtype=torch.long), torch.tensor(n))
            trees.append(head.grow(h, torch.tensor(n), layer.cfg.candidates).tolist())
    assert trees[0] == trees[1]


def test_pick_tree_keeps_the_best_candidates_closed_under_parents():
    tokens = torch.tensor([10, 11, 12, 13, 14])
    scores = torch.tensor([-0.1, -0.5, -0.1, -0.2, -3.0])  # node 2 (child of 0) ties its parent's score
    parents = torch.tensor([-1, -1, 0, 0, 2])
    depths = torch.tensor([1.0, 1.0, 2.0, 2.0, 3.0])
    out = pick_tree(tokens, scores, parents, depths, 3).tolist()
    assert out == [10, 12, 13, -1, 0, 0, 1, 2, 2]
    assert accepted_in_tree(out, 3, [10, 13, 99]) == 2 and accepted_in_tree(out, 3, [11]) == 0


# ---------------------------------------------------------------------- rounds
def _assert_cache_is_one_ingest(model, head: TargetEagle, seq: list[int]) -> None:
    """The head's cache holds, at every committed position of ``seq``, what one ingest of the whole
    committed text writes there."""
    t = len(seq) - 1
    fresh = _drafter(model, head.drafter.layer, capacity=512)
    with torch.no_grad():
        fresh.ingest_rows(_features(model, seq[:t]), torch.tensor(seq[1:]), torch.zeros((), dtype=torch.long),
                          torch.tensor(t))  # fmt: skip
    assert torch.allclose(head.drafter.k[:, :, :t], fresh.k[:, :, :t], atol=1e-5)
    assert torch.allclose(head.drafter.v[:, :, :t], fresh.v[:, :, :t], atol=1e-5)


def test_every_round_ingests_exactly_the_committed_positions(tmp_path):
    """After a generation (n-gram trees, the head's guesses, a lookahead window: rounds accept 0 to
    several tokens) the head's cache holds, at every committed position, what one ingest of the whole
    committed text writes there."""
    model = tiny_llama(3)
    path = _eagle_dir(model, tmp_path)
    with SpecSplitGenerator(copy.deepcopy(model), None, config=_config(path, window=3)) as gen:
        out = gen.generate(torch.tensor([PROMPT]), max_new_tokens=40, return_dict_in_generate=True)
        head = gen.target_engine.heads
        assert isinstance(head, TargetEagle)
        accepted = [r.accepted for r in out.spec_stats.rounds]
        assert max(accepted) >= 2 and min(accepted) == 0
        _assert_cache_is_one_ingest(model, head, out.sequences[0].tolist())


@pytest.mark.parametrize("graphs", [True, False], ids=["one-graph", "eager"])
def test_rounds_that_grow_no_guesses_still_feed_the_heads_cache(tmp_path, monkeypatch, graphs):
    """Under ``guess_policy="adaptive"`` with guesses priced above anything they add, most rounds
    grow none: those rounds only write the committed positions into the head's cache, so the
    output stays HF's and the cache holds what one ingest of the whole text writes (guesses asked for
    again, on the probes, see every position)."""
    model = tiny_llama(3)
    path = _eagle_dir(model, tmp_path)
    ids = torch.tensor([PROMPT])
    ref = model.generate(ids, max_new_tokens=60, do_sample=False, pad_token_id=0)
    cfg = _config(path, window=3, guess_policy="adaptive", guess_cost_tokens=1e9)
    calls = {"grow": 0, "ingest": 0}
    with SpecSplitGenerator(copy.deepcopy(model), None, config=cfg) as gen:
        head = gen.target_engine.heads
        assert isinstance(head, TargetEagle)
        if not graphs:  # every round on the eager path (its own ingest and growth)
            monkeypatch.setattr(gen.target_engine.config.tuning, "graph_rounds", False)
        grow, ingest = head.round_guesses, head.round_ingest
        eager = head.eager_guesses

        def counted_grow(*a):
            calls["grow"] += 1
            return grow(*a)

        def counted_ingest(*a):
            calls["ingest"] += 1
            return ingest(*a)

        def counted_eager(*a, grow=True):
            calls["grow" if grow else "ingest"] += 1
            return eager(*a, grow=grow)

        monkeypatch.setattr(head, "round_guesses", counted_grow)
        monkeypatch.setattr(head, "round_ingest", counted_ingest)
        monkeypatch.setattr(head, "eager_guesses", counted_eager)
        before = gen.target_engine.forward_count
        out = gen.generate(ids, max_new_tokens=60, return_dict_in_generate=True)
        assert torch.equal(out.sequences, ref)
        assert gen.target_engine.forward_count - before == len(out.spec_stats.rounds)  # one forward a round
        assert calls["ingest"] > calls["grow"] >= 2, calls  # mostly ingest-only, probes still grow
        _assert_cache_is_one_ingest(model, head, out.sequences[0].tolist())


@pytest.mark.parametrize("window", [0, 3], ids=["eagle", "eagle-lookahead"])
@pytest.mark.parametrize("make", [tiny_llama, tiny_qwen2], ids=["llama", "qwen2"])
def test_generation_with_an_eagle_head_equals_hf_greedy(tmp_path, make, window):
    model = make(0)
    path = _eagle_dir(model, tmp_path, subset=200)
    ids = torch.tensor([PROMPT])
    ref = model.generate(ids, max_new_tokens=40, do_sample=False, pad_token_id=0)
    with SpecSplitGenerator(copy.deepcopy(model), None, config=_config(path, window=window)) as gen:
        engine = gen.target_engine
        for _ in range(2):
            before = engine.forward_count
            out = gen.generate(ids, max_new_tokens=40, return_dict_in_generate=True)
            assert torch.equal(out.sequences, ref)
            rounds = out.spec_stats.rounds
            assert engine.forward_count - before == len(rounds)  # the head adds no target forward
            assert sum(r.accepted for r in rounds if r.drafter == "heads") > 0


def test_an_eagle_head_off_the_static_path_guesses_nothing_and_changes_nothing(tmp_path, caplog):
    model = tiny_qwen2(0)
    path = _eagle_dir(model, tmp_path)
    ids = torch.tensor([PROMPT])
    ref = model.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=0)
    with SpecSplitGenerator(copy.deepcopy(model), None, config=_config(path, graphs=False)) as gen:
        out = gen.generate(ids, max_new_tokens=24, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert "heads" not in out.spec_stats.rounds_by_drafter()
    assert "static workspace" in caplog.text


def test_a_compiled_eagle_head_sees_one_shape_and_stays_exact(tmp_path):
    """``target.compile``: the head's round step is compiled too, and every round pads its ingest
    to the same rows, so it compiles once (a new variant mid-generation would stall a round and
    sync the host); its tokens stay HF greedy's."""
    model = tiny_qwen2(0)
    path = _eagle_dir(model, tmp_path, subset=200)
    cfg = _config(path, window=3)
    cfg.target.compile = True
    ids = torch.tensor([PROMPT])
    ref = model.generate(ids, max_new_tokens=40, do_sample=False, pad_token_id=0)
    with SpecSplitGenerator(copy.deepcopy(model), None, config=cfg) as gen:
        heads = gen.target_engine.heads
        assert isinstance(heads, TargetEagle) and heads.compiled
        compiled, shapes = heads._round_fn, []

        def recording(rows, *args):
            shapes.append(tuple(rows.shape))
            return compiled(rows, *args)

        heads._round_fn = recording
        out = gen.generate(ids, max_new_tokens=40, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert out.spec_stats.rounds_by_drafter().get("heads", 0) > 0
    depths = {r.drafted_depth for r in out.spec_stats.rounds if r.drafter in ("heads", "lookahead")}
    assert len(depths) > 1  # trees of several depths: unpadded, several ingest sizes
    assert len(shapes) > 1 and set(shapes) == {(heads.max_ingest,)}, shapes


def test_eagle_sampling_gives_target_only_tokens_for_the_same_seed(tmp_path):
    model = tiny_llama(2)
    path = _eagle_dir(model, tmp_path, seed=2)
    assert_heads_sample_as_target_only(model, _config(path), torch.tensor([PROMPT]))


# ---------------------------------------------------------------------- files
def test_eagle_files_round_trip_and_misfits_are_refused(tmp_path):
    model = tiny_llama(1)
    path = _eagle_dir(model, tmp_path, subset=100)
    info = read_info(path)
    assert info.kind == "eagle" and info.eagle["topk"] == TREE["topk"] and info.eagle["vocab_subset"] == 100
    layer, vocab = load_eagle(path, info, "cpu", torch.float32)
    assert vocab.numel() == 100 and layer.cfg.depth == TREE["depth"]
    with pytest.raises(ConfigError, match="not Medusa heads"):
        load_heads(path, "cpu", torch.float32)
    with pytest.raises(ConfigError, match="hidden size"):
        SpecSplitGenerator(tiny_llama(1, hidden=32), None, config=_config(path))
    bad = json.loads((path / "heads.json").read_text())
    (path / "heads.json").write_text(json.dumps({**bad, "kind": "hydra"}))
    with pytest.raises(ConfigError, match="kind"):
        read_info(path)
    (path / "heads.json").write_text(json.dumps({**bad, "eagle": {**bad["eagle"], "width": 9}}))
    with pytest.raises(ConfigError, match="width"):
        load_eagle(path, read_info(path), "cpu", torch.float32)


# ---------------------------------------------------------------------- training
def _own_chats(model, n=120, prompt=6, answer=32):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 64, (prompt,), generator=g).tolist() for _ in range(n)]
    answers = generate_batched(model, prompts, answer, [2], 0, sample=False, batch=64, seed=0)
    return [Chat(p + a, len(p)) for p, a in zip(prompts, answers, strict=True) if len(a) > 2]


def test_an_eagle_head_trained_on_a_models_own_answers_guesses_its_tokens(tmp_path):
    """Trained on a tiny model's greedy answers, the head accepts more of held-out answers a round
    than the untrained warm start does, measured by the inference code, and a generation with it
    accepts its guesses (and equals HF greedy)."""
    model = tiny_llama(6, vocab=64, hidden=64)
    model.requires_grad_(False)
    chats = _own_chats(model)
    opts = EagleTrainingOptions(
        epochs=8, lr=2e-3, tokens_per_step=1024, vocab_subset=48, holdout=0.2, eval_positions=300,
        eval_nodes=16, **TREE,
    )  # fmt: skip
    layer, vocab, info, report = train_eagle(model, chats, opts, base_model="tiny")
    assert vocab.numel() == 48 and report.subset_coverage > 0.8 and report.steps > 0
    assert len(report.accuracy_by_depth) == opts.unroll
    held = chats[: max(1, int(len(chats) * 0.2))]  # train_eagle's split: the same shuffle
    untrained = EagleLayer(layer.cfg)
    untrained.warm_start(model)
    before, _ = evaluate_rounds(model, untrained, vocab, held, opts)
    assert report.accepted_per_round > before + 0.2
    path = save_eagle(layer, vocab, info, tmp_path / "trained")
    ids = torch.tensor([chats[0].ids[:6]])
    ref = model.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=0, eos_token_id=None)
    with SpecSplitGenerator(copy.deepcopy(model), None, config=_config(path, nodes=12)) as gen:
        out = gen.generate(ids, max_new_tokens=24, eos_token_id=None, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert sum(r.accepted for r in out.spec_stats.rounds if r.drafter == "heads") > 0


def test_heads_train_kind_eagle_trains_and_saves_a_head_that_loads(tmp_path, capsys):
    from specsplit.cli import main

    model = tiny_qwen2(7, vocab=64)
    model.save_pretrained(tmp_path / "model")
    lines = [json.dumps({"ids": c.ids, "answer_start": c.answer_start}) for c in _own_chats(model, n=16)]
    (tmp_path / "chats.jsonl").write_text("\n".join(lines) + "\n")
    rc = main([
        "heads", "train", "--kind", "eagle", "--target", str(tmp_path / "model"), "--chats",
        str(tmp_path / "chats.jsonl"), "--out", str(tmp_path / "eagle"), "--device", "cpu", "--epochs", "1",
        "--tokens-per-step", "256", "--eagle-tree", "4,2,3", "--vocab-subset", "40", "--eval-positions", "50",
    ])  # fmt: skip
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert report["steps"] > 0 and 0 <= report["accepted_per_round"] and len(report["accuracy_by_depth"]) == 4
    info = read_info(tmp_path / "eagle")
    assert info.kind == "eagle" and (info.eagle["topk"], info.eagle["width"], info.eagle["depth"]) == (
        4,
        2,
        3,
    )
    assert info.trained_on["options"]["epochs"] == 1 and info.base_model == str(tmp_path / "model")
    layer, vocab = load_eagle(tmp_path / "eagle", info, "cpu", torch.float32)
    assert vocab.numel() == 40 and layer.cfg.vocab_subset == 40
    with pytest.raises(SystemExit):
        main(["heads", "train", "--kind", "eagle", "--target", str(tmp_path / "model"), "--chats",
              str(tmp_path / "chats.jsonl"), "--out", str(tmp_path / "x"), "--eagle-tree", "4,2"])  # fmt: skip
    with pytest.raises(SystemExit, match="--kind eagle"):  # Medusa heads learn from the chats' own tokens
        main(["heads", "train", "--target", str(tmp_path / "model"), "--chats", str(tmp_path / "chats.jsonl"),
              "--out", str(tmp_path / "y"), "--device", "cpu", "--texts", str(tmp_path)])  # fmt: skip


def test_a_time_budget_shrinks_the_planned_steps_to_what_fits():
    from specsplit.runtime.eagle_training import _Schedule

    plan = _Schedule(100, budget_s=10.0)
    assert plan.lr_at(0) == 1 / 5 and plan.lr_at(4) == 1.0  # warm-up over 5% of the steps
    plan.after_epoch(20, 5.0)  # 0.25 s a step: 20 more fit
    assert plan.total == 40 and plan.lr_at(39) < 0.01  # the cosine now ends at the new last step
    plan.after_epoch(40, 12.0)  # over budget: stop here
    assert plan.total == 40
    # the first epoch also caches the target's features: the later, faster epochs win steps back
    slow_start = _Schedule(100, budget_s=10.0)
    slow_start.after_epoch(10, 6.0)  # 0.6 s a step: 6 more fit
    assert slow_start.total == 16
    slow_start.after_epoch(16, 6.6)  # 0.1 s a step now: 34 more fit
    assert slow_start.total == 50
    slow_start.after_epoch(50, 7.0)  # faster still, but never past the plan
    assert slow_start.total == 100
    free = _Schedule(100, budget_s=0.0)
    free.after_epoch(20, 5.0)
    assert free.total == 100


def test_text_passages_become_chats_the_head_trains_on_with_the_targets_choices(tmp_path):
    """``text_chats``: passages of a corpus's files wrapped as answers, within a token budget; an
    EAGLE head trains on them beside the chats (labelled with the target's own choices, so the text
    need not be the target's), and only the target's chats are held out to measure it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from specsplit.runtime.heads_training import text_chats

    vocab = {f"w{i}": i for i in range(3, 64)} | {"<pad>": 0, "<s>": 1, "</s>": 2}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>")
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    (tmp_path / "corpus" / "pkg").mkdir(parents=True)
    g = torch.Generator().manual_seed(3)
    for i in range(3):
        words = " ".join(f"w{int(t)}" for t in torch.randint(3, 64, (100,), generator=g))
        (tmp_path / "corpus" / "pkg" / f"m{i}.py").write_text(words)
    (tmp_path / "corpus" / "skip.bin").write_text("w3 w4")
    passages = text_chats(tokenizer, [str(tmp_path / "corpus")], max_tokens=250, chunk_tokens=40)
    assert passages and all(c.source == "text" for c in passages)
    assert 250 <= sum(len(c.ids) - c.answer_start for c in passages) < 250 + 45
    assert all(len(c.ids) - c.answer_start <= 40 + 2 for c in passages)  # a fence, then the passage
    assert text_chats(tokenizer, [str(tmp_path / "corpus")], 250, 40) == passages  # seeded order
    model = tiny_llama(6, vocab=64, hidden=64)
    model.requires_grad_(False)
    chats = _own_chats(model, n=24)
    opts = EagleTrainingOptions(epochs=1, tokens_per_step=512, vocab_subset=48, eval_positions=40, **TREE)
    _, _, _, report = train_eagle(model, chats + passages, opts)
    assert report.text_passages == len(passages) and report.chats == len(chats)
    assert report.text_tokens == sum(len(c.ids) - c.answer_start for c in passages) and report.steps > 0
    with pytest.raises(ValueError, match="target's chats"):
        train_eagle(model, passages, opts)
