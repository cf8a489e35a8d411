#!/usr/bin/env python
"""The README's main job against Hugging Face ``generate()``, side by side in one process.

The main job is ``specsplit generate "Write a quicksort in Python"``: the default target
(Qwen2.5-Coder 1.5B, fetched offline), the default drafter (``auto``, with the default 0.5B draft
model), the chat template, greedy, 128 new tokens and the model's own generation settings (its
repetition penalty). This runs exactly that
through :meth:`SpecSplitGenerator.from_pretrained` and ``generate_text``'s tokenization, and HF
``generate()`` of the same ids with the same settings on an unmodified copy of the model, alternating
the two; every output must equal HF's. Earlier generations are forgotten before each SpecSplit run
(the CLI starts a fresh process every time, so its suffix drafter has nothing indexed).

    python benchmarks/main_job.py --repeats 2 --threads 2 --tag cpu-2core
        # writes benchmarks/results/main_job-<tag>.{json,md}
    python benchmarks/main_job.py --repeats 2 --threads 2 --drafter suffix --tag cpu-2core-suffix
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

OUT = Path(__file__).resolve().parent / "results"
PROMPT = "Write a quicksort in Python"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--drafter",
        default=None,
        help="another drafter than `specsplit generate`'s default; the default draft model is loaded "
        "when it drafts with a model (model, hybrid, auto), as the command does",
    )
    p.add_argument("--tag", default="cpu")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from specsplit import SpecSplitConfig, SpecSplitGenerator
    from specsplit.generator import DEFAULT_DRAFTER
    from specsplit.models import DEFAULT_DRAFT, DEFAULT_TARGET, load_model
    from specsplit.runtime.runner import resolve_dtype

    t0 = time.perf_counter()
    cfg = SpecSplitConfig.from_env()
    drafter = args.drafter or DEFAULT_DRAFTER
    cfg.drafter = drafter
    cfg.target.device = cfg.draft.device = args.device
    draft = DEFAULT_DRAFT if drafter in ("model", "hybrid", "auto") else None  # as the command decides
    gen = SpecSplitGenerator.from_pretrained(target=DEFAULT_TARGET, draft=draft, config=cfg)
    load_specsplit = time.perf_counter() - t0
    t0 = time.perf_counter()
    hf = load_model(DEFAULT_TARGET, dtype=resolve_dtype("auto", args.device), device=args.device)
    load_hf = time.perf_counter() - t0

    tok = gen.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": args.prompt}], tokenize=False,
                                   add_generation_prompt=True)  # fmt: skip
    ids = tok(text, return_tensors="pt", add_special_tokens=False).input_ids
    settings = {"max_new_tokens": args.max_new_tokens, "do_sample": False}

    def run_hf() -> tuple[list[int], float]:
        t = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), **settings)
        return out[0, ids.shape[1] :].tolist(), time.perf_counter() - t

    def run_specsplit() -> tuple[list[int], float]:
        gen.forget_generations()
        t = time.perf_counter()
        out = gen.generate(ids, attention_mask=torch.ones_like(ids), **settings)
        return out[0, ids.shape[1] :].tolist(), time.perf_counter() - t

    hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)  # warm-ups
    gen.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    times: dict[str, list[float]] = {"hf": [], "specsplit": []}
    outputs: dict[str, list[int]] = {}
    for _ in range(args.repeats):
        for name, fn in (("hf", run_hf), ("specsplit", run_specsplit)):
            out, sec = fn()
            times[name].append(sec)
            if outputs.setdefault(name, out) != out:
                raise AssertionError(f"{name} changed its output between repeats")
    gen.close()
    same = outputs["hf"] == outputs["specsplit"]
    n = {k: len(v) for k, v in outputs.items()}
    speed = {k: n[k] / statistics.median(v) for k, v in times.items()}
    result: dict[str, Any] = {
        "command": "python benchmarks/main_job.py " + " ".join(argv if argv is not None else []),
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {
            "platform": platform.platform(),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
        },
        "target": DEFAULT_TARGET,
        "drafter": drafter,
        "draft": draft,
        "dtype": str(next(hf.parameters()).dtype),
        "repetition_penalty": getattr(hf.generation_config, "repetition_penalty", None),
        "prompt_tokens": ids.shape[1],
        "new_tokens": n,
        "seconds": times,
        "tok_s": speed,
        "x_hf": speed["specsplit"] / speed["hf"],
        "identical": same,
        "load_s": {"specsplit": load_specsplit, "hf": load_hf},
    }
    lines = [
        "# The README's main job against HF generate()",
        "",
        f"`{result['command'].strip()}` — {result['created_utc']}, {platform.platform()}, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}",
        "",
        f"Target `{DEFAULT_TARGET}` ({result['dtype']}), draft `{draft}`, drafter `{drafter}`, chat template, greedy, "
        f"repetition penalty {result['repetition_penalty']} (the model's), {args.max_new_tokens} new tokens, "
        f"median of {args.repeats} after a warm-up each.",
        "",
        "| decoder | new tokens | seconds (each repeat) | tok/s | × HF | load s |",
        "|---|---:|---|---:|---:|---:|",
    ]
    for name, label in (("hf", "HF `generate()`"), ("specsplit", "`specsplit generate` (main job)")):
        secs = ", ".join(f"{x:.2f}" for x in times[name])
        lines.append(f"| {label} | {n[name]} | {secs} | {speed[name]:.2f} | {speed[name] / speed['hf']:.2f}× "
                     f"| {result['load_s'][name]:.1f} |")  # fmt: skip
    lines += ["", f"Output identical to HF's: {'yes' if same else 'NO'}."]
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"main_job-{args.tag}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1), encoding="utf-8")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))
    return 0 if same else 1


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
