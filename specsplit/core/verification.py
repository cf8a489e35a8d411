"""Tree verification: greedy and lossless stochastic, as pure tensor functions on device.

Vocabulary (after vLLM's rejection sampler):

- *row*: ``0`` is the committed context (the tree's virtual root); row ``i + 1`` is tree node ``i``.
  ``p[row]`` is the target distribution for the children of that row.
- *accepted*: drafted tokens on the path the target agrees with, root to leaf.
- *recovered / correction token*: drawn from the residual where every child of the last accepted
  row was rejected; *bonus token*: drawn from ``p`` at an accepted leaf. Either way exactly one
  target token follows the accepted ones (``next_token``).

Stochastic verification is recursive rejection sampling: at a row, the children are tried in
sibling order; child ``c`` drawn from ``q_c`` is accepted with probability
``min(1, p_res(c) / q_c(c))``; on rejection ``p_res <- norm(relu(p_res - q_c))``. The output is
distributed exactly as ``p`` for any tree shape as long as ``q_c`` is exactly the distribution the
sibling was drawn from (one-hot for deterministic expansions). All rows are processed in parallel
(one vectorised step per sibling rank), then the accepted path is followed from the root (one
step per depth level); nothing here reads a value back to the host.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specsplit.core.sampling import exponential_noise
from specsplit.core.tree import TokenTree


@dataclass
class VerifyOutcome:
    """Device-resident result; read it with :meth:`to_host` (the round's one host sync)."""

    path: torch.Tensor  # [D] int64 accepted node indices, -1 padded
    num_accepted: torch.Tensor  # [] int64
    next_token: torch.Tensor  # [] int64
    extra_host: list[int] = field(default_factory=list)  # values read with to_host(extra=...)
    guard: torch.Tensor | None = None  # `[1]` int64 flag the deciding transform asks to read
    # `[N + 1]` int64 the target's token after row 0 and after each node (its argmax, or its
    # position-keyed draw under sampling); None where verification drew from ``q`` instead
    choice: torch.Tensor | None = None
    choices_host: list[int] | None = None  # :attr:`choice` as read with to_host(choices=True)

    def to_host(
        self, token_ids: torch.Tensor, extra: torch.Tensor | None = None, choices: bool = False
    ) -> tuple[list[int], list[int], int]:
        """``(accepted node indices, accepted token ids, next token id)`` in ONE device-to-host copy.

        Args:
            token_ids: `[N]` the tree's tokens (to return the accepted ones without a second sync).
            extra: `[k]` int64 values to read in the same copy; they land in :attr:`extra_host`.
            choices: also read :attr:`choice` (when set) in the same copy, into :attr:`choices_host`.
        """
        d = self.path.shape[0]
        toks = token_ids[self.path.clamp_min(0)] if token_ids.numel() else self.path
        parts = [self.num_accepted.view(1), self.next_token.view(1), self.path, toks.to(self.path.device)]
        choice = self.choice if choices else None
        c = 0 if choice is None else choice.shape[0]
        if choice is not None:
            parts.append(choice.to(self.path.device))
        if extra is not None:
            parts.append(extra.to(self.path.device))
        packed = torch.cat(parts).tolist()
        m, nxt = int(packed[0]), int(packed[1])
        self.choices_host = packed[2 + 2 * d : 2 + 2 * d + c] if c else None
        self.extra_host = packed[2 + 2 * d + c :]
        return packed[2 : 2 + m], packed[2 + d : 2 + d + m], nxt

    def min_margin_below(self, logits: torch.Tensor, margin: float) -> torch.Tensor:
        """`[1]` int64, 1 when a row that decided a committed token (row 0, each accepted node's
        row) has a top-1 over top-2 logit margin below ``margin``; stays on device."""
        top2 = logits.float().topk(2, dim=-1).values  # [N + 1, 2]
        gaps = top2[:, 0] - top2[:, 1]  # [N + 1]
        d = self.path.shape[0]
        rows = torch.cat([self.path.new_zeros(1), self.path + 1])  # -1 padding -> row 0
        used = torch.arange(d + 1, device=rows.device) <= self.num_accepted
        low = (gaps.index_select(0, rows.clamp_min(0)) < margin) & used
        return low.any().long().view(1)


def children_table(parents: torch.Tensor, max_branch: int) -> torch.Tensor:
    """`[N + 1, max_branch]` node index of the r-th child of each row (-1 where none).

    Sibling order is BFS index order.
    """
    n = parents.shape[0]
    dev = parents.device
    table = torch.full((n + 1, max(max_branch, 1)), -1, dtype=torch.long, device=dev)
    if n == 0:
        return table
    row = parents + 1  # [N]
    idx = torch.arange(n, device=dev)
    same = (row[:, None] == row[None, :]) & (idx[None, :] < idx[:, None])  # [N, N]
    rank = same.sum(-1)  # [N]
    # Ranks past the table go to a spare column that is dropped (no boolean indexing: no sync).
    wide = torch.full((n + 1, table.shape[1] + 1), -1, dtype=torch.long, device=dev)
    wide.index_put_((row, rank.clamp_max(table.shape[1])), idx)
    return wide[:, :-1].contiguous()


def _follow_path(
    accepted_child: torch.Tensor, max_depth: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Walk ``accepted_child`` (`[N + 1]` node index or -1) from row 0.

    By pointer doubling: ``ceil(log2(max_depth + 1))`` steps of a few device ops each, not a few
    ops per level (a padded n-gram tree may be 16 or more levels deep, and each op outside a
    captured graph is a kernel launch from the host). No host sync.

    Returns ``(path [D], num_accepted [], last_row [])``.
    """
    dev = accepted_child.device
    d = max(max_depth, 0)
    if d == 0:  # nothing drafted (a plain step): row 0 itself
        zeros = torch.zeros(2, dtype=torch.long, device=dev)
        return torch.empty(0, dtype=torch.long, device=dev), zeros[0], zeros[1]
    rows = torch.arange(accepted_child.shape[0], device=dev)
    # The row after each row on its accepted path; a row without an accepted child points to itself.
    jump = torch.where(accepted_child >= 0, accepted_child + 1, rows)
    walk = rows[:1]  # rows reached from row 0 after 0, 1, 2, ... steps
    while walk.shape[0] < d + 1:  # walk doubles: steps [0, 2^k) -> [0, 2^(k+1)); jump: 2^k steps
        walk = torch.cat([walk, jump.index_select(0, walk)])
        if walk.shape[0] < d + 1:
            jump = jump.index_select(0, jump)
    walk = walk[: d + 1]
    # Rows grow along a path (a child's index exceeds its parent's), so a step moved iff the row changed.
    moved = walk[1:] != walk[:-1]
    path = torch.where(moved, walk[1:] - 1, -1)
    return path, moved.sum(), walk[d]


def verify_greedy(
    target_logits: torch.Tensor, tree: TokenTree, max_depth: int, max_branch: int
) -> VerifyOutcome:
    """Longest path whose every token equals the target's argmax, then the target's next token.

    Args:
        target_logits: `[N + 1, vocab]` logits for row 0 (context) and each node.
        tree: the verified tree (same device).
        max_depth: upper bound on the tree depth (host int).
        max_branch: upper bound on children per row (host int).
    """
    return accept_matching(target_logits.argmax(dim=-1), tree, max_depth)


def verify_sampled_matching(
    target_probs: torch.Tensor, tree: TokenTree, max_depth: int, noise: torch.Tensor
) -> VerifyOutcome:
    """Lossless sampling verification of a deterministic tree (``q`` one-hot on every node).

    Each row samples its target token as ``argmax(p / noise[depth])`` (an exponential race, so a
    draw from ``p``) and the longest path of nodes whose tokens equal their parent row's draw is
    accepted. For one-hot ``q`` this is recursive rejection sampling realised with one draw per row:
    the first sibling is accepted with probability ``p(token)``, a later one with ``p(token)`` over
    the mass its earlier siblings left, and otherwise the row's own draw follows from the residual.
    ``noise`` depends on the absolute position only (:func:`~specsplit.core.sampling.position_noise`),
    so the committed tokens are the ones plain sampling with that noise would give: the tree only
    decides how many come per round.

    Args:
        target_probs: `[N + 1, vocab]` target sampling distributions of row 0 (context) and each node.
        tree: a deterministic tree (``q_ids`` is None), same device.
        max_depth: upper bound on the tree depth (host int).
        noise: `[max_depth + 1, vocab]` Exp(1) noise of the positions the rows sample.
    """
    depth = torch.cat([tree.depths.new_zeros(1), tree.depths])  # [N + 1] row depth (0: the context)
    choice = (target_probs.float() / noise.index_select(0, depth)).argmax(dim=-1)  # [N + 1]
    return accept_matching(choice, tree, max_depth)


def accept_matching(choice: torch.Tensor, tree: TokenTree, max_depth: int) -> VerifyOutcome:
    """Longest path whose every node's token equals its parent row's ``choice``, then the choice of
    the last accepted row.

    Args:
        choice: `[N + 1]` int64 the target's token at row 0 (context) and each node.
        tree: the verified tree (same device).
        max_depth: upper bound on the tree depth (host int).
    """
    n = tree.num_nodes
    dev = choice.device
    accepted_child = torch.full((n + 1,), -1, dtype=torch.long, device=dev)
    if n:
        match = tree.token_ids == choice[tree.parents + 1]  # [N]
        if tree.q_probs is not None:  # padding nodes (never drawn) cannot be accepted
            match &= tree.q_probs.sum(-1) > 0
        cand = torch.where(match, torch.arange(n, device=dev), n)
        first = torch.full((n + 1,), n, dtype=torch.long, device=dev)
        first = first.scatter_reduce(0, tree.parents + 1, cand, reduce="amin")
        accepted_child = torch.where(first < n, first, -1)
    path, count, row = _follow_path(accepted_child, max_depth)
    return VerifyOutcome(path, count, choice.index_select(0, row.view(1)).view(()), choice=choice)


def _dense_q(tree: TokenTree, nodes: torch.Tensor, vocab: int) -> torch.Tensor:
    """`[R, vocab]` dense q of ``nodes`` (`[R]`, -1 = none → zero row)."""
    dev = nodes.device
    out = torch.zeros(nodes.shape[0], vocab, dtype=torch.float32, device=dev)
    safe = nodes.clamp_min(0)
    valid = (nodes >= 0).float()[:, None]
    if tree.q_ids is None or tree.q_probs is None:
        out.scatter_(1, tree.token_ids[safe][:, None], valid)
    else:
        out.scatter_add_(1, tree.q_ids[safe], tree.q_probs[safe].float() * valid)
    return out


def verify_stochastic(
    target_probs: torch.Tensor,
    tree: TokenTree,
    max_depth: int,
    max_branch: int,
    generator: torch.Generator | None,
) -> VerifyOutcome:
    """Lossless recursive rejection sampling over any tree (see the module docstring).

    Args:
        target_probs: `[N + 1, vocab]` float32 target sampling distributions (after temperature,
            top-k, top-p) for row 0 and each node.
        tree: the verified tree; ``q`` one-hot when ``tree.q_ids`` is None.
        max_depth / max_branch: host-side bounds on depth and children per row.
        generator: RNG for the acceptance tests and the final draw.
    """
    p_res = target_probs.float().clone()  # [N + 1, V]
    rows, vocab = p_res.shape
    dev = p_res.device
    n = tree.num_nodes
    accepted_child = torch.full((rows,), -1, dtype=torch.long, device=dev)
    if n:
        table = children_table(tree.parents, max_branch)  # [N + 1, B]
        u = torch.rand(table.shape[1], rows, generator=generator, device=dev)  # [B, N + 1]
        decided = torch.zeros(rows, dtype=torch.bool, device=dev)
        for r in range(table.shape[1]):
            child = table[:, r]  # [N + 1]
            live = (child >= 0) & ~decided
            tok = tree.token_ids[child.clamp_min(0)]  # [N + 1]
            q = _dense_q(tree, torch.where(live, child, -1), vocab)  # [N + 1, V]
            p_tok = p_res.gather(1, tok[:, None]).squeeze(1)
            q_tok = q.gather(1, tok[:, None]).squeeze(1)
            accept = live & (q_tok > 0) & (u[r] * q_tok < p_tok)
            accepted_child = torch.where(accept, child, accepted_child)
            decided |= accept
            reject = live & ~accept
            resid = (p_res - q).clamp_min_(0)
            mass = resid.sum(-1, keepdim=True)
            # mass == 0 only when p_res <= q everywhere, where rejection has probability 0.
            upd = reject[:, None] & (mass > 0)
            p_res = torch.where(upd, resid / mass.clamp_min(1e-30), p_res)
    path, count, row = _follow_path(accepted_child, max_depth)
    final = p_res.index_select(0, row.view(1))[0]  # [V]
    e = exponential_noise((vocab,), dev, generator)
    next_token = (final / e).argmax()
    return VerifyOutcome(path, count, next_token)
