#!/usr/bin/env python
"""What an EAGLE head's guesses add to a round, by context and prompt: the data of ``GuessPolicy``.

Generates greedy answers to the bench's prompts (a few a category) with the n-gram drafter and an
EAGLE head (``--heads``, `specsplit heads train --kind eagle`) growing guesses in every round, and
records, for every round that verified guesses, their gain (accepted tokens past the longest
accepted run of the round's other nodes) under the context they were grown in
(:meth:`~specsplit.engines.ab_policy.GuessPolicy.context`), exactly as ``guess_policy="adaptive"``
sees them. With ``--adaptive COST`` it then runs the same prompts under the adaptive policy with
that cost in tokens and reports how many rounds grew and whether the outputs matched. No GPU is
needed: acceptance does not depend on the device.

    python benchmarks/guess_gain.py --target smollm2-135m --heads DIR [--per-category 2]
        [--max-new-tokens 96] [--adaptive 0.5] [--tag cpu-2core-smollm2]
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import torch

OUT = Path(__file__).resolve().parent / "results"
PROMPTS = Path(__file__).resolve().parent / "prompts"


def _config(heads: str, policy: str, cost: float | None):
    from specsplit.config import EngineTuning, NgramConfig, PipelineTuning, SpecSplitConfig, TargetConfig

    target = TargetConfig(cuda_graphs=True, draft_heads=heads, draft_heads_nodes=32,
                          tuning=EngineTuning(graph_capacity=2048))  # fmt: skip
    ngram = NgramConfig(lookahead=0, lookahead_policy="always", guess_policy=policy, guess_cost_tokens=cost)
    return SpecSplitConfig(drafter="ngram", tuning=PipelineTuning(ngram=ngram), target=target)


def _run(model, heads, prompts, max_new, policy, cost, record):
    from specsplit import SpecSplitGenerator

    rows, seqs = [], {}
    with SpecSplitGenerator(model, None, config=_config(heads, policy, cost)) as gen:
        head = gen.target_engine.heads
        grown = [0]
        grow = head.round_guesses

        def counted(*a):
            grown[0] += 1
            return grow(*a)

        head.round_guesses = counted
        for pid, cat, ids in prompts:
            record.clear()
            grown[0] = 0
            out = gen.generate(torch.tensor([ids]), max_new_tokens=max_new, return_dict_in_generate=True)
            rounds = out.spec_stats.rounds
            seqs[pid] = out.sequences[0].tolist()
            by: dict[int, list[int]] = defaultdict(list)
            for c, g in record:
                by[c].append(g)
            rows.append({"id": pid, "category": cat, "rounds": len(rounds), "grown": grown[0],
                         "tau": sum(r.committed for r in rounds) / max(len(rounds), 1),
                         "gains": {str(c): v for c, v in sorted(by.items())}})  # fmt: skip
            print(policy, pid, f"rounds {len(rounds)} grown {grown[0]} tau {rows[-1]['tau']:.2f}", flush=True)
    return rows, seqs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--heads", required=True, help="an EAGLE head directory of the target")
    p.add_argument("--per-category", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument(
        "--adaptive", type=float, default=None, metavar="COST", help="also run the adaptive policy"
    )
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tag", default="")
    p.add_argument("--out", default=str(OUT))
    a = p.parse_args(argv)
    from specsplit.engines.ab_policy import GuessPolicy
    from specsplit.models import load_model, load_tokenizer

    torch.set_num_threads(a.threads)
    model = load_model(a.target, dtype="float32", device="cpu")
    tok = load_tokenizer(a.target)
    prompts = []
    for f in sorted(PROMPTS.glob("*.jsonl")):
        for line in f.read_text().splitlines()[: a.per_category]:
            q = json.loads(line)
            ids = tok.apply_chat_template(
                q["messages"], add_generation_prompt=True, tokenize=True, return_dict=True
            )
            prompts.append((q["id"], q["category"], list(ids["input_ids"])))
    record: list[tuple[int, int]] = []
    original = GuessPolicy.record_gain

    def recording(self, context: int, gain: int) -> None:
        record.append((context, gain))
        original(self, context, gain)

    GuessPolicy.record_gain = recording  # type: ignore[method-assign]
    t0 = time.time()
    # every round grows (an adaptive policy that never skips), so every round's gain is seen
    always_grow = GuessPolicy.grow
    GuessPolicy.grow = lambda self, context: True  # type: ignore[method-assign]
    rows, seqs = _run(model, a.heads, prompts, a.max_new_tokens, "adaptive", 0.0, record)
    GuessPolicy.grow = always_grow  # type: ignore[method-assign]
    report: dict = {"target": a.target, "heads": a.heads, "max_new_tokens": a.max_new_tokens,
                    "per_category": a.per_category, "date": time.strftime("%Y-%m-%d"),
                    "torch": torch.__version__, "grow_every_round": rows}  # fmt: skip
    if a.adaptive is not None:
        arows, aseqs = _run(model, a.heads, prompts, a.max_new_tokens, "adaptive", a.adaptive, record)
        report["adaptive"] = {"cost_tokens": a.adaptive, "rounds": arows,
                              "same_outputs": all(aseqs[k] == seqs[k] for k in seqs)}  # fmt: skip
    report["seconds"] = time.time() - t0
    lines = [f"# Guess gain by context ({a.target}, {a.heads})", "",
             f"- command: `python benchmarks/guess_gain.py --target {a.target} --heads {a.heads} --per-category "
             f"{a.per_category} --max-new-tokens {a.max_new_tokens}"
             + (f" --adaptive {a.adaptive}" if a.adaptive is not None else "") + f" --tag {a.tag}`",
             f"- date: {report['date']}; torch {torch.__version__}; CPU, float32, {a.threads} thread(s)", "",
             "Tokens a round's guesses added (accepted past the other nodes' longest accepted run), by the",
             "context they were grown in (how far the other nodes alone reached the round before), every",
             "round growing guesses:", "",
             "| category | rounds | tau | context 0 (<2): rounds, mean gain | context 1 (2-3) | context 2 (>=4) |",
             "|---|---:|---:|---|---|---|"]  # fmt: skip
    cats: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        cats[r["category"]].append(r)
    total: dict[str, list[int]] = defaultdict(list)

    def cell(gains: list[int]) -> str:
        return f"{len(gains)}, {sum(gains) / len(gains):.2f}" if gains else "0, –"

    for cat, rs in cats.items():
        g: dict[str, list[int]] = defaultdict(list)
        for r in rs:
            for c, v in r["gains"].items():
                g[c] += v
                total[c] += v
        n = sum(r["rounds"] for r in rs)
        tau = sum(r["tau"] * r["rounds"] for r in rs) / max(n, 1)
        lines.append(f"| {cat} | {n} | {tau:.2f} | {cell(g['0'])} | {cell(g['1'])} | {cell(g['2'])} |")
    lines.append(f"| **all** | {sum(r['rounds'] for r in rows)} | | {cell(total['0'])} | {cell(total['1'])} | "
                 f"{cell(total['2'])} |")  # fmt: skip
    if a.adaptive is not None:
        ad = report["adaptive"]
        grown = sum(r["grown"] for r in ad["rounds"])
        n = sum(r["rounds"] for r in ad["rounds"])
        lines += ["", f"Adaptive, cost {a.adaptive} tokens: {grown} of {n} rounds grew guesses; outputs equal to "
                  f"the every-round run: {ad['same_outputs']}."]  # fmt: skip
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"guess_gain-{a.tag}" if a.tag else "guess_gain"
    (out / f"{name}.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
