"""Drafters that cost (almost) nothing: n-gram and suffix drafting, and trees merged with a model's.

A drafter proposes a :class:`~specsplit.core.tree.TokenTree` for a session's committed context. The
*model* drafter is the :class:`~specsplit.engines.draft.DraftEngine` (a small LM, reached through a
transport). The drafters here run on the host, beside the round loop:

- ``ngram``: prompt lookup over the session's own prompt and generated tokens
  (:class:`~specsplit.core.ngram.NgramIndex`): the longest suffix of the context that occurred
  before proposes what followed it; several earlier occurrences with different continuations form
  a branching tree, ranked by frequency.
- ``suffix``: the same, plus an index of earlier generations of this process or worker
  (:class:`~specsplit.core.ngram.SuffixCache`, bounded memory), as SuffixDecoding does for
  repetitive and agentic workloads.
- ``hybrid``: n-gram candidates merged into the model's tree (:func:`merge_trees`) under one
  node budget, verified by one target forward.
- lookahead (``NgramConfig.lookahead``, with any of the n-gram modes): every n-gram round also
  carries a Jacobi window whose outputs fill a pool of n-grams the target wrote itself
  (:mod:`specsplit.core.lookahead`, :func:`lookahead_tree`). On by default where the target replays
  CUDA graphs (``lookahead="auto"``), in every n-gram round, or under an A/B policy that keeps it
  only while its rounds commit tokens faster than the planner's (``lookahead_policy="adaptive"``).
- draft heads (``TargetConfig.draft_heads``, :mod:`specsplit.runtime.heads`): a target with heads
  returns their guesses with every verification (:class:`~specsplit.messages.HeadGuesses`); the
  n-gram modes then verify them in the same fixed rounds as the window (:func:`lookahead_tree`),
  under the same policy, beside the n-gram nodes.

Every tree here is deterministic: ``q`` is one-hot on each node's token, so verification stays
lossless under sampling (recursive rejection sampling accepts any tree whose ``q`` is exact).
For a target on the CUDA-graph path, trees are padded to a few fixed sizes (:data:`TREE_SIZES`) so
it replays (and compiles) a bounded set of graphs; a padding node is one more deterministic guess, so
padding never changes what is committed, only what a round costs. An eager target verifies trees of
exactly the size the round needs.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Protocol

import torch

from specsplit.config import DEFAULT_LOOKAHEAD, NgramConfig
from specsplit.core.lookahead import LookaheadWindow
from specsplit.core.ngram import NgramIndex, Proposal, Scoring, SuffixCache, propose_from
from specsplit.core.tree import TokenTree
from specsplit.engines.ab_policy import GrowthCost, GuessPolicy, OverlapPolicy
from specsplit.messages import HeadGuesses

# Node counts an n-gram tree is padded to for a target on the CUDA-graph path (one graph each, and one
# compile each under torch.compile): doubling sizes keep the padding below half a tree.
TREE_SIZES = (2, 4, 8, 16, 32, 64)


def tree_sizes(max_nodes: int, padded: bool) -> tuple[int, ...]:
    """The n-gram tree sizes a round may verify: :data:`TREE_SIZES` up to ``max_nodes`` when trees are
    padded for graphs (``max_nodes`` itself as the last), else every size from 1."""
    if not padded:
        return tuple(range(1, max_nodes + 1))
    return tuple(s for s in TREE_SIZES if s < max_nodes) + (max_nodes,)


def tree_size(k: int, sizes: tuple[int, ...] = TREE_SIZES) -> int:
    """The smallest of ``sizes`` that holds ``k`` nodes (0 for none; the largest when none does)."""
    if k <= 0:
        return 0
    return next((s for s in sizes if s >= k), sizes[-1])


class DrafterSession(Protocol):
    """One generation's host-side drafter: kept in step with the committed tokens, asked for a
    proposal every round (the model drafter is the DraftEngine behind a transport instead)."""

    def extend(self, tokens: list[int]) -> None: ...

    def propose(self) -> Proposal: ...

    def finish(self) -> None: ...


class Drafter(Protocol):
    """A process-wide drafter that runs beside the round loop (``ngram``, ``suffix``)."""

    def session(self, prompt: list[int]) -> DrafterSession: ...

    def clear(self) -> None: ...


class NgramDrafter:
    """Process-wide n-gram drafting: settings, and the suffix cache shared by every session.

    Args:
        settings: how proposals are made.
        suffix: also index finished generations (``suffix`` drafting).
        graphs: the target these sessions draft for replays CUDA graphs (``lookahead="auto"``
            turns the lookahead window on there).
    """

    def __init__(self, settings: NgramConfig | None = None, suffix: bool = False, graphs: bool = False):
        self.settings = settings or NgramConfig()
        self.graphs = graphs
        self.scoring = Scoring()
        self._cache: SuffixCache | None = None
        self._suffix = suffix
        self._lock = threading.Lock()
        # Lookahead rounds against the planner's, measured like overlap's speculation: kept across
        # generations, greedy and sampling apart (their rounds commit differently).
        self._lookahead: dict[bool, OverlapPolicy] = {}
        self._growth: dict[bool, GrowthCost] = {}  # what growing draft-head guesses costs a round

    def lookahead_policy(self, do_sample: bool) -> OverlapPolicy:
        """Whether this round is a lookahead round (``speculate()``), and the rounds' record."""
        with self._lock:
            policy = self._lookahead.get(do_sample)
            if policy is None:
                always = self.settings.lookahead_policy == "always"
                policy = self._lookahead[do_sample] = OverlapPolicy(always=always, probe=8)
            return policy

    def guess_policy(self, do_sample: bool) -> GuessPolicy:
        """A generation's choice of the rounds that grow the target's draft-head guesses
        (:class:`GuessPolicy`; ``NgramConfig.guess_policy`` ``"always"``: every round), timing the
        growth in a :class:`GrowthCost` kept across generations, greedy and sampling apart."""
        with self._lock:
            timing = self._growth.setdefault(do_sample, GrowthCost())
        s = self.settings
        return GuessPolicy(always=s.guess_policy == "always", cost_tokens=s.guess_cost_tokens, timing=timing)

    def lookahead_width(self, mode: str = "ngram") -> int:
        """Guesses a row of the lookahead windows of this drafter's ``mode`` generations holds (0:
        no window): the setting, or for ``"auto"`` :data:`~specsplit.config.DEFAULT_LOOKAHEAD` on
        a graph-replaying target unless ``mode`` is ``"hybrid"`` (the model's tree every round)."""
        width = self.settings.lookahead
        if width == "auto":
            return DEFAULT_LOOKAHEAD if self.graphs and mode != "hybrid" else 0
        return int(width)

    @property
    def cache(self) -> SuffixCache | None:
        """The suffix cache (created on first use), or None when this drafter does not keep one."""
        if not self._suffix:
            return None
        with self._lock:
            if self._cache is None:
                s = self.settings
                self._cache = SuffixCache(max_tokens=s.suffix_cache_tokens, max_n=s.max_n)
            return self._cache

    def clear(self) -> None:
        """Forget the earlier generations of the suffix cache."""
        with self._lock:
            self._cache = None

    def session(self, prompt: list[int], lookahead: int = 0) -> NgramSession:
        """A session's index over ``prompt`` (extended with every committed token), with a
        lookahead window ``lookahead`` guesses wide (0: none)."""
        return NgramSession(self, prompt, lookahead)


class NgramSession:
    """The n-gram index of one generation, and its lookahead window (``lookahead`` guesses wide; 0: none)."""

    def __init__(self, drafter: NgramDrafter, prompt: list[int], lookahead: int = 0):
        s = drafter.settings
        self.drafter = drafter
        self.index = NgramIndex(s.min_n, s.max_n, s.max_matches, prompt)
        self.window = (
            LookaheadWindow(lookahead, s.lookahead_levels, s.lookahead_pool, prompt) if lookahead else None
        )

    def extend(self, tokens: list[int]) -> None:
        """Index tokens just committed."""
        self.index.extend(tokens)

    def propose(self, lookahead: bool = False) -> Proposal:
        """The best tree the indexes suggest for the committed context (empty when nothing matched);
        with ``lookahead``, the window's pool adds its n-grams after the context's last token."""
        s = self.drafter.settings
        extra = []
        if lookahead and self.window is not None:
            extra = self.window.continuations(self.index.tokens[-1], s.lookahead_pool)
        budget = s.lookahead_nodes if lookahead else s.max_nodes
        return propose_from(self.index, self.drafter.cache, budget, s.max_depth, self.drafter.scoring, extra)

    def finish(self) -> None:
        """Offer the whole sequence to the suffix cache (``suffix`` drafting)."""
        cache = self.drafter.cache
        if cache is not None:
            cache.add(self.index.tokens)


def proposal_tree(
    proposal: Proposal, size: int, depth_bound: int, fixed_bounds: bool
) -> tuple[TokenTree, list[float]]:
    """The ``size`` best nodes of ``proposal`` as a host tree, padded with extra roots to ``size``.

    Args:
        proposal: n-gram candidates.
        size: nodes of the tree (the proposal's best, padded with extra roots beyond its own nodes).
        depth_bound: the deepest a proposal may go (the tree's depth bound).
        fixed_bounds: give the tree bounds that depend on ``size`` only (``(size, depth_bound)``), so
            a greedy target replays one graph per size; otherwise its exact bounds (sampling, where
            verification's work grows with the widest fan-out).

    Returns:
        ``(tree, scores)``: ``scores[i]`` is node ``i``'s proposal score (0 for padding).
    """
    top = proposal.top(size)
    pad = size - top.num_nodes
    tokens = top.token_ids + [top.token_ids[0] if top.token_ids else 0] * pad
    parents = top.parents + [-1] * pad
    depths = top.depths + [1] * pad
    tree = _host_tree(tokens, parents, depths, top.max_branch, top.max_depth, depth_bound, fixed_bounds)
    return tree, top.scores + [0.0] * pad


def _host_tree(
    tokens: list[int],
    parents: list[int],
    depths: list[int],
    branch: int,
    deepest: int,
    depth_bound: int,
    fixed_bounds: bool,
) -> TokenTree:
    """A host tree of these nodes, with bounds that depend on its size only (``fixed_bounds``: one
    graph per size) or its exact ones (``branch``: most children of a node, the roots aside;
    ``deepest``: its deepest node)."""
    size = len(tokens)
    z = torch.tensor
    tree = TokenTree(
        z(tokens, dtype=torch.long),
        z(parents, dtype=torch.long),
        z(depths, dtype=torch.long),
        torch.zeros(size, dtype=torch.float32),
        trusted=True,  # committed tokens in a well-formed trie: the engine skips its host checks
    )
    if fixed_bounds:  # a tree of `size` nodes is at most `size` deep: the walk of its path stays short
        tree.max_branch, tree.depth_bound = size, min(max(depth_bound, deepest), size)
    else:
        roots = sum(1 for p in parents if p < 0)
        tree.max_branch, tree.depth_bound = max(branch, roots), max(deepest, 1 if size else 0)
    return tree


def lookahead_tree(
    proposal: Proposal,
    window: LookaheadWindow | None,
    size: int,
    depth_bound: int,
    fixed_bounds: bool,
    guesses: HeadGuesses | None = None,
) -> tuple[TokenTree, int, int]:
    """A fixed-size round's tree: the proposal's best nodes, the target's draft-head guesses, the
    lookahead window's nodes, padding up to ``size``.

    Args:
        proposal: the round's n-gram candidates (prompt matches and pool n-grams).
        window: the generation's lookahead window (its nodes follow the others), or None.
        size: nodes of the tree (at least the guesses' and the window's).
        depth_bound / fixed_bounds: as :func:`proposal_tree`.
        guesses: the draft heads' nodes from the last verification (:class:`HeadGuesses`), or None.

    Returns:
        ``(tree, offset, guess_from)``: ``offset`` is the index of the window's first node (-1: no
        window); the nodes from ``guess_from`` up to the window's (or the padding's) are the guesses'
        own (the ones no n-gram node shares).
    """
    g_tokens, g_parents, g_depths = (
        (guesses.token_ids, guesses.parents, guesses.depths) if guesses else ([], [], [])
    )
    w_tokens, w_parents, w_depths = window.nodes() if window is not None else ([], [], [])
    free = size - len(w_tokens)
    top = proposal.top(free - len(g_tokens))
    tokens, parents, depths = merge_guesses(top, g_tokens, g_parents, g_depths)
    if len(tokens) < free and top.num_nodes < proposal.num_nodes:  # shared prefixes left room: more n-grams
        top = proposal.top(top.num_nodes + free - len(tokens))
        tokens, parents, depths = merge_guesses(top, g_tokens, g_parents, g_depths)
        while len(tokens) > free:  # the larger proposal shared fewer prefixes: drop its last n-grams
            top = proposal.top(top.num_nodes - (len(tokens) - free))
            tokens, parents, depths = merge_guesses(top, g_tokens, g_parents, g_depths)
    w_off, guess_from = len(tokens), top.num_nodes
    pad = size - w_off - len(w_tokens)
    filler = (w_tokens or tokens or [0])[0]
    tokens = tokens + w_tokens + [filler] * pad
    parents = parents + [p + w_off if p >= 0 else -1 for p in w_parents] + [-1] * pad
    depths = depths + w_depths + [1] * pad
    # a window node has at most two children (the next guess of its row, its column's next row)
    kids = Counter(p for p in parents[:w_off] if p >= 0)
    branch, deepest = max(kids.values(), default=1), max(depths[:w_off], default=0)
    if window is not None:
        branch, deepest = max(branch, 2), max(deepest, window.depth)
    tree = _host_tree(tokens, parents, depths, branch, deepest, depth_bound, fixed_bounds)
    return tree, (w_off if window is not None else -1), guess_from


def merge_guesses(
    top: Proposal, tokens: list[int], parents: list[int], depths: list[int]
) -> tuple[list[int], list[int], list[int]]:
    """The n-gram nodes ``top`` with the draft heads' guess tree merged in as a trie: a guess whose
    parent and token an earlier node already has is that node, so the two sources' paths share their
    common prefix (verification follows one child per token: a guess below a duplicate would never
    be reached) and no node is spent twice. Returns ``(tokens, parents, depths)``, parents first.

    Args:
        top: the n-gram nodes (a trie, parents first).
        tokens / parents / depths: the guesses (parents index them; -1: below the next token).
    """
    out_t, out_p, out_d = list(top.token_ids), list(top.parents), list(top.depths)
    at = {(p, t): i for i, (p, t) in enumerate(zip(out_p, out_t, strict=True))}
    where: list[int] = []  # each guess's node in the merged tree
    for t, p, d in zip(tokens, parents, depths, strict=True):
        par = where[p] if p >= 0 else -1
        node = at.get((par, t))
        if node is None:
            node = at[par, t] = len(out_t)
            out_t.append(t)
            out_p.append(par)
            out_d.append(d)
        where.append(node)
    return out_t, out_p, out_d


def merge_trees(model: TokenTree, extra: TokenTree) -> TokenTree:
    """One tree: the model's nodes, then ``extra``'s (its roots beside the model's roots).

    Siblings are verified in index order, so the model's children are tried first; the extra nodes
    are deterministic guesses (``q`` one-hot), which keeps stochastic verification exact after any
    earlier siblings. Device ops only (``extra`` is copied to the model tree's device without a sync).

    Args:
        model: the model draft's tree (its own device).
        extra: a deterministic tree (host or device).
    """
    if extra.num_nodes == 0:
        return model
    dev = model.device
    ex = extra.to(dev)
    n = model.num_nodes
    parents = torch.cat([model.parents, torch.where(ex.parents >= 0, ex.parents + n, ex.parents)])
    q_ids = q_probs = None
    if model.q_ids is not None and model.q_probs is not None:
        kq = model.q_ids.shape[1]
        one_ids = torch.zeros(ex.num_nodes, kq, dtype=model.q_ids.dtype, device=dev)
        one_ids[:, 0] = ex.token_ids
        one_probs = torch.zeros(ex.num_nodes, kq, dtype=model.q_probs.dtype, device=dev)
        one_probs[:, 0] = 1.0
        q_ids, q_probs = torch.cat([model.q_ids, one_ids]), torch.cat([model.q_probs, one_probs])
    mb, md = model.bounds()
    eb, ed = ex.bounds()
    return TokenTree(
        torch.cat([model.token_ids, ex.token_ids]),
        parents,
        torch.cat([model.depths, ex.depths]),
        torch.cat([model.log_probs.float(), ex.log_probs.float()]),
        q_ids,
        q_probs,
        max_branch=mb + eb,
        depth_bound=max(md, ed),
    )
