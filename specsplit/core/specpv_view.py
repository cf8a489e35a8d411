"""SpecPV's view maths: block scores, block selection and the layout of a partial KV view.

Pure tensor functions (see :mod:`specsplit.engines.partial_kv` for the vocabulary: blocks, sink,
window, candidates, speculative buffer, summaries). Scores are ``max(q . Kmax, q . Kmin)`` for the
post-RoPE query ``q`` of a tree token against each block's elementwise key maxima and minima.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


def score_blocks(
    query: torch.Tensor, kmax: torch.Tensor, kmin: torch.Tensor, reduce: str = "mean"
) -> torch.Tensor:
    """Block scores ``max(q . Kmax, q . Kmin)`` reduced over queries and GQA group heads.

    Args:
        query: `[batch, heads, nq, head_dim]` post-RoPE queries (heads = kv_heads * group, laid
            out as transformers' ``repeat_kv`` expects: head ``h`` reads KV head ``h // group``).
        kmax: `[batch, kv_heads, C, head_dim]` block maxima.
        kmin: `[batch, kv_heads, C, head_dim]` block minima.
        reduce: ``"mean"`` or ``"max"``.

    Returns:
        `[batch, kv_heads, C]` float32 scores.
    """
    b, h, nq, d = query.shape
    kvh, c = kmax.shape[1], kmax.shape[2]
    if h % kvh:
        raise ValueError(f"{h} query heads do not split into {kvh} KV heads")
    g = h // kvh
    q = query.float().reshape(b, kvh, g * nq, d)  # [B, kvH, G * nq, D]
    s = torch.maximum(q @ kmax.float().transpose(-1, -2), q @ kmin.float().transpose(-1, -2))
    s = s.view(b, kvh, g, nq, c)  # [B, kvH, G, nq, C]
    if reduce == "max":
        return s.amax(dim=3).amax(dim=2)
    return s.mean(dim=3).mean(dim=2)


def select_blocks(scores: torch.Tensor, k: int, first_block: int) -> torch.Tensor:
    """The ``k`` best blocks per KV head, ascending (position order).

    Args:
        scores: `[batch, kv_heads, C]` scores of the candidate blocks ``first_block ...``.
        k: blocks to keep (``<= C``).
        first_block: absolute index of candidate 0.

    Returns:
        `[batch, kv_heads, k]` int64 absolute block indices, sorted.
    """
    top = scores.topk(k, dim=-1, sorted=False).indices  # [B, kvH, k]
    return top.sort(dim=-1).values + first_block


def block_token_index(blocks: torch.Tensor, block_size: int) -> torch.Tensor:
    """`[batch, kv_heads, k]` block ids -> `[batch, kv_heads, k * block_size]` token slots."""
    offs = torch.arange(block_size, device=blocks.device)
    return (blocks[..., None] * block_size + offs).flatten(-2)


def gather_tokens(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Per-head gather along the sequence: `[B, H, T, D]`, `[B, H, n]` -> `[B, H, n, D]`."""
    return x.gather(2, index[..., None].expand(-1, -1, -1, x.shape[-1]))


@dataclass
class ViewLayout:
    """Where the parts of a freshly built view sit (token counts; host ints)."""

    full_len: int  # full-cache length the view was built from
    sink: int  # slots [0, sink)
    retrieved_blocks: int  # k blocks at slots [sink, sink + k * block_size)
    window_start: int  # absolute position of the first window token
    view_len: int  # sink + k * block_size + (full_len - window_start); the buffer starts here


def plan_layout(cfg: Any, full_len: int) -> tuple[ViewLayout, int]:
    """The layout for a full cache of ``full_len`` tokens, and the candidate block count.

    Args:
        cfg: a ``SpecPVConfig`` (its ``block_size`` and ``n_*_blocks`` fields).
        full_len: tokens in the full cache.
    """
    bs = cfg.block_size
    sink = min(cfg.n_sink_blocks * bs, full_len)
    ws = ((full_len - cfg.n_window_blocks * bs) // bs) * bs
    ws = max(ws, sink)
    n_cand = max(0, ws // bs - cfg.n_sink_blocks)
    k = min(cfg.n_retrieval_blocks, n_cand)
    layout = ViewLayout(full_len, sink, k, ws, sink + k * bs + (full_len - ws))
    return layout, n_cand
