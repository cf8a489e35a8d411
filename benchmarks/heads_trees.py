#!/usr/bin/env python
"""Guessed tokens a round accepts with a static or a dynamic guess tree, for trained draft heads.

On held-out chats of the heads' own training set (the split ``specsplit heads train`` keeps out, or
any chats file), the target's hidden states give each head's probabilities at every answer row. For
each row and tree size the script builds the tree both ways with the engine's own functions, the
``static`` tree of :func:`~specsplit.runtime.heads.choice_paths` and this row's ``dynamic`` tree of
:func:`~specsplit.runtime.heads.pick_guess_tree`, and counts the guesses the target's actual tokens
would accept (a path from the root whose every node is the token that followed). No GPU is needed:
acceptance does not depend on the device (a CPU in float32 takes minutes for a few dozen chats).

    python benchmarks/heads_trees.py --heads .models/heads-qwen1.5b --chats chats.jsonl.gz \
        [--max-chats 30] [--nodes 16,32,64] [--tag cpu-medusa-8k]
    python benchmarks/heads_trees.py --heads .models/heads-qwen1.5b --bench-prompts 4 --tag ...

``--eagle DIR`` also grows an EAGLE head's tree (``specsplit heads train --kind eagle``) at the same
positions (the next token of each row whose four following tokens are answer tokens) with the inference
code, and counts what it accepts (its trees may go deeper than the Medusa heads' four).

``--bench-prompts N`` takes, instead of chats, the target's greedy answers (128 tokens) to ``N``
prompts a category of the bench's prompt set (text the heads were not trained on), and keeps them
(``--save-chats FILE``).
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import time
from pathlib import Path

import torch

OUT = Path(__file__).resolve().parent / "results"


def _chats(path: str) -> list:
    from specsplit.runtime.heads_training import Chat

    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return [Chat(**json.loads(line)) for line in f if line.strip()]


def bench_chats(model, target: str, per_category: int, new_tokens: int = 128) -> list:
    """The target's greedy answers to ``per_category`` bench prompts a category, as chats."""
    from specsplit.bench.run import DEFAULT_PROMPTS, load_prompts
    from specsplit.models import load_tokenizer
    from specsplit.runtime.heads_training import Chat, _eos_ids, generate_batched

    tok = load_tokenizer(target)
    ids = [
        tok(tok.apply_chat_template(p.messages, tokenize=False, add_generation_prompt=True),
            add_special_tokens=False).input_ids
        for p in load_prompts(DEFAULT_PROMPTS, per_category)
    ]  # fmt: skip
    eos = _eos_ids(model, tok)
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
    answers = generate_batched(model, ids, new_tokens, eos, pad, sample=False, batch=8, seed=0)
    return [Chat(list(i) + a, len(i)) for i, a in zip(ids, answers, strict=True)]


def rank_rows(model, heads, chats, ranks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logp [M, K, ranks + 1], rank [M, K])`` over the rows where every head has a label: each
    head's top-``ranks`` log-probabilities with the rest of its mass in the last column, and the rank
    of the token that followed (``ranks``: not in the top)."""
    from specsplit.runtime.heads_training import _batches, _hidden, _rows

    lm = model.get_output_embeddings().weight
    embed = model.get_input_embeddings()
    k = heads.num_heads
    logps, hits = [], []
    with torch.no_grad():
        for batch in _batches(chats, 1024, random.Random(0)):
            hidden, ids, usable = _hidden(model, batch)
            b, p, _ = _rows(k, ids, usable)
            for s in range(0, b.numel(), 64):  # [K, rows, V] log-softmax in slices: bounded memory
                bb, pp = b[s : s + 64], p[s : s + 64]
                e = embed(ids[bb, pp + 1]) if heads.token_input else None
                lg = torch.nn.functional.linear(heads(hidden[bb, pp], e), lm).float().log_softmax(-1)
                top = lg.topk(ranks, dim=-1)  # [K, m, R]
                rest = torch.log1p(-top.values.exp().sum(-1).clamp(max=1 - 1e-7))  # the tail's mass
                logps.append(torch.cat([top.values, rest[..., None]], -1).transpose(0, 1))
                labels = torch.stack([ids[bb, pp + 1 + j] for j in range(1, k + 1)])  # [K, m]
                hits.append((top.indices == labels[..., None]).transpose(0, 1))
            del hidden
    logp, hit = torch.cat(logps), torch.cat(hits)
    rank = torch.where(hit.any(-1), hit.float().argmax(-1), torch.full(hit.shape[:2], ranks))
    return logp, rank


def eagle_accepted(model, path: str, chats: list, heads: int, nodes: list[int]) -> dict[int, float]:
    """An EAGLE head's accepted guesses a round at the positions :func:`rank_rows` scores: the next
    token of every row whose ``heads`` following tokens are answer tokens."""
    from specsplit.runtime.eagle import load_eagle
    from specsplit.runtime.eagle_training import accepted_at
    from specsplit.runtime.heads import read_info

    w = model.get_output_embeddings().weight
    layer, vocab = load_eagle(path, read_info(path), w.device, w.dtype)
    spots = {i: list(range(c.answer_start, len(c.ids) - heads)) for i, c in enumerate(chats)}
    spots = {i: s for i, s in spots.items() if s}
    return accepted_at(model, layer, vocab.to(w.device), chats, spots, nodes)


def accepted(tokens: list[int], parents: list[int], truth: list[int]) -> int:
    """Guesses a tree accepts: the longest root path whose node at depth ``d`` is ``truth[d]``
    (tokens here are ranks)."""
    depth, at = 0, -1
    while depth < len(truth):
        nxt = next(
            (
                i
                for i, (t, p) in enumerate(zip(tokens, parents, strict=True))
                if p == at and t == truth[depth]
            ),
            None,
        )
        if nxt is None:
            break
        depth, at = depth + 1, nxt
    return depth


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="qwen2.5-coder-1.5b")
    p.add_argument("--heads", required=True, help="a heads directory (`specsplit heads train`)")
    p.add_argument("--eagle", default=None, help="an EAGLE head directory, measured at the same positions")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--chats", help="the chats (.jsonl or .jsonl.gz) the heads trained on")
    src.add_argument(
        "--bench-prompts", type=int, metavar="N", help="the target's answers to N bench prompts a category"
    )
    p.add_argument("--save-chats", default=None, help="with --bench-prompts: also write those chats here")
    p.add_argument(
        "--holdout", type=float, default=0.05, help="the training run's held-out share (its seed 0)"
    )
    p.add_argument("--max-chats", type=int, default=30)
    p.add_argument("--nodes", default="16,32,64")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--tag", default="")
    a = p.parse_args(argv)
    from specsplit.models import load_model
    from specsplit.runtime.heads import (
        POOL_PER_NODE,
        GuessPool,
        choice_layout,
        choice_paths,
        load_heads,
        pick_guess_tree,
    )

    model = load_model(a.target, dtype=a.dtype, device=a.device)
    model.requires_grad_(False)
    heads, info = load_heads(a.heads, a.device, model.get_output_embeddings().weight.dtype)
    if a.chats:
        chats = _chats(a.chats)
        random.Random(0).shuffle(chats)  # the split train_heads makes
        held = chats[: max(1, int(len(chats) * a.holdout))][: a.max_chats]
    else:
        held = bench_chats(model, a.target, a.bench_prompts)
        if a.save_chats:
            Path(a.save_chats).write_text("".join(json.dumps(vars(c)) + "\n" for c in held))
    t0 = time.perf_counter()
    logp, rank = rank_rows(model, heads, held, len(info.rank_accuracy[0]))
    k, ranks = heads.num_heads, logp.shape[-1] - 1
    rows = rank.tolist()
    top = torch.arange(ranks).expand(k, ranks)  # "tokens" are ranks
    result: dict[str, dict[str, float]] = {}
    for n in (int(x) for x in a.nodes.split(",")):
        slots, parents, _ = choice_layout(ranks, choice_paths(info.rank_accuracy, n))
        static_tokens = [s % ranks for s in slots]
        pool_paths = choice_paths(info.rank_accuracy, n * POOL_PER_NODE)
        pool = GuessPool.build(pool_paths, k, ranks, torch.device("cpu"))
        nodes = min(n, len(pool_paths))
        dyn = 0
        for i, truth in enumerate(rows):
            packed = pick_guess_tree(logp[i], top, pool, nodes).tolist()
            dyn += accepted(packed[:nodes], packed[nodes : 2 * nodes], truth)
        stat = sum(accepted(static_tokens, parents, truth) for truth in rows)
        result[str(n)] = {"static": stat / len(rows), "dynamic": dyn / len(rows)}
        print(f"{n} nodes: static {stat / len(rows):.3f}, dynamic {dyn / len(rows):.3f} guesses a round")
    if a.eagle:
        for n, v in eagle_accepted(model, a.eagle, held, k, [int(x) for x in a.nodes.split(",")]).items():
            result[str(n)]["eagle"] = v
            print(f"{n} nodes: EAGLE {v:.3f} guesses a round")
    lines = [
        f"# Guess trees of draft heads: static against dynamic ({a.heads}, {len(held)} {'held-out chats' if a.chats else 'answers to bench prompts'}, "
        f"{len(rows)} rows)",
        "",
        f"- command: `python benchmarks/heads_trees.py --heads {a.heads} "
        + (f"--eagle {a.eagle} " if a.eagle else "")
        + (
            f"--chats {a.chats} --holdout {a.holdout} --max-chats {a.max_chats}"
            if a.chats
            else f"--bench-prompts {a.bench_prompts}"
        )
        + f" --nodes {a.nodes} --dtype {a.dtype} --device {a.device}"
        + (f" --tag {a.tag}" if a.tag else "")
        + "`",
        f"- date: {time.strftime('%Y-%m-%d')}; torch {torch.__version__}; {time.perf_counter() - t0:.0f} s",
        "",
        "| tree nodes | static: guesses accepted a round | dynamic | dynamic / static |"
        + (f" EAGLE ({a.eagle}) | EAGLE / dynamic |" if a.eagle else ""),
        "|---:|---:|---:|---:|" + ("---:|---:|" if a.eagle else ""),
    ]
    lines += [
        f"| {n} | {r['static']:.3f} | {r['dynamic']:.3f} | {r['dynamic'] / r['static']:.3f} |"
        + (f" {r['eagle']:.3f} | {r['eagle'] / r['dynamic']:.3f} |" if "eagle" in r else "")
        for n, r in result.items()
    ]
    stem = "heads_trees" + (f"-{a.tag}" if a.tag else "")
    OUT.mkdir(exist_ok=True)
    (OUT / f"{stem}.md").write_text("\n".join(lines) + "\n")
    (OUT / f"{stem}.json").write_text(
        json.dumps({"rows": len(rows), "chats": len(held), "accepted": result}, indent=1)
    )
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
