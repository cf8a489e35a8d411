"""Many prompts at once: one ``generate()`` call for a batch, and several threads sharing rounds.

    python examples/batched_generation.py                              # Qwen2.5-Coder-1.5B
    python examples/batched_generation.py --target smollm2-135m        # small, CPU-friendly
    python examples/batched_generation.py --cuda-graphs --threads 4    # four callers at once

The rows of a batch are verified together, one target forward per round for all of them, each row
with its own tree and KV slot; a row that ends leaves the batch at once. With ``--threads N`` the
prompts are split between N threads calling ``generate()`` on the same generator at the same time:
their rows join the same rounds. The script prints each answer and checks that every row equals the
same prompt generated alone (greedy).
"""

from __future__ import annotations

import argparse
import threading
import time

import torch

from specsplit import SpecSplitConfig, SpecSplitGenerator

PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Rename the variable `x` to `count` in: def f(x):\n    return x + x * x",
    "Translate to French: The weather is nice today.",
    "Explain in two sentences what a hash map is.",
    "Add type hints to: def area(w, h):\n    return w * h",
    "List three prime numbers greater than 100.",
]


def _encode(tok, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Chat-templated prompts, left-padded as ``generate()`` takes a batch."""
    texts = [
        tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        for p in prompts
    ]
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    return enc["input_ids"], enc["attention_mask"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="callers at once (their rows share rounds)")
    ap.add_argument(
        "--cuda-graphs", action="store_true", help="replay every batch size's rounds from CUDA graphs"
    )
    args = ap.parse_args()

    cfg = SpecSplitConfig(drafter="ngram", max_batch=16)
    cfg.target.cuda_graphs = args.cuda_graphs
    gen = SpecSplitGenerator.from_pretrained(args.target, config=cfg)
    tok = gen.tokenizer
    ids, mask = _encode(tok, PROMPTS)
    width = ids.shape[1]
    outputs: dict[int, torch.Tensor] = {}

    def call(rows: list[int]) -> None:
        out = gen.generate(ids[rows], attention_mask=mask[rows], max_new_tokens=args.max_new_tokens)
        for i, r in enumerate(rows):
            outputs[r] = out[i]

    gen.generate(ids, attention_mask=mask, max_new_tokens=4)  # warm-up: the pool, graphs
    shares = [list(range(len(PROMPTS)))[k :: args.threads] for k in range(args.threads)]
    t0 = time.perf_counter()
    threads = [threading.Thread(target=call, args=(rows,)) for rows in shares]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0

    total = 0
    for r, prompt in enumerate(PROMPTS):
        # The same prompt alone (its own length, no padding): the batch row must start with its tokens
        # (after its EOS, generate() pads a finished row).
        alone = gen.generate(ids[r : r + 1][:, mask[r].bool()], max_new_tokens=args.max_new_tokens)
        ref = alone[0, int(mask[r].sum()) :].tolist()
        row = outputs[r][width:].tolist()[: len(ref)]
        total += len(ref)
        print(
            f"--- {prompt!r} ({len(ref)} tokens, {'same as alone' if row == ref else 'DIFFERS from alone'})"
        )
        print(tok.decode(row, skip_special_tokens=True).strip())
    print(
        f"\n{len(PROMPTS)} rows, {args.threads} thread(s): {total} tokens in {wall:.2f} s = {total / wall:.1f} tok/s"
    )
    gen.close()


if __name__ == "__main__":
    main()
