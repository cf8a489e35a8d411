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

**With the draft model** (``auto`` and ``model`` drafting, for a draft that is cheap beside its
target: the CPU's int8 draft). ``record-draft`` runs the draft over each recorded answer once,
teacher-forced, and keeps at every position whether its greedy token is the answer's and the
probability it gave that token (``results/planner_replay-draft.json``). A chain drafted from a
position then holds exactly as far as those flags say, and stops where a confidence floor would
stop it (after the mismatch the confidences of the teacher-forced context stand in for the
draft's own). ``replay-model`` runs the loop against that target and draft on a virtual clock:
nothing is injected, the planner measures every cost from the charged seconds as it would on a
machine (the default profile, in one-token steps: a verification +4.5% a node, a draft forward
0.24 of a step, the draft's prompt 0.012 of a step a token: the 2-core CPU's figures of
``results/cpu-2core-2026-11-29-*``). ``--quick`` takes the first prompt of each category and 32
tokens, and warms the planner up with one short call, as ``specsplit bench --suite quick`` does.

    python benchmarks/planner_replay.py record-draft [--quantize int8] [--threads 2]
    python benchmarks/planner_replay.py replay-model [--drafter auto|model|suffix|ngram] [--quick] [--repeats 2]
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
DRAFTED = Path(__file__).resolve().parent / "results" / "planner_replay-draft.json"


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


def record_draft(
    draft: str, quantize: str, threads: int | None, answers: Path = ANSWERS, path: Path = DRAFTED
) -> None:
    """The draft's teacher-forced greedy hits and confidences along every recorded answer."""
    from specsplit.models import load_model
    from specsplit.runtime.int8 import quantize_linears

    if threads:
        torch.set_num_threads(threads)
    model = load_model(draft, dtype=torch.float32).eval()
    if quantize == "int8":
        quantize_linears(model)
    rows = []
    for a in (json.loads(line) for line in answers.open()):
        n = len(a["new"])
        with torch.no_grad():
            logits = model(torch.tensor([a["prompt"] + a["new"]])).logits[0, -n - 1 : -1]
        p, top = logits.float().softmax(-1).max(-1)
        hits = (top == torch.tensor(a["new"])).tolist()
        rows.append({"id": a["id"], "hit": [int(h) for h in hits], "p": [round(x, 3) for x in p.tolist()]})
        print(f"{a['id']}: draft hits {sum(hits)}/{n}", flush=True)
    path.write_text(json.dumps({"draft": draft, "quantize": quantize, "rows": rows}) + "\n")


class _Clock:
    """The loop's clock during a replay: it moves by what the stand-ins charge."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class _AnswerAndDraft(_Answer):
    """A target as :class:`_Answer` and a chain draft that holds as far as the recorded hits say."""

    has_draft = True

    def __init__(self, a: dict[str, Any], drafted: dict[str, Any], clock: _Clock, prof: dict[str, float],
                 chain: int, floor: float, model: bool) -> None:  # fmt: skip
        super().__init__(a["prompt"], a["new"], lambda n: prof["step"] * (1 + prof["node"] * n))
        self.hits, self.p = drafted["hit"], drafted["p"]
        self.clock, self.prof, self.chain, self.floor = clock, prof, chain, floor
        self.has_draft = model

    def verify(self, req: Any) -> Any:
        before = self.seconds
        res = super().verify(req)
        self.clock.now += self.seconds - before
        return res

    def draft(self, req: Any) -> Any:
        from specsplit.core.tree import TokenTree
        from specsplit.messages import DraftResult

        pos = req.prefix_length + len(req.new_token_ids) - len(self.prompt)
        toks: list[int] = []
        for j in range(pos, min(pos + self.chain, len(self.new))):
            toks.append(self.new[j] if self.hits[j] else -1)  # a miss: a token no answer holds
            if self.p[j] < self.floor:
                break
        prof, rows = self.prof, len(req.new_token_ids)
        cost = prof["level"] * max(len(toks), 1)
        cost += prof["draft_prompt"] * rows if req.prefix_length == 0 else prof["row"] * (rows - 1)
        self.seconds += cost * prof["step"]
        self.clock.now += cost * prof["step"]
        k = len(toks)
        tree = TokenTree(torch.tensor(toks, dtype=torch.long), torch.arange(-1, k - 1),
                         torch.arange(1, k + 1), torch.zeros(k))  # fmt: skip
        tree.max_branch, tree.depth_bound = min(k, 1), k
        return DraftResult(tree, req.prefix_length + len(req.new_token_ids))


def replay_model(mode: str, drafted_path: Path = DRAFTED, answers: Path = ANSWERS, *, quick: bool = False,
                 repeats: int = 1, chain: int = 8, floor: float = 0.5, node: float = 0.045, level: float = 0.24,
                 draft_prompt: float = 0.012) -> dict[str, Any]:  # fmt: skip
    """Projected × target-only per category, the planner measuring costs on a virtual clock."""
    from specsplit.config import TreeConfig
    from specsplit.engines.cost_model import CostModel
    from specsplit.engines.drafters import NgramDrafter
    from specsplit.pipeline import loop
    from specsplit.pipeline.params import DecodeParams

    drafted = {r["id"]: r for r in json.loads(drafted_path.read_text())["rows"]}
    rows = [json.loads(line) for line in answers.open()]
    if quick:
        first: dict[str, dict[str, Any]] = {}
        for a in rows:
            first.setdefault(a["category"], {**a, "new": a["new"][:32]})
        rows = list(first.values())
    prof = {"step": 1.0, "node": node, "level": level, "draft_prompt": draft_prompt, "row": 0.02}
    tree = TreeConfig(shape="chain", num_draft_tokens=chain, min_confidence=floor)
    drafter = NgramDrafter(suffix=mode in ("suffix", "auto"))
    planner = CostModel(mode, tree.max_nodes, drafter.settings.max_nodes, padded=False)
    clock, real_time = _Clock(), loop.time
    warm = rows if not quick else [{**rows[0], "prompt": rows[0]["prompt"][-16:], "new": rows[0]["new"][:6]}]
    by: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0, 0])
    loop.time = clock  # type: ignore[assignment]
    try:
        for measured, batch in [(False, warm)] + [(True, rows)] * repeats:
            for a in batch:
                drafter.clear()  # as the bench: a prompt never drafts from its own earlier runs
                target = _AnswerAndDraft(
                    a, drafted[a["id"]], clock, prof, chain, floor, mode in ("auto", "model")
                )
                params = DecodeParams(max_new_tokens=len(a["new"]), drafter=mode, tree=tree, ngram=drafter,
                                      cost=planner)  # fmt: skip
                out, stats = loop.decode(target, a["prompt"], params)  # type: ignore[arg-type]
                assert out == a["new"], f"{a['id']}: the loop committed something the answer does not say"
                if measured:
                    b = by[a["category"]]
                    b[0] += target.seconds
                    b[1] += len(out) * prof["step"]
                    b[2] += len(stats.rounds)
                    b[3] += sum(1 for r in stats.rounds if r.drafter == "model")
    finally:
        loop.time = real_time  # type: ignore[assignment]
    return {
        "overall": round(sum(b[1] for b in by.values()) / sum(b[0] for b in by.values()), 3),
        "categories": {
            c: {"x": round(b[1] / b[0], 3), "model_rounds": b[3], "rounds": b[2]}
            for c, b in sorted(by.items())
        },
    }


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
    d = sub.add_parser("record-draft", help="record the draft's teacher-forced hits along the answers (CPU)")
    d.add_argument("--draft", default="qwen2.5-coder-0.5b")
    d.add_argument("--quantize", default="int8", choices=["int8", "none"])
    d.add_argument("--threads", type=int, default=None)
    m = sub.add_parser("replay-model", help="project auto / model drafting with the draft's recorded hits")
    m.add_argument("--drafter", default="auto", choices=["auto", "model", "suffix", "ngram"])
    m.add_argument("--quick", action="store_true", help="first prompt a category, 32 tokens, a short warm-up")
    m.add_argument("--repeats", type=int, default=1)
    m.add_argument("--chain", type=int, default=8, help="most tokens a chain drafts")
    m.add_argument("--floor", type=float, default=0.5, help="the chain's confidence floor")
    m.add_argument("--per-node", type=float, default=0.045, help="a verification's growth a node, in steps")
    m.add_argument("--draft-level", type=float, default=0.24, help="a draft forward, in steps")
    for sp in (d, m):
        sp.add_argument("--drafted", type=Path, default=DRAFTED, help="the draft's recorded hits (JSON)")
    for sp in (r, q, d, m):
        sp.add_argument("--answers", type=Path, default=ANSWERS, help="the recorded answers (JSON lines)")
    a = p.parse_args(argv)
    if a.cmd == "record":
        record(a.target, a.prompts_per_category, a.max_new_tokens, a.threads, a.answers)
    elif a.cmd == "record-draft":
        record_draft(a.draft, a.quantize, a.threads, a.answers, a.drafted)
    elif a.cmd == "replay-model":
        result = replay_model(a.drafter, a.drafted, a.answers, quick=a.quick, repeats=a.repeats, chain=a.chain,
                              floor=a.floor, node=a.per_node, level=a.draft_level)  # fmt: skip
        print(json.dumps(result, indent=1))
    else:
        result = replay(
            a.drafter, a.step_ms, a.per_node, a.host_ms, a.oracle, a.answers, a.propose_ms, a.propose_match_ms
        )
        print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
