"""Could the target draft for itself from its first layers (early exit, no training)?

A self-draft that runs the target's first ``k`` layers, then its final norm and output layer, costs
about ``k / L`` of a step. It is worth building only if its greedy token agrees with the target's
often enough at a small ``k``. This measures that agreement, teacher-forced, on the target's own
greedy answers to the bench prompts: one forward over prompt + answer with every layer's hidden
states, each layer's early-exit argmax compared with the target's token at every answer position.

    python benchmarks/early_exit.py [--target qwen2.5-coder-1.5b] [--per-category 1] [--new-tokens 64]

Writes ``results/early_exit-<tag>.json`` and ``.md``. CPU (float32) is enough: agreement does not
depend on the device.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
from pathlib import Path

import torch

from specsplit.bench.run import DEFAULT_PROMPTS, load_prompts, tokenize_prompts
from specsplit.models import load_model, load_tokenizer

RESULTS = Path(__file__).resolve().parent / "results"
FREE_TEXT = ("chat", "code", "translation", "math")  # where prompt lookup finds little


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tag", default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tok = load_tokenizer(args.target)
    model = load_model(args.target, dtype=torch.float32).eval()
    n_layers = model.config.num_hidden_layers
    layers = sorted(
        {
            n_layers // 7,
            n_layers // 3,
            n_layers // 2,
            (3 * n_layers) // 4,
            n_layers - 4,
            n_layers - 2,
            n_layers - 1,
        }
    )
    prompts = [p for p in load_prompts(DEFAULT_PROMPTS, args.per_category) if p.category in FREE_TEXT]
    tokenize_prompts(prompts, tok)
    rows = []
    for p in prompts:
        ids = torch.tensor([p.input_ids])
        with torch.inference_mode():
            seq = model.generate(ids, max_new_tokens=args.new_tokens, do_sample=False, repetition_penalty=1.0)
            out = model(seq, output_hidden_states=True)
            start = ids.shape[1] - 1  # the row that predicts the first answer token
            final = out.logits[0, start:-1].argmax(-1)
            hits = {
                k: int(
                    (
                        model.lm_head(model.model.norm(out.hidden_states[k][0, start:-1])).argmax(-1) == final
                    ).sum()
                )
                for k in layers
            }
        rows.append({"prompt": p.id, "category": p.category, "tokens": int(final.numel()), "hits": hits})
        print(p.id, {k: round(h / final.numel(), 3) for k, h in hits.items()}, flush=True)
    total = sum(r["tokens"] for r in rows)
    overall = {k: sum(r["hits"][k] for r in rows) / total for k in layers}
    RESULTS.mkdir(exist_ok=True)
    stem = RESULTS / f"early_exit-{args.tag}"
    stem.with_suffix(".json").write_text(
        json.dumps(
            {
                "target": args.target,
                "layers": n_layers,
                "new_tokens": args.new_tokens,
                "rows": rows,
                "overall": overall,
            },
            indent=1,
        )  # fmt: skip
    )
    lines = [
        f"# Early-exit agreement with the target's greedy token ({args.target}, {n_layers} layers)",
        "",
        f"Teacher-forced over the target's own greedy answers ({args.new_tokens} tokens) to "
        f"{len(rows)} bench prompts ({', '.join(FREE_TEXT)}); float32.",
        "",
        f"- date (UTC): {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%dT%H:%MZ}; machine: "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        f"- command: `python benchmarks/early_exit.py --target {args.target} --per-category "
        f"{args.per_category} --new-tokens {args.new_tokens} --threads {args.threads} --tag {args.tag}`",
        "",
        f"| layers run (of {n_layers}) | share of a step's layers | agrees with the target |",
        "|---:|---:|---:|",
        *(f"| {k} | {k / n_layers:.2f} | {overall[k]:.3f} |" for k in layers),
        "",
    ]
    stem.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
