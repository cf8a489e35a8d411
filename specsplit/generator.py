"""SpecSplitGenerator: the facade users call like Hugging Face ``model.generate()``."""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.generation.logits_process import PrefixConstrainedLogitsProcessor
from transformers.generation.stopping_criteria import MaxTimeCriteria

from specsplit.config import BATCH_LIMIT, Drafter, SpecSplitConfig, TreeConfig
from specsplit.core.sampling import SamplingParams
from specsplit.engines.batch_plan import BATCH_TREE_SIZES, BatchPlanner
from specsplit.engines.batched import BatchedTarget, batch_bucket
from specsplit.engines.cost_model import CostModels
from specsplit.engines.draft import DraftEngine
from specsplit.engines.drafters import NgramDrafter
from specsplit.engines.processing import SCORE_FIELDS, needs_processing
from specsplit.engines.target import TargetEngine
from specsplit.errors import ConfigError
from specsplit.local import LocalTransport
from specsplit.messages import LogitsProcessing
from specsplit.pipeline import DecodeOutputs, DecodeParams, OverlapPolicies, OverlapPolicy, decode
from specsplit.pipeline.batch import BatchRequest, BatchScheduler, run_rows
from specsplit.telemetry import SpecStats
from specsplit.transport import Transport

logger = logging.getLogger(__name__)

# What from_pretrained() and `specsplit generate` draft with unless told otherwise: the fastest lossless
# mode measured on CPU and GPU (benchmarks/RESULTS.md, "Drafters").
DEFAULT_DRAFTER: Drafter = "auto"
DRAFTER_ENV = "SPECSPLIT_DRAFTER"
# ... and the model's tree there: a chain up to 8 deep that stops after a token the draft doubts, the
# fastest model tree measured where the draft model pays (a CPU; RESULTS, "An int8 draft on the CPU").
DEFAULT_TREE = TreeConfig(shape="chain", num_draft_tokens=8, min_confidence=0.5)
TREE_ENV_PREFIX = "SPECSPLIT_TREE_"


def default_tree_applies() -> bool:
    """Whether no ``SPECSPLIT_TREE_*`` variable sets the tree (then the defaults above apply)."""
    return not any(k.startswith(TREE_ENV_PREFIX) for k in os.environ)


# GenerationConfig fields that change the output and that SpecSplit refuses (beam search and the
# other multi-hypothesis or model-internal modes), with the values that mean "off".
_UNSUPPORTED_IF_SET: dict[str, tuple[Any, ...]] = {
    "num_beams": (None, 1),
    "num_beam_groups": (None, 1),
    "penalty_alpha": (None,),
    "constraints": (None,),
    "force_words_ids": (None,),
    "diversity_penalty": (None, 0.0),
    "guidance_scale": (None, 1.0),
    "watermarking_config": (None,),
    "token_healing": (None, False),
    "dola_layers": (None,),
    "output_attentions": (None, False),
    "output_hidden_states": (None, False),
    "use_mtp": (None, False),
}
# Warpers generate() applies only when sampling.
_SAMPLING_ONLY = frozenset({"temperature", "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff",
                            "top_h"})  # fmt: skip
# Score options that mean "off" (left out of the options sent to the target).
_NEUTRAL: dict[str, Any] = {
    "repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "min_length": 0,
    "min_new_tokens": 0,
    "typical_p": 1.0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "renormalize_logits": False,
    "remove_invalid_values": False,
    "top_k": 0,
    "top_p": 1.0,
    "temperature": 1.0,
}


@dataclass
class SpecSplitOutput:
    """Returned with ``return_dict_in_generate=True``.

    Attributes:
        sequences: `[batch, prompt + new]` as HF ``generate`` returns them (left padding kept,
            finished rows padded with ``pad_token_id``).
        spec_stats: statistics of the whole batch.
        per_sequence_stats: one :class:`SpecStats` per row.
        scores: with ``output_scores=True``, as HF returns them: one `[batch, vocab]` float32
            tensor per generated step, the target's processed scores (after every logits
            processor and warper) of the token chosen at that step; rows that already ended hold
            ``-inf``.
        logits: with ``output_logits=True``: the raw target logits, in the same layout.
    """

    sequences: torch.Tensor
    spec_stats: SpecStats
    per_sequence_stats: list[SpecStats] = field(default_factory=list)
    scores: tuple[torch.Tensor, ...] | None = None
    logits: tuple[torch.Tensor, ...] | None = None


def _generation_config_from(name: str) -> GenerationConfig | None:
    """The generation config saved with a model (alias or directory), if there is one."""
    from specsplit.models import apply_generation_defaults, resolve_model_path

    try:
        return apply_generation_defaults(GenerationConfig.from_pretrained(resolve_model_path(name)), name)
    except Exception as e:  # no file, or not resolvable offline: keep HF defaults
        logger.debug("no generation config for %s: %s", name, e)
        return None


def score_options(gc: GenerationConfig, width: int, max_new_tokens: int) -> dict[str, Any]:
    """The ``GenerationConfig`` fields that shape the scores, as JSON values, lengths counted from
    the start of the (padded) prompt as ``generate()`` counts them; "off" values left out."""
    options: dict[str, Any] = {}
    for name in SCORE_FIELDS:
        value = getattr(gc, name, None)
        if value is None or (name in _NEUTRAL and value == _NEUTRAL[name]):
            continue
        if name in _SAMPLING_ONLY and not gc.do_sample:  # generate() ignores them when greedy
            continue
        if isinstance(value, torch.Tensor):
            value = value.tolist()
        if name == "sequence_bias" and isinstance(value, dict):  # {(ids...): bias} -> [[ids], bias]
            value = [[list(k), float(v)] for k, v in value.items()]
        options[name] = value
    options["max_length"] = width + max_new_tokens
    if gc.min_new_tokens:
        options["min_length"] = width + int(gc.min_new_tokens)
    return options


def _row_generators(generator: Any, batch: int) -> list[torch.Generator] | None:
    """One generator per row when ``generate()`` got a list (each row then samples what its
    single-row generation with that generator samples); None for one shared generator."""
    if not isinstance(generator, (list, tuple)):
        return None
    if len(generator) != batch:
        raise ValueError(
            f"generator: {len(generator)} generators for {batch} rows (one per row, copies included)"
        )
    return list(generator)


def _steps(per_row: list[list[torch.Tensor]], width: int) -> tuple[torch.Tensor, ...]:
    """Per-row lists of `[vocab]` rows -> one `[batch, vocab]` tensor per step (-inf past a row's end)."""
    first = next((r[0] for r in per_row if r), None)
    if first is None:
        return ()
    out = []
    for t in range(width):
        step = torch.full(
            (len(per_row), first.shape[-1]), float("-inf"), dtype=first.dtype, device=first.device
        )
        for b, r in enumerate(per_row):
            if t < len(r):
                step[b] = r[t].to(first.device)
        out.append(step)
    return tuple(out)


class SpecSplitGenerator:
    """Speculative decoding behind an HF-style ``generate()``.

    Args:
        target_model: loaded HF causal LM for the target (``None`` in gRPC mode or to load
            ``config.target.model``).
        draft_model: loaded HF causal LM for the draft (``None``: ``config.draft.model`` or none,
            which means target-only decoding).
        tokenizer: needed for ``generate_text``, stop strings and streaming text.
        config: settings; ``config.transport == "grpc"`` talks to remote workers instead.
        transport: a ready transport (overrides ``config.transport``).
    """

    def __init__(
        self,
        target_model: torch.nn.Module | None = None,
        draft_model: torch.nn.Module | None = None,
        tokenizer: Any = None,
        config: SpecSplitConfig | None = None,
        *,
        transport: Transport | None = None,
    ):
        self.config = config or SpecSplitConfig()
        self.tokenizer = tokenizer
        self.draft_engine: DraftEngine | None = None
        self.target_engine: TargetEngine | None = None
        if transport is None:
            if self.config.transport == "grpc":
                from specsplit.remote import GrpcTransport

                transport = GrpcTransport.from_config(self.config)
            else:
                transport = self._local_transport(target_model, draft_model)
        self.transport = transport
        # Overlapped mode's speculate-or-not policy, one per (tree shape, sampling or greedy): what
        # it measured on earlier prompts holds for the next ones on the same machine and pair.
        self._overlap_policies = OverlapPolicies()
        # The n-gram drafters' suffix cache and the round planners: what they learned on earlier
        # prompts (earlier generations' text, costs and acceptance) holds for the next ones.
        mode = self.config.drafter
        graphs = self.target_engine is not None and self.target_engine.replays_graphs
        self._ngram = NgramDrafter(self.config.tuning.ngram, suffix=mode in ("suffix", "auto"), graphs=graphs)
        self._costs = CostModels()
        self._scheduler: BatchScheduler | None = None  # batched rounds: the KV pool, its graphs, its rows
        self._batch_lock = threading.Lock()
        self._calls = 0  # generate() calls in flight (a concurrent call joins the batched rounds)
        self._batch_planner = BatchPlanner(skip_first=self.config.target.cuda_graphs)
        gc = getattr(target_model, "generation_config", None)
        self.generation_config = copy.deepcopy(gc) if gc is not None else GenerationConfig()

    def _local_transport(self, target_model: Any, draft_model: Any) -> LocalTransport:
        self.target_engine = TargetEngine(target_model, self.config.target)
        if target_model is None:
            self.target_engine.load_model()
        if draft_model is not None or self.config.draft.model:
            self.draft_engine = DraftEngine(draft_model, self.config.draft)
            if draft_model is None:
                self.draft_engine.load_model()
            dv, tv = self.draft_engine.model_vocab_size, self.target_engine.model_vocab_size
            if dv != tv:
                raise ConfigError(
                    f"draft vocab ({dv}) differs from target vocab ({tv}): the two models must share a tokenizer"
                )
        return LocalTransport(self.draft_engine, self.target_engine)

    @classmethod
    def from_pretrained(
        cls,
        target: str | None = None,
        draft: str | None = None,
        tokenizer: str | Any = None,
        config: SpecSplitConfig | None = None,
    ) -> SpecSplitGenerator:
        """Load from aliases (``qwen2.5-coder-1.5b``), local directories or HF ids.

        Without a ``config`` (and without ``SPECSPLIT_DRAFTER``) the drafter is ``"auto"``: n-gram
        trees where the text repeats, the draft model's tree where it pays, plain steps otherwise;
        and (without ``SPECSPLIT_TREE_*`` variables) the model's tree is :data:`DEFAULT_TREE`.

        In gRPC mode no weights are loaded; ``tokenizer`` (or ``target``) only names the tokenizer.
        """
        from specsplit.models import load_tokenizer

        cfg = copy.deepcopy(config) if config is not None else SpecSplitConfig.from_env()
        if config is None and DRAFTER_ENV not in os.environ:
            cfg.drafter = DEFAULT_DRAFTER
        if config is None and default_tree_applies():
            cfg.tree = copy.deepcopy(DEFAULT_TREE)
        tok_src = tokenizer if tokenizer is not None else target
        tok = load_tokenizer(tok_src) if isinstance(tok_src, str) else tok_src
        if cfg.transport == "grpc":
            gen = cls(None, None, tokenizer=tok, config=cfg)
            src = tokenizer if isinstance(tokenizer, str) else target
            gc = _generation_config_from(src) if isinstance(src, str) else None
            if gc is not None:  # EOS ids and defaults of the served model
                gen.generation_config = gc
            elif tok is not None and getattr(tok, "eos_token_id", None) is not None:
                gen.generation_config.eos_token_id = tok.eos_token_id
            return gen
        cfg.target.model = target or cfg.target.model
        cfg.draft.model = draft or cfg.draft.model
        if not cfg.target.model:
            raise ConfigError("from_pretrained needs target= (alias, directory or HF id)")
        gen = cls(None, None, tokenizer=tok, config=cfg)
        assert gen.target_engine is not None
        model = gen.target_engine.runner.model
        gc = getattr(model, "generation_config", None)
        if gc is not None:
            gen.generation_config = copy.deepcopy(gc)
        return gen

    # ------------------------------------------------------------------ generation
    @torch.inference_mode()
    def generate(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        generation_config: GenerationConfig | None = None,
        logits_processor: LogitsProcessorList | list[Any] | None = None,
        stopping_criteria: StoppingCriteriaList | list[Any] | None = None,
        prefix_allowed_tokens_fn: Callable[[int, torch.Tensor], list[int]] | None = None,
        *,
        streamer: Any = None,
        generator: torch.Generator | list[torch.Generator] | None = None,
        tokenizer: Any = None,
        return_dict_in_generate: bool | None = None,
        **kwargs: Any,
    ) -> torch.Tensor | SpecSplitOutput:
        """Like ``model.generate``: greedy output equals the target's, sampling matches its distribution.

        Every ``GenerationConfig`` option that shapes one sequence's scores is applied exactly as
        ``generate()`` applies it (penalties, n-gram bans, length rules, bad words, biases, forced
        tokens, typical / min-p / epsilon / eta sampling, ...): the target runs the same logits
        processors on every row of every verified tree, each with that row's own context. Options
        SpecSplit cannot honour (beam search, contrastive search, guidance, watermarking, ...) raise
        :class:`~specsplit.errors.ConfigError`.

        Args:
            input_ids: `[batch, prompt]` int64 (left-padded for batch > 1).
            attention_mask: `[batch, prompt]` 1 = token, 0 = padding.
            generation_config: an HF ``GenerationConfig``; keyword arguments override its fields
                (``max_new_tokens``, ``do_sample``, ``temperature``, ``top_k``, ``top_p``,
                ``repetition_penalty``, ``eos_token_id``, ``stop_strings``, ``output_scores``,
                ``num_return_sequences``, ...).
            logits_processor: extra HF logits processors, merged as ``generate()`` merges them.
                They must be functions of ``(input_ids, scores)`` row by row (as HF's own are);
                in-process transport only.
            stopping_criteria: extra HF stopping criteria, called after every committed token on
                the whole sequence (``scores`` is the token's row when ``output_scores`` is on,
                else None).
            prefix_allowed_tokens_fn: as in ``generate()`` (in-process transport only).
            streamer: an HF streamer (batch 1 only), fed after every round.
            generator: CPU ``torch.Generator`` that makes sampling reproducible, or a list of one
                per row (each row then samples exactly what it samples alone with that generator).
            tokenizer: for stop strings (defaults to the generator's tokenizer).
            return_dict_in_generate: return a :class:`SpecSplitOutput` instead of a tensor.

        Returns:
            `[batch * num_return_sequences, prompt + new]` int64 tensor, or :class:`SpecSplitOutput`.
        """
        if input_ids is None:
            raise ValueError("input_ids is required")
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        gc = copy.deepcopy(generation_config if generation_config is not None else self.generation_config)
        if generation_config is not None and generation_config is not self.generation_config:
            # As HF generate(): what the given config leaves unset (None) comes from the model's own
            # defaults (a registry model's repetition penalty, say), then the keyword arguments.
            gc.update(**self.generation_config.to_dict(), defaults_only=True)
        unused = gc.update(**kwargs)
        if unused:
            raise TypeError(f"generate() got unexpected keyword arguments: {sorted(unused)}")
        return_dict = bool(
            return_dict_in_generate if return_dict_in_generate is not None else gc.return_dict_in_generate
        )
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        copies = int(gc.num_return_sequences or 1)
        if copies > 1:
            if not gc.do_sample:
                raise ConfigError(
                    "num_return_sequences > 1 needs do_sample=True (beam search is not supported)"
                )
            input_ids = input_ids.repeat_interleave(copies, dim=0)
            attention_mask = attention_mask.repeat_interleave(copies, dim=0)
        shared = None if isinstance(generator, (list, tuple)) else generator
        params = self._decode_params(gc, input_ids.shape[1], tokenizer or self.tokenizer, shared)
        params.stopping_criteria = list(stopping_criteria or [])
        if gc.max_time is not None:
            params.stopping_criteria.append(MaxTimeCriteria(float(gc.max_time)))
        custom = list(logits_processor or [])
        batch = input_ids.shape[0]
        if streamer is not None and batch > 1:
            raise ValueError("streamers support batch size 1 only (as in transformers)")
        generators = _row_generators(generator, batch)
        prompts: list[list[int]] = []
        per_row: list[DecodeParams] = []
        for b in range(batch):
            keep = attention_mask[b].bool()
            prompts.append(input_ids[b][keep].tolist())
            pads = input_ids[b][: int((~keep).sum())].tolist()  # left padding, as generate() sees it
            row_params = self._row_params(
                params, gc, input_ids.shape[1], pads, custom, prefix_allowed_tokens_fn, b
            )
            if generators is not None:
                row_params.generator = generators[b]
            per_row.append(row_params)
        row_outputs = [DecodeOutputs() for _ in range(batch)]
        with self._batch_lock:
            self._calls += 1
        try:
            batched = self._decode_batched(prompts, per_row) if self._batchable(per_row, streamer) else None
            if batched is not None:
                rows, all_stats = batched
            else:
                rows, all_stats = self._decode_rows(prompts, per_row, row_outputs, streamer, input_ids[0])
        finally:
            with self._batch_lock:
                self._calls -= 1
        pad = self._pad_id(gc)
        width = max((len(r) for r in rows), default=0)
        new_part = torch.full((batch, width), pad, dtype=input_ids.dtype)
        for b, r in enumerate(rows):
            if r:
                new_part[b, : len(r)] = torch.tensor(r, dtype=input_ids.dtype)
        sequences = torch.cat([input_ids.cpu(), new_part], dim=1)
        if return_dict:
            return SpecSplitOutput(
                sequences,
                SpecStats.merge(all_stats),
                all_stats,
                scores=_steps([o.scores for o in row_outputs], width) if params.return_scores else None,
                logits=_steps([o.logits for o in row_outputs], width) if params.return_logits else None,
            )
        return sequences

    def _decode_params(
        self, gc: GenerationConfig, prompt_len: int, tokenizer: Any, generator: torch.Generator | None
    ) -> DecodeParams:
        for name, off in _UNSUPPORTED_IF_SET.items():
            if getattr(gc, name, None) not in off:
                raise ConfigError(
                    f"generation option {name}={getattr(gc, name)!r} is not supported by SpecSplit"
                )
        if gc.max_new_tokens is not None:
            max_new = int(gc.max_new_tokens)
        else:
            max_new = int(gc.max_length) - prompt_len
        if max_new < 0:
            raise ConfigError(f"max_new_tokens must be >= 0 (got {max_new}; prompt length {prompt_len})")
        do_sample = bool(gc.do_sample)
        sampling = SamplingParams(
            do_sample=do_sample,
            temperature=float(gc.temperature if gc.temperature is not None else 1.0) if do_sample else 1.0,
            top_k=int(gc.top_k or 0) if do_sample else 0,
            top_p=float(gc.top_p if gc.top_p is not None else 1.0) if do_sample else 1.0,
        )
        eos = gc.eos_token_id
        eos_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
        stops = gc.stop_strings
        stop_strings = tuple([stops] if isinstance(stops, str) else (stops or []))
        after = None
        if self.config.tuning.sync_timing and self.draft_engine is not None:
            after = self.draft_engine.synchronize
        return DecodeParams(
            max_new_tokens=max_new,
            sampling=sampling,
            tree=self.config.tree,
            eos_token_ids=eos_ids,
            stop_strings=stop_strings,
            tokenizer=tokenizer,
            generator=generator,
            after_draft=after,
            overlap=self.config.overlap,
            overlap_policy=self.config.tuning.overlap_policy,
            policy=self._overlap_policy(do_sample) if self.config.overlap else None,
            loop=self.config.grpc_loop,
            drafter=self.config.drafter,
            ngram=self._ngram,
            cost=self._costs.get(
                self.config.drafter,
                repr(self.config.tree),
                self.config.tree.max_nodes,
                do_sample,
                self.config.tuning.ngram.max_nodes,
                self._padded_trees(),
            ),
            return_scores=bool(gc.output_scores),
            return_logits=bool(gc.output_logits),
        )

    def _row_params(
        self,
        params: DecodeParams,
        gc: GenerationConfig,
        width: int,
        pads: list[int],
        custom: list[Any],
        prefix_fn: Callable[[int, torch.Tensor], list[int]] | None,
        row: int,
    ) -> DecodeParams:
        """One row's parameters: the logits processing it needs (its left padding is part of the
        context HF's processors see) and what its stopping criteria see before the prompt."""
        options = score_options(gc, width, params.max_new_tokens)
        procs = list(custom)
        if prefix_fn is not None:  # PrefixConstrainedLogitsProcessor, told this row's batch index
            procs.append(PrefixConstrainedLogitsProcessor(lambda _i, ids: prefix_fn(row, ids), 1))
        if not (procs or needs_processing(options) or params.return_scores):
            return dataclasses.replace(params, criteria_prefix=pads)
        spec = LogitsProcessing(options, width, pads, procs)
        shaping = bool(procs) or needs_processing(options)  # not output_scores alone
        draft = spec if shaping and self.config.tuning.draft_processors else None
        return dataclasses.replace(params, processing=spec, draft_processing=draft, criteria_prefix=pads)

    def _decode_rows(
        self,
        prompts: list[list[int]],
        rows: list[DecodeParams],
        outputs: list[DecodeOutputs],
        streamer: Any,
        first: torch.Tensor,
    ) -> tuple[list[list[int]], list[SpecStats]]:
        """The rows one after another, each through the single-row round loop."""
        new_rows: list[list[int]] = []
        all_stats: list[SpecStats] = []
        if streamer is not None:
            streamer.put(first.cpu())
        on_tokens = (lambda t: streamer.put(torch.tensor(t, dtype=torch.long))) if streamer else None
        for prompt, row_params, out in zip(prompts, rows, outputs, strict=True):
            new, stats = decode(self.transport, prompt, row_params, on_tokens=on_tokens, outputs=out)
            new_rows.append(new)
            all_stats.append(stats)
        if streamer is not None:
            streamer.end()
        return new_rows, all_stats

    def _batchable(self, rows: list[DecodeParams], streamer: Any) -> bool:
        """Whether a batch's rows can share rounds (:mod:`specsplit.pipeline.batch`): in-process,
        ``max_batch`` > 1, several rows or another call in flight (a concurrent call's rows join the
        same rounds), and nothing that is applied row by row on the sequential path only (logits
        processors, output scores, a streamer, SpecPV, a target spread over several devices), and a
        drafter that needs no draft model per row (``"model"`` with a draft model keeps its drafts)."""
        engine = self.target_engine
        if self.config.max_batch < 2 or engine is None or streamer is not None:
            return False
        if len(rows) < 2 and self._calls < 2:  # one row alone: the single-row path (graphs, compile, drafts)
            return False
        if self.config.drafter == "model" and self.draft_engine is not None:
            logger.debug("rows decode one after another: drafter='model' drafts one row at a time")
            return False
        if engine.config.specpv.enabled or any(p.processing is not None for p in rows):
            logger.debug("rows decode one after another: logits processors or SpecPV are per-row features")
            return False
        devices = getattr(engine.runner.model, "hf_device_map", None)
        return not devices or len(set(devices.values())) <= 1

    def _decode_batched(
        self, prompts: list[list[int]], rows: list[DecodeParams]
    ) -> tuple[list[list[int]], list[SpecStats]] | None:
        """Every row through batched rounds on the target (a KV pool kept for later calls, grown
        when a batch needs more rows or positions than it holds)."""
        assert self.target_engine is not None
        need = max(len(p) + r.max_new_tokens for p, r in zip(prompts, rows, strict=True))
        capacity = -(-(need + max(BATCH_TREE_SIZES) + 1) // 256) * 256
        # Slots for max_batch rows: concurrent calls share the pool.
        scheduler = self._scheduler_for(batch_bucket(self.config.max_batch, BATCH_LIMIT), capacity)
        if scheduler is None:
            logger.info("the batch pool is in use and too small for this call: its rows decode one by one")
            return None
        if self.draft_engine is not None:
            logger.info("batched rows draft with n-grams (the draft model drafts for one row at a time)")
        # drafter="model" without a draft model is target-only decoding: plain batched steps.
        target_only = self.config.drafter == "model" and self.draft_engine is None
        requests = [BatchRequest(p, r) for p, r in zip(prompts, rows, strict=True)]
        out = run_rows(scheduler, requests, None if target_only else self._ngram)
        return [o[0] for o in out], [o[1] for o in out]

    def _scheduler_for(self, slots: int, capacity: int) -> BatchScheduler | None:
        """The scheduler whose pool holds ``slots`` rows of ``capacity`` positions: the current one,
        or (while no call is using it) a bigger one; None while a too small one is in use."""
        assert self.target_engine is not None
        with self._batch_lock:
            sched = self._scheduler
            if sched is not None and sched.target.fits(slots, capacity):
                return sched
            if sched is not None and (sched.live_rows or sched.waiting_rows):
                return None
            if sched is not None:
                slots, capacity = max(slots, sched.target.slots), max(capacity, sched.target.capacity)
            self._scheduler = None  # the old pool's memory goes before the new one is allocated
            cfg = self.target_engine.config
            pool = BatchedTarget(
                self.target_engine.runner, slots, capacity, use_graphs=cfg.cuda_graphs, compile=cfg.compile
            )
            self._scheduler = BatchScheduler(
                pool, min(self.config.max_batch, pool.slots), self._batch_planner
            )
            return self._scheduler

    @property
    def _batched(self) -> BatchedTarget | None:
        """The batched rounds' KV pool (None before the first batched call)."""
        return self._scheduler.target if self._scheduler is not None else None

    def _padded_trees(self) -> bool:
        """Pad n-gram trees to a few sizes: the target may replay graphs (a remote one may: padding
        then costs a little, while a graph and a compile per tree size would cost a lot)."""
        engine = self.target_engine
        return engine is None or engine.config.cuda_graphs

    def _overlap_policy(self, do_sample: bool) -> OverlapPolicy:
        always = self.config.tuning.overlap_policy == "always"
        return self._overlap_policies.policy(self.config.tree, do_sample, always)

    @staticmethod
    def _pad_id(gc: GenerationConfig) -> int:
        if gc.pad_token_id is not None:
            return int(gc.pad_token_id)
        eos = gc.eos_token_id
        if isinstance(eos, int):
            return eos
        if eos:
            return int(list(eos)[0])
        return 0

    def generate_text(
        self,
        prompt: str,
        chat: bool = False,
        system: str | None = None,
        return_stats: bool = False,
        **kwargs: Any,
    ) -> str | tuple[str, SpecStats]:
        """Tokenize ``prompt`` (through the chat template when ``chat``), generate, decode the new text."""
        tok = self.tokenizer
        if tok is None:
            raise ConfigError("generate_text needs a tokenizer: pass tokenizer= when building the generator")
        if chat:
            messages = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": prompt}
            ]
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        else:
            text = prompt
        enc = tok(text, return_tensors="pt", add_special_tokens=not chat)
        kwargs["return_dict_in_generate"] = True
        out = self.generate(enc["input_ids"], attention_mask=enc.get("attention_mask"), **kwargs)
        assert isinstance(out, SpecSplitOutput)
        new = out.sequences[0, enc["input_ids"].shape[1] :]
        result = tok.decode(new.tolist(), skip_special_tokens=True)
        return (result, out.spec_stats) if return_stats else result

    def forget_generations(self) -> None:
        """Drop the earlier generations the ``suffix`` and ``auto`` drafters draft from (what the cost
        model measured stays)."""
        self._ngram.clear()

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Release the transport and the batched rounds' KV pool (idempotent)."""
        self._scheduler = None
        self.transport.close()

    def __enter__(self) -> SpecSplitGenerator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
