"""An int8 draft on the CPU: what a draft step costs, and how often it still picks the target's token.

    python benchmarks/draft_quant.py [--draft qwen2.5-coder-0.5b] [--threads 2] [--tag cpu-2core]

On a CPU a draft step is bound by reading its weights, so int8 weights (specsplit.runtime.int8) make
it cheaper; what they can cost is acceptance. This script times the draft's cached forward of 1 and 4
rows (the steps of a chain and of a dynamic tree's levels) with its float32 weights packed as the
engines pack them and with int8 weights, and measures on the target's own recorded greedy answers
(benchmarks/results/planner_replay-answers.jsonl: 28 prompts, 7 categories) how often each draft's
greedy choice is the target's next token (teacher-forced), and how often the two drafts agree.

Writes benchmarks/results/draft_quant-<tag>.{md,json}.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import time
from datetime import date
from pathlib import Path

import torch

from specsplit.models import load_model
from specsplit.runtime.int8 import quantize_linears
from specsplit.runtime.packed import pack_linears

HERE = Path(__file__).resolve().parent
ANSWERS = HERE / "results" / "planner_replay-answers.jsonl"


@torch.inference_mode()
def step_ms(model: torch.nn.Module, context: int, rows: int, repeats: int) -> float:
    """Median ms of a cached forward of ``rows`` new tokens after ``context`` cached ones."""
    g = torch.Generator().manual_seed(0)
    past = model(torch.randint(0, 1000, (1, context), generator=g), use_cache=True).past_key_values
    x = torch.randint(0, 1000, (1, rows), generator=g)
    times = []
    for _ in range(repeats + 1):
        cache = copy.deepcopy(past)  # every step appends to the same context length
        t0 = time.perf_counter()
        model(x, past_key_values=cache, use_cache=True)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times[1:])


@torch.inference_mode()
def layer_rows(model: torch.nn.Module, rows: list[int], repeats: int) -> dict[str, dict[int, float]]:
    """Median ms of the model's largest hidden layer over ``rows`` rows: packed float32 against the
    int8 kernel (where the two cross sets ``specsplit.runtime.int8.DENSE_ROWS``)."""
    from specsplit.runtime.int8 import Int8Linear
    from specsplit.runtime.packed import PackedLinear

    big = max((m for m in model.modules() if type(m) is torch.nn.Linear and m is not model.get_output_embeddings()),
              key=lambda m: m.weight.numel())  # fmt: skip
    layers = {"float32 packed": PackedLinear(big), "int8": Int8Linear(big, dense_rows=None)}
    out: dict[str, dict[int, float]] = {}
    for name, layer in layers.items():
        out[name] = {}
        for n in rows:
            x = torch.randn(n, big.in_features)
            layer(x)
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                layer(x)
                times.append(time.perf_counter() - t0)
            out[name][n] = 1e3 * statistics.median(times)
    return out


@torch.inference_mode()
def agreement(models: dict[str, torch.nn.Module]) -> dict[str, dict[str, float]]:
    """Per category: each model's greedy hit rate on the answers, and the share of positions where the
    two models pick the same token."""
    names = list(models)
    counts: dict[str, list[int]] = {}
    for line in ANSWERS.read_text().splitlines():
        row = json.loads(line)
        new = row["new"]
        ids = torch.tensor([row["prompt"] + new])
        picks = [m(ids).logits[0, -len(new) - 1 : -1].argmax(-1) for m in models.values()]
        want = torch.tensor(new)
        c = counts.setdefault(row["category"], [0, 0, 0, 0])
        c[0] += int((picks[0] == want).sum())
        c[1] += int((picks[1] == want).sum())
        c[2] += int((picks[0] == picks[1]).sum())
        c[3] += len(new)
    counts["all"] = [sum(c[i] for c in counts.values()) for i in range(4)]
    return {
        cat: {
            f"{names[0]} hits": c[0] / c[3],
            f"{names[1]} hits": c[1] / c[3],
            "agree": c[2] / c[3],
            "tokens": c[3],
        }
        for cat, c in counts.items()
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=160, help="cached tokens before the timed step")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--tag", default="cpu")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dense = load_model(args.draft, dtype=torch.float32, device="cpu")
    row_list = [1, 2, 4, 6, 8, 16, 32, 64, 160]
    by_rows = layer_rows(dense, row_list, 4 * args.repeats)
    q8 = copy.deepcopy(dense)
    quantize_linears(q8)
    pack_linears(dense)
    models = {"float32 packed": dense, "int8": q8}
    steps = {
        name: {f"{rows} rows": step_ms(m, args.context, rows, args.repeats) for rows in (1, 4)}
        for name, m in models.items()
    }
    agree = agreement(models)
    result = {
        "draft": args.draft,
        "machine": f"{platform.processor() or platform.machine()}, {args.threads} threads",
        "date": str(date.today()),
        "command": f"python benchmarks/draft_quant.py --draft {args.draft} --threads {args.threads} "
        f"--context {args.context} --repeats {args.repeats} --tag {args.tag}",
        "torch": torch.__version__,
        "step_ms": steps,
        "layer_ms_by_rows": by_rows,
        "agreement": agree,
    }
    lines = [
        f"# int8 draft on the CPU: {args.draft}",
        "",
        f"{result['date']}, {result['machine']}, torch {torch.__version__}. Command: `{result['command']}`",
        "",
        f"Cached forward after {args.context} tokens, ms (median of {args.repeats}):",
        "",
        "| weights | 1 row | 4 rows |",
        "|---|---:|---:|",
        *(f"| {n} | {s['1 rows']:.1f} | {s['4 rows']:.1f} |" for n, s in steps.items()),
        "",
        "The draft's largest hidden layer, ms a call by rows (median):",
        "",
        "| weights | " + " | ".join(str(n) for n in row_list) + " |",
        "|---|" + "---:|" * len(row_list),
        *(f"| {n} | " + " | ".join(f"{ms[r]:.2f}" for r in row_list) + " |" for n, ms in by_rows.items()),
        "",
        "Greedy choice against the target's recorded answers (teacher-forced):",
        "",
        "| category | tokens | float32 draft hits | int8 draft hits | the two agree |",
        "|---|---:|---:|---:|---:|",
        *(
            f"| {cat} | {a['tokens']} | {a['float32 packed hits']:.3f} | {a['int8 hits']:.3f} | {a['agree']:.3f} |"
            for cat, a in agree.items()
        ),
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"draft_quant-{args.tag}.md").write_text(text)
    (args.out / f"draft_quant-{args.tag}.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
