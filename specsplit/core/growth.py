"""Growing a draft tree level by level: static plans, dynamic (EAGLE-2 style) trees, the main path.

Each function takes the draft's root logits and a ``level`` callback that runs ONE forward for a
whole level of frontier nodes (the engine's business: eager, static workspace or a captured graph)
and returns their logits; the selection between levels is pure device ops with shapes fixed by the
tree's shape, so the same code runs eagerly or inside one captured CUDA graph.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specsplit.core.pinned import to_device
from specsplit.core.sampling import (
    SamplingParams,
    fast_probs,
    sample_without_replacement,
    truncate_top_k,
)
from specsplit.core.tree import StaticTreePlan, TokenTree, dynamic_level_widths
from specsplit.core.tree_attention import ancestor_matrix

# level(d, tokens [W], allowed [W, n]) -> logits [W, V]
LevelForward = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]
# process(logits [W, V], paths [W, d]) -> scores [W, V]: reshapes the logits of W nodes whose
# tokens below the committed context are `paths` (root first), e.g. HF logits processors.
ScoreProcess = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _probs(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """The draft's distribution: the fast top-k + top-p transform as it comes (a draft may draw from
    any distribution as long as its ``q`` is the one it drew from, so its rare tie overflow needs
    no redo)."""
    return fast_probs(logits, sampling)[0]


@dataclass(frozen=True)
class PlanTensors:
    """A :class:`StaticTreePlan` as device tensors (built once per plan and device).

    Attributes:
        parents / depths: `[N]` int64.
        anc: `[N, N]` bool ancestor matrix (a node is its own ancestor).
        levels: per level ``(local parent index [W], sibling rank [W], node index [W], start, end,
            kmax)``: the level's nodes are ``start .. end - 1``, each the ``rank``-th child of the
            ``local``-th node of the level above; ``kmax`` children are drawn per parent.
    """

    parents: torch.Tensor
    depths: torch.Tensor
    anc: torch.Tensor
    levels: tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int, int], ...]

    @classmethod
    def build(cls, plan: StaticTreePlan, device: torch.device) -> PlanTensors:
        def on_dev(values: list[int] | tuple[int, ...]) -> torch.Tensor:
            return to_device(torch.tensor(values, dtype=torch.long), device)

        parents = on_dev(plan.parents)
        levels = []
        prev: tuple[int, ...] = (-1,)
        for idx, par, rank in plan.levels:
            local = on_dev([prev.index(p) for p in par])
            levels.append((local, on_dev(rank), on_dev(idx), idx[0], idx[-1] + 1, max(rank) + 1))
            prev = idx
        return cls(parents, on_dev(plan.depths), ancestor_matrix(parents), tuple(levels))


def grow_static_tree(
    root_logits: torch.Tensor,
    plan: StaticTreePlan,
    pt: PlanTensors,
    sampling: SamplingParams,
    q_top_k: int,
    gen: torch.Generator | None,
    level: LevelForward,
    process: ScoreProcess | None = None,
    min_confidence: float = 0.0,
) -> TokenTree:
    """Fill a fixed plan: greedy top-k children, or (sampling) children drawn without replacement.

    Under sampling the draft draws from its top-``q_top_k`` distribution (renormalised), so ``q``
    is exact and small enough to ship sparsely; the ``r``-th sibling's ``q`` is that distribution
    without the siblings drawn before it.

    Args:
        root_logits: `[V]` the draft's logits after the committed context.
        plan / pt: the tree's plan and its device tensors.
        sampling: how the draft turns logits into probabilities.
        q_top_k: support of the sampled ``q`` (clamped to the vocabulary).
        gen: RNG of the draws (sampling only).
        level: ``level(d, tokens [W], allowed [W, end])`` forwards the nodes of level ``d``
            (0-based; they sit at position ``context + d``) and returns their `[W, V]` logits.
        process: applied to every level's logits (with each row's path) before ``sampling``.
        min_confidence: stop after the first level whose first node the draft gave a probability
            below this (its ``q``): the tree keeps the levels grown so far. Each level then reads that
            probability on the host (a device sync on a GPU). 0 grows every level.
    """
    dev = root_logits.device
    floor = math.log(min_confidence) if min_confidence > 0.0 else None
    n = plan.num_nodes
    tokens = torch.zeros(n, dtype=torch.long, device=dev)
    logq = torch.zeros(n, dtype=torch.float32, device=dev)
    kq = min(q_top_k, root_logits.shape[-1])
    q_ids = torch.zeros(n, kq, dtype=torch.long, device=dev) if sampling.do_sample else None
    q_probs = torch.zeros(n, kq, dtype=torch.float32, device=dev) if sampling.do_sample else None
    parent_logits = root_logits[None]  # [P, V]
    paths = torch.zeros(1, 0, dtype=torch.long, device=dev)  # [P, d] the parents' paths
    for d, (local, rank, _idx, start, end, kmax) in enumerate(pt.levels):
        if process is not None:
            parent_logits = process(parent_logits, paths)
        probs = _probs(parent_logits, sampling)  # [P, V]
        if q_ids is None or q_probs is None:
            vals, ids = torch.topk(probs, kmax, dim=-1)  # deterministic top-k expansion
            tok = ids[local, rank]
            logq[start:end] = vals[local, rank].clamp_min(1e-30).log()
        else:
            sids, sprobs = truncate_top_k(probs, kq)  # [P, Kq]
            order = sample_without_replacement(sprobs, kmax, gen)  # [P, kmax] draw order
            # q of the r-th sibling: the truncated q without siblings drawn before it.
            drawn = torch.nn.functional.one_hot(order, sprobs.shape[-1]).bool()  # [P, kmax, Kq]
            earlier = (drawn.cumsum(1) - drawn.long()) > 0
            qs = sprobs[:, None, :].masked_fill(earlier, 0.0)
            qs = qs / qs.sum(-1, keepdim=True).clamp_min(1e-30)  # exhausted rows stay 0
            pos = order[local, rank]  # [W]
            tok = sids[local, pos]
            q_ids[start:end] = sids[local]
            q_probs[start:end] = qs[local, rank]
            logq[start:end] = qs[local, rank].gather(1, pos[:, None]).squeeze(1).clamp_min(1e-30).log()
        tokens[start:end] = tok
        if d + 1 < len(pt.levels):
            if floor is not None and float(logq[start]) < floor:
                # The draft doubts this level: its children would rarely be accepted, and each
                # further level costs a draft forward. Keep the levels grown so far.
                return TokenTree(tokens[:end], pt.parents[:end], pt.depths[:end], logq[:end],
                                 None if q_ids is None else q_ids[:end], None if q_probs is None else q_probs[:end],
                                 plan.max_branch, d + 1)  # fmt: skip
            parent_logits = level(d, tok, pt.anc[start:end, :end])
            if process is not None:
                paths = torch.cat([paths[local], tok[:, None]], dim=1)
    return TokenTree(tokens, pt.parents, pt.depths, logq, q_ids, q_probs, plan.max_branch, plan.depth)


@dataclass(frozen=True)
class DynamicShape:
    """The fixed shape of a dynamic tree round: top-``topk`` children per expanded node, the
    ``width`` best nodes of each level expanded, ``budget`` nodes kept, ``depth`` levels."""

    topk: int
    width: int
    budget: int
    depth: int

    @property
    def widths(self) -> tuple[int, ...]:
        """Nodes forwarded at levels 1 .. depth - 1."""
        return dynamic_level_widths(self.topk, self.width, self.depth)

    @property
    def forwarded(self) -> int:
        return sum(self.widths)


def grow_dynamic_tree(
    root_logits: torch.Tensor,
    shape: DynamicShape,
    sampling: SamplingParams,
    level: LevelForward,
    process: ScoreProcess | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """EAGLE-2 style: expand the top-``width`` candidates of each level by cumulative draft
    log-probability, then keep the ``budget`` best nodes overall (always a valid tree, since a
    child's cumulative score never exceeds its parent's). Expansion is deterministic top-k, so
    ``q`` is one-hot and verification stays lossless under sampling.

    Device ops only, with shapes fixed by ``shape``: the same code runs eagerly or captured as one
    graph. ``level(d, tokens [W], allowed [W, n])`` forwards the ``W`` frontier nodes at depth ``d``
    (``allowed``: their ancestors among the ``n`` nodes forwarded so far, this level last) and
    returns their `[W, V]` logits. ``process`` (eager only: it may read the host) reshapes every
    level's logits, given each row's path, before ``sampling``.

    Returns:
        ``(tokens, parents, depths, log_q)``, each `[min(budget, pool)]`, in BFS order.
    """
    dev = root_logits.device
    k = shape.topk
    root = root_logits[None]
    if process is not None:
        root = process(root, torch.zeros(1, 0, dtype=torch.long, device=dev))
    probs = _probs(root, sampling)  # [1, V]
    vals, ids = torch.topk(probs, k, dim=-1)
    paths = ids[0][:, None]  # [level_len, d] the current level's paths (with process only)
    pool_tok = [ids[0]]
    pool_score = [vals[0].clamp_min(1e-30).log()]
    pool_logq = [pool_score[0]]
    pool_parent = [torch.full((k,), -1, dtype=torch.long, device=dev)]
    pool_depth = [torch.ones(k, dtype=torch.long, device=dev)]
    size = k  # pool size so far (host int: shapes are static)
    level_start, level_len = 0, k
    fw_slot = torch.full((k + shape.forwarded * k,), -1, dtype=torch.long, device=dev)
    fw_anc = torch.zeros(0, 0, dtype=torch.bool, device=dev)
    n_fw = 0
    for d, width in enumerate(shape.widths, start=1):
        cat_score = torch.cat(pool_score)
        front = level_start + torch.topk(cat_score[level_start : level_start + level_len], width).indices
        # Ancestors of the frontier among forwarded nodes: the parent's row plus itself.
        par = torch.cat(pool_parent)[front]
        par_slot = torch.where(par >= 0, fw_slot[par.clamp_min(0)], -1)
        grown = torch.zeros(n_fw + width, n_fw + width, dtype=torch.bool, device=dev)
        grown[:n_fw, :n_fw] = fw_anc
        if n_fw:
            grown[n_fw:, :n_fw] = fw_anc[par_slot.clamp_min(0)] & (par_slot >= 0)[:, None]
        grown[n_fw:, n_fw:] = torch.eye(width, dtype=torch.bool, device=dev)
        fw_anc = grown
        fw_slot[front] = torch.arange(n_fw, n_fw + width, device=dev)
        n_fw += width
        logits = level(d, torch.cat(pool_tok)[front], fw_anc[n_fw - width :])
        if process is not None:
            front_paths = paths[front - level_start]  # [W, d]
            logits = process(logits, front_paths)
        probs = _probs(logits, sampling)  # [W, V]
        vals, ids = torch.topk(probs, k, dim=-1)  # [W, K]
        if process is not None:
            paths = torch.cat([front_paths.repeat_interleave(k, dim=0), ids.reshape(-1, 1)], dim=1)
        lq = vals.clamp_min(1e-30).log()
        pool_tok.append(ids.reshape(-1))
        pool_logq.append(lq.reshape(-1))
        pool_score.append((cat_score[front][:, None] + lq).reshape(-1))
        pool_parent.append(front[:, None].expand(width, k).reshape(-1))
        pool_depth.append(torch.full((width * k,), d + 1, dtype=torch.long, device=dev))
        level_start, level_len = size, width * k
        size += width * k
    score = torch.cat(pool_score)
    tok = torch.cat(pool_tok)
    logq = torch.cat(pool_logq)
    parent = torch.cat(pool_parent)
    dep = torch.cat(pool_depth)
    budget = min(shape.budget, size)
    # Best `budget` by score; ties go to the shallower node so parents rank before children.
    by_depth = torch.sort(dep, stable=True).indices
    by_score = by_depth[torch.sort(score[by_depth], descending=True, stable=True).indices]
    chosen = by_score[:budget]
    bfs = chosen[torch.sort(dep[chosen] * size + chosen).indices]  # BFS order
    new_index = torch.full((size,), -1, dtype=torch.long, device=dev)
    new_index[bfs] = torch.arange(budget, device=dev)
    par = parent[bfs]
    new_par = torch.where(par >= 0, new_index[par.clamp_min(0)], -1)
    return tok[bfs], new_par, dep[bfs], logq[bfs]


def main_path(tree: TokenTree) -> list[int]:
    """Token ids along the first child of every level, root to leaf (the draft's likeliest path:
    children are stored best first). One small host read of the tree."""
    if tree.num_nodes == 0:
        return []
    n = tree.num_nodes
    idx = torch.arange(n, device=tree.device)
    first = torch.full((n + 1,), n, dtype=torch.long, device=tree.device)
    first.scatter_reduce_(0, tree.parents + 1, idx, reduce="amin")  # first child of each node (+1)
    packed = torch.cat([first, tree.token_ids]).tolist()
    first_child, tokens = packed[: n + 1], packed[n + 1 :]
    path, node = [], first_child[0]
    while node < n:  # at most the tree depth
        path.append(tokens[node])
        node = first_child[node + 1]
    return path
