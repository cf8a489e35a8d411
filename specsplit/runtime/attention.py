"""The attention function SpecSplit's forwards use: GQA folded into the query rows, query recording.

A tree forward (verify, draft level, ingest) attends a few query rows to a cached prefix under an
additive mask. transformers' SDPA integration, given a mask, copies K and V to every query head
(``repeat_kv``) and hands SDPA ``heads`` slices that each stream the whole prefix. For GQA models
(Qwen2.5-Coder-1.5B: 12 query heads over 2 KV heads) that moves ``group`` times the KV bytes the
step needs, and at long contexts it dominates the step (see benchmarks/NOTES.md, "Folded GQA
attention and the math kernel").

Folding the GQA group into the query rows, `[b, heads, q, d] -> [b, kv_heads, group * q, d]`,
reads each K/V head once. Query head ``h`` reads KV head ``h // group`` exactly as ``repeat_kv``
arranges it, so the result is the same attention. Short prefixes go to SDPA. Long ones go to two
matmuls with a float32 softmax: cuBLAS spreads the long KV dimension over the whole GPU, while a
batch-1 verify gives SDPA's kernels only ``kv_heads x query blocks`` units of work.

The function is registered once through transformers' ``AttentionInterface`` (no modeling-file
change). It does nothing new unless a forward passes one of its keyword arguments, so a model
switched to it behaves exactly as under ``"sdpa"`` elsewhere (e.g. in HF ``generate()``):

- :data:`FOLD_KWARG` ``=True``: fold GQA for masked forwards of at most :data:`FOLD_MAX_ROWS` rows
  over at least :data:`FOLD_MIN_KV` cached tokens; ``="math"``: every masked forward of at most
  :data:`FOLD_MAX_ROWS` rows attends through the folded matmul kernel, whatever the prefix length
  (``attention_kernel="math"`` of the engine configs). Under CUDA graphs at short prefixes this is
  fewer kernels a layer than transformers' SDPA path, which copies K/V to every query head
  (``repeat_kv``) and, through cuDNN, adds a memset and a launch gap before each attention kernel;
- :data:`RECORDER_KWARG` ``=recorder``: hand the post-RoPE queries to ``recorder.record`` (SpecPV);
- :data:`ENGINE_KWARG` ``=True`` (every forward of a SpecSplit engine): on CUDA, masked attention that
  goes to SDPA runs PyTorch's memory-efficient kernel, called by name, never cuDNN's.

Why not cuDNN: on Hopper (and B200) PyTorch ranks cuDNN attention first for bf16. cuDNN builds an
execution plan per problem shape, the sequence lengths included, and PyTorch caches those plans per
*thread*. A prefill over a prompt of a new length, or one run on another thread than the last prompt
of that length (a gRPC worker serves each call on whichever pool thread is free), builds a plan
first: host time per forward paid by every new prompt. The memory-efficient kernel has no per-shape
plan (see benchmarks/NOTES.md, "Avoiding cuDNN SDPA"). :data:`AVOID_CUDNN` holds the choice.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import torch

from specsplit.core.tree_attention import MASK_ALIGN, aligned_zeros

logger = logging.getLogger(__name__)

ATTENTION_NAME = "specsplit"  # the name registered with transformers' AttentionInterface
FOLD_KWARG = "specsplit_fold_gqa"  # model-forward kwarg: fold GQA into the query rows
RECORDER_KWARG = "specpv_recorder"  # model-forward kwarg: a SpecPV QueryRecorder
ENGINE_KWARG = "specsplit_engine"  # model-forward kwarg: a SpecSplit engine's forward (see above)
# Engine forwards' SDPA skips cuDNN (a module attribute so a benchmark can route around it for an A/B)
AVOID_CUDNN = True
# Tree forwards: the largest padded round (64 nodes and the pending token: 65 rows) must fold, since
# past the limit a round falls back to the memory-efficient kernel, whose batch-1 grid is a few
# blocks per head (see benchmarks/NOTES.md, "Folded GQA attention and the math kernel"). A long
# prefill keeps SDPA (its folded mask would be huge).
FOLD_MAX_ROWS = 128
# Below this many cached tokens transformers' path is as fast or faster, so the fold starts here (see
# benchmarks/NOTES.md, "Folded GQA attention and the math kernel").
FOLD_MIN_KV = 2048
MATH_MIN_KV = 4096  # prefix length from which the matmul kernel replaces SDPA


def gqa_group(model: torch.nn.Module) -> int:
    """Query heads per KV head of ``model`` (1 when it has no GQA or does not say)."""
    cfg = getattr(model, "config", None)
    heads = getattr(cfg, "num_attention_heads", None)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    if not heads or not kv_heads or heads % kv_heads:
        return 1
    return int(heads // kv_heads)


def folded_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    scaling: float | None = None,
    kernel: Literal["auto", "sdpa", "math"] = "auto",
) -> torch.Tensor:
    """Masked GQA attention with K/V read once per KV head.

    Args:
        query: `[b, heads, q, d]` (``heads`` a multiple of ``kv_heads``).
        key, value: `[b, kv_heads, kv, d]`.
        mask: `[b or 1, 1, q, kv]` additive float mask.
        scaling: softmax scale (default ``d ** -0.5``).
        kernel: ``"auto"``: matmuls from :data:`MATH_MIN_KV` cached tokens on, else SDPA.

    Returns:
        `[b, q, heads, d]`, the layout the attention modules expect back.
    """
    b, h, n, d = query.shape
    hk, kv = key.shape[1], key.shape[2]
    group = h // hk
    scale = d**-0.5 if scaling is None else scaling
    qf = query.reshape(b, hk, group * n, d)  # row g * n + i of KV head k = query head k * group + g
    if kernel == "math" or (kernel == "auto" and kv >= MATH_MIN_KV):
        scores = torch.matmul(qf, key.transpose(-1, -2)).float().mul_(scale)
        scores.view(b, hk, group, n, kv).add_(mask[:, :, None])  # mask broadcast over the group, no copy
        out = torch.matmul(torch.softmax(scores, dim=-1).to(value.dtype), value)
    else:  # SDPA wants one mask row per query row: repeat it over the group
        mf = mask.expand(b, 1, n, kv).repeat(1, 1, group, 1)
        out = masked_sdpa(qf, key, value, mf, scale)
    return out.reshape(b, h, n, d).transpose(1, 2).contiguous()


def masked_sdpa(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scale: float | None
) -> torch.Tensor:
    """SDPA of `[b, h, q, d]` queries over `[b, h, kv, d]` keys/values under an additive float mask
    (broadcastable to `[b, h, q, kv]`); `[b, h, q, d]` out.

    On CUDA with :data:`AVOID_CUDNN` this is the memory-efficient kernel, called by name (see the
    module docstring), with the mask's rows :data:`~specsplit.core.tree_attention.MASK_ALIGN` apart
    (a copy only when they are not); elsewhere ``scaled_dot_product_attention``.
    """
    if not _efficient_kernel(query):
        return torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, scale=scale
        )
    b, h, q, _ = query.shape
    kv = key.shape[2]
    if mask.stride(-2) % MASK_ALIGN or mask.stride(-1) != 1:  # masks from bool_mask_to_float never are
        mask = aligned_zeros(mask.shape, mask.dtype, mask.device).copy_(mask)
    bias = mask.expand(b, h, q, kv)
    try:
        return _efficient_op(query, key, value, bias, False, scale=scale)[0]
    except RuntimeError as e:  # an argument the kernel does not take (checked before any launch)
        _UNSUPPORTED.add((query.shape[-1], query.dtype))
        logger.warning("memory-efficient attention refused head_dim %d / %s (%s); using SDPA's own choice",
                       query.shape[-1], query.dtype, e)  # fmt: skip
        return torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, scale=scale
        )


_UNSUPPORTED: set[tuple[int, torch.dtype]] = set()  # (head_dim, dtype) the kernel refused once


def _efficient_kernel(query: torch.Tensor) -> bool:
    """Whether an engine's masked SDPA of ``query`` runs the memory-efficient kernel by name."""
    return AVOID_CUDNN and query.is_cuda and (query.shape[-1], query.dtype) not in _UNSUPPORTED


# PyTorch's memory-efficient attention (CUDA): (q, k, v, bias, compute_log_sumexp, ...) -> (out, ...)
_efficient_op = torch.ops.aten._scaled_dot_product_efficient_attention


def _foldable(
    query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None, any_length: bool = False
) -> bool:
    if mask is None or mask.dim() != 4 or mask.shape[1] != 1 or not mask.is_floating_point():
        return False
    h, hk = query.shape[1], key.shape[1]
    if h % hk or query.shape[2] > FOLD_MAX_ROWS:
        return False
    return any_length or (h > hk and key.shape[2] >= FOLD_MIN_KV)


def specsplit_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention function for ``AttentionInterface`` (see the module docstring).

    transformers calls it after RoPE and after ``past_key_values.update``: ``query`` is post-RoPE
    at the true positions, ``key``/``value`` are what the cache returned (the valid prefix, a KV
    bucket of the static workspace, or the SpecPV partial view).
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    recorder = kwargs.pop(RECORDER_KWARG, None)
    fold = kwargs.pop(FOLD_KWARG, False)
    engine = kwargs.pop(ENGINE_KWARG, False)
    layer_idx = getattr(module, "layer_idx", None)
    if recorder is not None and layer_idx is not None:  # missing queries -> full verification later
        recorder.record(int(layer_idx), query)
    math = fold == "math"
    plain = kwargs.get("dropout", 0.0) == 0.0
    if fold and plain and _foldable(query, key, attention_mask, any_length=math):
        assert attention_mask is not None
        kernel: Literal["auto", "math"] = "math" if math else "auto"
        return folded_attention(query, key, value, attention_mask, kwargs.get("scaling"), kernel), None
    if engine and plain and _efficient_kernel(query) and _is_additive(attention_mask):
        assert attention_mask is not None
        attention_mask = attention_mask[..., : key.shape[2]]
        group = query.shape[1] // key.shape[1]
        if group > 1:  # one K/V head per query head, as transformers' SDPA path does with a mask
            key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
        out = masked_sdpa(query, key, value, attention_mask, kwargs.get("scaling"))
        return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _is_additive(mask: torch.Tensor | None) -> bool:
    return mask is not None and mask.dim() == 4 and mask.is_floating_point()


_registered = False


def install(model: torch.nn.Module, allow_from: tuple[str | None, ...] = ("sdpa", None, "eager")) -> bool:
    """Switch ``model`` to :func:`specsplit_attention` (idempotent); False if it cannot.

    Models whose attention goes through ``ALL_ATTENTION_FUNCTIONS`` (Llama, Qwen2, ... in
    transformers 5) switch without any modeling-file change. Only implementations named in
    ``allow_from`` are replaced (an eager model moves to SDPA math: same result, other kernel).
    """
    global _registered
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if not _registered:
        AttentionInterface.register(ATTENTION_NAME, specsplit_attention)
        AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)  # 2-D masks (e.g. HF generate)
        _registered = True
    config = getattr(model, "config", None)
    current = getattr(config, "_attn_implementation", None)
    if current == ATTENTION_NAME:
        return True
    if current not in allow_from:
        logger.info(
            "attention implementation %r kept (SpecSplit's attention replaces only %s)", current, allow_from
        )
        return False
    try:
        model.set_attn_implementation(ATTENTION_NAME)  # type: ignore[operator]
    except (AttributeError, ValueError, TypeError) as e:
        logger.warning("cannot install SpecSplit's attention function on this model (%s)", e)
        return False
    ok = getattr(config, "_attn_implementation", None) == ATTENTION_NAME
    if ok and current not in ("sdpa", None):
        logger.info("attention implementation %r replaced by SDPA (SpecSplit's attention function)", current)
    return ok
