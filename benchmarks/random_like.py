#!/usr/bin/env python
"""Write a random-weight copy of a model directory: same config and tokenizer, new weights.

Timing runs that depend on shapes, not weights (per-round host overhead, transport, kernel times)
can then run where the real weights are not staged: a config and a tokenizer are a few MiB, the
weights gigabytes. Acceptance differs from the real pair (random models rarely agree), so such runs
report time a round, never tokens a second.

    python benchmarks/random_like.py SRC_DIR DST_DIR [--device cuda:0] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

_KEEP = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", type=Path, help="directory with config.json (+ tokenizer files)")
    ap.add_argument("dst", type=Path)
    ap.add_argument("--device", default="cpu", help="where to initialise the weights (cuda is faster)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(args.seed)
    cfg = AutoConfig.from_pretrained(args.src)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, args.dtype))
    args.dst.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.dst)
    for name in _KEEP[1:]:
        if (args.src / name).is_file():
            shutil.copy(args.src / name, args.dst / name)
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {args.dst}: {cfg.model_type}, {n / 1e6:.0f}M random parameters ({args.dtype})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
