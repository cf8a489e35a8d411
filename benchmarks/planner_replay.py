#!/usr/bin/env python
"""The n-gram round planner replayed over recorded greedy answers, under a fixed cost profile.

A planner change is judged here without a GPU and without timing noise: the real round loop
(:func:`specsplit.pipeline.decode`, with its :class:`~specsplit.engines.cost_model.CostModel`) runs
against a stand-in target that accepts exactly what the recorded greedy answer says, and every
round is charged the profile's seconds (by default a one-token step of 3.85 ms, a verification
growing 2.3% a node and 0.5 ms of host work a tree round: the H200's plain-graph figures of
``results/h200-2026-11-28-drafters-2``). The planner is given the same profile, so only its
acceptance estimates decide. ``--oracle`` replaces the planner with one that knows, each round,
how many nodes of each tree size the answer would accept: the most any planner could get from
these proposals at this profile. ``--propose-ms`` (``--propose-match-ms`` when a proposal matched)
also charges the drafter's host work on every round the loop asks it for a proposal, tree round or
not: a generation that stops proposing saves it.

    python benchmarks/planner_replay.py record            # greedy fp32 answers of the bench prompts
    python benchmarks/planner_replay.py replay [--oracle] [--host-ms 0.5] [--propose-ms 0.07 --propose-match-ms 0.26]

``record`` runs HF ``generate()`` on a CPU (4 prompts a category, 128 tokens; ~30 s a prompt on 2
cores) into ``results/planner_replay-answers.jsonl``. Projected ratios are a model of a GPU run,
not a measurement: speed claims come from ``specsplit bench``.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

ANSWERS = Path(__file__).resolve().parent / "results" / "planner_replay-answers.jsonl"


def record(
    target: str, per_category: int, new_tokens: int, threads: int | None, path: Path = ANSWERS
) -> None:
    from specsplit.bench.run import DEFAULT_PROMPTS, load_prompts, tokenize_prompts
    from specsplit.models import load_model, load_tokenizer

    if threads:
        torch.set_num_threads(threads)
    tok = load_tokenizer(target)
    model = load_model(target, dtype=torch.float32).eval()
    prompts = load_prompts(DEFAULT_PROMPTS, per_category)
    tokenize_prompts(prompts, tok)
    with path.open("w") as f:
        for p in prompts:
            t0 = time.perf_counter()
            with torch.no_grad():
                out = model.generate(
                    torch.tensor([p.input_ids]),
                    max_new_tokens=new_tokens,
                    do_sample=False,
                    repetition_penalty=1.0,
                )
            new = out[0, len(p.input_ids) :].tolist()
            f.write(
                json.dumps({"id": p.id, "category": p.category, "prompt": p.input_ids, "new": new}) + "\n"
            )
            print(f"{p.id}: {len(new)} tokens in {time.perf_counter() - t0:.1f} s", flush=True)


def accepted(proposal: Any, answer: Sequence[int]) -> int:
    """Nodes of ``proposal`` a greedy verification accepts when the target goes on with ``answer``:
    those whose root path equals the answer's tokens it covers (at most one per depth)."""
    ok: list[bool] = []
    for tok, parent, depth in zip(proposal.token_ids, proposal.parents, proposal.depths, strict=True):
        ok.append(depth <= len(answer) and (parent < 0 or ok[parent]) and tok == answer[depth - 1])
    return sum(ok)


class _Answer:
    """A target that accepts what the recorded answer says and charges the profile's seconds."""

    has_draft = False

    def __init__(self, prompt: list[int], new: list[int], cost: Any):
        self.prompt, self.new, self.cost = prompt, new, cost
        self.seconds, self.pos = 0.0, 0

    def verify(self, req: Any) -> Any:
        from specsplit.messages import VerifyResult

        tree = req.tree
        pos = req.expected_prefix_length + len(req.pending_token_ids) - len(self.prompt)
        toks, parents = tree.token_ids.tolist(), tree.parents.tolist()
        path: list[int] = []
        row = -1
        while pos + len(path) < len(self.new):  # greedy: the first child that matches, level by level
            want = self.new[pos + len(path)]
            kid = next(
                (i for i, (t, p) in enumerate(zip(toks, parents, strict=True)) if p == row and t == want),
                None,
            )
            if kid is None:
                break
            path.append(kid)
            row = kid
        end = pos + len(path)
        self.pos = end + 1
        self.seconds += self.cost(len(toks))
        nxt = self.new[end] if end < len(self.new) else 0
        prefix = req.expected_prefix_length + len(req.pending_token_ids) + len(path)
        return VerifyResult(
            [toks[i] for i in path], nxt, path, prefix, max(tree.depths.tolist(), default=0), len(toks)
        )

    def end_session(self, session_id: str) -> None:
        pass


def replay(
    mode: str,
    step_ms: float,
    per_node: float,
    host_ms: float,
    oracle: bool,
    path: Path = ANSWERS,
    propose_ms: float = 0.0,
    match_ms: float | None = None,
) -> dict[str, Any]:
    from specsplit.engines.cost_model import CostModel, FixedCosts, RoundPlan
    from specsplit.engines.drafters import NgramDrafter, NgramSession

    def cost(n: int) -> float:
        return step_ms * 1e-3 * (1 + per_node * n) + (host_ms * 1e-3 if n else 0.0)

    answers = [json.loads(line) for line in path.open()]
    planner = CostModel(mode, 0, 32, padded=True, costs=FixedCosts(fixed=0.0, verify=cost))
    drafter = NgramDrafter(suffix=mode == "suffix")
    state: dict[str, Any] = {}
    propose = NgramSession.propose
    miss_s, hit_s = propose_ms * 1e-3, (propose_ms if match_ms is None else match_ms) * 1e-3

    def remember(self: NgramSession) -> Any:  # every proposal the loop asks for costs host time
        state["proposal"] = p = propose(self)
        state["target"].seconds += hit_s if p.num_nodes else miss_s
        return p

    NgramSession.propose = remember  # type: ignore[method-assign]
    if oracle:

        def best(scores: Any, model_available: bool) -> RoundPlan:
            p, target = state["proposal"], state["target"]
            truth = target.new[target.pos : target.pos + 64]
            plan = RoundPlan(False, 0, 1.0, cost(0))
            for size in planner.sizes if p.num_nodes else ():
                arm = RoundPlan(False, size, 1.0 + accepted(p.top(size), truth), cost(size))
                if arm.expected / arm.seconds > plan.expected / plan.seconds:
                    plan = arm
                if size >= p.num_nodes:
                    break
            return plan

        planner.plan = best  # type: ignore[method-assign]
    by: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0, 0])
    try:
        _run(answers, mode, planner, drafter, cost, state, by)
    finally:
        NgramSession.propose = propose  # type: ignore[method-assign]
    total = sum(b[1] for b in by.values()) / sum(b[0] for b in by.values())
    return {
        "overall": round(total, 3),
        "categories": {
            c: {"x": round(b[1] / b[0], 3), "tree_rounds": b[3], "rounds": b[2]}
            for c, b in sorted(by.items())
        },
    }


def _run(answers: list[dict[str, Any]], mode: str, planner: Any, drafter: Any, cost: Any, state: dict[str, Any],
         by: dict[str, list[float]]) -> None:  # fmt: skip
    from specsplit.pipeline.loop import decode
    from specsplit.pipeline.params import DecodeParams

    for measured in (False, True):  # a warm-up pass teaches the planner, as the bench's warm-up does
        for a in answers:
            drafter.clear()
            target = state["target"] = _Answer(a["prompt"], a["new"], cost)
            params = DecodeParams(max_new_tokens=len(a["new"]), drafter=mode, ngram=drafter, cost=planner)
            out, stats = decode(target, a["prompt"], params)  # type: ignore[arg-type]
            assert out == a["new"], f"{a['id']}: the loop committed something the answer does not say"
            if measured:
                b = by[a["category"]]
                b[0] += target.seconds
                b[1] += len(out) * cost(0)
                b[2] += len(stats.rounds)
                b[3] += sum(1 for r in stats.rounds if r.tree_nodes)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="record greedy fp32 answers of the bench prompts (CPU)")
    r.add_argument("--target", default="qwen2.5-coder-1.5b")
    r.add_argument("--prompts-per-category", type=int, default=4)
    r.add_argument("--max-new-tokens", type=int, default=128)
    r.add_argument("--threads", type=int, default=None)
    q = sub.add_parser("replay", help="project the planner's tokens/s against target-only decoding")
    q.add_argument("--drafter", default="ngram", choices=["ngram", "suffix"])
    q.add_argument("--step-ms", type=float, default=3.85, help="a one-token step")
    q.add_argument(
        "--per-node", type=float, default=0.023, help="a verification's growth a node, as a share of a step"
    )
    q.add_argument("--host-ms", type=float, default=0.5, help="host work a tree round adds")
    q.add_argument(
        "--propose-ms",
        type=float,
        default=0.0,
        help="host work of every proposal the loop asks the drafter for (any round, tree or not)",
    )
    q.add_argument(
        "--propose-match-ms",
        type=float,
        default=None,
        help="the same for a proposal that matched (default: --propose-ms)",
    )
    q.add_argument(
        "--oracle", action="store_true", help="a planner that knows what each tree would get accepted"
    )
    for sp in (r, q):
        sp.add_argument("--answers", type=Path, default=ANSWERS, help="the recorded answers (JSON lines)")
    a = p.parse_args(argv)
    if a.cmd == "record":
        record(a.target, a.prompts_per_category, a.max_new_tokens, a.threads, a.answers)
    else:
        result = replay(
            a.drafter, a.step_ms, a.per_node, a.host_ms, a.oracle, a.answers, a.propose_ms, a.propose_match_ms
        )
        print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
