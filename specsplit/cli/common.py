"""Flags that several commands share, spelled the same way on each."""

from __future__ import annotations

import argparse
from typing import Any

from specsplit.config import DEFAULT_LOOKAHEAD, DEFAULT_LOOKAHEAD_LEVELS, DEFAULT_LOOKAHEAD_NODES
from specsplit.errors import ConfigError

DTYPES = ("auto", "float32", "float16", "bfloat16")


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """How the engines run their models: the flags most users set (``generate``, ``serve``, ``bench``)."""
    p.add_argument("--dtype", default=None, choices=DTYPES, help="auto: bfloat16 on CUDA, float32 on CPU")
    p.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="replay fixed-shape steps (tree levels, verification, padded prompts) from CUDA graphs",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="with --cuda-graphs: fuse those steps with torch.compile first (the first rounds compile)",
    )
    p.add_argument(
        "--fuse-projections",
        action="store_true",
        help="one GEMM for q/k/v and one for gate/up per layer (Llama/Qwen2; rewrites the loaded models)",
    )
    p.add_argument(
        "--pack-weights",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="pack the linear layers' weights once for the CPU's matmul (a tree or a small batch then "
        "costs about one row); default: on for float32 models on a CPU",
    )


def add_draft_flags(p: argparse.ArgumentParser) -> None:
    """How the draft model runs: ``--draft-quantize`` (int8 weights) and ``--draft-vocab`` /
    ``--draft-vocab-ranking`` (its restricted output layer, FR-Spec)."""
    p.add_argument(
        "--draft-quantize",
        choices=("auto", "int8", "none"),
        default=None,
        help="the draft's linear weights as int8, CPU only (lossless: a cheaper draft step, about the "
        "same acceptance); default auto: on a CPU where this machine's int8 kernel is the faster one",
    )
    p.add_argument(
        "--draft-vocab",
        type=int,
        default=None,
        metavar="N",
        help="the draft scores only the N best-ranked tokens (lossless; pays where the output layer is "
        "a large share of the draft's weight reads, costs acceptance otherwise); default: all",
    )
    p.add_argument(
        "--draft-vocab-ranking",
        default=None,
        metavar="FILE",
        help="JSON ranking for --draft-vocab (`specsplit models rank-vocab`); default: token id order",
    )


def draft_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """``DraftConfig`` fields the :func:`add_draft_flags` flags set (absent where not given)."""
    out: dict[str, Any] = {}
    if getattr(args, "draft_quantize", None) is not None:
        out["quantize"] = args.draft_quantize
    if getattr(args, "draft_vocab", None) is not None:
        out["vocab_subset"] = args.draft_vocab
    if getattr(args, "draft_vocab_ranking", None) is not None:
        out["vocab_ranking"] = args.draft_vocab_ranking
    return out


def add_drafter_flag(p: argparse.ArgumentParser, help: str) -> None:
    """``--drafter``: what drafts each round (``SpecSplitConfig.drafter``); ``--lookahead``: the
    n-gram drafters' lookahead window (``NgramConfig.lookahead``)."""
    p.add_argument(
        "--drafter", choices=("model", "ngram", "suffix", "hybrid", "auto"), default=None, help=help
    )
    p.add_argument(
        "--lookahead",
        default=None,
        metavar="WIDTH[,LEVELS[,NODES]]|auto",
        help=f"n-gram rounds carry a lookahead window of LEVELS rows (default {DEFAULT_LOOKAHEAD_LEVELS}) "
        "of WIDTH guesses whose outputs propose n-grams the target wrote itself, beside NODES n-gram "
        f"nodes (default {DEFAULT_LOOKAHEAD_NODES}); 0: none. Pays on a GPU with --cuda-graphs, "
        f"not on a CPU (default: auto, {DEFAULT_LOOKAHEAD} wide where the target replays CUDA graphs, "
        "else none)",
    )


def add_heads_flags(p: argparse.ArgumentParser) -> None:
    """``--draft-heads DIR`` / ``--draft-heads-nodes N`` / ``--draft-heads-tree``: the target's draft
    heads (``TargetConfig.draft_heads`` / ``draft_heads_nodes`` / ``draft_heads_tree``)."""
    p.add_argument(
        "--draft-heads",
        default=None,
        metavar="DIR",
        help="draft heads trained for the target (`specsplit heads train`): the target guesses the next "
        "tokens from its own hidden state after every round, and the n-gram drafters' rounds verify "
        "those guesses too (lossless)",
    )
    p.add_argument(
        "--draft-heads-nodes", type=int, default=None, metavar="N", help="tree nodes the guesses take (32)"
    )
    p.add_argument(
        "--draft-heads-tree",
        choices=("dynamic", "static"),
        default=None,
        help="dynamic (default): each round's most probable guesses; static: the same tree every round",
    )


def heads_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The :class:`~specsplit.config.TargetConfig` fields ``--draft-heads`` and
    ``--draft-heads-nodes`` set (none when unset)."""
    out: dict[str, Any] = {}
    if getattr(args, "draft_heads", None) is not None:
        out["draft_heads"] = args.draft_heads
    if getattr(args, "draft_heads_nodes", None) is not None:
        out["draft_heads_nodes"] = args.draft_heads_nodes
    if getattr(args, "draft_heads_tree", None) is not None:
        out["draft_heads_tree"] = args.draft_heads_tree
    return out


def lookahead_overrides(text: str | None) -> dict[str, Any]:
    """``--lookahead WIDTH[,LEVELS[,NODES]]`` (or ``auto``) as :class:`~specsplit.config.NgramConfig`
    fields (``lookahead``, ``lookahead_levels``, ``lookahead_nodes``; none when unset).

    Raises:
        ConfigError: neither ``auto`` nor one to three integers.
    """
    if text is None:
        return {}
    if text.strip() == "auto":
        return {"lookahead": "auto"}
    try:
        parts = [int(x) for x in text.split(",")]
    except ValueError:
        parts = []
    if len(parts) not in (1, 2, 3):
        raise ConfigError(f"--lookahead wants WIDTH[,LEVELS[,NODES]] (integers) or auto, got {text!r}")
    names = ("lookahead", "lookahead_levels", "lookahead_nodes")
    return dict(zip(names, parts, strict=False))


def add_tuning_flags(p: argparse.ArgumentParser, pipeline: bool = False) -> None:
    """A/B switches, in their own help group: the defaults are right for most users.

    Args:
        p: the command's parser.
        pipeline: also the round loop's switches (commands that run the loop).
    """
    g = p.add_argument_group("tuning", "switches that exist to compare implementations; defaults are right")
    g.add_argument(
        "--graph-rounds",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="with --cuda-graphs: a whole round in one graph (the draft's tree growth, the target's greedy "
        "verification); default on",
    )
    g.add_argument(
        "--prefill-graphs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="with --cuda-graphs: pad a prompt's forward to a bucket replayed from one graph per bucket; "
        "default on",
    )
    g.add_argument(
        "--fold-gqa",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="fold a GQA model's head groups into the query rows in tree forwards; default on",
    )
    g.add_argument(
        "--attention-kernel",
        choices=("auto", "math", "sdpa"),
        default=None,
        help="tree forwards' attention: math = folded matmul kernel at every prefix length; sdpa = "
        "transformers' SDPA below 2,048 cached tokens; auto (default) = math with --cuda-graphs, else sdpa",
    )
    g.add_argument("--graph-capacity", type=int, default=None, help="slots of the CUDA-graph workspace")
    g.add_argument("--q-top-k", type=int, default=None, help="support size of a sampling draft's q")
    if pipeline:
        g.add_argument(
            "--overlap-policy",
            choices=("adaptive", "always"),
            default=None,
            help="with --overlap: adaptive (default) keeps speculation only where it is faster; always",
        )
        g.add_argument(
            "--grpc-streams",
            action=argparse.BooleanOptionalAction,
            default=None,
            help="gRPC: each round's calls over long-lived streams (default on); --no-grpc-streams: unary",
        )
        g.add_argument(
            "--sync-timing",
            action="store_true",
            help="synchronise the GPU around each phase so telemetry's draft/verify split is exact (slower)",
        )


_TUNING = ("graph_rounds", "prefill_graphs", "fold_gqa", "attention_kernel", "graph_capacity", "q_top_k")


def check_engine_flags(args: argparse.Namespace) -> None:
    """Refuse flag combinations that need a path the command does not take."""
    from specsplit.errors import ConfigError

    if args.compile and not args.cuda_graphs:
        raise ConfigError("--compile fuses the CUDA-graph steps: add --cuda-graphs")
    if args.prefill_graphs and not args.cuda_graphs:
        raise ConfigError("--prefill-graphs pads prompts for the CUDA-graph path: add --cuda-graphs")


def engine_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """Engine-config fields the flags set (absent where a flag was not given), ``tuning`` as a dict."""
    out: dict[str, Any] = {}
    if args.dtype:
        out["dtype"] = args.dtype
    for name in ("cuda_graphs", "compile", "fuse_projections"):
        if getattr(args, name):
            out[name] = True
    if getattr(args, "pack_weights", None) is not None:
        out["pack_weights"] = args.pack_weights
    tuning = {name: getattr(args, name) for name in _TUNING if getattr(args, name, None) is not None}
    if tuning:
        out["tuning"] = tuning
    return out


def apply_engine_overrides(section: Any, overrides: dict[str, Any]) -> None:
    """Set :func:`engine_overrides` on a ``DraftConfig`` / ``TargetConfig`` in place."""
    import dataclasses

    for name, value in overrides.items():
        if name == "tuning":
            section.tuning = dataclasses.replace(section.tuning, **value)
        else:
            setattr(section, name, value)


def apply_pipeline_overrides(cfg: Any, args: argparse.Namespace) -> None:
    """Set the round loop's tuning flags on a ``SpecSplitConfig`` in place."""
    import dataclasses

    given = {
        name: getattr(args, name)
        for name in ("overlap_policy", "grpc_streams")
        if getattr(args, name) is not None
    }
    if args.sync_timing:
        given["sync_timing"] = True
    if given:
        cfg.tuning = dataclasses.replace(cfg.tuning, **given)
