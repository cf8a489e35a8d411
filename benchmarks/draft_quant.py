"""An int8 draft on the CPU: what a draft step costs, and how often it still picks the target's token.

    python benchmarks/draft_quant.py [--draft qwen2.5-coder-0.5b] [--threads 2] [--tag cpu-2core]

On a CPU a draft step is bound by reading its weights, so int8 weights (specsplit.runtime.int8) make
it cheaper; what they can cost is acceptance. This script times the draft's cached forward of 1 and 4
rows (the steps of a chain and of a dynamic tree's levels) and a prompt's forward, with its float32
weights packed as the engines pack them and with int8 weights under each int8 kernel the build has.
On the target's own recorded greedy answers (benchmarks/results/planner_replay-answers.jsonl: 28
prompts, 7 categories) it measures how often each draft's greedy choice is the target's next token,
and how often an int8 draft agrees with the float32 one. Each draft runs as the engines run it: the
prompt in one forward, then the answer fed back a few tokens a step through the cache (teacher-forced),
so every kernel sees the row counts it sees in a generation.

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
from specsplit.runtime import int8
from specsplit.runtime.int8 import quantize_linears
from specsplit.runtime.packed import pack_linears

HERE = Path(__file__).resolve().parent
ANSWERS = HERE / "results" / "planner_replay-answers.jsonl"
KERNELS = ["fbgemm", "int8pack"] if int8.fbgemm_available() else ["int8pack"]


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
def prompt_ms(model: torch.nn.Module, context: int, repeats: int) -> float:
    """Median ms of a prompt's forward of ``context`` tokens (no cache before it)."""
    x = torch.randint(0, 1000, (1, context), generator=torch.Generator().manual_seed(1))
    times = []
    for _ in range(max(2, repeats // 3) + 1):
        t0 = time.perf_counter()
        model(x, use_cache=True, logits_to_keep=1)  # as the engines: the last position's logits only
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times[1:])


@torch.inference_mode()
def layer_rows(model: torch.nn.Module, rows: list[int], repeats: int) -> dict[str, dict[int, float]]:
    """Median ms of the model's largest hidden layer over ``rows`` rows: packed float32 against each
    int8 kernel (where int8pack and float32 cross sets ``specsplit.runtime.int8.DENSE_ROWS``)."""
    from specsplit.runtime.int8 import Int8Linear
    from specsplit.runtime.packed import PackedLinear

    big = max((m for m in model.modules() if type(m) is torch.nn.Linear and m is not model.get_output_embeddings()),
              key=lambda m: m.weight.numel())  # fmt: skip
    layers: dict[str, torch.nn.Module] = {"float32 packed": PackedLinear(big)}
    for kernel in KERNELS:
        layers[f"int8 ({kernel})"] = Int8Linear(big, dense_rows=None, kernel=kernel)
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
def answer_hits(model: torch.nn.Module, step_rows: int = 4) -> dict[str, list[torch.Tensor]]:
    """Per category, per answer: the model's greedy choice at every answer position, run as the
    engines run a draft (the prompt in one forward, then the answer ``step_rows`` tokens a step)."""
    out: dict[str, list[torch.Tensor]] = {}
    for line in ANSWERS.read_text().splitlines():
        row = json.loads(line)
        prompt, new = row["prompt"], row["new"]
        res = model(torch.tensor([prompt]), use_cache=True)
        picks, past = [res.logits[0, -1:].argmax(-1)], res.past_key_values
        for i in range(0, len(new) - 1, step_rows):
            res = model(
                torch.tensor([new[i : min(i + step_rows, len(new) - 1)]]),
                past_key_values=past,
                use_cache=True,
            )
            picks.append(res.logits[0].argmax(-1))
            past = res.past_key_values
        out.setdefault(row["category"], []).append(torch.cat(picks))
    return out


@torch.inference_mode()
def agreement(models: dict[str, torch.nn.Module]) -> dict[str, dict[str, float]]:
    """Per category: each model's greedy hit rate on the answers, and the share of positions where each
    int8 model picks the float32 model's token (the first model is the float32 one)."""
    wants: dict[str, torch.Tensor] = {}
    for line in ANSWERS.read_text().splitlines():
        row = json.loads(line)
        wants[row["category"]] = torch.cat([wants.get(row["category"], torch.tensor([], dtype=torch.long)),
                                            torch.tensor(row["new"])])  # fmt: skip
    picks = {name: {c: torch.cat(v) for c, v in answer_hits(m).items()} for name, m in models.items()}
    first = next(iter(models))
    cats = list(picks[first])
    wants["all"] = torch.cat([wants[c] for c in cats])
    for p in picks.values():
        p["all"] = torch.cat([p[c] for c in cats])
    result: dict[str, dict[str, float]] = {}
    for cat, want in wants.items():
        r = result[cat] = {"tokens": float(want.numel())}
        for name, p in picks.items():
            r[f"{name} hits"] = float((p[cat] == want).float().mean())
            if name != first:
                r[f"{name} agree"] = float((p[cat] == picks[first][cat]).float().mean())
    return result


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
    models: dict[str, torch.nn.Module] = {"float32 packed": dense}
    for kernel in KERNELS:
        models[f"int8 ({kernel})"] = q8 = copy.deepcopy(dense)
        quantize_linears(q8, kernel=kernel)  # type: ignore[arg-type]
    pack_linears(dense)
    steps = {name: {**{f"{rows} rows": step_ms(m, args.context, rows, args.repeats) for rows in (1, 4)},
                    "prompt": prompt_ms(m, args.context, args.repeats)}
             for name, m in models.items()}  # fmt: skip
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
        f"| weights | 1 row | 4 rows | prompt of {args.context} tokens |",
        "|---|---:|---:|---:|",
        *(f"| {n} | {s['1 rows']:.1f} | {s['4 rows']:.1f} | {s['prompt']:.1f} |" for n, s in steps.items()),
        "",
        "The draft's largest hidden layer, ms a call by rows (median):",
        "",
        "| weights | " + " | ".join(str(n) for n in row_list) + " |",
        "|---|" + "---:|" * len(row_list),
        *(f"| {n} | " + " | ".join(f"{ms[r]:.2f}" for r in row_list) + " |" for n, ms in by_rows.items()),
        "",
        "Greedy choice against the target's recorded answers (teacher-forced; the prompt in one forward,",
        "then the answer 4 tokens a step), and each int8 draft's agreement with the float32 one:",
        "",
        "| category | tokens | "
        + " | ".join(f"{n} hits" for n in models)
        + " | "
        + " | ".join(f"{n} agrees" for n in list(models)[1:])
        + " |",
        "|---|" + "---:|" * (2 * len(models)),
        *(
            f"| {cat} | {int(a['tokens'])} | "
            + " | ".join(f"{a[f'{n} hits']:.3f}" for n in models)
            + " | "
            + " | ".join(f"{a[f'{n} agree']:.3f}" for n in list(models)[1:])
            + " |"
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
