"""SpecSplitGenerator: the facade users call like Hugging Face ``model.generate()``."""

from __future__ import annotations

import copy
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import GenerationConfig

from specsplit.config import Drafter, SpecSplitConfig
from specsplit.core.sampling import SamplingParams
from specsplit.engines.cost_model import CostModels
from specsplit.engines.draft import DraftEngine
from specsplit.engines.drafters import NgramDrafter
from specsplit.engines.target import TargetEngine
from specsplit.errors import ConfigError
from specsplit.local import LocalTransport
from specsplit.pipeline import DecodeParams, OverlapPolicies, OverlapPolicy, decode
from specsplit.telemetry import SpecStats
from specsplit.transport import Transport

logger = logging.getLogger(__name__)

# What from_pretrained() and `specsplit generate` draft with unless told otherwise: the fastest lossless
# mode measured on CPU and GPU (benchmarks/RESULTS.md, "Drafters").
DEFAULT_DRAFTER: Drafter = "auto"
DRAFTER_ENV = "SPECSPLIT_DRAFTER"

# GenerationConfig fields we honour; others that change the distribution are refused or warned about.
_UNSUPPORTED_IF_SET: dict[str, Any] = {
    "num_beams": 1,
    "num_beam_groups": 1,
    "penalty_alpha": None,
    "constraints": None,
    "force_words_ids": None,
}
_IGNORED_WARN: dict[str, Any] = {
    "repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "min_new_tokens": None,
    "min_length": 0,
    "typical_p": 1.0,
    "min_p": None,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "bad_words_ids": None,
    "suppress_tokens": None,
    "begin_suppress_tokens": None,
    "forced_bos_token_id": None,
    "forced_eos_token_id": None,
}


@dataclass
class SpecSplitOutput:
    """Returned with ``return_dict_in_generate=True``.

    Attributes:
        sequences: `[batch, prompt + new]` as HF ``generate`` returns them (left padding kept,
            finished rows padded with ``pad_token_id``).
        spec_stats: statistics of the whole batch.
        per_sequence_stats: one :class:`SpecStats` per row.
    """

    sequences: torch.Tensor
    spec_stats: SpecStats
    per_sequence_stats: list[SpecStats] = field(default_factory=list)


def _generation_config_from(name: str) -> GenerationConfig | None:
    """The generation config saved with a model (alias or directory), if there is one."""
    from specsplit.models import resolve_model_path

    try:
        return GenerationConfig.from_pretrained(resolve_model_path(name))
    except Exception as e:  # no file, or not resolvable offline: keep HF defaults
        logger.debug("no generation config for %s: %s", name, e)
        return None


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
        self._ngram = NgramDrafter(self.config.tuning.ngram, suffix=mode in ("suffix", "auto"))
        self._costs = CostModels()
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
        trees where the text repeats, the draft model's tree where it pays, plain steps otherwise.

        In gRPC mode no weights are loaded; ``tokenizer`` (or ``target``) only names the tokenizer.
        """
        from specsplit.models import load_tokenizer

        cfg = copy.deepcopy(config) if config is not None else SpecSplitConfig.from_env()
        if config is None and DRAFTER_ENV not in os.environ:
            cfg.drafter = DEFAULT_DRAFTER
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
        *,
        streamer: Any = None,
        generator: torch.Generator | None = None,
        tokenizer: Any = None,
        return_dict_in_generate: bool | None = None,
        **kwargs: Any,
    ) -> torch.Tensor | SpecSplitOutput:
        """Like ``model.generate``: greedy output equals the target's, sampling matches its distribution.

        Args:
            input_ids: `[batch, prompt]` int64 (left-padded for batch > 1).
            attention_mask: `[batch, prompt]` 1 = token, 0 = padding.
            generation_config: an HF ``GenerationConfig``; keyword arguments override its fields
                (``max_new_tokens``, ``do_sample``, ``temperature``, ``top_k``, ``top_p``,
                ``eos_token_id``, ``pad_token_id``, ``stop_strings``, ...).
            streamer: an HF streamer (batch 1 only), fed after every round.
            generator: CPU ``torch.Generator`` that makes sampling reproducible.
            tokenizer: for stop strings (defaults to the generator's tokenizer).
            return_dict_in_generate: return a :class:`SpecSplitOutput` instead of a tensor.

        Returns:
            `[batch, prompt + new]` int64 tensor, or :class:`SpecSplitOutput`.
        """
        if input_ids is None:
            raise ValueError("input_ids is required")
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        gc = copy.deepcopy(generation_config if generation_config is not None else self.generation_config)
        unused = gc.update(**kwargs)
        if unused:
            raise TypeError(f"generate() got unexpected keyword arguments: {sorted(unused)}")
        return_dict = bool(
            return_dict_in_generate if return_dict_in_generate is not None else gc.return_dict_in_generate
        )
        params = self._decode_params(gc, input_ids.shape[1], tokenizer or self.tokenizer, generator)
        batch = input_ids.shape[0]
        if streamer is not None and batch > 1:
            raise ValueError("streamers support batch size 1 only (as in transformers)")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        rows: list[list[int]] = []
        all_stats: list[SpecStats] = []
        if streamer is not None:
            streamer.put(input_ids[0].cpu())
        for b in range(batch):
            prompt = input_ids[b][attention_mask[b].bool()].tolist()
            on_tokens = (lambda t: streamer.put(torch.tensor(t, dtype=torch.long))) if streamer else None
            new, stats = decode(self.transport, prompt, params, on_tokens=on_tokens)
            rows.append(new)
            all_stats.append(stats)
        if streamer is not None:
            streamer.end()
        pad = self._pad_id(gc)
        width = max((len(r) for r in rows), default=0)
        new_part = torch.full((batch, width), pad, dtype=input_ids.dtype)
        for b, r in enumerate(rows):
            if r:
                new_part[b, : len(r)] = torch.tensor(r, dtype=input_ids.dtype)
        sequences = torch.cat([input_ids.cpu(), new_part], dim=1)
        if return_dict:
            return SpecSplitOutput(sequences, SpecStats.merge(all_stats), all_stats)
        return sequences

    def _decode_params(
        self, gc: GenerationConfig, prompt_len: int, tokenizer: Any, generator: torch.Generator | None
    ) -> DecodeParams:
        for name, default in _UNSUPPORTED_IF_SET.items():
            if getattr(gc, name, default) not in (default, None):
                raise ConfigError(
                    f"generation option {name}={getattr(gc, name)!r} is not supported by SpecSplit"
                )
        for name, default in _IGNORED_WARN.items():
            val = getattr(gc, name, default)
            if val is not None and val != default:
                logger.warning("generation option %s=%r is ignored by SpecSplit", name, val)
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
        )

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
        """Release the transport (idempotent)."""
        self.transport.close()

    def __enter__(self) -> SpecSplitGenerator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
