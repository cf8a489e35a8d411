"""``specsplit heads train``: train draft heads for a target from the target's own chats."""

from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import asdict
from pathlib import Path

from specsplit.cli.common import DTYPES

logger = logging.getLogger(__name__)


def add_cli(sub: argparse._SubParsersAction) -> None:
    """Add ``specsplit heads train`` to the top-level sub-parsers."""
    from specsplit.runtime.heads_training import HeadsTrainingOptions

    d = HeadsTrainingOptions()
    p = sub.add_parser("heads", help="draft heads on the target's hidden states (Medusa style)")
    hsub = p.add_subparsers(dest="heads_command", required=True)
    t = hsub.add_parser(
        "train",
        help="the target writes chats (sampled questions, greedy answers) and heads learn to guess its "
        "next tokens from its hidden states; a GPU does the default sizes in minutes",
    )
    t.add_argument("--target", default="qwen2.5-coder-1.5b", help="alias, directory or GGUF file")
    t.add_argument("--out", required=True, help="directory for heads.safetensors and heads.json")
    t.add_argument("--device", default=None, help="default: cuda:0 when there is a GPU, else cpu")
    t.add_argument("--dtype", default="auto", choices=DTYPES)
    t.add_argument("--num-heads", type=int, default=d.num_heads)
    t.add_argument("--conversations", type=int, default=d.conversations)
    t.add_argument("--question-tokens", type=int, default=d.question_tokens)
    t.add_argument("--answer-tokens", type=int, default=d.answer_tokens)
    t.add_argument("--generate-batch", type=int, default=d.generate_batch)
    t.add_argument("--epochs", type=int, default=d.epochs)
    t.add_argument("--lr", type=float, default=d.lr)
    t.add_argument("--tokens-per-step", type=int, default=d.tokens_per_step)
    t.add_argument("--seed", type=int, default=d.seed)
    t.add_argument(
        "--token-input",
        action="store_true",
        help="token-conditioned heads: each also reads the embedding of the token the target decided "
        "(twice the heads' weights; default: Medusa's heads, which read the hidden state only)",
    )
    t.add_argument("--chats", default=None, help="JSONL of chats to train on instead of generating them")
    t.add_argument("--save-chats", default=None, help="also write the generated chats to this JSONL file")
    t.set_defaults(func=_cmd_train)


def _cmd_train(args: argparse.Namespace) -> int:
    import torch

    from specsplit.models import load_model, load_tokenizer
    from specsplit.runtime.heads import save_heads
    from specsplit.runtime.heads_training import Chat, HeadsTrainingOptions, synthesize_chats, train_heads
    from specsplit.runtime.runner import default_device

    opts = HeadsTrainingOptions(
        num_heads=args.num_heads, conversations=args.conversations, question_tokens=args.question_tokens,
        answer_tokens=args.answer_tokens, generate_batch=args.generate_batch, epochs=args.epochs, lr=args.lr,
        tokens_per_step=args.tokens_per_step, seed=args.seed,
        token_input=args.token_input,
    )  # fmt: skip
    device = args.device or str(default_device())
    model = load_model(args.target, dtype=args.dtype, device=device)
    model.requires_grad_(False)
    t0 = time.perf_counter()
    if args.chats:
        lines = Path(args.chats).read_text().splitlines()
        chats = [Chat(**json.loads(line)) for line in lines if line.strip()]
    else:
        tokenizer = load_tokenizer(args.target)
        chats = synthesize_chats(model, tokenizer, opts)
        if args.save_chats:
            Path(args.save_chats).write_text("".join(json.dumps(asdict(c)) + "\n" for c in chats))
    generate_s = time.perf_counter() - t0
    heads, info, report = train_heads(model, chats, opts, base_model=args.target)
    report.generate_s = generate_s
    info.trained_on = {
        "options": asdict(opts),
        "report": asdict(report),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu",
    }
    out = save_heads(heads, info, args.out)
    print(json.dumps({"out": str(out), **asdict(report)}, indent=1))
    return 0
