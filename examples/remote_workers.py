"""Remote mode: a draft worker and a target worker over gRPC, with either side running the rounds.

    python examples/remote_workers.py "Write a quicksort in Python"
    python examples/remote_workers.py --draft smollm2-135m --target smollm2-135m   # small, CPU-friendly

Starts both workers on this machine as ``specsplit serve`` subprocesses (in production each runs on
its own GPU or machine), then generates the same prompt twice:

* ``grpc_loop="client"``: this process calls the draft worker, then the target worker, every round;
* ``grpc_loop="target"``: one streaming call; the target worker (started with ``--draft-address``)
  calls the draft worker itself, one network hop a round, and streams the tokens back. This is the
  mode for clients far from their workers.

Both print the same text (greedy); the example checks it.
"""

from __future__ import annotations

import argparse

import torch

from specsplit import SpecSplitConfig, SpecSplitGenerator, TreeConfig
from specsplit.models import load_tokenizer
from specsplit.remote.launch import WorkerProcess


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("prompt", nargs="?", default="Write a quicksort in Python")
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--device", default=None, help="device of both workers (default: cuda:0 or cpu)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()

    tok = load_tokenizer(args.target)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": args.prompt}], add_generation_prompt=True, return_tensors="pt"
    )
    ids = ids["input_ids"] if not isinstance(ids, torch.Tensor) else ids
    tree = TreeConfig(shape="dynamic", topk=4, width=4, budget=24, max_depth=5)
    with WorkerProcess("draft", args.draft, device=args.device) as draft:
        peer = ["--draft-address", draft.address]  # lets the target worker run the rounds
        with WorkerProcess("target", args.target, device=args.device, args=peer) as target:
            texts = []
            for loop in ("client", "target"):
                cfg = SpecSplitConfig(transport="grpc", target_address=target.address, draft_address=draft.address,
                                      tree=tree, grpc_loop=loop)  # fmt: skip
                with SpecSplitGenerator(tokenizer=tok, config=cfg) as gen:
                    out = gen.generate(ids, max_new_tokens=args.max_new_tokens, return_dict_in_generate=True)
                s = out.spec_stats.summary()
                texts.append(tok.decode(out.sequences[0, ids.shape[1] :], skip_special_tokens=True))
                print(f"--- grpc_loop={loop!r}: {s['new_tokens']} tokens in {s['rounds']} rounds, "
                      f"{s['tokens_per_s']:.1f} tok/s, tau {s['tau']:.2f}")  # fmt: skip
            print(texts[1])
            assert texts[0] == texts[1], "both loops must produce the same text"


if __name__ == "__main__":
    main()
