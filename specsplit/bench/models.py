"""The models ``specsplit bench`` loads once and every decoder shares: real pairs or a tiny random one."""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)


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
    packed: bool = False  # SpecSplit decoders run copies with packed CPU weights (use_cpu_weights)
    int8_draft: bool = False  # ... and an int8 copy of the draft (use_cpu_weights)
    own_target: Any = None  # the SpecSplit decoders' copies (fused or packed), None: the originals
    own_draft: Any = None
    own_heads_target: Any = None  # the -heads decoders' copy of the target (heads_target)
    own_eagle_target: Any = None  # the -eagle decoders' copy (heads_target(eagle=True))

    @property
    def specsplit_target(self) -> Any:
        """The target the SpecSplit decoders run (their own copy once fused or packed)."""
        return self.own_target if self.own_target is not None else self.target

    @property
    def specsplit_draft(self) -> Any:
        """The draft the SpecSplit decoders run (their own copy once fused or packed)."""
        return self.own_draft if self.own_target is not None else self.draft

    def heads_target(self, eagle: bool = False) -> Any:
        """The -heads (or -eagle) decoders' own copy of the SpecSplit target (rewritten as it is):
        draft heads wrap a target's output layer (an EAGLE head its final norm), which the other
        decoders' target keeps as it is."""
        if eagle:
            if self.own_eagle_target is None:
                self.own_eagle_target = self._rewritten_copy()
            return self.own_eagle_target
        if self.own_heads_target is None:
            self.own_heads_target = self._rewritten_copy()
        return self.own_heads_target

    def _rewritten_copy(self) -> Any:
        """A copy of the target, fused or packed as the SpecSplit decoders' is."""
        from specsplit.runtime.fused import fuse_projections
        from specsplit.runtime.packed import pack_linears

        target = copy.deepcopy(self.target)
        if self.fused:
            fuse_projections(target)
        elif self.packed:
            pack_linears(target)
        return target

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
        from specsplit.runtime.fused import fuse_projections

        if self.fused or self.packed:
            return 0
        n = self._own_copies(fuse_projections)
        if self.overlap_draft is not None:
            n += fuse_projections(self.overlap_draft)
        self.fused = True
        return n

    def use_cpu_weights(self, pack: bool, int8_draft: bool) -> int:
        """SpecSplit decoders get copies of the models with their linear weights packed for the CPU
        (:mod:`specsplit.runtime.packed`) and, with ``int8_draft``, the draft's as int8 instead
        (:mod:`specsplit.runtime.int8`), as the engines do with the models they load themselves; the
        HF decoders keep the originals. Returns how many layers were rewritten (0 where neither
        applies: packing needs float32 on a CPU, int8 a CPU and a draft model of its own)."""
        from specsplit.runtime.int8 import quantizable, quantize_linears
        from specsplit.runtime.packed import pack_linears, packable

        pack = pack and packable(self.target)
        int8_draft = int8_draft and self.draft is not None and not self.draft_name.startswith("self:")
        int8_draft = int8_draft and quantizable(self.draft)
        if self.fused or self.packed or self.int8_draft or not (pack or int8_draft):
            return 0

        n = self._own_copies(pack_linears if pack else None, quantize_linears if int8_draft else pack_linears)
        self.packed, self.int8_draft = pack, int8_draft
        return n

    def _own_copies(self, rewrite: Any, draft_rewrite: Any = None) -> int:
        """The SpecSplit decoders' copies of the models, rewritten by ``rewrite`` (the draft's by
        ``draft_rewrite`` when given; a ``self:N`` draft is cut from the target's copy, sharing its
        weights; ``rewrite=None`` leaves the target itself, uncopied); how many modules they changed."""
        from specsplit.models.self_draft import truncated_draft

        self.own_target = copy.deepcopy(self.target) if rewrite is not None else self.target
        n: int = rewrite(self.own_target) if rewrite is not None else 0
        if self.draft is not None and self.draft_name.startswith("self:"):
            self.own_draft = truncated_draft(self.own_target, int(self.draft_name.split(":", 1)[1]))
        elif self.draft is not None:
            self.own_draft = copy.deepcopy(self.draft)
            n += (draft_rewrite or rewrite)(self.own_draft)
        return n

    def generation_config(self, max_new_tokens: int) -> Any:
        """The one greedy ``GenerationConfig`` every decoder runs with (EOS kept, explicit pad, no
        repetition penalty whatever the model's defaults say)."""
        from transformers import GenerationConfig

        return GenerationConfig(
            do_sample=False,
            repetition_penalty=1.0,  # set: generate() would take a registry model's default (1.1)
            max_new_tokens=max_new_tokens,
            eos_token_id=list(self.eos_token_ids),
            pad_token_id=self.pad_token_id,
        )


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
    with_draft: bool = True,
) -> BenchModels:
    """Load the models every decoder shares.

    Args:
        tiny: build the seeded tiny random pair (:func:`tiny_models`, float32) instead of real weights.
        device: target device.
        draft_device: draft device (default ``device``).
        target_name: target alias or directory (default the Qwen 1.5B).
        draft_name: draft alias or directory, or ``self:N`` (the target's first N layers).
        dtype_name: ``auto`` (bf16 on CUDA, fp32 on CPU) or a dtype name.
        with_draft: load a draft (off: ``draft`` is None and ``draft_name`` empty).

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
    if not with_draft:
        draft_name = ""
    elif not draft_name:
        raise ValueError("--draft is needed with a non-default --target (an alias, a path or self:N)")
    t0 = time.perf_counter()
    target = load_model(target_name, dtype=dtype, device=device)
    draft: Any = None
    if not draft_name:
        pass
    elif draft_name.startswith("self:"):
        if draft_device != device:
            raise ValueError("a self:N draft shares the target's weights: it cannot use another device")
        draft = truncated_draft(target, int(draft_name.split(":", 1)[1]))
        # the shallow copy shares the target's generation config; HF assisted generation edits the draft's
        draft.generation_config = copy.deepcopy(target.generation_config)
    else:
        draft = load_model(draft_name, dtype=dtype, device=draft_device)
    tok = load_tokenizer(target_name)
    logger.info(
        "loaded %s and %s (%s) in %.1f s",
        target_name,
        draft_name or "no draft",
        dtype,
        time.perf_counter() - t0,
    )
    eos = target.generation_config.eos_token_id
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    if tok.eos_token_id is not None and tok.eos_token_id not in eos_ids:
        eos_ids.append(int(tok.eos_token_id))
    pad = target.generation_config.pad_token_id
    pad = int(pad if pad is not None else (tok.pad_token_id if tok.pad_token_id is not None else eos_ids[0]))
    return BenchModels(target, draft, tok, target_name, draft_name, str(dtype).removeprefix("torch."),
                       device, draft_device, eos_ids, pad)  # fmt: skip
