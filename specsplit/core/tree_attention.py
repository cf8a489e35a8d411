"""Tree attention: parents array -> additive mask and position ids (one pure, vectorised function).

A node attends to the whole committed prefix, to its ancestors and to itself. Masks are additive
float masks (``0`` / ``torch.finfo(dtype).min``) of shape `[1, 1, q, kv]`: boolean masks are
silently wrong under eager attention, so they are converted with :func:`bool_mask_to_float`.
"""

from __future__ import annotations

import math

import torch


def ancestor_matrix(parents: torch.Tensor) -> torch.Tensor:
    """`[N, N]` bool: ``A[i, j]`` is True when ``j`` is ``i`` or an ancestor of ``i``.

    Computed by repeated squaring of the parent relation (ceil(log2 N) matmuls, no host sync).

    Args:
        parents: `[N]` int64, -1 for roots, ``parents[i] < i``.
    """
    n = parents.shape[0]
    dev = parents.device
    if n == 0:
        return torch.zeros(0, 0, dtype=torch.bool, device=dev)
    rel = torch.eye(n, dtype=torch.float32, device=dev)
    has = (parents >= 0).float()
    rows = torch.arange(n, device=dev)
    # Adds 1 at (i, parent) and 0 for roots: no boolean indexing, so no host sync.
    rel.index_put_((rows, parents.clamp_min(0)), has, accumulate=True)
    for _ in range(max(1, math.ceil(math.log2(n)))):
        rel = ((rel @ rel) > 0).float()
    return rel > 0


def build_tree_attention(
    topology_map: torch.Tensor,
    prefix_length: int,
    device: torch.device | str | None = None,
    tree_rows_only: bool = False,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask and positions for a forward over a tree that hangs below ``prefix_length`` tokens.

    Args:
        topology_map: `[N]` int64 parents (-1 = child of the prefix), BFS order.
        prefix_length: number of committed tokens before the tree (already in the KV cache when
            ``tree_rows_only``; otherwise fed in the same forward, causally).
        device: where to build (defaults to ``topology_map``'s device).
        tree_rows_only: build only the N tree rows (`q = N`); else prefix rows too (`q = prefix + N`).
        dtype: dtype of the additive mask (use the model's dtype).

    Returns:
        ``(mask [1, 1, q, prefix + N], position_ids [1, q])`` where a tree node's position is
        ``prefix_length + depth - 1`` (roots sit right after the prefix).
    """
    dev = torch.device(device) if device is not None else topology_map.device
    parents = topology_map.to(dev)
    n = parents.shape[0]
    anc = ancestor_matrix(parents)  # [N, N]
    depth = anc.sum(dim=-1)  # [N], 1 for roots
    tree_rows = torch.cat(
        [torch.ones(n, prefix_length, dtype=torch.bool, device=dev), anc], dim=1
    )  # [N, prefix + N]
    tree_pos = prefix_length + depth - 1
    if tree_rows_only:
        allowed, pos = tree_rows, tree_pos
    else:
        causal = torch.ones(prefix_length, prefix_length, dtype=torch.bool, device=dev).tril()
        prefix_rows = torch.cat([causal, torch.zeros(prefix_length, n, dtype=torch.bool, device=dev)], dim=1)
        allowed = torch.cat([prefix_rows, tree_rows], dim=0)
        pos = torch.cat([torch.arange(prefix_length, device=dev), tree_pos])
    return bool_mask_to_float(allowed[None, None], dtype), pos[None].long()


MASK_ALIGN = 16  # elements: the row stride the fused attention kernels take a bias at without a copy


def bool_mask_to_float(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """True/False (attend/blocked) -> 0 / ``finfo(dtype).min`` additive mask of the same shape.

    The rows are laid out :data:`MASK_ALIGN` elements apart (a view into a slightly wider buffer),
    so the memory-efficient attention kernel reads the mask in place instead of every layer padding
    a copy of it.
    """
    out = aligned_zeros(mask.shape, dtype, mask.device)
    return out.masked_fill_(~mask.bool(), torch.finfo(dtype).min)


def aligned_zeros(
    shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Zeros of ``shape`` whose rows (last dim) start :data:`MASK_ALIGN` elements apart: a view into a
    buffer with the last dim rounded up."""
    kv = shape[-1]
    wide = -(-kv // MASK_ALIGN) * MASK_ALIGN
    return torch.zeros((*shape[:-1], wide), dtype=dtype, device=device)[..., :kv]


def chain_parents(n: int, first_parent: int = -1, device: torch.device | str = "cpu") -> torch.Tensor:
    """Parents of ``n`` tokens in a line: `[first_parent, 0, 1, ..., n-2]`."""
    p = torch.arange(-1, n - 1, device=device)
    if n:
        p[0] = first_parent
    return p


def build_verify_attention(
    tree_parents: torch.Tensor,
    cache_length: int,
    num_pending: int,
    dtype: torch.dtype = torch.float32,
    anc: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask and positions for ONE forward over ``pending + tree`` on top of a cache.

    The pending tokens are a causal chain after the ``cache_length`` cached tokens; every tree
    root hangs below the last pending token (or below the cache when there is none).

    Args:
        tree_parents: `[N]` int64 tree parents (-1 = root).
        cache_length: tokens already in the KV cache.
        num_pending: committed tokens fed in this forward before the tree.
        dtype: mask dtype (the model's).
        anc: optional precomputed `[N, N]` ancestor matrix of the tree.

    Returns:
        ``(mask [1, 1, P + N, cache_length + P + N], position_ids [1, P + N])``.
    """
    dev = tree_parents.device
    n, p, c = tree_parents.shape[0], num_pending, cache_length
    if anc is None:
        anc = ancestor_matrix(tree_parents)
    pend = torch.cat(
        [
            torch.ones(p, c, dtype=torch.bool, device=dev),
            torch.ones(p, p, dtype=torch.bool, device=dev).tril(),
            torch.zeros(p, n, dtype=torch.bool, device=dev),
        ],
        dim=1,
    )  # [P, c + P + N]
    tree = torch.cat([torch.ones(n, c + p, dtype=torch.bool, device=dev), anc], dim=1)
    allowed = torch.cat([pend, tree], dim=0)[None, None]
    pos = torch.cat([torch.arange(p, device=dev), p + anc.sum(-1) - 1]) + c
    return bool_mask_to_float(allowed, dtype), pos[None].long()
