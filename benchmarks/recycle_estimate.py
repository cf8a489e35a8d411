#!/usr/bin/env python
"""How many tokens a round could a Token-Recycling-style drafter commit on the bench's answers?

Token Recycling keeps, for every token, the target's top-k next tokens from the last forward that
scored a position holding it, and drafts a tree by walking that table from the pending token
(a static tree shape; no draft model, a few gathers). This script estimates its tokens a round
(tau) on this pair without building it: one teacher-forced forward of the fp32 target over each
recorded greedy answer (``results/planner_replay-answers.jsonl``) gives the top-k at every
position; a round then walks the table from the last committed token along a best-first static
tree of ``n`` nodes (a node's value is the product of its ranks' hit rates, measured first), the
answer says how deep it holds, and the table is refreshed from the positions the round verified
on the answer's path. The real method also refreshes it from the nodes that failed (other
contexts), which this walk cannot see, so treat the estimate as a floor.

    python benchmarks/recycle_estimate.py record     # top-k of the fp32 target (~3 s a prompt on 2 cores)
    python benchmarks/recycle_estimate.py estimate   # tau by tree size, per category

What a round gains also depends on what its tree costs (RESULTS, "Drafters on one H200": a 16-node
round ~1.29x a plain step with plain graphs), so tau near that ratio gains nothing.
"""

from __future__ import annotations

import argparse
import heapq
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
ANSWERS = RESULTS / "planner_replay-answers.jsonl"


def record(target: str, answers: Path, out: Path, k: int) -> None:
    import torch

    from specsplit.models import load_model

    model = load_model(target, dtype=torch.float32).eval()
    with out.open("w") as f, torch.inference_mode():
        for line in answers.open():
            r = json.loads(line)
            ids = r["prompt"] + r["new"]
            top = model(torch.tensor([ids])).logits[0].topk(k, dim=-1).indices.tolist()
            f.write(json.dumps({**r, "top": top}) + "\n")
            print(r["id"], len(ids), flush=True)


def _template(p_rank: list[float], n: int) -> list[tuple[int, int]]:
    """A best-first static tree of ``n`` nodes, ``(parent, rank)`` each (parent -1: the root)."""
    k = len(p_rank)
    nodes: list[tuple[int, int]] = []
    heap = [(-p_rank[r], -1, r) for r in range(k)]
    heapq.heapify(heap)
    while heap and len(nodes) < n:
        v, parent, r = heapq.heappop(heap)
        nodes.append((parent, r))
        for r2 in range(k):
            heapq.heappush(heap, (v * p_rank[r2], len(nodes) - 1, r2))
    return nodes


def _walk(rows: list[dict[str, Any]], tree: list[tuple[int, int]]) -> tuple[dict[str, list[int]], list[int]]:
    """Replays every answer: ``({category: [tokens, rounds]}, root rank hits)``."""
    k = len(rows[0]["top"][0])
    by: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    hits = [0] * (k + 1)  # rank of the answer's next token in the root's table entry (k: absent)
    for r in rows:
        table: dict[int, list[int]] = {}
        ids, top, n_prompt = r["prompt"] + r["new"], r["top"], len(r["prompt"])
        for p in range(n_prompt):  # the prompt's forward fills the table
            table[ids[p]] = top[p]
        t, rounds = 1, 0  # the first new token comes from the prompt's forward
        while t < len(r["new"]):
            last = ids[n_prompt + t - 1]
            toks: list[int | None] = []
            for parent, rank in tree:
                src = last if parent < 0 else toks[parent]
                entry = table.get(src) if src is not None else None
                toks.append(entry[rank] if entry is not None else None)
            acc, node = 0, -1
            while n_prompt + t + acc < len(ids):
                want = ids[n_prompt + t + acc]
                nxt = next((i for i, (p, _) in enumerate(tree) if p == node and toks[i] == want), None)
                if nxt is None:
                    break
                node, acc = nxt, acc + 1
            entry = table.get(last)
            want = ids[n_prompt + t]
            hits[entry.index(want) if entry is not None and want in entry else k] += 1
            for q in range(n_prompt + t - 1, min(n_prompt + t + acc, len(ids))):
                table[ids[q]] = top[q]
            t, rounds = t + acc + 1, rounds + 1
        by[r["category"]][0] += len(r["new"]) - 1
        by[r["category"]][1] += rounds
    return by, hits


def estimate(path: Path, sizes: list[int]) -> dict[str, Any]:
    rows = [json.loads(line) for line in path.open()]
    k = len(rows[0]["top"][0])
    _, hits = _walk(rows, _template([1.0 / (r + 1) for r in range(k)], 1))
    p_rank = [h / sum(hits) for h in hits[:k]]
    out: dict[str, Any] = {"root_rank_hit_rates": [round(p, 3) for p in p_rank],
                           "root_miss": round(hits[k] / sum(hits), 3), "tau": {}}  # fmt: skip
    for n in sizes:
        by, _ = _walk(rows, _template(p_rank, n))
        total = sum(v[0] for v in by.values()) / sum(v[1] for v in by.values())
        out["tau"][n] = {
            "overall": round(total, 2),
            **{c: round(v[0] / v[1], 2) for c, v in sorted(by.items())},
        }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("--target", default="qwen2.5-coder-1.5b")
    r.add_argument("--answers", type=Path, default=ANSWERS)
    r.add_argument("--k", type=int, default=8)
    e = sub.add_parser("estimate")
    e.add_argument("--sizes", default="4,8,16,32,64")
    for sp in (r, e):
        sp.add_argument("--topk-file", type=Path, default=Path("/tmp/recycle_topk.jsonl"))
    a = ap.parse_args(argv)
    if a.cmd == "record":
        record(a.target, a.answers, a.topk_file, a.k)
    else:
        print(json.dumps(estimate(a.topk_file, [int(x) for x in a.sizes.split(",")]), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
