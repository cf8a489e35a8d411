"""`specsplit generate | serve | bench | models` — the command line.

Each sub-command's parser and handler live next to the code they drive; this module only
dispatches, so importing it stays cheap.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text with speculative decoding")
    p.add_argument("prompt", help="the prompt (chat template applied unless --raw)")
    p.add_argument("--target", default=None, help="target model: alias, local dir or HF id")
    p.add_argument("--draft", default=None, help="draft model: alias, local dir or HF id")
    p.add_argument("--config", default=None, help="JSON/TOML SpecSplitConfig file")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--tree", choices=["chain", "static", "dynamic"], default=None)
    p.add_argument("--num-draft-tokens", type=int, default=None, help="chain length K")
    p.add_argument("--do-sample", action="store_true")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--device", default=None, help="device for both models (e.g. cuda:0, cpu)")
    p.add_argument("--draft-device", default=None)
    p.add_argument("--target-device", default=None)
    p.add_argument("--dtype", default=None, choices=["auto", "float32", "float16", "bfloat16"])
    p.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="replay fixed-shape draft steps and verification from CUDA graphs (GPU; eager elsewhere)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="with --cuda-graphs: fuse those steps with torch.compile first (slow first rounds)",
    )
    add_model_kernel_flags(p)
    p.add_argument(
        "--overlap",
        action="store_true",
        help="draft the next round while this one verifies (pays with the models on two GPUs)",
    )
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--no-stream", action="store_true", help="print the text at the end only")
    p.add_argument("--json", action="store_true", help="print the stats as JSON")
    p.set_defaults(func=_cmd_generate)


def add_model_kernel_flags(p: argparse.ArgumentParser) -> None:
    """The flags that choose how the engines run a model's layers (``generate`` and ``serve``)."""
    p.add_argument(
        "--prefill-graphs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="with --cuda-graphs: pad a prompt's forward to a bucket replayed from one CUDA graph per "
        "bucket (prefill_graphs; on by default; --no-prefill-graphs: eager prompt forwards)",
    )
    p.add_argument(
        "--no-fold-gqa",
        action="store_true",
        help="attend through transformers' SDPA (repeat_kv) instead of SpecSplit's folded GQA attention",
    )
    p.add_argument(
        "--fuse-projections",
        action="store_true",
        help="one GEMM for q/k/v and one for gate/up per layer (Llama/Qwen2; rewrites the loaded models)",
    )
    p.add_argument(
        "--attention-kernel",
        choices=("auto", "math", "sdpa"),
        default=None,
        help="tree forwards' attention: math = folded matmul kernel at every prefix length; sdpa = "
        "transformers' SDPA below 2,048 cached tokens; auto (default) = math with --cuda-graphs, else sdpa",
    )


def check_kernel_flags(args: argparse.Namespace) -> None:
    """Refuse flags of :func:`add_model_kernel_flags` that need a path the command does not take."""
    from specsplit.errors import ConfigError

    if args.prefill_graphs and not args.cuda_graphs:
        raise ConfigError("--prefill-graphs pads prompts for the CUDA-graph path: add --cuda-graphs")


def _cmd_generate(args: argparse.Namespace) -> int:
    import json

    import torch

    from specsplit.config import SpecSplitConfig
    from specsplit.errors import ConfigError
    from specsplit.generator import SpecSplitGenerator
    from specsplit.models import DEFAULT_DRAFT, DEFAULT_TARGET

    cfg = SpecSplitConfig.from_file(args.config) if args.config else SpecSplitConfig.from_env()
    if args.tree:
        cfg.tree.shape = args.tree
    if args.num_draft_tokens is not None:
        cfg.tree.num_draft_tokens = args.num_draft_tokens
    if args.compile and not args.cuda_graphs:
        raise ConfigError("--compile fuses the CUDA-graph steps: add --cuda-graphs")
    check_kernel_flags(args)
    for attr in ("draft", "target"):
        sec = getattr(cfg, attr)
        dev = getattr(args, f"{attr}_device") or args.device
        if dev:
            sec.device = dev
        if args.dtype:
            sec.dtype = args.dtype
        if args.cuda_graphs:
            sec.cuda_graphs = True
        if args.compile:
            sec.compile = True
        if args.prefill_graphs is not None:
            sec.prefill_graphs = args.prefill_graphs
        if args.no_fold_gqa:
            sec.fold_gqa = False
        if args.fuse_projections:
            sec.fuse_projections = True
        if args.attention_kernel:
            sec.attention_kernel = args.attention_kernel
    if args.overlap:
        cfg.overlap = True
    target = args.target or cfg.target.model or DEFAULT_TARGET
    draft = args.draft or cfg.draft.model or (DEFAULT_DRAFT if cfg.transport == "local" else None)
    gen = SpecSplitGenerator.from_pretrained(target=target, draft=draft, config=cfg)
    streamer = None
    if not args.no_stream and not args.json:
        from transformers import TextStreamer

        streamer = TextStreamer(gen.tokenizer, skip_prompt=True, skip_special_tokens=True)
    kwargs: dict = {"max_new_tokens": args.max_new_tokens, "do_sample": args.do_sample}
    for k in ("temperature", "top_p", "top_k"):
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
            f"acceptance={s['acceptance_rate']:.2f}, tree={cfg.tree.shape}",
            file=sys.stderr,
        )
    gen.close()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specsplit", description=__doc__)
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv: debug)")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    for modname in ("specsplit.cli.models", "specsplit.cli.serve", "specsplit.bench.run"):
        try:
            mod = __import__(modname, fromlist=["add_cli"])
        except ImportError as e:  # optional parts (grpc extra) may be missing
            logging.getLogger(__name__).debug("sub-commands of %s unavailable: %s", modname, e)
            continue
        add = getattr(mod, "add_cli", None)
        if add is not None:
            add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from specsplit.errors import SpecSplitError

    try:
        return int(args.func(args) or 0)
    except SpecSplitError as e:
        print(f"specsplit: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
