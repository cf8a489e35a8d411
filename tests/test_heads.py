"""Draft heads on the target's hidden states (Medusa style).

Pins: the guess tree is the best-scored rank paths, closed under prefixes; guesses become tree
nodes head by head; the output-layer tap keeps the hidden state of every logits row (eager, and
through a compiled forward); a target with heads returns guesses computed from the row that decided
its next token (checked against the heads applied to HF's own hidden state), on the eager path and
the one-graph round alike; generations with heads equal HF ``generate()`` greedy in float32 and
target-only sampling for the same seed; heads trained on a tiny model's own answers guess some of
its tokens, and those guesses are accepted; saved heads load back; heads that do not fit the
target are refused.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import EOS, assert_heads_sample_as_target_only, tiny_llama, tiny_qwen2

from specsplit import SpecSplitConfig, SpecSplitGenerator
from specsplit.config import EngineTuning, NgramConfig, PipelineTuning, TargetConfig
from specsplit.core.tree import TokenTree
from specsplit.errors import ConfigError
from specsplit.messages import VerifyRequest
from specsplit.runtime.heads import (
    POOL_PER_NODE,
    DraftHeads,
    GuessPool,
    HeadsInfo,
    HiddenTap,
    choice_paths,
    head_logits,
    install_tap,
    load_heads,
    paths_to_nodes,
    pick_guess_tree,
    save_heads,
)
from specsplit.runtime.heads_training import (
    Chat,
    HeadsTrainingOptions,
    evaluate_heads,
    generate_batched,
    train_heads,
)

PROMPT = [44, 3, 19, 250, 61, 62, 63, 64, 9, 3, 19]
RANKS = 4


def _random_heads(model, tmp_path, num_heads=3, seed=0, scale=0.05, token_input=True):
    """A heads directory with small random blocks (guesses near the target's own next token)."""
    torch.manual_seed(seed)
    w = model.get_output_embeddings().weight
    heads = DraftHeads(num_heads, w.shape[1], token_input)
    with torch.no_grad():
        heads.weight.normal_(0, scale)
        if heads.token_weight is not None:
            # U e ~ N(0, 2) per unit: large enough that the decided token changes the guesses
            std = float(model.get_input_embeddings().weight.std()) * w.shape[1] ** 0.5
            heads.token_weight.normal_(0, 2.0 / std)
    acc = [[0.5 / (r + 1) / (k + 1) for r in range(RANKS)] for k in range(num_heads)]
    info = HeadsInfo(
        num_heads=num_heads, hidden_size=w.shape[1], vocab_size=w.shape[0], rank_accuracy=acc,
        token_input=token_input,
    )  # fmt: skip
    return save_heads(heads, info, tmp_path / f"heads{seed}-{int(token_input)}")


def _config(
    heads_dir, graphs=False, window=0, nodes=8, policy="always", packed=None, tree="dynamic"
) -> SpecSplitConfig:
    ngram = NgramConfig(lookahead=window, lookahead_policy=policy)
    target = TargetConfig(
        cuda_graphs=graphs, draft_heads=str(heads_dir), draft_heads_nodes=nodes, pack_weights=packed,
        draft_heads_tree=tree, tuning=EngineTuning(graph_capacity=512),
    )  # fmt: skip
    return SpecSplitConfig(drafter="ngram", tuning=PipelineTuning(ngram=ngram), target=target)


# ---------------------------------------------------------------------- the guess tree
def test_choice_paths_are_the_best_scored_paths_closed_under_prefixes():
    acc = [[0.6, 0.2, 0.1], [0.5, 0.3, 0.1], [0.4, 0.1, 0.05]]
    paths = choice_paths(acc, 6)
    # scores 0.6, 0.3, 0.2, 0.18, 0.12, 0.1
    assert paths == [(0,), (0, 0), (1,), (0, 1), (0, 0, 0), (2,)]
    scores = []
    for p in paths:
        s = 1.0
        for k, r in enumerate(p):
            s *= acc[k][r]
        scores.append(s)
        assert len(p) == 1 or p[:-1] in paths[: paths.index(p)]  # a path's prefix comes first
    assert scores == sorted(scores, reverse=True)
    # no path left out scores above the last one kept
    best_out = max(
        acc[0][a] * (acc[1][b] if b >= 0 else 1)
        for a in range(3)
        for b in range(-1, 3)
        if ((a,) if b < 0 else (a, b)) not in paths
    )
    assert best_out <= scores[-1]
    assert choice_paths(acc, 0) == [] and len(choice_paths(acc, 100)) == 3 + 9 + 27


def _most_probable_paths(logits, ranks, pool, nodes):
    """Oracle of the dynamic tree, on the host: score every pool path by its tokens' log-softmax,
    keep the ``nodes`` best (a shallower path first on a tie), in pool order, as tree nodes."""
    logp = logits.double().log_softmax(-1)
    top = logits.topk(ranks, dim=-1).indices
    score = [sum(float(logp[k, top[k, r]]) for k, r in enumerate(path)) for path in pool]
    best = sorted(range(len(pool)), key=lambda i: (-score[i], len(pool[i]), i))[:nodes]
    chosen = [pool[i] for i in sorted(best)]
    at = {path: j for j, path in enumerate(chosen)}
    tokens = [int(top[len(path) - 1, path[-1]]) for path in chosen]
    return tokens, [at[path[:-1]] if len(path) > 1 else -1 for path in chosen], [len(path) for path in chosen]


@pytest.mark.parametrize("peaked", [False, True], ids=["spread", "peaked"])
def test_the_dynamic_tree_is_the_most_probable_paths_closed_under_prefixes(peaked):
    """Each round's tree: the pool paths of highest probability under the heads' distributions, in
    an order where a parent comes first; also when a head's top probability rounds to 1 (a path
    then scores as its prefix but for the depth tie-break)."""
    torch.manual_seed(3)
    heads, ranks, nodes = 3, 4, 12
    acc = [[0.6 / (r + 1) / (k + 1) for r in range(ranks)] for k in range(heads)]
    pool_paths = choice_paths(acc, nodes * POOL_PER_NODE)
    pool = GuessPool.build(pool_paths, heads, ranks, torch.device("cpu"))
    for trial in range(20):
        logits = torch.randn(heads, 50) * (3 + trial % 4)
        if peaked:
            logits[:, 7] = 200.0  # probability 1.0 in float32 for each head's best token
        top = logits.topk(ranks, dim=-1).indices
        packed = pick_guess_tree(logits, top, pool, nodes).tolist()
        tokens, parents, depths = packed[:nodes], packed[nodes : 2 * nodes], packed[2 * nodes :]
        assert all(-1 <= p < i for i, p in enumerate(parents))  # a tree in topological order
        assert all(d == (1 if p < 0 else depths[p] + 1) for p, d in zip(parents, depths, strict=True))
        if not peaked:  # (ties between unrelated paths may break either way when peaked)
            assert (tokens, parents, depths) == _most_probable_paths(logits, ranks, pool_paths, nodes)


def test_guesses_become_nodes_head_by_head():
    guesses = [10, 11, 12, 20, 21, 22]  # head 1's three best, then head 2's
    tokens, parents, depths = paths_to_nodes(guesses, 3, [(0,), (0, 0), (1,), (0, 2), (1, 1)])
    assert tokens == [10, 20, 11, 22, 21]
    assert parents == [-1, 0, -1, 0, 2]
    assert depths == [1, 2, 1, 2, 2]


# ---------------------------------------------------------------------- the tap
def test_the_tap_keeps_the_hidden_state_of_every_logits_row(qwen_target):
    model = tiny_qwen2(3)
    tap = install_tap(model, 8)
    assert install_tap(model, 8) is tap and isinstance(model.get_output_embeddings(), HiddenTap)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        out = model(ids, output_hidden_states=True, logits_to_keep=5)
    assert torch.allclose(tap.rows[:5], out.hidden_states[-1][0, -5:])
    ref = tiny_qwen2(3)(ids).logits[0, -5:]
    assert torch.allclose(out.logits[0], ref, atol=1e-5)  # the logits are the model's own


def test_the_tap_works_through_torch_compile():
    model = tiny_llama(4)
    tap = install_tap(model, 8)
    ids = torch.tensor([PROMPT])

    def step(x):
        return model(x, logits_to_keep=3).logits

    compiled = torch.compile(step)
    with torch.no_grad():
        compiled(ids)
        hidden = model(ids, output_hidden_states=True).hidden_states[-1][0, -3:]
    assert torch.allclose(tap.rows[:3], hidden, atol=1e-5)


# ---------------------------------------------------------------------- the target's guesses
@pytest.mark.parametrize(
    "token_input,kind",
    [(True, "dynamic"), (False, "dynamic"), (True, "static")],
    ids=["token-dynamic", "hidden-only-dynamic", "token-static"],
)
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "static"])
def test_verify_returns_guesses_from_the_row_that_decided_the_next_token(
    llama_target, tmp_path, graphs, token_input, kind
):
    """``return_guesses``: guesses from the row that decided the next token (and from that token's
    embedding), equal to the heads applied to HF's own hidden state; a request that does not ask
    gets none."""
    heads_dir = _random_heads(llama_target, tmp_path, token_input=token_input)
    heads, info = load_heads(heads_dir, "cpu", torch.float32)
    pool = choice_paths(info.rank_accuracy, 8 * (POOL_PER_NODE if kind == "dynamic" else 1))

    def want_nodes(top_logits):  # [K, V] -> the round's tree, as the engine should pick it
        if kind == "dynamic":
            return _most_probable_paths(top_logits, RANKS, pool, 8)
        return paths_to_nodes(top_logits.topk(RANKS, dim=-1).indices.reshape(-1).tolist(), RANKS, pool)

    target = copy.deepcopy(llama_target)  # the heads wrap its output layer: the fixture stays as it is
    with SpecSplitGenerator(target, None, config=_config(heads_dir, graphs=graphs, tree=kind)) as gen:
        engine = gen.target_engine
        assert engine is not None and engine.heads is not None
        first = engine.verify(VerifyRequest("s", TokenTree.empty(), PROMPT, 0, return_guesses=True))
        context = PROMPT + [first.next_token_id]
        nxt = int(llama_target(torch.tensor([context])).logits[0, -1].argmax())
        # a tree whose first node is the target's token: accepted, so its row decides the next token
        tree = TokenTree(torch.tensor([nxt, 7]), torch.tensor([-1, -1]), torch.tensor([1, 1]), torch.zeros(2))
        res = engine.verify(
            VerifyRequest("s", tree, [first.next_token_id], first.prefix_length, return_guesses=True)
        )
        assert res.accepted_token_ids == [nxt]
        # not asked: the heads' work is left undone (a plain step of a model-drafter round, say)
        unasked = engine.verify(VerifyRequest("s", TokenTree.empty(), [res.next_token_id], res.prefix_length))
        assert unasked.guesses is None
        for r, ctx in ((first, PROMPT), (res, context + [nxt])):
            assert r.guesses is not None
            with torch.no_grad():
                h = llama_target(torch.tensor([ctx]), output_hidden_states=True).hidden_states[-1][0, -1:]
                e = (
                    llama_target.get_input_embeddings()(torch.tensor([r.next_token_id]))
                    if token_input
                    else None
                )
                top = head_logits(heads, llama_target.get_output_embeddings().weight, h, e)[:, 0]
            want = want_nodes(top)
            assert (r.guesses.token_ids, r.guesses.parents, r.guesses.depths) == want
            if token_input:  # the token matters: another one would have given other guesses
                with torch.no_grad():
                    e = llama_target.get_input_embeddings()(torch.tensor([r.next_token_id + 1]))
                    top = head_logits(heads, llama_target.get_output_embeddings().weight, h, e)[:, 0]
                assert want_nodes(top) != want


@pytest.mark.parametrize(
    "graphs,window,packed",
    [(False, 0, None), (True, 0, None), (True, 3, None), (False, 0, True)],
    ids=["eager", "static", "window", "packed"],
)
def test_generation_with_heads_equals_hf_greedy(llama_target, qwen_target, tmp_path, graphs, window, packed):
    """Also with the CPU's packed weights, where the output layer is no ``nn.Linear`` any more."""
    for model in (llama_target, qwen_target):
        heads_dir = _random_heads(model, tmp_path, seed=1)
        ids = torch.tensor([PROMPT])
        ref = model.generate(ids, max_new_tokens=40, do_sample=False, pad_token_id=0)
        target = copy.deepcopy(model)  # the heads wrap its output layer (and packing rewrites it)
        cfg = _config(heads_dir, graphs, window, packed=packed)
        with SpecSplitGenerator(target, None, config=cfg) as gen:
            engine = gen.target_engine
            assert engine is not None
            outs, forwards = [], []
            for _ in range(2):
                before = engine.forward_count
                outs.append(gen.generate(ids, max_new_tokens=40, return_dict_in_generate=True))
                forwards.append(engine.forward_count - before)
        for out, n in zip(outs, forwards, strict=True):
            assert torch.equal(out.sequences, ref)
            assert out.spec_stats.rounds_by_drafter().get("heads", 0) > 0
            assert n == len(out.spec_stats.rounds)  # one target forward a round: the heads add none


def test_heads_sampling_gives_target_only_tokens_for_the_same_seed(llama_target, tmp_path):
    heads_dir = _random_heads(llama_target, tmp_path, seed=2)
    assert_heads_sample_as_target_only(llama_target, _config(heads_dir), torch.tensor([PROMPT]))


def test_heads_that_do_not_fit_the_target_are_refused(llama_target, tmp_path):
    other = tiny_llama(5, hidden=32)
    heads_dir = _random_heads(other, tmp_path)
    with pytest.raises(ConfigError, match="hidden size"):
        SpecSplitGenerator(llama_target, None, config=_config(heads_dir))
    with pytest.raises(ConfigError, match="heads.safetensors"):
        SpecSplitGenerator(llama_target, None, config=_config(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="draft_heads_nodes"):
        TargetConfig(draft_heads="x", draft_heads_nodes=0)
    with pytest.raises(ConfigError, match="draft_heads_tree"):
        TargetConfig(draft_heads="x", draft_heads_tree="wide")
    bad = _random_heads(llama_target, tmp_path, seed=3)
    (bad / "heads.json").write_text(json.dumps({"num_heads": 2}))
    with pytest.raises(ConfigError, match="heads description"):
        load_heads(bad, "cpu", torch.float32)


# ---------------------------------------------------------------------- training
@pytest.mark.parametrize("token_input", [False, True], ids=["medusa", "token"])
def test_heads_trained_on_a_models_own_answers_guess_its_tokens(tmp_path, token_input):
    """A tiny model writes greedy answers to random prompts; heads trained on them guess better
    than untrained ones on held-out answers, and a generation with them accepts guessed tokens."""
    model = tiny_llama(6, vocab=64, hidden=64)
    model.requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 64, (8,), generator=g).tolist() for _ in range(96)]
    answers = generate_batched(model, prompts, 24, [EOS], 0, sample=False, batch=32, seed=0)
    chats = [Chat(p + a, len(p)) for p, a in zip(prompts, answers, strict=True) if len(a) > 1]
    opts = HeadsTrainingOptions(
        num_heads=2, epochs=30, lr=3e-3, tokens_per_step=2048, holdout=0.2, ranks=4, token_input=token_input
    )
    heads, info, report = train_heads(model, chats, opts, base_model="tiny")
    assert info.token_input == token_input
    untrained = DraftHeads(2, 64, token_input)
    held = chats[: max(1, int(len(chats) * 0.2))]
    acc0, _ = evaluate_heads(model, untrained, held, 4)
    assert sum(info.rank_accuracy[1]) > sum(acc0[1]) + 0.1  # head 2 learned what the model writes
    assert report.accepted_per_round > 0.3 and report.steps > 0
    path = save_heads(heads, info, tmp_path / "trained")
    loaded, info2 = load_heads(path, "cpu", torch.float32)
    assert info2.rank_accuracy == info.rank_accuracy
    assert torch.allclose(loaded.weight, heads.weight.to(torch.bfloat16).float())
    ids = torch.tensor([prompts[0]])
    ref = model.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=0, eos_token_id=None)
    with SpecSplitGenerator(model, None, config=_config(path, nodes=12)) as gen:
        out = gen.generate(ids, max_new_tokens=24, eos_token_id=None, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    rounds = out.spec_stats.rounds
    assert sum(r.accepted for r in rounds if r.drafter == "heads") > 0


def test_heads_train_command_trains_and_saves_heads_that_load(tmp_path, capsys):
    """``specsplit heads train --chats FILE``: heads for a model directory from given chats (no
    generation), saved with their rank accuracies and a report of the run."""
    from specsplit.cli import main

    model = tiny_qwen2(7, vocab=64)
    model.save_pretrained(tmp_path / "model")
    g = torch.Generator().manual_seed(1)
    lines = []
    for _ in range(12):
        ids = torch.randint(3, 64, (20,), generator=g).tolist()
        lines.append(json.dumps({"ids": ids, "answer_start": 6}))
    (tmp_path / "chats.jsonl").write_text("\n".join(lines) + "\n")
    for out, flags in (("medusa", []), ("heads", ["--token-input"])):
        rc = main([
            "heads", "train", "--target", str(tmp_path / "model"), "--chats", str(tmp_path / "chats.jsonl"),
            "--out", str(tmp_path / out), "--device", "cpu", "--num-heads", "2", "--epochs", "2",
            "--tokens-per-step", "128", *flags,
        ])  # fmt: skip
        assert rc == 0
        report = json.loads(capsys.readouterr().out)
        assert report["chats"] == 12 and report["steps"] > 0 and len(report["rank_accuracy"]) == 2
        heads, info = load_heads(tmp_path / out, "cpu", torch.float32)
        assert heads.num_heads == 2 and info.hidden_size == 64 and info.vocab_size == 64
        assert info.trained_on["options"]["epochs"] == 2 and info.base_model == str(tmp_path / "model")
        assert info.token_input == bool(flags) and heads.token_input == bool(flags)
    trained = load_heads(tmp_path / "heads", "cpu", torch.float32)[0].token_weight
    assert trained is not None and trained.abs().sum() > 0  # the token's weights learned something


def test_heads_flags_set_the_target_config():
    """``--draft-heads DIR --draft-heads-nodes N --draft-heads-tree T`` (``generate``, ``serve target``)
    become the target's config fields; unset flags leave the defaults."""
    import argparse

    from specsplit.cli.common import add_heads_flags, heads_overrides

    p = argparse.ArgumentParser()
    add_heads_flags(p)
    args = p.parse_args(["--draft-heads", "h/", "--draft-heads-nodes", "12", "--draft-heads-tree", "static"])
    assert heads_overrides(args) == {
        "draft_heads": "h/",
        "draft_heads_nodes": 12,
        "draft_heads_tree": "static",
    }
    assert heads_overrides(p.parse_args([])) == {}
    with pytest.raises(SystemExit):
        p.parse_args(["--draft-heads-tree", "wide"])
