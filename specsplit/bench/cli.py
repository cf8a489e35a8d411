"""``specsplit bench``: Hugging Face baselines and SpecSplit decoders on the same prompts, in one process."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import shlex
import sys
from pathlib import Path

import torch

from specsplit.bench.batch import (
    BATCH_DECODERS,
    CLIENT_DECODERS,
    CLIENT_LOOP_DECODER,
    DRAFT_WORKER_DECODERS,
    TARGET_LOOP_MODEL_DECODER,
    BatchBenchOptions,
    batch_markdown,
    run_batch_bench,
)
from specsplit.bench.decoders import ASSISTED, BASELINE, DEFAULT_DECODERS, FRSPEC_VOCAB, OPTIONAL_DECODERS
from specsplit.bench.report import RunRecord, summarize, write_plot
from specsplit.bench.run import (
    DEFAULT_PROMPTS,
    SCHEMA,
    SUITES,
    BenchOptions,
    _dynamic_tree,
    _markdown,
    run_bench,
)
from specsplit.cli.common import (
    add_engine_flags,
    add_tuning_flags,
    check_engine_flags,
    engine_overrides,
    lookahead_overrides,
)
from specsplit.config import DEFAULT_LOOKAHEAD, DEFAULT_LOOKAHEAD_LEVELS, DEFAULT_LOOKAHEAD_NODES
from specsplit.errors import ConfigError

_DESCRIPTION = (
    "The engine and tuning options (--cuda-graphs, --compile, --fuse-projections, --graph-rounds, ...) "
    "set every SpecSplit decoder, local engines and gRPC workers, draft and target alike; the Hugging "
    "Face baselines (hf-*) run the loaded models as transformers does. A decoder's own switches "
    "(the -compiled, -prefill, -levels, -unary, ... rows of specsplit.bench.decoder_specs) override them."
)


def add_cli(sub: argparse._SubParsersAction) -> None:
    """Register ``specsplit bench`` on the top-level sub-parsers."""
    p = sub.add_parser(
        "bench",
        help="benchmark SpecSplit against Hugging Face baselines on the same prompts",
        description=_DESCRIPTION,
    )
    p.add_argument(
        "--suite",
        choices=sorted(SUITES),
        default="quick",
        help="smoke: tiny random models on two random prompts (checks every decoder, on CPU too); quick: "
        "Qwen pair, 1 prompt per category, 32 tokens; full: all prompts, 128 tokens, 3 repeats",
    )
    p.add_argument("--device", default=None, help="target device (default cuda:0 if available, else cpu)")
    p.add_argument("--draft-device", default=None, help="draft device (default: --device)")
    p.add_argument("--target", default=None, help="target alias or directory (default: the Qwen 1.5B)")
    p.add_argument(
        "--draft", default=None, help="draft alias or directory, or self:N (first N target layers)"
    )
    add_engine_flags(p)
    _set_help(
        p,
        "fuse_projections",
        "SpecSplit decoders, local or a gRPC worker, run copies of the models with q/k/v and gate/up "
        "fused into one GEMM each (specsplit.runtime.fused); the HF decoders keep the originals. Costs "
        "one more copy of each model",
    )
    _set_help(
        p,
        "pack_weights",
        "SpecSplit decoders, local or a gRPC worker, run copies of the models with every linear weight "
        "packed for the CPU's matmul (specsplit.runtime.packed), as the engines pack models they load; "
        "the HF decoders keep the originals. Default: on for float32 models on a CPU",
    )
    p.add_argument(
        "--draft-quantize",
        choices=("auto", "int8", "none"),
        default="auto",
        help="the SpecSplit decoders' draft model runs an int8 copy (specsplit.runtime.int8, CPU only), "
        "local or a gRPC worker; the HF decoders keep the original. Default auto: as the engines decide "
        "for a draft they load (on a CPU where the int8 kernel pays, not compiled). Batch runs keep "
        "the float32 draft",
    )
    p.add_argument("--max-new-tokens", type=int, default=None, help="override the suite's token count")
    p.add_argument("--repeats", type=int, default=None, help="override the suite's timed repeats")
    p.add_argument(
        "--baseline-repeats",
        type=int,
        default=None,
        help="time the Hugging Face decoders (hf-*) in the first N repeats only (they are the slow ones)",
    )
    p.add_argument(
        "--grpc-workers",
        choices=["process", "thread"],
        default="process",
        help="gRPC decoders: workers as separate `specsplit serve` processes (default; real models) or "
        "as servers inside the bench process (they then share its GIL)",
    )
    p.add_argument(
        "--overlap-draft-device",
        default=None,
        help="a copy of the draft on this device for the overlapped decoders (e.g. cuda:1; default: --draft-device)",
    )
    p.add_argument("--prompts-per-category", type=int, default=None, help="override the suite's prompt count")
    p.add_argument(
        "--decoders",
        default=",".join(DEFAULT_DECODERS),
        help=f"comma-separated subset of {','.join(DEFAULT_DECODERS)} (the default), plus the optional "
        f"{','.join(OPTIONAL_DECODERS)} (see specsplit.bench.decoder_specs)",
    )
    p.add_argument(
        "--num-draft-tokens", type=int, default=4, help="K for hf-assisted and the SpecSplit chain"
    )
    p.add_argument(
        "--chain-confidence",
        type=float,
        default=0.0,
        metavar="P",
        help="the SpecSplit chain stops after a token the draft gave a probability below P "
        "(TreeConfig.min_confidence); default 0: all K tokens",
    )
    p.add_argument(
        "--dynamic-tree",
        default=None,
        metavar="TOPK,WIDTH,BUDGET,DEPTH",
        help="shape of the dynamic-tree decoders (default: TreeConfig's, 4,4,24,6)",
    )
    p.add_argument(
        "--frspec-vocab",
        type=int,
        default=FRSPEC_VOCAB,
        help="tokens the -frspec decoders' draft output layer scores, best-ranked first (token id order)",
    )
    p.add_argument(
        "--lookahead",
        default=f"{DEFAULT_LOOKAHEAD},{DEFAULT_LOOKAHEAD_LEVELS}",
        metavar="WIDTH[,LEVELS[,NODES]]",
        help="window of the -lookahead decoders: guesses a row, rows, and the n-gram nodes beside it "
        f"(NgramConfig.lookahead / lookahead_levels / lookahead_nodes; default {DEFAULT_LOOKAHEAD},"
        f"{DEFAULT_LOOKAHEAD_LEVELS},{DEFAULT_LOOKAHEAD_NODES})",
    )
    p.add_argument(
        "--draft-heads",
        default=None,
        metavar="DIR",
        help="draft heads of the target for the -heads decoders (`specsplit heads train`); without it "
        "they are skipped",
    )
    p.add_argument(
        "--eagle-heads",
        default=None,
        metavar="DIR",
        help="an EAGLE head of the target for the -eagle decoders (`specsplit heads train --kind eagle`); "
        "without it they are skipped",
    )
    p.add_argument("--heads-nodes", type=int, default=32, help="tree nodes the heads' guesses take a round")
    p.add_argument(
        "--heads-tree",
        choices=("dynamic", "static"),
        default="dynamic",
        help="the heads' guess tree: each round's most probable paths, or the same tree every round",
    )
    p.add_argument(
        "--profile-prompts",
        type=int,
        default=0,
        metavar="N",
        help="after the timed runs, generate N prompts (spread over the categories) once more with each "
        "SpecSplit decoder under the torch profiler; the report adds GPU busy/idle time a round by "
        "phase and the largest kernels (default 0: none)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument(
        "--prompts",
        type=Path,
        default=DEFAULT_PROMPTS,
        help="directory of *.jsonl prompt files (any category names; the report has a column for each)",
    )
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="results directory")
    p.add_argument("--tag", default="", help="suffix for the result file names")
    p.add_argument("--note", action="append", default=[], help="a note stored with the results (repeatable)")
    p.add_argument(
        "--tie-analysis",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="check every greedy mismatch vs hf-target is a numerical near-tie (float32 copy of the target); "
        "default: when the dtype is not float32 and some output differs",
    )
    p.add_argument(
        "--from-json",
        type=Path,
        default=None,
        help="run nothing: rewrite the .md and .png next to an existing results .json",
    )
    p.add_argument(
        "--batch-size",
        default=None,
        metavar="B[,B...]",
        help="run the batched bench instead (specsplit.bench.batch): at each batch size, one left-padded "
        f"generate() call over B prompts for each of {','.join(BATCH_DECODERS)} (--decoders may pick "
        "a subset); aggregate tok/s, per-row ms/token p50/p95, and ratios to batch 1 and to hf-batch",
    )
    p.add_argument(
        "--concurrent-clients",
        default=None,
        metavar="N[,N...]",
        help="run the concurrency bench instead: for each N, N client threads (grpc_loop='target', one "
        f"Generate call each) against one batching target worker in this process; decoders {','.join(CLIENT_DECODERS)} "
        f"(default), {CLIENT_LOOP_DECODER} (client loop with a draft worker) and {TARGET_LOOP_MODEL_DECODER} "
        "(a target worker drafting on a draft worker: alone a generation speculates with the draft model, "
        "concurrent ones share batched rounds); those two load the draft model",
    )
    p.add_argument(
        "--client-processes",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="--concurrent-clients: each client a process of its own, as separate programs would be "
        "(default: when --grpc-workers is process); threads share the bench's GIL, so N client loops' "
        "per-round Python runs one at a time",
    )
    add_tuning_flags(p, pipeline=True)
    _set_help(
        p,
        "sync_timing",
        "synchronise the GPU around each phase so the draft/verify split is exact (slower); without it "
        "the split is host-side wall time and the GPU work of a phase may spill into the next",
    )
    p.set_defaults(func=_cmd_bench)


def _set_help(p: argparse.ArgumentParser, dest: str, text: str) -> None:
    """Say what a shared flag means in the bench (the SpecSplit decoders only, not the baselines)."""
    (action,) = (a for a in p._actions if a.dest == dest)
    action.help = text


def _rerender(path: Path) -> int:
    """Write ``<stem>.md`` and ``<stem>.png`` from ``<stem>.json`` (e.g. a GPU run without matplotlib)."""
    result = json.loads(path.read_text(encoding="utf-8"))
    if result.get("schema") != SCHEMA:
        print(f"specsplit bench: {path} is not a {SCHEMA} results file", file=sys.stderr)
        return 2
    # The summary again from the per-run records: a report of an older run gains what the
    # summary has learned to show since (the JSON keeps the records it was computed from).
    records = [RunRecord(**r) for r in result.get("runs", [])]
    cfg = result.get("config", {})
    if records and cfg.get("decoders") and cfg.get("categories"):
        result["summary"] = summarize(records, cfg["decoders"], cfg["categories"], BASELINE, ASSISTED)
    md, png = path.with_suffix(".md"), path.with_suffix(".png")
    md.write_text(_markdown(result), encoding="utf-8")
    print(f"wrote md: {md}")
    if write_plot(result, png):
        print(f"wrote png: {png}")
    return 0


def _tuning_flags(args: argparse.Namespace) -> list[str]:
    """The tuning options given, spelled as ``add_tuning_flags`` names them."""
    parts: list[str] = []
    for name in ("graph_rounds", "prefill_graphs", "fold_gqa", "grpc_streams"):
        value = getattr(args, name)
        if value is not None:
            parts.append(f"--{'' if value else 'no-'}{name.replace('_', '-')}")
    for name in ("attention_kernel", "graph_capacity", "q_top_k", "overlap_policy"):
        value = getattr(args, name)
        if value is not None:
            parts += [f"--{name.replace('_', '-')}", str(value)]
    return parts + (["--sync-timing"] if args.sync_timing else [])


def _command_line(args: argparse.Namespace, device: str) -> str:
    """The command that reproduces this run, every option spelled out with the value used."""
    parts = ["specsplit", "bench", "--suite", args.suite, "--device", device]
    for opt in (
        "draft_device",
        "overlap_draft_device",
        "baseline_repeats",
        "target",
        "draft",
        "max_new_tokens",
        "repeats",
        "prompts_per_category",
        "tag",
    ):
        val = getattr(args, opt)
        if val not in (None, ""):
            parts += [f"--{opt.replace('_', '-')}", str(val)]
    parts += ["--dtype", args.dtype or "auto", "--num-draft-tokens", str(args.num_draft_tokens)]
    if args.chain_confidence:
        parts += ["--chain-confidence", str(args.chain_confidence)]
    if args.dynamic_tree:
        parts += ["--dynamic-tree", args.dynamic_tree]
    if args.frspec_vocab != FRSPEC_VOCAB:
        parts += ["--frspec-vocab", str(args.frspec_vocab)]
    if _lookahead(args.lookahead) != (DEFAULT_LOOKAHEAD, DEFAULT_LOOKAHEAD_LEVELS, DEFAULT_LOOKAHEAD_NODES):
        parts += ["--lookahead", args.lookahead]
    if args.draft_heads:
        parts += ["--draft-heads", args.draft_heads, "--heads-tree", args.heads_tree]
    if args.eagle_heads:
        parts += ["--eagle-heads", args.eagle_heads]
    if args.draft_heads or args.eagle_heads:
        parts += ["--heads-nodes", str(args.heads_nodes)]
    if args.profile_prompts:
        parts += ["--profile-prompts", str(args.profile_prompts)]
    if args.threads:
        parts += ["--threads", str(args.threads)]
    if args.cuda_graphs:
        parts.append("--cuda-graphs")
    if args.compile:
        parts.append("--compile")
    parts += ["--grpc-workers", args.grpc_workers]
    if args.fuse_projections:
        parts.append("--fuse-projections")
    if args.pack_weights is not None:
        parts.append("--pack-weights" if args.pack_weights else "--no-pack-weights")
    if args.draft_quantize != "auto":
        parts += ["--draft-quantize", args.draft_quantize]
    parts += _tuning_flags(args)
    if args.tie_analysis is not None:
        parts.append("--tie-analysis" if args.tie_analysis else "--no-tie-analysis")
    parts += ["--decoders", args.decoders, "--out", str(args.out)]
    if Path(args.prompts).resolve() != DEFAULT_PROMPTS:
        parts += ["--prompts", str(args.prompts)]
    return shlex.join(parts)


def _options(args: argparse.Namespace, device: str) -> BenchOptions:
    """:class:`BenchOptions` from the parsed flags (the tuning ones on top of the configs' defaults)."""
    from specsplit.config import EngineTuning, PipelineTuning

    pipeline = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(PipelineTuning)
        if getattr(args, f.name, None) is not None
    }
    return BenchOptions(
        suite=args.suite,
        device=device,
        draft_device=args.draft_device,
        target=args.target,
        draft=args.draft,
        dtype=args.dtype or "auto",
        max_new_tokens=args.max_new_tokens,
        repeats=args.repeats,
        prompts_per_category=args.prompts_per_category,
        decoders=tuple(d.strip() for d in args.decoders.split(",") if d.strip()),
        num_draft_tokens=args.num_draft_tokens,
        chain_confidence=args.chain_confidence,
        threads=args.threads,
        cuda_graphs=args.cuda_graphs,
        compile=args.compile,
        tuning=EngineTuning(**engine_overrides(args).get("tuning", {})),
        pipeline=PipelineTuning(**pipeline),
        grpc_workers=args.grpc_workers,
        prompts_dir=args.prompts,
        out=args.out,
        tag=args.tag,
        notes=list(args.note),
        command=_command_line(args, device),
        tie_analysis=args.tie_analysis,
        profile_prompts=args.profile_prompts,
        baseline_repeats=args.baseline_repeats,
        overlap_draft_device=args.overlap_draft_device,
        fuse_projections=args.fuse_projections,
        pack_weights=args.pack_weights,
        draft_quantize=args.draft_quantize,
        frspec_vocab=args.frspec_vocab,
        lookahead=_lookahead(args.lookahead),
        draft_heads=args.draft_heads,
        heads_nodes=args.heads_nodes,
        heads_tree=args.heads_tree,
        eagle_heads=args.eagle_heads,
    )


def _lookahead(text: str) -> tuple[int, int, int]:
    """``--lookahead WIDTH[,LEVELS[,NODES]]`` -> ``(width, levels, nodes)`` (the values are checked by
    NgramConfig when the decoders are built)."""
    try:
        fields = lookahead_overrides(text)
    except ConfigError as e:
        raise SystemExit(str(e)) from None
    if fields["lookahead"] == "auto":  # the -lookahead decoders always carry a window: its size only
        raise SystemExit(
            "--lookahead of the bench wants WIDTH[,LEVELS[,NODES]] (the -lookahead decoders' window)"
        )
    return (
        fields["lookahead"],
        fields.get("lookahead_levels", DEFAULT_LOOKAHEAD_LEVELS),
        fields.get("lookahead_nodes", DEFAULT_LOOKAHEAD_NODES),
    )


def _cmd_bench(args: argparse.Namespace) -> int:
    if getattr(args, "verbose", 0) == 0:  # long runs: show progress
        logging.getLogger("specsplit.bench").setLevel(logging.INFO)
    if args.from_json is not None:
        return _rerender(args.from_json)
    check_engine_flags(args)
    device = args.device or ("cuda:0" if torch.cuda.is_available() else "cpu")
    if args.batch_size or args.concurrent_clients:
        return _cmd_batch_bench(args, device)
    opts = _options(args, device)
    try:
        opts.dynamic_tree = _dynamic_tree(args.dynamic_tree)
    except ValueError as e:
        print(f"specsplit bench: error: {e}", file=sys.stderr)
        return 2
    counts = (
        opts.num_draft_tokens,
        opts.max_new_tokens,
        opts.repeats,
        opts.prompts_per_category,
        opts.threads,
        opts.baseline_repeats,
    )
    if opts.profile_prompts < 0:
        print("specsplit bench: --profile-prompts must be >= 0", file=sys.stderr)
        return 2
    if any(x is not None and x < 1 for x in counts):
        print(
            "specsplit bench: --num-draft-tokens, --max-new-tokens, --repeats, --prompts-per-category "
            "and --threads must be >= 1",
            file=sys.stderr,
        )
        return 2
    try:
        result = run_bench(opts)
    except ValueError as e:
        print(f"specsplit bench: error: {e}", file=sys.stderr)
        return 2
    print(_markdown(result))
    for kind, path in result["files"].items():
        print(f"wrote {kind}: {path}")
    return 0


def _cmd_batch_bench(args: argparse.Namespace, device: str) -> int:
    """``specsplit bench --batch-size ...`` (see :mod:`specsplit.bench.batch`)."""
    try:
        clients = tuple(int(x) for x in (args.concurrent_clients or "").split(",") if x.strip())
        sizes = tuple(int(x) for x in (args.batch_size or "").split(",") if x.strip())
        if clients and sizes:
            raise ValueError("--batch-size and --concurrent-clients are two different runs: pick one")
        if args.profile_prompts:
            raise ValueError("--profile-prompts profiles the single-sequence bench's decoders, not this run")
        if any(x < 1 for x in clients + sizes):
            raise ValueError("batch sizes and client counts must be >= 1")
        picked = tuple(d.strip() for d in args.decoders.split(",") if d.strip())
        default = CLIENT_DECODERS if clients else BATCH_DECODERS
        decoders = default if picked == tuple(DEFAULT_DECODERS) else picked
        if set(decoders) - set(default) - (set(DRAFT_WORKER_DECODERS) if clients else set()):
            raise ValueError(f"decoders of this run: {','.join(default)}")
        suite = SUITES[args.suite]
        which = (
            ["--concurrent-clients", args.concurrent_clients]
            if clients
            else ["--batch-size", args.batch_size]
        )
        parts = ["specsplit", "bench", "--suite", args.suite, "--device", device, *which,
                 "--dtype", args.dtype or "auto", "--decoders", ",".join(decoders)]  # fmt: skip
        for flag, value in (("--max-new-tokens", args.max_new_tokens), ("--repeats", args.repeats),
                            ("--threads", args.threads), ("--target", args.target), ("--tag", args.tag)):  # fmt: skip
            if value not in (None, ""):
                parts += [flag, str(value)]
        parts += [f for f, on in (("--cuda-graphs", args.cuda_graphs), ("--compile", args.compile)) if on]
        if clients and args.client_processes is not None:
            parts.append("--client-processes" if args.client_processes else "--no-client-processes")
        opts = BatchBenchOptions(
            batch_sizes=sizes,
            clients=clients,
            workers=args.grpc_workers,
            client_processes=args.client_processes,
            device=device,
            target=args.target,
            draft=args.draft,
            dtype=args.dtype or "auto",
            tiny=suite.tiny,
            max_new_tokens=args.max_new_tokens or suite.max_new_tokens,
            repeats=args.repeats or suite.repeats,
            decoders=decoders,
            cuda_graphs=args.cuda_graphs,
            compile=args.compile,
            pack_weights=args.pack_weights,
            threads=args.threads,
            prompts_dir=args.prompts,
            out=args.out,
            tag=args.tag,
            command=shlex.join(parts),
            notes=list(args.note),
        )
        result = run_batch_bench(opts)
    except ValueError as e:
        print(f"specsplit bench: error: {e}", file=sys.stderr)
        return 2
    print(batch_markdown(result))
    for kind, path in result["files"].items():
        print(f"wrote {kind}: {path}")
    return 0
