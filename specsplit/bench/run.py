"""``specsplit bench``: Hugging Face baselines and SpecSplit decoders on the same prompts, in one process.

Every decoder (a row of :data:`specsplit.bench.decoder_specs.DECODERS`: HF ``generate()``, HF
assisted generation, HF prompt lookup, SpecSplit target-only / chain / static tree / dynamic tree,
SpecSplit over gRPC, ...) gets the same prompts (chat template applied), the same greedy
``GenerationConfig`` (``do_sample=False``, ``max_new_tokens``, EOS and pad ids) and the same loaded
model objects.

The loop is repeat -> prompt -> decoder, so slow drifts of a shared machine hit every decoder alike;
each decoder is warmed up once before timing (one that captures CUDA graphs or compiles: on every
prompt, since each KV bucket's graph is made on first use); CUDA devices are synchronised before and after each
timed call. Results go to ``<out>/<machine>-<date>.{json,md,png}`` (see :mod:`specsplit.bench.report`).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from specsplit.bench.decoder_specs import Workers
from specsplit.bench.decoders import (
    ASSISTED,
    BASELINE,
    DECODERS,
    DEFAULT_DECODERS,
    FRSPEC_VOCAB,
    PROMPT_LOOKUP_TOKENS,
    BuildOptions,
    DecodeOutput,
    Decoder,
    build_decoders,
)
from specsplit.bench.models import load_models
from specsplit.bench.report import (
    RunRecord,
    first_difference,
    machine_info,
    machine_slug,
    rounds_to_counts,
    summarize,
    to_markdown,
    write_plot,
)
from specsplit.bench.roofline import copy_bandwidth, weight_read_bound
from specsplit.config import (
    DEFAULT_LOOKAHEAD,
    DEFAULT_LOOKAHEAD_LEVELS,
    DEFAULT_LOOKAHEAD_NODES,
    EngineTuning,
    PipelineTuning,
)

logger = logging.getLogger(__name__)

SCHEMA = "specsplit-bench/1"
# The categories of benchmarks/prompts, in report order; prompt files may add any others (sorted after).
CATEGORIES = ("chat", "code", "code-editing", "translation", "summarization", "qa", "math")
DEFAULT_PROMPTS = Path(__file__).resolve().parents[2] / "benchmarks" / "prompts"
_ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Suite:
    """A named benchmark size.

    Attributes:
        name: ``smoke``, ``quick`` or ``full``.
        max_new_tokens: tokens generated per prompt.
        repeats: timed repeats (median and spread are reported).
        prompts_per_category: first N prompts of each category (``None``: all).
        tiny: random tiny Llama models built in-process instead of real weights.
    """

    name: str
    max_new_tokens: int
    repeats: int
    prompts_per_category: int | None
    tiny: bool = False


SUITES = {
    "smoke": Suite("smoke", 16, 2, None, tiny=True),
    "quick": Suite("quick", 32, 1, 1),
    "full": Suite("full", 128, 3, None),
}


@dataclass
class BenchPrompt:
    """One prompt: ``messages`` in chat format, ``input_ids`` once tokenized."""

    id: str
    category: str
    messages: list[dict[str, str]] = field(default_factory=list)
    input_ids: list[int] = field(default_factory=list)


@dataclass
class BenchOptions:
    """Everything one bench run needs (the CLI fills it)."""

    suite: str = "smoke"
    device: str = "cpu"
    draft_device: str | None = None
    target: str | None = None
    draft: str | None = None
    dtype: str = "auto"
    max_new_tokens: int | None = None
    repeats: int | None = None
    prompts_per_category: int | None = None
    decoders: tuple[str, ...] = DEFAULT_DECODERS
    num_draft_tokens: int = 4
    chain_confidence: float = 0.0  # the chain tree's TreeConfig.min_confidence (0: every level)
    threads: int | None = None
    cuda_graphs: bool = False  # SpecSplit engines replay their fixed-shape steps from CUDA graphs
    compile: bool = False  # SpecSplit engines fuse those steps with torch.compile
    tuning: EngineTuning = field(default_factory=EngineTuning)  # every SpecSplit engine's A/B switches
    pipeline: PipelineTuning = field(default_factory=PipelineTuning)  # the round loop's A/B switches
    grpc_workers: Workers = "process"  # gRPC workers: separate `specsplit serve` processes or "thread"
    prompts_dir: Path = DEFAULT_PROMPTS
    out: Path = Path("benchmarks/results")
    tag: str = ""
    notes: list[str] = field(default_factory=list)
    command: str = ""
    tie_analysis: bool | None = None  # None: when the dtype is not float32 and an output differs
    baseline_repeats: int | None = None  # HF decoders time only this many repeats (None: all)
    overlap_draft_device: str | None = None  # the overlapped decoders' draft copy goes here
    fuse_projections: bool = False  # SpecSplit decoders run fused-projection copies of the models
    pack_weights: bool | None = None  # ... packed-weight copies (None: where they are float32 on a CPU)
    draft_quantize: str = "auto"  # ... an int8 draft copy ("auto": on a CPU where the int8 kernel pays)
    dynamic_tree: tuple[int, int, int, int] | None = None  # (topk, width, budget, depth) of dynamic trees
    frspec_vocab: int = FRSPEC_VOCAB  # tokens the -frspec decoders' draft output layer scores
    # the -lookahead decoders' window: (width, levels, n-gram nodes beside it)
    lookahead: tuple[int, int, int] = (DEFAULT_LOOKAHEAD, DEFAULT_LOOKAHEAD_LEVELS, DEFAULT_LOOKAHEAD_NODES)
    draft_heads: str | None = None  # the -heads decoders' heads directory
    heads_nodes: int = 32  # tree nodes their guesses take a round
    heads_tree: str = "dynamic"  # their guess tree (TargetConfig.draft_heads_tree)
    eagle_heads: str | None = None  # the -eagle decoders' EAGLE head directory
    profile_prompts: int = 0  # after the timing, profile each SpecSplit decoder's rounds on this many prompts

    def build_options(self) -> BuildOptions:
        """What the SpecSplit decoders are built from (the HF baselines take only ``num_draft_tokens``)."""
        return BuildOptions(
            k=self.num_draft_tokens, chain_confidence=self.chain_confidence, cuda_graphs=self.cuda_graphs,
            compile=self.compile,
            tuning=self.tuning, pipeline=self.pipeline, grpc_workers=self.grpc_workers,
            dynamic_tree=self.dynamic_tree, frspec_vocab=self.frspec_vocab, lookahead=self.lookahead,
            draft_heads=self.draft_heads, heads_nodes=self.heads_nodes, heads_tree=self.heads_tree,
            eagle_heads=self.eagle_heads,
        )  # fmt: skip


def _dynamic_tree(text: str | None) -> tuple[int, int, int, int] | None:
    """``"topk,width,budget,depth"`` -> ints (checked by TreeConfig when the decoders are built)."""
    if not text:
        return None
    try:
        topk, width, budget, depth = (int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--dynamic-tree wants TOPK,WIDTH,BUDGET,DEPTH, got {text!r}") from None
    return topk, width, budget, depth


# --------------------------------------------------------------------------------------------- prompts


def order_categories(names: Iterable[str]) -> list[str]:
    """Distinct category names in report order: :data:`CATEGORIES` first, then the others sorted."""
    distinct = set(names)
    return [c for c in CATEGORIES if c in distinct] + sorted(distinct - set(CATEGORIES))


def load_prompts(directory: Path, per_category: int | None = None) -> list[BenchPrompt]:
    """Read every ``*.jsonl`` in ``directory`` (one ``{id, category, messages}`` object a line).

    Any category name is accepted, so users can bench their own workloads beside the shipped ones.

    Returns:
        Prompts ordered by :func:`order_categories`, then by id; only the first ``per_category`` of
        each category when given.

    Raises:
        ValueError: a malformed entry (a category that is not a plain one-line name, an unknown
            role), or a duplicate id.
    """
    files = sorted(Path(directory).glob("*.jsonl"))
    if not files:
        raise ValueError(f"no *.jsonl prompt files in {directory}")
    seen: dict[str, BenchPrompt] = {}
    for f in files:
        for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            where = f"{f.name}:{n}"
            rec = json.loads(line)
            if not {"id", "category", "messages"} <= set(rec):
                raise ValueError(f"{where}: needs id, category and messages")
            if not _category_name(rec["category"]):
                raise ValueError(
                    f"{where}: category {rec['category']!r} must be a non-empty name on one line, without "
                    "'|' (it heads a Markdown column) or surrounding spaces"
                )
            msgs = rec["messages"]
            if not msgs or any(m.get("role") not in _ROLES or not m.get("content") for m in msgs):
                raise ValueError(f"{where}: messages must be non-empty {{role, content}} with roles {_ROLES}")
            if msgs[-1]["role"] != "user":
                raise ValueError(f"{where}: the last message must be the user's")
            if rec["id"] in seen:
                raise ValueError(f"{where}: duplicate id {rec['id']!r}")
            seen[rec["id"]] = BenchPrompt(rec["id"], rec["category"], msgs)
    out: list[BenchPrompt] = []
    for cat in order_categories(p.category for p in seen.values()):
        group = sorted((p for p in seen.values() if p.category == cat), key=lambda p: p.id)
        out += group[:per_category] if per_category is not None else group
    return out


def _category_name(value: object) -> bool:
    return isinstance(value, str) and value == value.strip() != "" and not any(c in value for c in "|\n\r")


def tokenize_prompts(prompts: list[BenchPrompt], tokenizer: Any) -> None:
    """Fill ``input_ids`` through the tokenizer's chat template (generation prompt added)."""
    for p in prompts:
        text = tokenizer.apply_chat_template(p.messages, tokenize=False, add_generation_prompt=True)
        p.input_ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])


def smoke_prompts(seed: int = 0, vocab: int = 256) -> list[BenchPrompt]:
    """Two prompts of seeded random ids (ids >= 3 keep clear of pad/bos/eos)."""
    g = torch.Generator().manual_seed(seed)
    return [
        BenchPrompt(f"random-{i:02d}", cat, input_ids=torch.randint(3, vocab, (n,), generator=g).tolist())
        for i, (cat, n) in enumerate((("chat", 12), ("code", 24)), 1)
    ]


# --------------------------------------------------------------------------------------------- run


def _sync(devices: Sequence[str]) -> None:
    for d in set(devices):
        if torch.device(d).type == "cuda":
            torch.cuda.synchronize(torch.device(d))


def _timed(
    dec: Decoder, ids: torch.Tensor, max_new: int, devices: Sequence[str]
) -> tuple[DecodeOutput, float]:
    _sync(devices)
    t0 = time.perf_counter()
    out = dec.run(ids, max_new)
    _sync(devices)
    return out, time.perf_counter() - t0


def _measure(
    decoders: list[Decoder],
    prompts: list[BenchPrompt],
    repeats: int,
    max_new: int,
    devices: Sequence[str],
    tokens: dict[tuple[str, str], list[int]] | None = None,
    baseline_repeats: int | None = None,
) -> list[RunRecord]:
    """Warm every decoder up, then time repeat -> prompt -> decoder; mark matches with the baseline.

    ``baseline_repeats``: Hugging Face decoders (``hf-*``) are timed in the first N repeats only
    (they are the slow ones; speedups against a repeat they skipped use their median)."""
    warm = torch.tensor([prompts[0].input_ids[-16:]], dtype=torch.long)
    for dec in decoders:  # first calls pay for lazy init, allocator growth, kernel selection
        t0 = time.perf_counter()
        if dec.shape_warmup:  # one graph (and compile) per KV bucket, made on first use
            for p in prompts:
                _timed(dec, torch.tensor([p.input_ids], dtype=torch.long), max_new, devices)
        else:
            _timed(dec, warm, min(6, max_new), devices)
        logger.info("warm-up %-22s %.2f s", dec.name, time.perf_counter() - t0)
    records: list[RunRecord] = []
    tokens = {} if tokens is None else tokens  # first repeat's new tokens per (decoder, prompt)
    for rep in range(repeats):
        for p in prompts:
            ids = torch.tensor([p.input_ids], dtype=torch.long)
            for dec in decoders:
                if baseline_repeats is not None and rep >= baseline_repeats and dec.name.startswith("hf-"):
                    continue
                out, dt = _timed(dec, ids, max_new, devices)
                drafted, accepted, elig, acc = rounds_to_counts(out.rounds)
                records.append(
                    RunRecord(
                        decoder=dec.name, prompt_id=p.id, category=p.category, repeat=rep,
                        prompt_tokens=len(p.input_ids), new_tokens=len(out.tokens), time_s=dt,
                        rounds=len(out.rounds), drafted=drafted, accepted=accepted,
                        pos_eligible=elig, pos_accepted=acc, split_s=out.split_s,
                    )
                )  # fmt: skip
                tokens.setdefault((dec.name, p.id), out.tokens)
                tps = len(out.tokens) / dt if dt > 0 else 0.0
                logger.info("repeat %d %-16s %-22s %3d tokens %7.2f s (%6.2f tok/s)",
                            rep, p.id, dec.name, len(out.tokens), dt, tps)  # fmt: skip
    for r in records:
        base = tokens.get((BASELINE, r.prompt_id))
        if base is not None:
            mine = tokens[(r.decoder, r.prompt_id)]
            r.matches_baseline = mine == base
            r.first_diff = first_difference(mine, base)
    return records


def spread_prompts(prompts: list[BenchPrompt], count: int) -> list[BenchPrompt]:
    """``count`` prompts that spread over the categories: each category's first, then its second..."""
    by_cat: dict[str, list[BenchPrompt]] = {}
    for p in prompts:
        by_cat.setdefault(p.category, []).append(p)
    cats = order_categories(by_cat)
    picked: list[BenchPrompt] = []
    for i in range(max((len(v) for v in by_cat.values()), default=0)):
        picked += [by_cat[c][i] for c in cats if i < len(by_cat[c])]
    return picked[:count]


def _profile(
    decoders: list[Decoder], prompts: list[BenchPrompt], count: int, max_new: int
) -> dict[str, Any] | None:
    """Each SpecSplit decoder's rounds on ``count`` prompts under the profiler, pooled
    (:func:`~specsplit.bench.profiling.merge_profiles`); decoders without a profile are left out, and
    one whose profile fails gets the error's text instead. None when ``count`` is 0."""
    if count <= 0:
        return None
    from specsplit.bench.profiling import merge_profiles

    chosen = spread_prompts(prompts, count)
    out: dict[str, Any] = {}
    for dec in decoders:
        if dec.profile is None:
            continue
        t0 = time.perf_counter()
        try:
            runs = [dec.profile(torch.tensor([p.input_ids], dtype=torch.long), max_new) for p in chosen]
        except Exception as e:  # a report with one decoder's reason beats no report at all
            logger.warning("profiling %s failed: %s", dec.name, e)
            out[dec.name] = f"profiling failed: {type(e).__name__}: {e}"
            continue
        out[dec.name] = merge_profiles(runs, [p.id for p in chosen])
        logger.info("profiled %-22s on %d prompts in %.1f s", dec.name, len(chosen), time.perf_counter() - t0)
    return out


def pack_copies(pack_weights: bool | None, compile: bool, decoders: Any) -> bool:
    """Whether the SpecSplit decoders run packed-weight copies: unless ``--no-pack-weights``, and not
    when any of them compiles (torch.compile cannot lower packed weights; they all share the copies)."""
    compiles = compile or any(str(d).endswith("-compiled") for d in decoders)
    if pack_weights and compiles:
        raise ValueError("--pack-weights and compiled decoders exclude each other: torch.compile cannot "
                         "lower packed oneDNN weights")  # fmt: skip
    if compiles and pack_weights is None:
        logger.info("compiled decoders: the weights stay unpacked (torch.compile packs what it compiles)")
    return pack_weights is not False and not compiles


def int8_copy(opts: BenchOptions, draft: Any) -> bool:
    """Whether the SpecSplit decoders' draft copy gets int8 weights (``--draft-quantize``): as the
    engines decide for a draft they load themselves (``"auto"``: not compiled, and the int8 kernel
    pays on this machine)."""
    if draft is None:
        return False
    from specsplit.runtime.int8 import wants_int8

    compiles = opts.compile or any(str(d).endswith("-compiled") for d in opts.decoders)
    return wants_int8(opts.draft_quantize, draft, excluded=compiles)


def run_bench(opts: BenchOptions) -> dict[str, Any]:
    """Run the suite and write ``<out>/<machine>-<date>[...].{json,md,png}``.

    Returns:
        The results dict written to the JSON file, with ``"files"`` naming what was written.
    """
    suite = SUITES[opts.suite]
    max_new = opts.max_new_tokens or suite.max_new_tokens
    repeats = opts.repeats or suite.repeats
    unknown = set(opts.decoders) - set(DECODERS)
    if unknown:
        raise ValueError(f"unknown decoders {sorted(unknown)}; choose from {', '.join(DECODERS)}")
    old_threads = torch.get_num_threads()
    if opts.threads:
        torch.set_num_threads(opts.threads)
    try:
        return _run(opts, suite, max_new, repeats)
    finally:
        torch.set_num_threads(old_threads)


def _weight_read_bound(target: torch.nn.Module, device: str) -> dict[str, Any] | None:
    """The target's weight-read bound on a CUDA ``device`` (None elsewhere, or if it cannot be measured:
    a report line is not worth a run)."""
    if torch.device(device).type != "cuda":
        return None
    try:
        bound = weight_read_bound(target, copy_bandwidth(device))
    except Exception as e:  # e.g. no room for the copy's buffers beside the models
        logger.warning("weight-read bound not measured: %s", e)
        return None
    logger.info(
        "weight-read bound of the target: %.2f GB at %.0f GB/s = %.3f ms a token",
        bound["weight_bytes"] / 1e9, bound["copy_bandwidth_GBps"], bound["bound_ms"],
    )  # fmt: skip
    return bound


def _run(opts: BenchOptions, suite: Suite, max_new: int, repeats: int) -> dict[str, Any]:
    load0 = os.getloadavg()
    t_start = time.perf_counter()
    models = load_models(suite.tiny, opts.device, opts.draft_device, opts.target, opts.draft, opts.dtype)
    if suite.tiny:
        prompts = smoke_prompts()
    else:
        per_cat = (
            opts.prompts_per_category if opts.prompts_per_category is not None else suite.prompts_per_category
        )
        prompts = load_prompts(opts.prompts_dir, per_cat)
        tokenize_prompts(prompts, models.tokenizer)
    if opts.overlap_draft_device:
        models.use_overlap_device(opts.overlap_draft_device)
    if opts.fuse_projections:
        logger.info("fused the projections of %d modules in the SpecSplit decoders' copies",
                    models.use_fused_projections())  # fmt: skip
    elif models.use_cpu_weights(
        pack_copies(opts.pack_weights, opts.compile, opts.decoders), int8_copy(opts, models.draft)
    ):
        logger.info(
            "SpecSplit decoders' copies: packed weights %s, int8 draft %s", models.packed, models.int8_draft
        )
    devices = [models.device, models.draft_device] + (
        [models.overlap_draft_device] if models.overlap_draft_device else []
    )
    bound = _weight_read_bound(models.target, models.device)  # before any graph holds memory
    decoders, skipped = build_decoders(models, opts.decoders, opts.build_options())
    logger.info(
        "%d prompts x %d decoders x %d repeats, %d new tokens", len(prompts), len(decoders), repeats, max_new
    )
    new_tokens: dict[tuple[str, str], list[int]] = {}
    try:
        records = _measure(decoders, prompts, repeats, max_new, devices, new_tokens, opts.baseline_repeats)
        profiles = _profile(decoders, prompts, opts.profile_prompts, max_new)
    finally:
        for dec in decoders:
            dec.close()
    names = [d.name for d in decoders]
    categories = order_categories(p.category for p in prompts)
    info = machine_info(devices)
    info["slug"] = machine_slug(info)
    notes = list(opts.notes)
    load1 = os.getloadavg()
    if all(torch.device(d).type == "cpu" for d in devices):
        notes.append(
            f"CPU timings: the cores may be shared with other processes, so absolute numbers are noisy; "
            f"1-minute load average {load0[0]:.1f} at start and {load1[0]:.1f} at end on {info['cpu_cores']} cores"
        )
    now = time.gmtime()
    result: dict[str, Any] = {
        "schema": SCHEMA,
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", now),
        "command": opts.command,
        "machine": info,
        "config": {
            "suite": suite.name,
            "target": models.target_name,
            "draft": models.draft_name,
            "dtype": models.dtype,
            "device": models.device,
            "draft_device": models.draft_device,
            "max_new_tokens": max_new,
            "repeats": repeats,
            "baseline_repeats": min(repeats, opts.baseline_repeats or repeats),
            "overlap_draft_device": models.overlap_draft_device,
            "sync_timing": opts.pipeline.sync_timing,
            "graph_rounds": opts.tuning.graph_rounds,
            "target_graph_rounds": opts.tuning.graph_rounds,  # its name in results written before
            "prefill_graphs": opts.tuning.prefill_graphs,
            "engine_tuning": asdict(opts.tuning),
            "pipeline_tuning": asdict(opts.pipeline),
            "fuse_projections": opts.fuse_projections,
            "pack_weights": models.packed,
            "int8_draft": models.int8_draft,
            "weight_read_bound": bound,
            "num_draft_tokens": opts.num_draft_tokens,
            "chain_confidence": opts.chain_confidence,
            "dynamic_tree": list(opts.dynamic_tree) if opts.dynamic_tree else None,
            "frspec_vocab": opts.frspec_vocab,
            "lookahead": list(opts.lookahead),
            "draft_heads": opts.draft_heads,
            "heads_nodes": opts.heads_nodes,
            "heads_tree": opts.heads_tree,
            "eagle_heads": opts.eagle_heads,
            "cuda_graphs": opts.cuda_graphs,
            "compile": opts.compile,
            "grpc_workers": opts.grpc_workers,
            "prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS,
            "num_prompts": len(prompts),
            "prompt_ids": [p.id for p in prompts],
            "categories": categories,
            "decoders": names,
            "skipped": skipped,
            "greedy": True,
            "eos_token_ids": models.eos_token_ids,
        },
        "decoder_labels": {d.name: d.label for d in decoders},
        "notes": notes,
        "wall_time_s": time.perf_counter() - t_start,
        "summary": summarize(records, names, categories, BASELINE, ASSISTED),
        "runs": [asdict(r) for r in records],
    }
    if profiles:
        result["config"]["profile_prompts"] = opts.profile_prompts
        result["profiles"] = profiles
    from specsplit.bench.ties import bench_tie_analysis  # greedy mismatches: near-ties or not?

    ties = bench_tie_analysis(models, prompts, new_tokens, BASELINE, opts.tie_analysis)
    if ties is not None:
        result["tie_analysis"] = ties
    stem = f"{info['slug']}-{time.strftime('%Y-%m-%d', now)}" + ("-smoke" if suite.tiny else "")
    stem += f"-{opts.tag}" if opts.tag else ""
    opts.out.mkdir(parents=True, exist_ok=True)
    files = {
        "json": opts.out / f"{stem}.json",
        "md": opts.out / f"{stem}.md",
        "png": opts.out / f"{stem}.png",
    }
    files["md"].write_text(_markdown(result), encoding="utf-8")
    if not write_plot(result, files["png"]):
        del files["png"]
    result["files"] = {k: str(v) for k, v in files.items()}
    files["json"].write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return result


def _markdown(result: dict[str, Any]) -> str:
    """The report's markdown, with the near-tie analysis section when the run has one."""
    from specsplit.bench.profiling import profiles_markdown
    from specsplit.bench.ties import to_markdown as ties_markdown

    return (
        to_markdown(result)
        + profiles_markdown(result.get("profiles"))
        + ties_markdown(result.get("tie_analysis"))
    )
