"""Draft token trees as flat BFS arrays, and the tree shapes a draft can grow.

Vocabulary (used across the package):

- *committed context*: tokens both sides agree on; the tree hangs below its last token.
- *node*: one drafted token. Nodes are stored in BFS order, so ``parents[i] < i`` and ``-1`` marks a
  root (a child of the committed context). Depth of a root is 1.
- *q*: the exact distribution a node was drawn from (``q_ids``/``q_probs``, sparse). ``None`` means
  every node is a deterministic top-k expansion, i.e. ``q`` is one-hot on the node's own token.
  A row of all-zero ``q_probs`` marks a padding node that was never drawn (the draft ran out of
  support); verification never accepts it and it leaves the residual unchanged.

The nested form ``TokenNode {token_id, log_prob, children, top_k_token_ids, top_k_probs}`` of the
original design is available through :meth:`TokenTree.to_nodes` / :meth:`TokenTree.from_nodes`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from specsplit.core.pinned import pin
from specsplit.errors import InvalidRequest

# A sensible default static tree (16 nodes, depth 5): wide near the root where the draft is least
# sure, a single spine further down where only the top path usually survives (Medusa/Sequoia style).
DEFAULT_STATIC_PATHS: tuple[tuple[int, ...], ...] = (
    (0,), (1,), (2,), (3,),
    (0, 0), (0, 1), (0, 2), (1, 0), (2, 0),
    (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0),
    (0, 0, 0, 0), (0, 0, 0, 1),
    (0, 0, 0, 0, 0),
)  # fmt: skip


def _host(t: torch.Tensor, kind: type = int) -> np.ndarray:
    """A tensor's values as a host numpy array (int64, or float64 for ``kind=float``)."""
    t = t.detach()
    if kind is float:
        return t.to("cpu", torch.float64).numpy()
    return t.to("cpu", torch.int64).numpy()


def dynamic_level_widths(topk: int, width: int, depth: int) -> tuple[int, ...]:
    """Frontier nodes a dynamic tree forwards at levels 1 .. depth - 1 (the top-``width`` of the
    ``topk`` children of the previous level's frontier)."""
    out: list[int] = []
    level_len = topk
    for _ in range(1, depth):
        out.append(min(width, level_len))
        level_len = out[-1] * topk
    return tuple(out)


@dataclass
class TokenNode:
    """Nested (pointer) form of one tree node, as in the original SpecSplit documents."""

    token_id: int
    log_prob: float = 0.0
    children: list[TokenNode] = field(default_factory=list)
    top_k_token_ids: list[int] = field(default_factory=list)
    top_k_probs: list[float] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form (JSON-serialisable), children included recursively."""
        return {
            "token_id": self.token_id,
            "log_prob": self.log_prob,
            "children": [c.to_dict() for c in self.children],
            "top_k_token_ids": list(self.top_k_token_ids),
            "top_k_probs": list(self.top_k_probs),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TokenNode:
        return cls(
            token_id=int(d["token_id"]),
            log_prob=float(d.get("log_prob", 0.0)),
            children=[cls.from_dict(c) for c in d.get("children", [])],
            top_k_token_ids=[int(t) for t in d.get("top_k_token_ids", [])],
            top_k_probs=[float(p) for p in d.get("top_k_probs", [])],
        )


@dataclass
class TokenTree:
    """A draft tree in flat BFS arrays (all tensors on one device).

    Attributes:
        token_ids: `[N]` int64 drafted tokens.
        parents: `[N]` int64 parent index, -1 for roots; ``parents[i] < i``.
        depths: `[N]` int64 depth, 1 for roots.
        log_probs: `[N]` float32 ``log q(token)`` under the distribution the node was drawn from.
        q_ids: `[N, Kq]` int64 support of that distribution, or ``None`` (one-hot, see module doc).
        q_probs: `[N, Kq]` float32 probabilities on ``q_ids`` (rows sum to 1, or 0 for padding).
    """

    token_ids: torch.Tensor  # [N]
    parents: torch.Tensor  # [N]
    depths: torch.Tensor  # [N]
    log_probs: torch.Tensor  # [N]
    q_ids: torch.Tensor | None = None  # [N, Kq]
    q_probs: torch.Tensor | None = None  # [N, Kq]
    # Host-side upper bounds (set by the producer so verification needs no host read).
    max_branch: int | None = None
    depth_bound: int | None = None
    # Built by this package's own drafters from committed tokens, so well-formed by construction:
    # an engine skips :meth:`validate` and takes the host arrays as they are. Never set on a tree
    # that arrives from outside (a deserialised request leaves it False).
    trusted: bool = field(default=False, compare=False)

    def bounds(self) -> tuple[int, int]:
        """``(max children of any row, max depth)``; reads the tensors only if not preset."""
        if self.max_branch is not None and self.depth_bound is not None:
            return self.max_branch, self.depth_bound
        if self.num_nodes == 0:
            return 0, 0
        par = self.parents.detach().cpu()
        branch = int(torch.bincount(par + 1).max())
        depth = int(self.depths.detach().cpu().max())
        self.max_branch, self.depth_bound = branch, depth
        return branch, depth

    @property
    def num_nodes(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def device(self) -> torch.device:
        return self.token_ids.device

    @property
    def is_deterministic(self) -> bool:
        """True when every node is a deterministic expansion (q one-hot)."""
        return self.q_ids is None

    @classmethod
    def empty(cls, device: torch.device | str = "cpu") -> TokenTree:
        """A tree with no nodes: verification then just produces the target's next token."""
        z = torch.zeros(0, dtype=torch.long, device=device)
        lp = torch.zeros(0, dtype=torch.float32, device=device)
        return cls(z, z.clone(), z.clone(), lp, max_branch=0, depth_bound=0, trusted=True)

    def to(self, device: torch.device | str) -> TokenTree:
        """Copy to ``device`` (non-blocking; only ids and draft probabilities move)."""
        dev = torch.device(device)
        if self.device == dev:
            return self

        def mv(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            if dev.type == "cuda" and t.device.type == "cpu":  # pinned: no hidden host sync
                t = pin(t)
            return t.to(dev, non_blocking=True)

        ids = (self.token_ids, self.parents, self.depths)
        same = all(t.device.type == "cpu" and t.dtype == torch.long and t.shape == ids[0].shape for t in ids)
        if dev.type == "cuda" and same:
            # One staging copy for the three id rows (a host-built tree, e.g. an n-gram proposal).
            token_ids, parents, depths = mv(torch.stack(ids)).unbind(0)  # type: ignore[union-attr]
        else:
            token_ids, parents, depths = (mv(t) for t in ids)  # type: ignore[misc]
        return TokenTree(
            token_ids,  # type: ignore[arg-type]
            parents,  # type: ignore[arg-type]
            depths,  # type: ignore[arg-type]
            mv(self.log_probs),  # type: ignore[arg-type]
            mv(self.q_ids),
            mv(self.q_probs),
            self.max_branch,
            self.depth_bound,
            self.trusted,
        )

    def max_depth(self) -> int:
        return int(self.depths.max().item()) if self.num_nodes else 0

    # ------------------------------------------------------------------ validation
    def validate(
        self,
        vocab_size: int,
        max_nodes: int | None = None,
        max_depth: int | None = None,
    ) -> None:
        """Check shapes and values; raise :class:`InvalidRequest` with the first problem found.

        Reads the tensors on the host: call it on trees that arrive from outside (gRPC), not on the
        device-resident trees the local DraftEngine produces.
        """
        n = self.num_nodes
        for name in ("token_ids", "parents", "depths", "log_probs"):
            t = getattr(self, name)
            if t.dim() != 1 or t.shape[0] != n:
                raise InvalidRequest(f"tree.{name} must have shape [{n}], got {list(t.shape)}")
        if max_nodes is not None and n > max_nodes:
            raise InvalidRequest(f"tree has {n} nodes; this engine accepts at most {max_nodes}")
        if n == 0:
            return
        # numpy on the host: a tree is tens to hundreds of values, where each torch op's dispatch
        # (~10 us) would dominate; these checks sit on a remote round's critical path.
        tok, par, dep = (_host(getattr(self, name)) for name in ("token_ids", "parents", "depths"))
        bad_tok = (tok < 0) | (tok >= vocab_size)
        if bad_tok.any():
            raise InvalidRequest(
                f"token id {int(tok[bad_tok][0])} is outside the vocabulary [0, {vocab_size})"
            )
        bad_par = (par < -1) | (par >= np.arange(n))
        if bad_par.any():
            i = int(bad_par.nonzero()[0][0])
            raise InvalidRequest(
                f"parents[{i}] = {int(par[i])}: parents must be -1 or an earlier node index "
                "(BFS order, which also rules out cycles)"
            )
        # Parents precede children, so checking each node against its parent's stated depth (roots
        # at 1) proves every stated depth by induction: one vectorised comparison, no per-node loop.
        expect = np.where(par >= 0, dep[np.maximum(par, 0)] + 1, 1)
        if not np.array_equal(expect, dep):
            raise InvalidRequest("tree.depths disagree with tree.parents")
        if max_depth is not None and int(dep.max()) > max_depth:
            raise InvalidRequest(f"tree depth {int(dep.max())} exceeds the limit {max_depth}")
        lp = _host(self.log_probs, float)
        if np.isnan(lp).any() or np.isposinf(lp).any():
            raise InvalidRequest("tree.log_probs contain NaN or +inf")
        if (self.q_ids is None) != (self.q_probs is None):
            raise InvalidRequest("q_ids and q_probs must be given together")
        if self.q_ids is not None and self.q_probs is not None:
            qi, qp = _host(self.q_ids), _host(self.q_probs, float)
            if qi.ndim != 2 or qi.shape[0] != n or qp.shape != qi.shape:
                raise InvalidRequest(
                    f"q_ids/q_probs must both have shape [{n}, Kq], got {list(qi.shape)} and {list(qp.shape)}"
                )
            if qi.size and (int(qi.min()) < 0 or int(qi.max()) >= vocab_size):
                raise InvalidRequest(f"q_ids contain ids outside the vocabulary [0, {vocab_size})")
            if not np.isfinite(qp).all() or (qp < 0).any():
                raise InvalidRequest("q_probs must be finite and non-negative")
            sums = qp.sum(-1)
            if not ((np.abs(sums - 1) < 1e-3) | (sums == 0)).all():
                raise InvalidRequest("each q_probs row must sum to 1 (or be all zero for padding)")

    # ------------------------------------------------------------------ nested form
    def to_nodes(self) -> list[TokenNode]:
        """Nested :class:`TokenNode` roots (host-side; for inspection and interoperability)."""
        tok = self.token_ids.tolist()
        par = self.parents.tolist()
        lp = self.log_probs.float().tolist()
        qi = self.q_ids.tolist() if self.q_ids is not None else None
        qp = self.q_probs.float().tolist() if self.q_probs is not None else None
        nodes = [
            TokenNode(
                token_id=tok[i],
                log_prob=lp[i],
                top_k_token_ids=qi[i] if qi is not None else [],
                top_k_probs=qp[i] if qp is not None else [],
            )
            for i in range(len(tok))
        ]
        roots: list[TokenNode] = []
        for i, p in enumerate(par):
            (roots if p < 0 else nodes[p].children).append(nodes[i])
        return roots

    @classmethod
    def from_nodes(cls, roots: Sequence[TokenNode], device: torch.device | str = "cpu") -> TokenTree:
        """Flatten nested nodes into BFS arrays. ``q`` is kept only if every node carries one."""
        flat: list[tuple[TokenNode, int, int]] = []  # (node, parent index, depth)
        frontier = [(r, -1, 1) for r in roots]
        while frontier:
            nxt: list[tuple[TokenNode, int, int]] = []
            for node, parent, depth in frontier:
                flat.append((node, parent, depth))
                me = len(flat) - 1
                nxt.extend((c, me, depth + 1) for c in node.children)
            frontier = nxt
        if not flat:
            return cls.empty(device)
        tok = torch.tensor([n.token_id for n, _, _ in flat], dtype=torch.long, device=device)
        par = torch.tensor([p for _, p, _ in flat], dtype=torch.long, device=device)
        dep = torch.tensor([d for _, _, d in flat], dtype=torch.long, device=device)
        lp = torch.tensor([n.log_prob for n, _, _ in flat], dtype=torch.float32, device=device)
        q_ids = q_probs = None
        if all(n.top_k_token_ids for n, _, _ in flat):
            width = max(len(n.top_k_token_ids) for n, _, _ in flat)
            ids = torch.zeros(len(flat), width, dtype=torch.long)
            probs = torch.zeros(len(flat), width, dtype=torch.float32)
            for i, (n, _, _) in enumerate(flat):
                k = len(n.top_k_token_ids)
                ids[i, :k] = torch.tensor(n.top_k_token_ids)
                probs[i, :k] = torch.tensor(n.top_k_probs, dtype=torch.float32)
            q_ids, q_probs = ids.to(device), probs.to(device)
        return cls(tok, par, dep, lp, q_ids, q_probs)


# ---------------------------------------------------------------------- static shapes
@dataclass(frozen=True)
class StaticTreePlan:
    """A fixed tree topology, precomputed once per shape (host lists and device-ready tensors).

    ``levels[d]`` holds, for the nodes at depth ``d + 1``: their BFS indices, their parents'
    indices (-1 for roots) and their rank among siblings (0 = most probable / first drawn).
    """

    parents: tuple[int, ...]
    depths: tuple[int, ...]
    ranks: tuple[int, ...]
    levels: tuple[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]], ...]
    max_branch: int

    @property
    def num_nodes(self) -> int:
        return len(self.parents)

    @property
    def depth(self) -> int:
        return len(self.levels)

    def truncated(self, max_depth: int) -> StaticTreePlan:
        """The same plan cut to ``max_depth`` levels (used near ``max_new_tokens``)."""
        if max_depth >= self.depth:
            return self
        keep = [i for i, d in enumerate(self.depths) if d <= max_depth]
        paths = _plan_to_paths(self)
        return static_plan_from_paths([paths[i] for i in keep])


def _plan_to_paths(plan: StaticTreePlan) -> list[tuple[int, ...]]:
    paths: list[tuple[int, ...]] = []
    for i, p in enumerate(plan.parents):
        paths.append((paths[p] if p >= 0 else ()) + (plan.ranks[i],))
    return paths


def chain_plan(k: int) -> StaticTreePlan:
    """A chain of ``k`` tokens (classic speculative decoding)."""
    if k < 0:
        raise ValueError(f"chain length must be >= 0, got {k}")
    return static_plan_from_paths([(0,) * d for d in range(1, k + 1)])


def static_plan_from_paths(paths: Sequence[Sequence[int]]) -> StaticTreePlan:
    """Build a plan from Medusa-style paths: ``(0, 1)`` = second child of the first root.

    Raises:
        ValueError: duplicate paths, a missing ancestor, or sibling ranks that skip a value (the
            children of a node must be ranks ``0..k-1``: losslessness under sampling without
            replacement needs every drawn sibling up to the last one present).
    """
    norm = sorted({tuple(int(x) for x in p) for p in paths}, key=lambda p: (len(p), p))
    if len(norm) != len(paths):
        raise ValueError("static tree paths contain duplicates")
    if any(len(p) == 0 or min(p) < 0 for p in norm):
        raise ValueError("static tree paths must be non-empty tuples of non-negative ranks")
    index = {p: i for i, p in enumerate(norm)}
    parents, depths, ranks = [], [], []
    children: dict[int, list[int]] = {}
    for p in norm:
        par = -1 if len(p) == 1 else index.get(p[:-1])
        if par is None:
            raise ValueError(f"static tree path {p} has no parent path {p[:-1]}")
        parents.append(par)
        depths.append(len(p))
        ranks.append(p[-1])
        children.setdefault(par, []).append(p[-1])
    for par, rs in children.items():
        if sorted(rs) != list(range(len(rs))):
            raise ValueError(f"children of node {par} have ranks {sorted(rs)}; they must be 0..{len(rs) - 1}")
    levels = []
    for d in range(1, (max(depths) if depths else 0) + 1):
        idx = tuple(i for i in range(len(norm)) if depths[i] == d)
        levels.append((idx, tuple(parents[i] for i in idx), tuple(ranks[i] for i in idx)))
    max_branch = max((len(v) for v in children.values()), default=0)
    return StaticTreePlan(tuple(parents), tuple(depths), tuple(ranks), tuple(levels), max_branch)
