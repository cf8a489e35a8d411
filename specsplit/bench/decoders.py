"""Build the decoders ``specsplit bench`` compares, over ONE set of loaded models.

What each decoder is lives in :data:`specsplit.bench.decoder_specs.DECODERS` (one row per name);
:func:`build_decoders` turns rows into runnable :class:`Decoder` objects, reading nothing but a row's
fields and the run's options (:class:`BuildOptions`: the bench's engine and tuning flags, which a
row's fields override).

Every decoder gets the same greedy ``GenerationConfig`` (:meth:`BenchModels.generation_config`) and
returns the new tokens plus ``(drafted depth, accepted)`` per round, so tau and acceptance by depth
are comparable across libraries.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from specsplit.bench.decoder_specs import (
    ASSISTED,
    BASELINE,
    DECODERS,
    DEFAULT_DECODERS,
    OPTIONAL_DECODERS,
    DecoderSpec,
    HfMode,
    Workers,
)
from specsplit.bench.models import BenchModels, load_models, tiny_models
from specsplit.config import (
    DEFAULT_LOOKAHEAD,
    DEFAULT_LOOKAHEAD_LEVELS,
    DEFAULT_LOOKAHEAD_NODES,
    EngineTuning,
    NgramConfig,
    PipelineTuning,
    TreeConfig,
)

logger = logging.getLogger(__name__)

__all__ = [
    "ASSISTED", "BASELINE", "DECODERS", "DEFAULT_DECODERS", "OPTIONAL_DECODERS", "BenchModels",
    "BuildOptions", "DecodeOutput", "Decoder", "DecoderSpec", "build_decoder", "build_decoders",
    "load_models", "tiny_models",
]  # fmt: skip

FUSED_WORDS = ", fused q/k/v and gate/up projections"  # label words of the decoders that run fused copies
PACKED_WORDS = ", packed CPU weights"  # ... and of those that run packed copies
INT8_WORDS = ", int8 draft"  # ... and of those whose draft model runs an int8 copy
PROMPT_LOOKUP_TOKENS = 10
FRSPEC_VOCAB = 32768  # tokens the -frspec decoders' draft scores (FR-Spec's size for a 128k vocabulary)


@dataclass
class DecodeOutput:
    """What one decoder call returns: new tokens, ``(drafted depth, accepted)`` per round, time split."""

    tokens: list[int]
    rounds: list[tuple[int, int]]
    split_s: dict[str, float] | None = None


@dataclass
class Decoder:
    """A named way to generate: ``run(input_ids [1, prompt], max_new_tokens) -> DecodeOutput``."""

    name: str
    label: str
    run: Callable[[torch.Tensor, int], DecodeOutput]
    close: Callable[[], None] = lambda: None
    config: Any = None  # the SpecSplitConfig of a local SpecSplit decoder
    shape_warmup: bool = False  # captures graphs / compiles per shape: warm up on every prompt
    # ``run`` once more under the profiler: profiling.round_timeline's summary (SpecSplit decoders)
    profile: Callable[[torch.Tensor, int], dict[str, Any]] | None = None


# --------------------------------------------------------------------------------------------- decoders


class _RoundRecorder:
    """Records ``(candidates, matches)`` of each HF assisted-decoding round.

    HF reports neither; its loop calls ``candidate_generator.update_candidate_strategy(input_ids,
    scores, num_matches)`` once per round with `scores` `[1, candidates + 1, vocab]`, so this wraps
    the instance's ``_get_candidate_generator`` for the duration of one call. Values are read after
    the timed region (``num_matches`` may be a device tensor).
    """

    def __init__(self, model: Any):
        self.model = model
        self.raw: list[tuple[int, Any]] = []

    def __enter__(self) -> _RoundRecorder:
        bound = self.model._get_candidate_generator
        raw = self.raw

        def patched(*args: Any, **kwargs: Any) -> Any:
            gen = bound(*args, **kwargs)
            update = gen.update_candidate_strategy

            def recording(input_ids: Any, scores: torch.Tensor, num_matches: Any) -> Any:
                raw.append((int(scores.shape[1]) - 1, num_matches))
                return update(input_ids, scores, num_matches)

            gen.update_candidate_strategy = recording
            return gen

        self.model.__dict__["_get_candidate_generator"] = patched
        return self

    def __exit__(self, *exc: object) -> None:
        self.model.__dict__.pop("_get_candidate_generator", None)

    def rounds(self) -> list[tuple[int, int]]:
        return [(d, int(m)) for d, m in self.raw]


def _assistant_config(base: Any, constant_k: int | None) -> Any:
    """The draft's generation config for one assisted call (HF reads the schedule from the assistant)."""
    from transformers import GenerationConfig

    gc = copy.deepcopy(base)
    defaults = GenerationConfig()._get_default_generation_params()
    if constant_k is None:  # the library's defaults, reset at every call (some are adapted in place)
        for k in ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold"):
            setattr(gc, k, defaults[k])
    else:
        gc.num_assistant_tokens = constant_k
        gc.num_assistant_tokens_schedule = "constant"
        gc.assistant_confidence_threshold = 0.0  # 0 disables the early stop: exactly K tokens a round
    return gc


def _hf_decoder(name: str, label: str, m: BenchModels, mode: HfMode, k: int) -> Decoder:
    """transformers' ``generate()``: plain, assisted by the draft (``k`` tokens a round, constant, or
    the library's default schedule) or prompt lookup (``mode``: :attr:`DecoderSpec.hf_mode`)."""
    lookup = mode == "prompt-lookup"
    assistant_defaults = mode == "assisted-default"
    assisted_k = k if mode == "assisted" else None
    base_draft_gc = copy.deepcopy(m.draft.generation_config) if m.draft is not None else None
    speculative = lookup or assisted_k is not None or assistant_defaults

    @torch.inference_mode()
    def run(ids: torch.Tensor, max_new: int) -> DecodeOutput:
        gc = m.generation_config(max_new)
        kwargs: dict[str, Any] = {}
        if lookup:
            gc.prompt_lookup_num_tokens = PROMPT_LOOKUP_TOKENS
        elif assisted_k is not None or assistant_defaults:
            assert m.draft is not None
            m.draft.generation_config = _assistant_config(
                base_draft_gc, None if assistant_defaults else assisted_k
            )
            kwargs["assistant_model"] = m.draft
        ids = ids.to(m.device)
        with _RoundRecorder(m.target) as rec:
            out = m.target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gc,
                                    **kwargs)  # fmt: skip
        if m.draft is not None:
            m.draft.generation_config = copy.deepcopy(base_draft_gc)
        new = out[0, ids.shape[1] :].tolist()
        rounds = rec.rounds() if speculative else [(0, 0)] * len(new)
        return DecodeOutput(new, rounds)

    return Decoder(name, label, run)


def _specsplit_decoder(
    name: str, label: str, m: BenchModels, gen: Any, close: Callable[[], None], shape_warmup: bool = False
) -> Decoder:
    def forget() -> None:
        forget = getattr(gen, "forget_generations", None)
        if forget is not None:  # a prompt must not draft from its own earlier runs (warm-up, repeats)
            forget()

    def profile(ids: torch.Tensor, max_new: int) -> dict[str, Any]:
        from specsplit.bench.profiling import round_timeline

        forget()
        return round_timeline(gen, ids, generation_config=m.generation_config(max_new))

    def run(ids: torch.Tensor, max_new: int) -> DecodeOutput:
        forget()
        out = gen.generate(ids, generation_config=m.generation_config(max_new), return_dict_in_generate=True)
        rs = out.spec_stats.rounds
        split = {
            "draft": sum(r.draft_s for r in rs),
            "verify": sum(r.verify_s for r in rs),
            "transport": sum(r.transport_s for r in rs),
            "host": sum(r.host_s for r in rs),
            "overlap_draft": sum(r.overlap_draft_s for r in rs),
            "spec_rounds": float(out.spec_stats.spec_rounds),
            "spec_hits": float(out.spec_stats.spec_hits),
        }
        for r in rs:  # rounds and draft seconds per drafter (the cost model's mix)
            kind = r.drafter or ("model" if r.drafted_depth else "none")
            split[f"rounds_{kind}"] = split.get(f"rounds_{kind}", 0.0) + 1.0
            split[f"draft_{kind}_s"] = split.get(f"draft_{kind}_s", 0.0) + r.draft_s
        new = out.sequences[0, ids.shape[1] :].tolist()
        return DecodeOutput(new, [(r.drafted_depth, r.accepted) for r in rs], split)

    return Decoder(
        name,
        label,
        run,
        close,
        config=getattr(gen, "config", None),
        shape_warmup=shape_warmup,
        profile=profile,
    )


def _tree_words(tree: Any) -> str:
    """A tree shape in words, for decoder labels."""
    if tree.shape == "chain":
        stop = f", stops below q {tree.min_confidence:g}" if tree.min_confidence > 0 else ""
        return f"chain of K={tree.num_draft_tokens}{stop}"
    if tree.shape == "static":
        return f"static tree ({tree.max_nodes} nodes, depth {tree.depth_limit})"
    return f"dynamic tree (top-{tree.topk}, width {tree.width}, budget {tree.budget}, depth {tree.max_depth})"


# --------------------------------------------------------------------------------------------- build


@dataclass
class BuildOptions:
    """The run's settings every SpecSplit decoder starts from (a spec's fields override them).

    Attributes:
        k: draft tokens a round of ``hf-assisted`` and of the chain tree.
        chain_confidence: the chain tree's ``TreeConfig.min_confidence``.
        cuda_graphs: engines replay their fixed-shape steps from CUDA graphs (eager on CPU).
        compile: engines fuse those steps with ``torch.compile`` first.
        tuning: every engine's A/B switches (``--graph-rounds``, ``--prefill-graphs``, ...), draft and
            target, local engines and gRPC workers alike.
        pipeline: the round loop's switches (``--overlap-policy``, ``--grpc-streams``,
            ``--sync-timing``; the last only where a CUDA device takes part).
        grpc_workers: gRPC workers as separate ``specsplit serve`` processes (real models; the tiny
            smoke models always run in-process) or as servers in this process.
        dynamic_tree: ``(topk, width, budget, depth)`` of the dynamic tree (default
            :class:`TreeConfig`'s).
        frspec_vocab: tokens the ``-frspec`` decoders' draft output layer scores.
        lookahead: ``(width, levels, n-gram nodes)`` of the ``-lookahead`` decoders' rounds.
        draft_heads: the ``-heads`` decoders' draft heads directory (``None``: they are skipped).
        heads_nodes: tree nodes their guesses take a round (``TargetConfig.draft_heads_nodes``).
        heads_tree: their guess tree (``TargetConfig.draft_heads_tree``).
        eagle_heads: the ``-eagle`` decoders' EAGLE head directory (``None``: they are skipped); its
            tree takes ``heads_nodes`` nodes too.
    """

    k: int = 4
    chain_confidence: float = 0.0
    cuda_graphs: bool = False
    compile: bool = False
    tuning: EngineTuning = field(default_factory=EngineTuning)
    pipeline: PipelineTuning = field(default_factory=PipelineTuning)
    grpc_workers: Workers = "process"
    dynamic_tree: tuple[int, int, int, int] | None = None
    frspec_vocab: int = FRSPEC_VOCAB
    lookahead: tuple[int, int, int] = (DEFAULT_LOOKAHEAD, DEFAULT_LOOKAHEAD_LEVELS, DEFAULT_LOOKAHEAD_NODES)
    draft_heads: str | None = None
    heads_nodes: int = 32
    heads_tree: str = "dynamic"
    eagle_heads: str | None = None


@dataclass
class _Plan:
    """A SpecSplit spec resolved against the run: what its engines and round loop get."""

    graphs: bool
    compile: bool
    draft_tuning: EngineTuning
    target_tuning: EngineTuning
    pipeline: PipelineTuning
    tree: TreeConfig
    draft: Any  # the draft model this decoder runs (None: target-only)
    draft_device: str
    processes: bool  # gRPC workers as `specsplit serve` processes
    vocab_subset: int | None = None  # the draft's restricted output layer (-frspec decoders)


def _trees(opts: BuildOptions) -> dict[str, TreeConfig]:
    """The run's trees by :attr:`DecoderSpec.tree` key (fresh objects: each decoder owns its config)."""
    dyn = opts.dynamic_tree
    return {
        "chain": TreeConfig(shape="chain", num_draft_tokens=opts.k, min_confidence=opts.chain_confidence),
        "static": TreeConfig(shape="static"),
        "dynamic": TreeConfig(shape="dynamic")
        if dyn is None
        else TreeConfig("dynamic", topk=dyn[0], width=dyn[1], budget=dyn[2], max_depth=dyn[3]),
    }


def _plan(m: BenchModels, spec: DecoderSpec, opts: BuildOptions, sync: bool) -> _Plan:
    """The spec's fields over the run's options (a field left ``None`` follows the flag)."""
    graphs = opts.cuda_graphs or spec.compile
    padded = opts.tuning.prefill_graphs if spec.prefill_graphs is None else spec.prefill_graphs
    target_tuning = dataclasses.replace(opts.tuning, prefill_graphs=padded and graphs)  # a graph-path step
    rounds = opts.tuning.graph_rounds if spec.draft_graph_rounds is None else spec.draft_graph_rounds
    streams = opts.pipeline.grpc_streams if spec.grpc_streams is None else spec.grpc_streams
    on_overlap_device = spec.draft_placement == "overlap-device"
    draft = m.specsplit_draft if spec.uses_draft_model else None
    if on_overlap_device and m.overlap_draft is not None and draft is not None:
        draft = m.overlap_draft
    return _Plan(
        graphs=graphs,
        compile=opts.compile or spec.compile,
        draft_tuning=dataclasses.replace(target_tuning, graph_rounds=rounds),
        target_tuning=target_tuning,
        pipeline=dataclasses.replace(
            opts.pipeline, grpc_streams=streams, sync_timing=sync, ngram=_ngram_settings(opts, spec)
        ),
        tree=_trees(opts)[spec.tree],
        draft=draft,
        draft_device=(m.overlap_draft_device or m.draft_device) if on_overlap_device else m.draft_device,
        processes=(spec.workers or opts.grpc_workers) == "process",
        vocab_subset=opts.frspec_vocab if spec.draft_vocab else None,
    )


def _ngram_settings(opts: BuildOptions, spec: DecoderSpec) -> NgramConfig:
    """The run's n-gram settings, with the spec's lookahead window (the run's width) or none."""
    ngram = opts.pipeline.ngram
    width, levels, nodes = opts.lookahead
    if spec.heads:
        ngram = dataclasses.replace(ngram, guess_policy=spec.guesses)
    if not spec.lookahead:  # fixed rounds for the heads' guesses only, beside as many n-gram nodes
        policy = spec.heads or ngram.lookahead_policy
        return dataclasses.replace(ngram, lookahead=0, lookahead_nodes=nodes, lookahead_policy=policy)
    return dataclasses.replace(
        ngram, lookahead=width, lookahead_levels=levels, lookahead_nodes=nodes,
        lookahead_policy=spec.lookahead,
    )  # fmt: skip


def _lookahead_words(opts: BuildOptions) -> str:
    width, levels, nodes = opts.lookahead
    return f"{levels} rows of {width} beside {nodes} n-gram nodes"


def _label(m: BenchModels, spec: DecoderSpec, opts: BuildOptions, plan: _Plan | None) -> str:
    """The spec's label filled in, plus the words the run's flags add to a SpecSplit decoder."""
    tree = plan.tree if plan is not None else _trees(opts)[spec.tree]
    text = spec.label.format(k=opts.k, lookup=PROMPT_LOOKUP_TOKENS, vocab=opts.frspec_vocab,
                             lookahead=_lookahead_words(opts), heads=f"{opts.heads_nodes} nodes, {opts.heads_tree} tree", eagle=f"{opts.heads_nodes} nodes",
                             tree=_tree_words(tree), device=m.device,
                             draft_device=plan.draft_device if plan is not None else m.draft_device)  # fmt: skip
    if plan is None:
        return text
    flags = [w for w, on in (("CUDA graphs", opts.cuda_graphs), ("torch.compile", opts.compile)) if on]
    if flags and not spec.compile:
        text += ", " + ", ".join(flags)
    text += FUSED_WORDS if m.fused else ""
    text += PACKED_WORDS if m.packed else ""
    text += INT8_WORDS if m.int8_draft and spec.uses_draft_model else ""
    if plan.graphs and spec.prefill_graphs is None and not opts.tuning.prefill_graphs:
        text += ", eager prompt forwards"
    if spec.grpc:
        text += (
            ", draft and target workers as separate processes on loopback"
            if _worker_processes(m, plan)
            else ", both workers in-process on loopback"
        )
    return text


def _worker_processes(m: BenchModels, plan: _Plan) -> bool:
    """Workers as processes: they load the models by name (not the tiny in-memory ones or a self-draft)."""
    return plan.processes and m.tokenizer is not None and not m.draft_name.startswith("self:")


def _worker_args(m: BenchModels, plan: _Plan, tuning: EngineTuning, draft: bool = False) -> list[str]:
    """``specsplit serve`` options that give a worker's engine the settings of a local one."""
    args = (["--cuda-graphs"] if plan.graphs else []) + (["--compile"] if plan.compile else [])
    if plan.graphs:
        args.append("--prefill-graphs" if tuning.prefill_graphs else "--no-prefill-graphs")
    args.append("--graph-rounds" if tuning.graph_rounds else "--no-graph-rounds")
    default = EngineTuning()
    args += [] if tuning.fold_gqa else ["--no-fold-gqa"]
    for name in ("attention_kernel", "graph_capacity", "q_top_k"):
        if getattr(tuning, name) != getattr(default, name):
            args += [f"--{name.replace('_', '-')}", str(getattr(tuning, name))]
    if draft:
        args += ["--draft-quantize", "int8" if m.int8_draft else "none"]
    args.append("--pack-weights" if m.packed and not (draft and m.int8_draft) else "--no-pack-weights")
    return args + (["--fuse-projections"] if m.fused else [])


def _grpc_decoder(m: BenchModels, spec: DecoderSpec, plan: _Plan, label: str) -> Decoder | str:
    """The draft and target workers on loopback ports: separate ``specsplit serve`` processes or
    servers inside this process. A string says why the decoder is unavailable."""
    try:
        from specsplit.remote import serve_draft, serve_target
        from specsplit.remote.launch import WorkerProcess
    except ImportError as e:
        return f"specsplit.remote is not importable ({e})"
    from specsplit.config import DraftConfig, SpecSplitConfig, TargetConfig
    from specsplit.engines.draft import DraftEngine
    from specsplit.engines.target import TargetEngine
    from specsplit.generator import SpecSplitGenerator

    target_loop = spec.transport == "grpc-target"
    loop: Literal["client", "target"] = "target" if target_loop else "client"
    streams = plan.pipeline.grpc_streams
    if _worker_processes(m, plan):
        workers = [WorkerProcess("draft", m.draft_name, device=plan.draft_device, dtype=m.dtype,
                                 args=_worker_args(m, plan, plan.draft_tuning, draft=True))]  # fmt: skip
        try:
            workers[0].start()
            peer = ["--draft-address", workers[0].address] if target_loop else []
            # the draft worker compiles a new shape on its first call, which may outlast the default deadline
            peer += ["--draft-timeout", "600"] if target_loop and plan.compile else []
            peer += [] if streams or not target_loop else ["--no-grpc-streams"]
            peer += [] if spec.tree_ipc or not target_loop else ["--no-tree-ipc"]
            workers.append(WorkerProcess("target", m.target_name, device=m.device, dtype=m.dtype,
                                         args=_worker_args(m, plan, plan.target_tuning) + peer))  # fmt: skip
            workers[1].start()
        except Exception:
            for w in workers:
                w.stop(grace=1.0)
            raise
        # the workers' devices belong to other processes: nothing here to synchronise
        cfg = SpecSplitConfig(transport="grpc", draft_address=workers[0].address,
                              target_address=workers[1].address, tree=plan.tree, timeout_s=600.0,
                              overlap=spec.overlap, grpc_loop=loop,
                              tuning=dataclasses.replace(plan.pipeline, sync_timing=False))  # fmt: skip
        pgen = SpecSplitGenerator(None, None, tokenizer=m.tokenizer, config=cfg)

        def close_processes() -> None:
            pgen.close()
            for w in workers:
                w.stop()

        return _specsplit_decoder(spec.name, label, m, pgen, close_processes, plan.graphs or plan.compile)

    d_engine = DraftEngine(
        plan.draft, DraftConfig(cuda_graphs=plan.graphs, compile=plan.compile, tuning=plan.draft_tuning)
    )
    t_engine = TargetEngine(
        m.specsplit_target,
        TargetConfig(cuda_graphs=plan.graphs, compile=plan.compile, tuning=plan.target_tuning),
    )
    d_srv = serve_draft(d_engine, port=0, host="127.0.0.1")
    t_srv = serve_target(t_engine, port=0, host="127.0.0.1",
                         draft_address=d_srv.address if target_loop else None,
                         draft_streams=streams, tree_slots=spec.tree_ipc)  # fmt: skip
    cfg = SpecSplitConfig(transport="grpc", draft_address=d_srv.address, target_address=t_srv.address,
                          tree=plan.tree, timeout_s=600.0, overlap=spec.overlap, grpc_loop=loop,
                          tuning=plan.pipeline)  # fmt: skip
    gen = SpecSplitGenerator(None, None, tokenizer=m.tokenizer, config=cfg)

    def close() -> None:
        gen.close()
        for srv in (d_srv, t_srv):
            srv.stop(grace=1.0, shutdown_engine=True)

    return _specsplit_decoder(spec.name, label, m, gen, close, plan.graphs or plan.compile)


def _local_decoder(
    m: BenchModels, spec: DecoderSpec, plan: _Plan, label: str, opts: BuildOptions | None = None
) -> Decoder:
    from specsplit.config import DraftConfig, SpecSplitConfig, TargetConfig
    from specsplit.generator import SpecSplitGenerator

    target, heads, nodes = m.specsplit_target, None, 32
    path = None if opts is None else opts.eagle_heads if spec.eagle else opts.draft_heads
    if spec.heads and opts is not None and path:
        target, heads, nodes = m.heads_target(eagle=spec.eagle), path, opts.heads_nodes

    cfg = SpecSplitConfig(
        drafter=spec.drafter,
        tree=plan.tree,
        tuning=plan.pipeline,
        draft=DraftConfig(
            cuda_graphs=plan.graphs,
            compile=plan.compile,
            tuning=plan.draft_tuning,
            vocab_subset=plan.vocab_subset,
        ),  # fmt: skip
        target=TargetConfig(
            cuda_graphs=plan.graphs,
            compile=plan.compile,
            tuning=plan.target_tuning,
            draft_heads=heads,
            draft_heads_nodes=nodes,
            draft_heads_tree=opts.heads_tree if opts is not None else "dynamic",
        ),  # fmt: skip
        overlap=spec.overlap,
    )
    gen = SpecSplitGenerator(target, plan.draft, tokenizer=m.tokenizer, config=cfg)
    return _specsplit_decoder(spec.name, label, m, gen, gen.close, plan.graphs or plan.compile)


def check_buildable(spec: DecoderSpec) -> None:
    """Raise ``ValueError`` for a spec the bench cannot build yet."""
    if spec.kind == "specsplit" and spec.grpc and spec.drafter != "model":
        raise ValueError(
            f"decoder {spec.name}: drafter {spec.drafter!r} over gRPC is not built yet (the bench starts a "
            "draft-model worker, and a target worker that runs the rounds drafts with the model); "
            "use a local decoder"
        )


def build_decoder(m: BenchModels, spec: DecoderSpec, opts: BuildOptions, sync: bool = False) -> Decoder | str:
    """One decoder from its spec, or a string saying why it is skipped.

    Args:
        m: the shared models.
        spec: what to build (a row of :data:`DECODERS`, or any other spec).
        opts: the run's settings the spec's fields override.
        sync: the round loop synchronises devices around its phases (``PipelineTuning.sync_timing``).

    Raises:
        ValueError: the spec cannot be built yet (:func:`check_buildable`).
    """
    check_buildable(spec)
    if spec.needs_draft and m.draft is None:
        return "no draft model"
    if spec.heads and spec.eagle and not opts.eagle_heads:
        return "no EAGLE head (--eagle-heads DIR, trained with `specsplit heads train --kind eagle`)"
    if spec.heads and not spec.eagle and not opts.draft_heads:
        return "no draft heads (--draft-heads DIR, trained with `specsplit heads train`)"
    if spec.kind == "hf":
        assert spec.hf_mode is not None
        return _hf_decoder(spec.name, _label(m, spec, opts, None), m, spec.hf_mode, opts.k)
    plan = _plan(m, spec, opts, sync)
    if spec.prefill_graphs and not plan.graphs:
        return "prompts padded for CUDA graphs: needs --cuda-graphs (or its -compiled twin)"
    label = _label(m, spec, opts, plan)
    if spec.grpc:
        return _grpc_decoder(m, spec, plan, label)
    return _local_decoder(m, spec, plan, label, opts)


def build_decoders(
    m: BenchModels, names: Sequence[str], opts: BuildOptions | None = None
) -> tuple[list[Decoder], dict[str, str]]:
    """The named decoders (in :data:`DECODERS` order) and ``{skipped name: reason}``.

    Args:
        m: the shared models.
        names: rows of :data:`DECODERS` to build.
        opts: the run's settings (default :class:`BuildOptions`'s).

    Raises:
        ValueError: an unknown name, or a row that cannot be built yet.
    """
    opts = opts or BuildOptions()
    unknown = sorted(set(names) - set(DECODERS))
    if unknown:
        raise ValueError(f"unknown decoders {unknown}; choose from {', '.join(DECODERS)}")
    specs = [spec for name, spec in DECODERS.items() if name in names]
    for spec in specs:
        check_buildable(spec)
    devices = (m.device, m.draft_device, m.overlap_draft_device or "cpu")
    sync = opts.pipeline.sync_timing and any(torch.device(d).type == "cuda" for d in devices)
    decoders: list[Decoder] = []
    skipped: dict[str, str] = {}
    try:
        for spec in specs:
            dec = build_decoder(m, spec, opts, sync)
            if isinstance(dec, str):
                logger.warning("skipping %s: %s", spec.name, dec)
                skipped[spec.name] = dec
            else:
                decoders.append(dec)
    except BaseException:  # a failed worker start must not leak the servers already running
        for d in decoders:
            d.close()
        raise
    return decoders, skipped
