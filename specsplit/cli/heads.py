"""``specsplit heads train``: train draft heads for a target from the target's own chats."""

from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from specsplit.cli.common import DTYPES

logger = logging.getLogger(__name__)


def add_cli(sub: argparse._SubParsersAction) -> None:
    """Add ``specsplit heads train`` to the top-level sub-parsers."""
    from specsplit.runtime.eagle_training import EagleTrainingOptions
    from specsplit.runtime.heads_training import HeadsTrainingOptions

    d = HeadsTrainingOptions()
    e = EagleTrainingOptions()
    p = sub.add_parser("heads", help="draft heads on the target's hidden states (Medusa or EAGLE style)")
    hsub = p.add_subparsers(dest="heads_command", required=True)
    t = hsub.add_parser(
        "train",
        help="the target writes chats (sampled questions, greedy answers) and heads learn to guess its "
        "next tokens from its hidden states; a GPU does the default sizes in minutes",
    )
    t.add_argument("--target", default="qwen2.5-coder-1.5b", help="alias, directory or GGUF file")
    t.add_argument(
        "--kind",
        choices=("medusa", "eagle"),
        default="medusa",
        help="medusa: residual blocks that guess every position from one hidden state; eagle: one "
        "decoder layer that drafts a tree level by level from the target's features (guesses better, "
        "costs a small forward a level)",
    )
    t.add_argument("--out", required=True, help="directory for heads.safetensors and heads.json")
    t.add_argument("--device", default=None, help="default: cuda:0 when there is a GPU, else cpu")
    t.add_argument("--dtype", default="auto", choices=DTYPES)
    t.add_argument("--num-heads", type=int, default=d.num_heads)
    t.add_argument("--conversations", type=int, default=d.conversations)
    t.add_argument("--question-tokens", type=int, default=d.question_tokens)
    t.add_argument("--answer-tokens", type=int, default=d.answer_tokens)
    t.add_argument("--generate-batch", type=int, default=d.generate_batch)
    t.add_argument(
        "--epochs", type=int, default=None, help=f"default: {d.epochs} (medusa), {e.epochs} (eagle)"
    )
    t.add_argument("--lr", type=float, default=None, help=f"default: {d.lr} (medusa), {e.lr} (eagle)")
    t.add_argument(
        "--tokens-per-step", type=int, default=None,
        help=f"default: {d.tokens_per_step} (medusa), {e.tokens_per_step} (eagle)",
    )  # fmt: skip
    t.add_argument("--seed", type=int, default=d.seed)
    t.add_argument(
        "--token-input",
        action="store_true",
        help="token-conditioned heads: each also reads the embedding of the token the target decided "
        "(twice the heads' weights; default: Medusa's heads, which read the hidden state only)",
    )
    g = t.add_argument_group("EAGLE head (--kind eagle)")
    g.add_argument("--unroll", type=int, default=e.unroll, help="levels unrolled a training step")
    g.add_argument("--vocab-subset", type=int, default=e.vocab_subset,
                   help="tokens the head scores (the most frequent in the answers)")  # fmt: skip
    g.add_argument(
        "--eagle-tree", default=f"{e.topk},{e.width},{e.depth}", metavar="TOPK,WIDTH,DEPTH",
        help="the tree a round grows: children of a node, nodes expanded a level, levels",
    )  # fmt: skip
    g.add_argument(
        "--texts", nargs="+", default=None, metavar="PATH",
        help="also train on passages of these files or directories (.py, .md, .rst, .txt, .json), "
        "labelled with the target's own choices: data without generation, but no substitute for the "
        "target's own answers (at equal steps, source files cut held-out acceptance; RESULTS.md)",
    )  # fmt: skip
    g.add_argument("--text-tokens", type=int, default=4_000_000, help="most tokens taken from --texts")
    g.add_argument("--cache-features-gb", type=float, default=e.cache_features_gb,
                   help="keep this much of the target's features on the device between epochs")  # fmt: skip
    g.add_argument("--train-minutes", type=float, default=0.0,
                   help="a time budget for the optimiser's steps: the planned steps shrink to what fits")  # fmt: skip
    g.add_argument("--eval-positions", type=int, default=e.eval_positions,
                   help="held-out answer positions where a round's tree is grown to measure the head")  # fmt: skip
    t.add_argument("--chats", default=None, help="JSONL of chats to train on instead of generating them")
    t.add_argument("--save-chats", default=None, help="also write the generated chats to this JSONL file")
    t.set_defaults(func=_cmd_train)


def _cmd_train(args: argparse.Namespace) -> int:
    import torch

    from specsplit.models import load_model, load_tokenizer
    from specsplit.runtime.heads_training import HeadsTrainingOptions, synthesize_chats
    from specsplit.runtime.runner import default_device

    base = HeadsTrainingOptions()
    opts = HeadsTrainingOptions(
        num_heads=args.num_heads, conversations=args.conversations, question_tokens=args.question_tokens,
        answer_tokens=args.answer_tokens, generate_batch=args.generate_batch,
        epochs=base.epochs if args.epochs is None else args.epochs, lr=base.lr if args.lr is None else args.lr,
        tokens_per_step=base.tokens_per_step if args.tokens_per_step is None else args.tokens_per_step,
        seed=args.seed, token_input=args.token_input,
    )  # fmt: skip
    device = args.device or str(default_device())
    model = load_model(args.target, dtype=args.dtype, device=device)
    model.requires_grad_(False)
    t0 = time.perf_counter()
    if args.chats:
        chats = read_chats(args.chats)
    else:
        tokenizer = load_tokenizer(args.target)
        chats = synthesize_chats(model, tokenizer, opts)
        if args.save_chats:
            Path(args.save_chats).write_text("".join(json.dumps(asdict(c)) + "\n" for c in chats))
    generate_s = time.perf_counter() - t0
    meta = {"torch": torch.__version__,
            "device": torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"}  # fmt: skip
    if args.texts and args.kind != "eagle":
        raise SystemExit(
            "--texts trains an EAGLE head (--kind eagle): Medusa heads learn from the chats' tokens"
        )
    if args.kind == "eagle":
        if args.texts:
            from specsplit.runtime.heads_training import text_chats

            chats = chats + text_chats(
                load_tokenizer(args.target), args.texts, args.text_tokens, seed=args.seed
            )
        out, report = _train_eagle(args, model, chats, opts, meta)
    elif opts.epochs == 0:  # only the chats were wanted
        print(json.dumps({"chats": len(chats), "generate_s": generate_s}))
        return 0
    else:
        out, report = _train_medusa(args, model, chats, opts, meta)
    report.generate_s = generate_s
    print(json.dumps({"out": str(out), **asdict(report)}, indent=1))
    return 0


def read_chats(path: str) -> list:
    """Chats from a JSONL file (gzipped when it ends in ``.gz``)."""
    import gzip

    from specsplit.runtime.heads_training import Chat

    opener: Any = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return [Chat(**json.loads(line)) for line in f if line.strip()]


def _train_medusa(
    args: argparse.Namespace, model: Any, chats: list, opts: Any, meta: dict
) -> tuple[Path, Any]:
    from specsplit.runtime.heads import save_heads
    from specsplit.runtime.heads_training import train_heads

    heads, info, report = train_heads(model, chats, opts, base_model=args.target)
    info.trained_on = {"options": asdict(opts), "report": asdict(report), **meta}
    return save_heads(heads, info, args.out), report


def _train_eagle(
    args: argparse.Namespace, model: Any, chats: list, opts: Any, meta: dict
) -> tuple[Path, Any]:
    from specsplit.runtime.eagle import save_eagle
    from specsplit.runtime.eagle_training import EagleTrainingOptions, train_eagle

    d = EagleTrainingOptions()
    try:
        topk, width, depth = (int(x) for x in args.eagle_tree.split(","))
    except ValueError:
        raise SystemExit(f"--eagle-tree takes TOPK,WIDTH,DEPTH, got {args.eagle_tree!r}") from None
    eo = EagleTrainingOptions(
        unroll=args.unroll, epochs=d.epochs if args.epochs is None else args.epochs,
        lr=d.lr if args.lr is None else args.lr,
        tokens_per_step=d.tokens_per_step if args.tokens_per_step is None else args.tokens_per_step,
        vocab_subset=args.vocab_subset, topk=topk, width=width, depth=depth,
        eval_positions=args.eval_positions, train_seconds=60.0 * args.train_minutes, seed=args.seed,
        cache_features_gb=args.cache_features_gb,
    )  # fmt: skip
    layer, vocab_ids, info, report = train_eagle(model, chats, eo, base_model=args.target)
    chat_opts = {k: v for k, v in asdict(opts).items() if k in ("conversations", "question_tokens",
                                                                 "answer_tokens", "seed")}  # fmt: skip
    texts = {"paths": args.texts, "max_tokens": args.text_tokens} if args.texts else None
    info.trained_on = {"options": {**asdict(eo), "chats": chat_opts, "texts": texts}, "report": asdict(report),
                       **meta}  # fmt: skip
    return save_eagle(layer, vocab_ids, info, args.out), report
