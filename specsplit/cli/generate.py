"""``specsplit generate``: generate text from a prompt with speculative decoding (the main job)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any

from specsplit.cli.common import (
    add_draft_flags,
    add_drafter_flag,
    add_engine_flags,
    add_heads_flags,
    add_tuning_flags,
    apply_engine_overrides,
    apply_pipeline_overrides,
    check_engine_flags,
    draft_overrides,
    engine_overrides,
    heads_overrides,
    lookahead_overrides,
)


def add_cli(sub: argparse._SubParsersAction) -> None:
    """Register ``generate`` on the ``specsplit`` command line."""
    p = sub.add_parser("generate", help="generate text with speculative decoding")
    p.add_argument("prompt", help="the prompt (chat template applied unless --raw)")
    p.add_argument("--target", default=None, help="target model: alias, local dir or HF id")
    p.add_argument("--draft", default=None, help="draft model: alias, local dir or HF id")
    p.add_argument("--config", default=None, help="JSON/TOML SpecSplitConfig file")
    p.add_argument("--max-new-tokens", type=int, default=128)
    add_drafter_flag(
        p,
        "what drafts each round: the draft model, n-gram lookup in the prompt and output (ngram; "
        "suffix: also earlier generations), both in one tree (hybrid), or a measured choice per round "
        "(auto, the default: n-gram trees, and the --draft model where it pays)",
    )
    add_heads_flags(p)
    p.add_argument(
        "--tree", choices=["chain", "static", "dynamic"], default=None, help="shape of the draft tree"
    )
    p.add_argument("--num-draft-tokens", type=int, default=None, help="chain length K")
    p.add_argument(
        "--min-confidence",
        type=float,
        default=None,
        metavar="P",
        help="chain / static tree: stop drafting after a token the draft gave a probability below P",
    )
    p.add_argument(
        "--do-sample",
        action="store_true",
        help="sample (default: greedy); unset options take the model's defaults",
    )
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument(
        "--repetition-penalty",
        type=float,
        default=None,
        help="HF's repetition penalty (default: the model's own, e.g. 1.1 for Qwen2.5-Coder; 1.0 turns it off)",
    )
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--device", default=None, help="device for both models (e.g. cuda:0, cpu)")
    p.add_argument("--draft-device", default=None, help="the draft's device (default: --device)")
    p.add_argument("--target-device", default=None, help="the target's device (default: --device)")
    add_engine_flags(p)
    add_draft_flags(p)
    p.add_argument(
        "--overlap",
        action="store_true",
        help="draft the next round while this one verifies (pays with the models on two GPUs)",
    )
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--no-stream", action="store_true", help="print the text at the end only")
    p.add_argument("--json", action="store_true", help="print the stats as JSON")
    add_tuning_flags(p, pipeline=True)
    p.set_defaults(func=_cmd_generate)


def _cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from specsplit.config import SpecSplitConfig
    from specsplit.errors import ConfigError
    from specsplit.generator import (
        DEFAULT_DRAFTER,
        DEFAULT_TREE,
        DRAFTER_ENV,
        SpecSplitGenerator,
        default_tree_applies,
    )
    from specsplit.models import DEFAULT_DRAFT, DEFAULT_TARGET

    cfg = SpecSplitConfig.from_file(args.config) if args.config else SpecSplitConfig.from_env()
    if args.drafter:
        cfg.drafter = args.drafter
    elif args.overlap:  # the overlapped pipeline drafts with the model
        cfg.drafter = "model"
    elif not args.config and DRAFTER_ENV not in os.environ:
        cfg.drafter = DEFAULT_DRAFTER
    if not args.config and default_tree_applies() and args.tree in (None, "chain"):
        cfg.tree = dataclasses.replace(DEFAULT_TREE)
    if args.lookahead is not None:
        cfg.tuning.ngram = dataclasses.replace(cfg.tuning.ngram, **lookahead_overrides(args.lookahead))
    if args.tree:
        cfg.tree.shape = args.tree
    if args.num_draft_tokens is not None:
        cfg.tree.num_draft_tokens = args.num_draft_tokens
    if args.min_confidence is not None:
        cfg.tree.min_confidence = args.min_confidence
    cfg.tree = dataclasses.replace(cfg.tree)  # validated again with the flags applied
    check_engine_flags(args)
    overrides = engine_overrides(args)
    for attr in ("draft", "target"):
        sec = getattr(cfg, attr)
        dev = getattr(args, f"{attr}_device") or args.device
        if dev:
            sec.device = dev
        apply_engine_overrides(sec, overrides)
    given = draft_overrides(args)
    if given:
        cfg.draft = dataclasses.replace(cfg.draft, **given)  # validated again
    heads = heads_overrides(args)
    if heads:
        cfg.target = dataclasses.replace(cfg.target, **heads)  # validated again
    apply_pipeline_overrides(cfg, args)
    if args.overlap:
        if cfg.drafter != "model":
            raise ConfigError(
                f"--overlap drafts the next round with the draft model: not with --drafter {cfg.drafter}"
            )
        cfg.overlap = True
    target = args.target or cfg.target.model or DEFAULT_TARGET
    wants_model = cfg.drafter in ("model", "hybrid", "auto")
    draft = (
        args.draft or cfg.draft.model or (DEFAULT_DRAFT if cfg.transport == "local" and wants_model else None)
    )
    gen = SpecSplitGenerator.from_pretrained(target=target, draft=draft, config=cfg)
    streamer = None
    if not args.no_stream and not args.json:
        from transformers import TextStreamer

        streamer = TextStreamer(gen.tokenizer, skip_prompt=True, skip_special_tokens=True)
    kwargs: dict = {"max_new_tokens": args.max_new_tokens, "do_sample": args.do_sample}
    for k in ("temperature", "top_p", "top_k", "repetition_penalty"):
        if getattr(args, k) is not None:
            kwargs[k] = getattr(args, k)
    if args.seed is not None:
        kwargs["generator"] = torch.Generator().manual_seed(args.seed)
    result: Any = gen.generate_text(
        args.prompt, chat=not args.raw, streamer=streamer, return_stats=True, **kwargs
    )
    text, stats = result
    if args.json:
        print(json.dumps({"text": text, "stats": stats.summary()}, indent=2))
    else:
        if streamer is None:
            print(text)
        s = stats.summary()
        print(
            f"\n[specsplit] {s['new_tokens']} tokens in {s['wall_time_s']:.2f}s "
            f"({s['tokens_per_s']:.1f} tok/s), {s['rounds']} rounds, tau={s['tau']:.2f}, "
            f"acceptance={s['acceptance_rate']:.2f}, drafter={cfg.drafter}, rounds by drafter "
            f"{s['rounds_by_drafter']}",
            file=sys.stderr,
        )
    gen.close()
    return 0
