"""The decoders ``specsplit bench`` compares, built over ONE set of loaded models.

===========================  =============================================================================
``hf-target``                (a) ``target.generate()``: the baseline every speedup and exact match refers to
``hf-assisted``              (b) HF assisted generation with the draft, K tokens, constant, no confidence stop
``hf-assisted-default``      (b') HF assisted generation with the library's default schedule
``hf-prompt-lookup``         (c) HF prompt-lookup decoding, 10 tokens
``specsplit-target-only``    (d) our engine without a draft (our own target-only decode)
``specsplit-chain``          (d) chain of K draft tokens
``specsplit-static``         (d) the default static tree
``specsplit-dynamic``        (d) the default dynamic (EAGLE-2 style) tree
``specsplit-overlap-chain``  (d) chain of K, overlapped pipeline (next round drafted during verification)
``specsplit-overlap-dynamic``(d) the default dynamic tree, overlapped pipeline
``specsplit-grpc``           (e) chain of K over gRPC, both workers in this process on loopback ports
===========================  =============================================================================

Every decoder gets the same greedy ``GenerationConfig`` (:meth:`BenchModels.generation_config`) and
returns the new tokens plus ``(drafted depth, accepted)`` per round, so tau and acceptance by depth
are comparable across libraries.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

logger = logging.getLogger(__name__)

DECODERS = (
    "hf-target",
    "hf-assisted",
    "hf-assisted-default",
    "hf-prompt-lookup",
    "specsplit-target-only",
    "specsplit-chain",
    "specsplit-static",
    "specsplit-dynamic",
    "specsplit-overlap-chain",
    "specsplit-overlap-dynamic",
    "specsplit-grpc",
)
# Selectable, not run by default: the same engines with their CUDA-graph steps fused by torch.compile
# (compiling takes minutes, on CPU too), to time compiled against plain graphs side by side in one run.
# ``-levels``: the dynamic tree with one graph per level (``DraftConfig.graph_rounds=False``), for A/B.
# ``-split``: sequential rounds with the draft on ``--overlap-draft-device`` (the overlapped decoder's
# placement without its speculation). ``-grpc-dynamic``: the dynamic tree over gRPC workers;
# ``-grpc-overlap-dynamic``: the same with the overlapped pipeline (draft worker on the overlap device).
# ``-grpc-targetloop-...``: the same over gRPC with the rounds run by the target worker
# (``SpecSplitConfig.grpc_loop="target"``: one network hop a round instead of two).
# ``specsplit-grpc-dynamic`` / ``-grpc-targetloop-dynamic`` (no suffix): that A/B without torch.compile
# (plain CUDA graphs with ``--cuda-graphs``; their workers start in seconds instead of minutes).
# ``...-unary``: the same with unary calls instead of the long-lived streams (the streams' A/B:
# ``SpecSplitConfig(grpc_streams=False)``, ``specsplit serve target --no-draft-stream``).
# ``-targetloop-dynamic-noipc``: the target loop with every tree in the draft worker's reply (the A/B
# of tree slots, ``specsplit serve target --no-tree-ipc``; with slots on, the default, a co-located
# target worker reads greedy trees from the draft worker's GPU memory).
# ``-prefill``: target-only / dynamic tree with their prompts padded to buckets replayed from CUDA
# graphs (``prefill_graphs``, the default) whatever ``--prefill-graphs`` says: with
# ``--no-prefill-graphs`` the A/B against eager prompt forwards side by side in one run.
OPTIONAL_DECODERS = (
    "specsplit-target-only-compiled",
    "specsplit-dynamic-compiled",
    "specsplit-dynamic-levels-compiled",
    "specsplit-overlap-dynamic-compiled",
    "specsplit-split-dynamic-compiled",
    "specsplit-grpc-dynamic-compiled",
    "specsplit-grpc-overlap-dynamic-compiled",
    "specsplit-grpc-targetloop-dynamic-compiled",
    "specsplit-grpc-targetloop-overlap-dynamic-compiled",
    "specsplit-grpc-dynamic",
    "specsplit-grpc-targetloop-dynamic",
    "specsplit-grpc-dynamic-unary",
    "specsplit-grpc-targetloop-dynamic-unary",
    "specsplit-grpc-targetloop-dynamic-noipc",
    "specsplit-target-only-prefill",
    "specsplit-dynamic-prefill",
    "specsplit-target-only-prefill-compiled",
    "specsplit-dynamic-prefill-compiled",
)
PREFILL_SUFFIX = "-prefill"
FUSED_WORDS = ", fused q/k/v and gate/up projections"  # label words of the decoders that run fused copies
ALL_DECODERS = DECODERS + OPTIONAL_DECODERS
COMPILED_SUFFIX = "-compiled"
BASELINE, ASSISTED = "hf-target", "hf-assisted"
PROMPT_LOOKUP_TOKENS = 10


@dataclass
class BenchModels:
    """The loaded models and what every decoder shares."""

    target: Any  # a loaded HF causal LM (PreTrainedModel)
    draft: Any  # a loaded HF causal LM, or None
    tokenizer: Any
    target_name: str
    draft_name: str
    dtype: str
    device: str
    draft_device: str
    eos_token_ids: list[int]
    pad_token_id: int
    overlap_draft: Any = None  # a copy of the draft on another device for the overlapped decoders
    overlap_draft_device: str | None = None
    fused: bool = False  # SpecSplit decoders run copies with fused projections (use_fused_projections)
    fused_target: Any = None
    fused_draft: Any = None

    @property
    def specsplit_target(self) -> Any:
        """The target the SpecSplit decoders run (the fused copy after :meth:`use_fused_projections`)."""
        return self.fused_target if self.fused else self.target

    @property
    def specsplit_draft(self) -> Any:
        """The draft the SpecSplit decoders run (the fused copy after :meth:`use_fused_projections`)."""
        return self.fused_draft if self.fused else self.draft

    def use_overlap_device(self, device: str) -> None:
        """Give the overlapped decoders their own draft copy on ``device`` (e.g. a second GPU)."""
        if self.draft is None or device == self.draft_device:
            return
        self.overlap_draft = copy.deepcopy(self.specsplit_draft).to(device)
        self.overlap_draft_device = device

    def use_fused_projections(self) -> int:
        """SpecSplit decoders get copies of the models with q/k/v and gate/up fused (:mod:`specsplit.runtime.fused`).

        The HF decoders keep the originals, so the baseline and the exact-match oracle stay
        transformers' own code path. A ``self:N`` draft is cut from the fused target copy (it shares
        its weights); the overlapped decoders' draft copy, used by SpecSplit only, is fused in place.
        Costs one more copy of each model on its device. Returns how many modules were fused.
        """
        from specsplit.models.self_draft import truncated_draft
        from specsplit.runtime.fused import fuse_projections

        if self.fused:
            return 0
        self.fused_target = copy.deepcopy(self.target)
        n = fuse_projections(self.fused_target)
        if self.draft is not None and self.draft_name.startswith("self:"):
            self.fused_draft = truncated_draft(self.fused_target, int(self.draft_name.split(":", 1)[1]))
        elif self.draft is not None:
            self.fused_draft = copy.deepcopy(self.draft)
            n += fuse_projections(self.fused_draft)
        if self.overlap_draft is not None:
            n += fuse_projections(self.overlap_draft)
        self.fused = True
        return n

    def generation_config(self, max_new_tokens: int) -> Any:
        """The one greedy ``GenerationConfig`` every decoder runs with (EOS kept, explicit pad)."""
        from transformers import GenerationConfig

        return GenerationConfig(
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=list(self.eos_token_ids),
            pad_token_id=self.pad_token_id,
        )


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


# --------------------------------------------------------------------------------------------- models


def tiny_models(seed: int = 0, noise: float = 0.002) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A seeded tiny Llama target and a draft that is the target plus noise (partial acceptance).

    Both LM heads are scaled up so next-token distributions are peaked: float32 greedy decoding is
    then free of numerical near-ties and every decoder must reproduce the baseline exactly.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):  # seeded without touching the caller's RNG state
        torch.manual_seed(seed)
        target = LlamaForCausalLM(cfg).eval()
        draft = LlamaForCausalLM(cfg).eval()
    draft.load_state_dict(target.state_dict())
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed + 1)
        for p in draft.parameters():
            p.add_(noise * torch.randn(p.shape, generator=g))
        for m in (target, draft):
            m.get_output_embeddings().weight.mul_(8.0)
    return target, draft


def _torch_dtype(name: str, device: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return getattr(torch, name)


def load_models(
    tiny: bool,
    device: str,
    draft_device: str | None = None,
    target_name: str | None = None,
    draft_name: str | None = None,
    dtype_name: str = "auto",
) -> BenchModels:
    """Load the models every decoder shares.

    Args:
        tiny: build the seeded tiny random pair (:func:`tiny_models`, float32) instead of real weights.
        device: target device.
        draft_device: draft device (default ``device``).
        target_name: target alias or directory (default the Qwen 1.5B).
        draft_name: draft alias or directory, or ``self:N`` (the target's first N layers).
        dtype_name: ``auto`` (bf16 on CUDA, fp32 on CPU) or a dtype name.

    Raises:
        ValueError: a non-default target without a draft, or a ``self:N`` draft on another device.
    """
    draft_device = draft_device or device
    dtype = _torch_dtype(dtype_name, device)
    if tiny:
        if target_name or draft_name:
            logger.warning("the smoke suite uses tiny random models; --target/--draft are ignored")
        tiny_target, tiny_draft = tiny_models()
        tiny_target.to(device, torch.float32)
        tiny_draft.to(draft_device, torch.float32)
        names = ("tiny-llama-random", "tiny-llama-random+noise")
        return BenchModels(tiny_target, tiny_draft, None, *names, "float32", device, draft_device, [2], 0)
    from specsplit.models import DEFAULT_DRAFT, DEFAULT_TARGET, load_model, load_tokenizer
    from specsplit.models.self_draft import truncated_draft

    draft_name = draft_name or (DEFAULT_DRAFT if target_name in (None, DEFAULT_TARGET) else "")
    target_name = target_name or DEFAULT_TARGET
    if not draft_name:
        raise ValueError("--draft is needed with a non-default --target (an alias, a path or self:N)")
    t0 = time.perf_counter()
    target = load_model(target_name, dtype=dtype, device=device)
    if draft_name.startswith("self:"):
        if draft_device != device:
            raise ValueError("a self:N draft shares the target's weights: it cannot use another device")
        draft: Any = truncated_draft(target, int(draft_name.split(":", 1)[1]))
        # the shallow copy shares the target's generation config; HF assisted generation edits the draft's
        draft.generation_config = copy.deepcopy(target.generation_config)
    else:
        draft = load_model(draft_name, dtype=dtype, device=draft_device)
    tok = load_tokenizer(target_name)
    logger.info("loaded %s and %s (%s) in %.1f s", target_name, draft_name, dtype, time.perf_counter() - t0)
    eos = target.generation_config.eos_token_id
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    if tok.eos_token_id is not None and tok.eos_token_id not in eos_ids:
        eos_ids.append(int(tok.eos_token_id))
    pad = target.generation_config.pad_token_id
    pad = int(pad if pad is not None else (tok.pad_token_id if tok.pad_token_id is not None else eos_ids[0]))
    return BenchModels(target, draft, tok, target_name, draft_name, str(dtype).removeprefix("torch."),
                       device, draft_device, eos_ids, pad)  # fmt: skip


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


def _hf_decoder(name: str, label: str, m: BenchModels, assisted_k: int | None = None, lookup: bool = False,
                assistant_defaults: bool = False) -> Decoder:  # fmt: skip
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
    def run(ids: torch.Tensor, max_new: int) -> DecodeOutput:
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
        new = out.sequences[0, ids.shape[1] :].tolist()
        return DecodeOutput(new, [(r.drafted_depth, r.accepted) for r in rs], split)

    return Decoder(name, label, run, close, config=getattr(gen, "config", None), shape_warmup=shape_warmup)


def _tree_words(tree: Any) -> str:
    """A tree shape in words, for decoder labels."""
    if tree.shape == "chain":
        return f"chain of K={tree.num_draft_tokens}"
    if tree.shape == "static":
        return f"static tree ({tree.max_nodes} nodes, depth {tree.depth_limit})"
    return f"dynamic tree (top-{tree.topk}, width {tree.width}, budget {tree.budget}, depth {tree.max_depth})"


def _grpc_decoder(
    m: BenchModels,
    tree: Any,
    sync: bool,
    graphs: bool,
    compile: bool = False,
    processes: bool = True,
    name: str = "specsplit-grpc",
    overlap: bool = False,
    target_loop: bool = False,
    target_graph_rounds: bool = True,
    streams: bool = True,
    tree_ipc: bool = True,
    prefill_graphs: bool = True,
) -> Decoder | str:
    """The draft and target workers on loopback ports: separate ``specsplit serve`` processes
    (``processes``, real models only) or servers inside this process. A string says why the
    decoder is unavailable."""
    prefill_graphs = prefill_graphs and graphs  # the padded prefills are part of the graph path
    what = _tree_words(tree)
    what += ", CUDA graphs fused by torch.compile" if compile else (", CUDA graphs" if graphs else "")
    what += FUSED_WORDS if m.fused else ""
    what += "" if streams else ", unary calls"
    what += "" if tree_ipc or not target_loop else ", trees in replies (no tree slots)"
    draft_device = (m.overlap_draft_device or m.draft_device) if overlap else m.draft_device
    if overlap:
        what += f", overlapped pipeline (draft worker on {draft_device}, target worker on {m.device})"
    loop: Literal["client", "target"] = "target" if target_loop else "client"
    try:
        from specsplit.remote import serve_draft, serve_target
        from specsplit.remote.launch import WorkerProcess
    except ImportError as e:
        return f"specsplit.remote is not importable ({e})"
    from specsplit.config import DraftConfig, EngineTuning, PipelineTuning, SpecSplitConfig, TargetConfig
    from specsplit.engines.draft import DraftEngine
    from specsplit.engines.target import TargetEngine
    from specsplit.generator import SpecSplitGenerator

    if processes and m.tokenizer is not None and not m.draft_name.startswith("self:"):
        extra = (["--cuda-graphs"] if graphs else []) + (["--compile"] if compile else [])
        extra += ["--prefill-graphs"] if prefill_graphs else ["--no-prefill-graphs"] if graphs else []
        extra += ["--fuse-projections"] if m.fused else []
        workers = [WorkerProcess("draft", m.draft_name, device=draft_device, dtype=m.dtype, args=extra)]
        try:
            workers[0].start()
            peer = ["--draft-address", workers[0].address] if target_loop else []
            # the draft worker compiles a new shape on its first call (minutes under --compile)
            peer += ["--draft-timeout", "600"] if target_loop and compile else []
            peer += ["--graph-rounds" if target_graph_rounds else "--no-graph-rounds"]
            peer += [] if streams or not target_loop else ["--no-grpc-streams"]
            peer += [] if tree_ipc or not target_loop else ["--no-tree-ipc"]
            workers.append(WorkerProcess("target", m.target_name, device=m.device, dtype=m.dtype,
                                         args=extra + peer))  # fmt: skip
            workers[1].start()
        except Exception:
            for w in workers:
                w.stop(grace=1.0)
            raise
        cfg = SpecSplitConfig(transport="grpc", draft_address=workers[0].address,
                              target_address=workers[1].address, tree=copy.deepcopy(tree),
                              timeout_s=600.0, overlap=overlap, grpc_loop=loop,
                              tuning=PipelineTuning(grpc_streams=streams))  # fmt: skip
        pgen = SpecSplitGenerator(None, None, tokenizer=m.tokenizer, config=cfg)

        def close_processes() -> None:
            pgen.close()
            for w in workers:
                w.stop()

        plabel = f"SpecSplit {what} over gRPC, draft and target workers as separate processes on loopback"
        return _specsplit_decoder(name, plabel, m, pgen, close_processes, graphs or compile)

    draft = m.overlap_draft if overlap and m.overlap_draft is not None else m.specsplit_draft
    d_engine = DraftEngine(
        draft,
        DraftConfig(cuda_graphs=graphs, compile=compile, tuning=EngineTuning(prefill_graphs=prefill_graphs)),
    )
    t_engine = TargetEngine(
        m.specsplit_target,
        TargetConfig(
            cuda_graphs=graphs,
            compile=compile,
            tuning=EngineTuning(graph_rounds=target_graph_rounds, prefill_graphs=prefill_graphs),
        ),
    )
    d_srv = serve_draft(d_engine, port=0, host="127.0.0.1")
    t_srv = serve_target(
        t_engine,
        port=0,
        host="127.0.0.1",
        draft_address=d_srv.address if target_loop else None,
        draft_streams=streams,
        tree_slots=tree_ipc,
    )
    cfg = SpecSplitConfig(transport="grpc", draft_address=d_srv.address, target_address=t_srv.address,
                          tree=copy.deepcopy(tree), timeout_s=600.0, overlap=overlap, grpc_loop=loop,
                          tuning=PipelineTuning(sync_timing=sync, grpc_streams=streams))  # fmt: skip
    gen = SpecSplitGenerator(None, None, tokenizer=m.tokenizer, config=cfg)

    def close() -> None:
        gen.close()
        for srv in (d_srv, t_srv):
            srv.stop(grace=1.0, shutdown_engine=True)

    label = f"SpecSplit {what} over gRPC, both workers in-process on loopback"
    return _specsplit_decoder(name, label, m, gen, close, graphs or compile)


def build_decoders(
    m: BenchModels,
    names: Sequence[str],
    k: int,
    cuda_graphs: bool = False,
    sync_timing: bool = False,
    compile: bool = False,
    grpc_processes: bool = True,
    dynamic_tree: tuple[int, int, int, int] | None = None,
    target_graph_rounds: bool = True,
    prefill_graphs: bool = True,
) -> tuple[list[Decoder], dict[str, str]]:
    """The selected decoders (in :data:`DECODERS` order) and ``{skipped name: reason}``.

    Args:
        m: the shared models.
        names: decoder names to build.
        k: draft tokens per round for ``hf-assisted`` and the SpecSplit chain.
        cuda_graphs: SpecSplit engines replay their fixed-shape steps from CUDA graphs
            (``DraftConfig/TargetConfig.cuda_graphs``; eager on CPU).
        compile: SpecSplit engines fuse their static-path forwards with ``torch.compile``.
        dynamic_tree: ``(topk, width, budget, depth)`` of the dynamic-tree decoders (default
            :class:`TreeConfig`'s).
        grpc_processes: ``specsplit-grpc`` runs its workers as separate ``specsplit serve``
            processes (real models; the tiny smoke models always run in-process).
        target_graph_rounds: every SpecSplit target verifies a greedy round in one CUDA graph
            (``TargetConfig.graph_rounds``, the default; False gives every target, local or a gRPC
            worker (``--no-graph-rounds``), the forward alone in a graph, for the A/B).
        prefill_graphs: every SpecSplit engine with CUDA graphs, local or a gRPC worker, pads its
            prompts to buckets replayed from CUDA graphs (``DraftConfig/TargetConfig.prefill_graphs``,
            the default); False runs their prompt forwards eagerly, except the ``-prefill`` twins'.
        sync_timing: SpecSplit decoders synchronise the draft device after each draft so the
            draft/verify split is exact on a GPU (``SpecSplitConfig.sync_timing``); it costs speed,
            because the host then cannot queue the verification while the draft still runs.
    """
    from specsplit.config import (
        DraftConfig,
        EngineTuning,
        PipelineTuning,
        SpecSplitConfig,
        TargetConfig,
        TreeConfig,
    )
    from specsplit.generator import SpecSplitGenerator

    sync = sync_timing and any(
        torch.device(d).type == "cuda" for d in (m.device, m.draft_device, m.overlap_draft_device or "cpu")
    )
    trees = {
        "specsplit-chain": TreeConfig(shape="chain", num_draft_tokens=k),
        "specsplit-static": TreeConfig(shape="static"),
        "specsplit-dynamic": TreeConfig(shape="dynamic")
        if dynamic_tree is None
        else TreeConfig(
            "dynamic",
            topk=dynamic_tree[0],
            width=dynamic_tree[1],
            budget=dynamic_tree[2],
            max_depth=dynamic_tree[3],
        ),  # fmt: skip
    }
    trees["specsplit-overlap-chain"] = trees["specsplit-chain"]
    trees["specsplit-overlap-dynamic"] = trees["specsplit-dynamic"]
    trees["specsplit-dynamic-levels"] = trees["specsplit-dynamic"]
    trees["specsplit-split-dynamic"] = trees["specsplit-dynamic"]
    trees["specsplit-grpc"] = trees["specsplit-chain"]
    trees["specsplit-grpc-dynamic"] = trees["specsplit-dynamic"]
    trees["specsplit-grpc-overlap-dynamic"] = trees["specsplit-dynamic"]
    trees["specsplit-grpc-targetloop-dynamic"] = trees["specsplit-dynamic"]
    trees["specsplit-grpc-targetloop-overlap-dynamic"] = trees["specsplit-dynamic"]
    trees["specsplit-grpc-dynamic-unary"] = trees["specsplit-dynamic"]
    trees["specsplit-grpc-targetloop-dynamic-unary"] = trees["specsplit-dynamic"]
    trees["specsplit-grpc-targetloop-dynamic-noipc"] = trees["specsplit-dynamic"]
    labels = {
        "hf-target": "HF generate(), target only, greedy (baseline a)",
        "hf-assisted": f"HF assisted generation, {k} draft tokens a round, constant schedule, no confidence stop",
        "hf-assisted-default": "HF assisted generation, library default schedule and confidence threshold",
        "hf-prompt-lookup": f"HF prompt-lookup decoding, {PROMPT_LOOKUP_TOKENS} tokens",
        "specsplit-target-only": "SpecSplit engine without a draft (our target-only decode)",
        "specsplit-chain": f"SpecSplit local, {_tree_words(trees['specsplit-chain'])}",
        "specsplit-static": f"SpecSplit local, default {_tree_words(trees['specsplit-static'])}",
        "specsplit-dynamic": f"SpecSplit local, {_tree_words(trees['specsplit-dynamic'])}",
    }
    where = f"draft on {m.overlap_draft_device or m.draft_device}, target on {m.device}"
    labels["specsplit-overlap-chain"] = f"{labels['specsplit-chain']}, overlapped pipeline ({where})"
    labels["specsplit-overlap-dynamic"] = f"{labels['specsplit-dynamic']}, overlapped pipeline ({where})"
    labels["specsplit-dynamic-levels"] = f"{labels['specsplit-dynamic']}, one graph per tree level"
    labels["specsplit-split-dynamic"] = (f"{labels['specsplit-dynamic']}, sequential, draft on "
                                         f"{m.overlap_draft_device or m.draft_device}, target on {m.device}")  # fmt: skip
    labels["specsplit-grpc-dynamic"] = f"{labels['specsplit-dynamic']} over gRPC"
    labels["specsplit-grpc-overlap-dynamic"] = f"{labels['specsplit-dynamic']} over gRPC, overlapped pipeline"
    on_target = "rounds run by the target worker (one hop a round)"
    labels["specsplit-grpc-targetloop-dynamic"] = f"{labels['specsplit-dynamic']} over gRPC, {on_target}"
    labels["specsplit-grpc-targetloop-overlap-dynamic"] = (
        f"{labels['specsplit-dynamic']} over gRPC, {on_target}, overlapped pipeline"
    )
    for name in ("specsplit-grpc-dynamic", "specsplit-grpc-targetloop-dynamic"):
        labels[f"{name}-unary"] = f"{labels[name]}, unary calls instead of streams"
    labels["specsplit-grpc-targetloop-dynamic-noipc"] = (
        f"{labels['specsplit-grpc-targetloop-dynamic']}, trees in the draft worker's replies (no tree slots)"
    )
    for name in ("specsplit-target-only", "specsplit-dynamic"):
        labels[name + PREFILL_SUFFIX] = (
            f"{labels[name]}, prompts padded to CUDA-graph buckets (prefill_graphs)"
        )
    for name in (
        n for n in OPTIONAL_DECODERS if n.endswith(COMPILED_SUFFIX)
    ):  # these always fuse their graphs
        labels[name] = f"{labels[name.removesuffix(COMPILED_SUFFIX)]}, CUDA graphs fused by torch.compile"
    if cuda_graphs or compile:
        extra = ", ".join(x for x, on in (("CUDA graphs", cuda_graphs), ("torch.compile", compile)) if on)
        labels = {
            n: (f"{v}, {extra}" if n.startswith("specsplit") and not n.endswith(COMPILED_SUFFIX) else v)
            for n, v in labels.items()
        }
    if m.fused:
        labels = {n: (v + FUSED_WORDS if n.startswith("specsplit") else v) for n, v in labels.items()}
    if not prefill_graphs:  # the A/B: only the -prefill twins pad their prompts
        labels = {
            n: (
                f"{v}, eager prompt forwards"
                if n.startswith("specsplit")
                and not n.removesuffix(COMPILED_SUFFIX).endswith(PREFILL_SUFFIX)
                and (cuda_graphs or n.endswith(COMPILED_SUFFIX))
                else v
            )
            for n, v in labels.items()
        }
    decoders: list[Decoder] = []
    skipped: dict[str, str] = {}
    try:
        for name in ALL_DECODERS:
            if name not in names:
                continue
            base = name.removesuffix(COMPILED_SUFFIX)
            padded = base.endswith(PREFILL_SUFFIX)  # prefill graphs whatever the flag says
            base = base.removesuffix(PREFILL_SUFFIX)
            if m.draft is None and base not in ("hf-target", "hf-prompt-lookup", "specsplit-target-only"):
                skipped[name] = "no draft model"
                continue
            if name == "hf-target":
                decoders.append(_hf_decoder(name, labels[name], m))
            elif name == "hf-assisted":
                decoders.append(_hf_decoder(name, labels[name], m, assisted_k=k))
            elif name == "hf-assisted-default":
                decoders.append(_hf_decoder(name, labels[name], m, assistant_defaults=True))
            elif name == "hf-prompt-lookup":
                decoders.append(_hf_decoder(name, labels[name], m, lookup=True))
            elif base.startswith("specsplit-grpc"):
                fused = base != name
                dec = _grpc_decoder(m, trees[base], sync, cuda_graphs or fused, compile or fused,
                                    grpc_processes, name, overlap="-overlap" in base,
                                    target_loop="-targetloop" in base,
                                    target_graph_rounds=target_graph_rounds,
                                    streams=not base.endswith("-unary"),
                                    tree_ipc=not base.endswith("-noipc"),
                                    prefill_graphs=prefill_graphs)  # fmt: skip
                if isinstance(dec, str):
                    logger.warning("skipping %s: %s", name, dec)
                    skipped[name] = dec
                else:
                    decoders.append(dec)
            else:
                fused = name.endswith(COMPILED_SUFFIX)  # graphs + compile whatever the flags
                graphs, fuse = cuda_graphs or fused, compile or fused
                if padded and not graphs:
                    skipped[name] = (
                        "prompts padded for CUDA graphs: needs --cuda-graphs (or its -compiled twin)"
                    )
                    continue
                draft = None if base == "specsplit-target-only" else m.specsplit_draft
                if base.startswith(("specsplit-overlap", "specsplit-split")) and m.overlap_draft is not None:
                    draft = m.overlap_draft
                prefill = (prefill_graphs or padded) and graphs
                cfg = SpecSplitConfig(
                    tree=copy.deepcopy(trees.get(base, trees["specsplit-chain"])),
                    tuning=PipelineTuning(sync_timing=sync),
                    draft=DraftConfig(
                        cuda_graphs=graphs,
                        compile=fuse,
                        tuning=EngineTuning(
                            graph_rounds=not base.endswith("-levels"), prefill_graphs=prefill
                        ),
                    ),
                    target=TargetConfig(
                        cuda_graphs=graphs,
                        compile=fuse,
                        tuning=EngineTuning(graph_rounds=target_graph_rounds, prefill_graphs=prefill),
                    ),
                    overlap=name.startswith("specsplit-overlap"),
                )
                gen = SpecSplitGenerator(m.specsplit_target, draft, tokenizer=m.tokenizer, config=cfg)
                decoders.append(_specsplit_decoder(name, labels[name], m, gen, gen.close, graphs or fuse))
    except BaseException:  # a failed worker start must not leak the servers already running
        for dec in decoders:
            dec.close()
        raise
    return decoders, skipped
