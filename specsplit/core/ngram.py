"""Draft token trees from already-seen tokens: prompt-lookup and SuffixDecoding-style n-gram indexes.

Vocabulary:

- *committed context*: the tokens a session has committed so far (prompt + accepted output).
- *node*: one draft token of a proposal tree. Its parent is another node, or ``-1`` for a child of
  the committed context (a root, depth 1). Trees are host lists in BFS order (``parents[i] < i``).
- *continuation*: the tokens that followed an earlier occurrence of the context's last ``n`` tokens
  (the matched suffix), at most ``max_depth`` of them and never past the end of the sequence they
  come from.
- *score*: estimated probability that a node ends up on the accepted path, i.e. that its whole path
  from the root is correct. Scores lie in (0, 1] and never grow from a parent to its child.

Index. For every suffix length ``n`` in ``[min_n, max_n]`` (a *level*) an index keeps a dict from the
hash of each n-gram to its most recent position (that of its last token) and an array ``prev``:
``prev[i]`` is the previous position of the n-gram ending at ``i``, or -1. An n-gram's occurrences,
most recent first, are thus a chain walked in O(1) a step; the context's own suffix chain starts at
``prev[len - 1]``. Hashes are 64-bit polynomial rolling hashes, computed with numpy for long blocks
and in pure Python for a round's few tokens (same values). They may collide, so every chain entry is
checked against the real tokens: a collision costs a wasted step, never a wrong match.

Costs (``levels = max_n - min_n + 1``): ``extend`` does O(new tokens x levels) dict operations and
memory is one dict entry (~100-130 bytes with its key and value objects) plus an 8-byte ``prev`` slot
per (position, level); a lookup walks at most ``2 x max_matches`` chain steps a level and copies at
most ``max_matches x max_depth`` tokens. None of these grows with the sequence length.

Proposal. The longest matched suffix gives the continuations of its ``max_matches`` most recent
occurrences; if they are fewer, shorter suffixes add occurrences not yet used (*backoff*) at a lower
weight. The continuations go into a trie (shared prefixes merge). With continuation ``c`` of weight
``w_c`` from a match of length ``n_c``, a node scores ``sum(w_c * prior(n_c) for c through it) /
sum(w_c for all c)``, times ``depth_decay ** (depth - 1)``: a mixture in which the text goes on as
``c`` with probability proportional to ``w_c`` and a match of length ``n`` holds with probability
``prior(n)``. With equal weights this is ``prior(n) x count / continuations``. A child's sum runs
over a subset of its parent's, so scores are monotone. Siblings are ordered by score, then recency
(first reached by the more recent continuation). :class:`SuffixCache` indexes finished sequences of
earlier requests the same way; :func:`propose_from` merges its continuations after the session's own.
"""

from __future__ import annotations

import threading
from array import array
from collections import Counter, OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import accumulate, compress, repeat
from operator import mul
from typing import overload

import numpy as np

_B = 0x9E3779B97F4A7C15  # odd multiplier of the rolling hash (arithmetic is mod 2**64)
_M = (1 << 64) - 1
_BN = np.uint64(_B)
_NP_MIN = 64  # blocks at least this long are hashed with numpy; a round's few tokens go the Python way
_SEQ_BITS = 32  # SuffixCache positions are (sequence id << _SEQ_BITS) | offset
_Lasts = list[dict[int, int]]  # per level: n-gram hash -> most recent position
_Prevs = list[array]  # per level: position -> previous position of the same hash, or -1


@dataclass
class Proposal:
    """A candidate draft tree as host lists in BFS order (``parents[i] < i``, depths never decrease)."""

    token_ids: list[int]
    parents: list[int]
    depths: list[int]
    scores: list[float]

    @staticmethod
    def empty() -> Proposal:
        """Returns a proposal with no nodes."""
        return Proposal([], [], [], [])

    @property
    def num_nodes(self) -> int:
        """Number of nodes."""
        return len(self.token_ids)

    @property
    def max_depth(self) -> int:
        """Depth of the deepest node (0 when empty)."""
        return max(self.depths, default=0)

    @property
    def max_branch(self) -> int:
        """Most children of any row, the committed context (virtual root) included (0 when empty)."""
        return max(Counter(self.parents).values(), default=0)

    def top(self, k: int) -> Proposal:
        """Returns a new proposal: the ``k`` best-scored nodes (ties: shallower, then lower index).

        A parent scores at least its child and is shallower, so it ranks ahead of it: the kept nodes are
        closed under ancestors. They are returned in BFS order with parents re-indexed.
        """
        n = len(self.token_ids)
        if k >= n:
            return Proposal(list(self.token_ids), list(self.parents), list(self.depths), list(self.scores))
        if k <= 0:
            return Proposal.empty()
        # In BFS order depths never decrease, so "shallower, then lower index" is "lower index", which
        # a stable sort by score (reverse keeps ties in order) gives with a C-level key.
        s, d = self.scores, self.depths
        keep = sorted(sorted(range(n), key=s.__getitem__, reverse=True)[:k])
        # A subsequence of a BFS order that is closed under ancestors is a BFS order of the sub-tree.
        remap = {old: new for new, old in enumerate(keep)}
        return Proposal(
            [self.token_ids[i] for i in keep],
            [remap[self.parents[i]] if self.parents[i] >= 0 else -1 for i in keep],
            [d[i] for i in keep],
            [s[i] for i in keep],
        )

    def expected_curve(self) -> list[float]:
        """Returns ``curve`` with ``curve[k] == expected_tokens(k)`` for every ``k`` in ``[0, num_nodes]``."""
        return list(accumulate(sorted(self.scores, reverse=True), initial=1.0))

    def expected_tokens(self, k: int) -> float:
        """Expected tokens committed by a greedy round verifying ``top(k)``: 1 + the ``k`` best scores."""
        return 1.0 + sum(sorted(self.scores, reverse=True)[: max(k, 0)])

    def validate(self) -> None:
        """Raises ValueError unless the lists describe a BFS-ordered tree with monotone scores in (0, 1]."""
        n = len(self.token_ids)
        if not len(self.parents) == len(self.depths) == len(self.scores) == n:
            raise ValueError("proposal lists differ in length")
        for i, (p, d, s) in enumerate(zip(self.parents, self.depths, self.scores, strict=True)):
            if not -1 <= p < i:
                raise ValueError(f"node {i}: parent {p} is not an earlier node")
            if d != (1 if p < 0 else self.depths[p] + 1) or (i and d < self.depths[i - 1]):
                raise ValueError(f"node {i}: depth {d} inconsistent with its parent or BFS order")
            if not 0.0 < s <= (1.0 if p < 0 else self.scores[p]):
                raise ValueError(f"node {i}: score {s} outside (0, parent score]")


@dataclass(slots=True)
class Continuation:
    """Tokens that followed one earlier occurrence of the context's suffix."""

    tokens: list[int]
    n: int  # length of the matched suffix
    cached: bool = False  # True when it comes from a SuffixCache (another request)


_DEFAULT_PRIOR = tuple(n / (n + 1.0) for n in range(33))


@dataclass(frozen=True)
class Scoring:
    """How continuations are weighted into scores (uncalibrated defaults; see the module docstring)."""

    match_prior: tuple[float, ...] = _DEFAULT_PRIOR  # [n]: trust in a match of length n, in (0, 1]
    backoff_weight: float = 0.3  # weight factor per token a match is shorter than the longest; 0 = off
    cache_weight: float = 0.5  # weight factor of SuffixCache continuations versus the session's own
    depth_decay: float = 1.0  # score factor per level below the roots (1 = pure frequency)

    def __post_init__(self) -> None:
        if not all(0.0 < p <= 1.0 for p in self.match_prior[1:]) or not 0.0 < self.depth_decay <= 1.0:
            raise ValueError("match priors (n >= 1) and depth_decay must lie in (0, 1]")
        if self.backoff_weight < 0.0 or self.cache_weight < 0.0:
            raise ValueError("weights must be non-negative")

    def prior(self, n: int) -> float:
        """Trust in a match of length ``n`` (the last entry covers longer matches)."""
        return self.match_prior[min(n, len(self.match_prior) - 1)]


_DEFAULT_SCORING = Scoring()


class TokenView(Sequence[int]):
    """Read-only view of an index's tokens (no copy; slices return new lists)."""

    __slots__ = ("_data",)

    def __init__(self, data: list[int]) -> None:
        self._data = data

    def __len__(self) -> int:
        return len(self._data)

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> list[int]: ...
    def __getitem__(self, i: int | slice) -> int | list[int]:
        return self._data[i]


def _level_hashes(t: np.ndarray, max_n: int) -> Iterator[tuple[int, np.ndarray]]:
    """Yields ``(n, h)`` for n = 1..max_n, ``h[j]`` the hash of the n-gram of ``t`` ending at ``j+n-1``."""
    h = np.zeros(len(t), dtype=np.uint64)
    for n in range(1, min(max_n, len(t)) + 1):
        # H_n[i] = H_{n-1}[i] * B + t[i - n + 1], as _insert's Python path and SuffixCache.lookup do.
        h = h[1:] * _BN + t[: len(t) - n + 1] if n > 1 else t.copy()
        yield n, h


def _insert(
    toks: list[int], old: int, end: int, min_n: int, lasts: _Lasts, prevs: _Prevs, base: int = 0
) -> None:
    """Indexes the n-grams of ``toks`` ending at positions ``[old, end)`` on every level.

    Args:
        toks: The whole sequence.
        old: First position to index (``prevs`` hold ``old`` entries already).
        end: One past the last position to index.
        min_n: Length of level 0.
        lasts: Per level, hash -> most recent position (``base + i``).
        prevs: Per level, ``prev[i]`` = previous position of the same hash, or -1 (padded below n - 1).
        base: Added to every stored position (SuffixCache sequence id).
    """
    max_n = min_n + len(lasts) - 1
    if old < max_n - 1:
        for lvl, prev in enumerate(prevs):  # no n-gram ends before position n - 1
            prev.extend(repeat(-1, max(min(min_n + lvl - 1, end) - old, 0)))
    if end - old < _NP_MIN:
        levels = list(zip(lasts, prevs, strict=True))
        for i in range(old, end):
            hashes, k, g = [], 0, base + i
            for t in reversed(toks[max(i - max_n + 1, 0) : i + 1]):
                k = (k * _B + t) & _M  # the recurrence of _level_hashes
                hashes.append(k)
            for k, (last, prev) in zip(hashes[min_n - 1 :], levels, strict=False):
                prev.append(last.get(k, -1))
                last[k] = g
        return
    w = max(old - max_n + 1, 0)
    block = np.asarray(toks[w:end], dtype=np.int64).view(np.uint64)
    for n, h in _level_hashes(block, max_n):
        if n < min_n:
            continue
        first = max(n - 1, old)
        a = h[first - w - n + 1 :]
        m = len(a)
        if not m:
            continue
        last = lasts[n - min_n]
        keys = a.tolist()
        pos = np.arange(base + first, base + first + m, dtype=np.int64)
        # Previous occurrence inside the block: neighbours in a stable sort by hash; the first
        # occurrence of each hash in the block links to the dict's entry from earlier blocks.
        order = np.argsort(a, kind="stable")
        same = a[order[1:]] == a[order[:-1]]
        p = np.full(m, -1, dtype=np.int64)
        p[order[1:][same]] = pos[order[:-1][same]]
        if last:
            head = p < 0
            p[head] = np.fromiter(map(last.get, compress(keys, head.tolist()), repeat(-1)), np.int64)
        last.update(zip(keys, pos.tolist(), strict=True))
        prevs[n - min_n].frombytes(p.tobytes())


class NgramIndex:
    """Incremental n-gram index over one growing token sequence (a session's prompt + output).

    Not thread-safe: one index belongs to one session.
    """

    def __init__(self, min_n: int = 1, max_n: int = 6, max_matches: int = 8, tokens: Iterable[int] = ()):
        """Creates an index.

        Args:
            min_n: Shortest suffix that may match (HF prompt lookup matches down to 1 token).
            max_n: Longest suffix tried. Longer matches are more reliable, but each level costs time in
                ``extend`` and memory; past ~6 tokens a match is rarely ambiguous among recent ones.
            max_matches: Most recent occurrences used per lookup (bounds lookup cost and tree width).
            tokens: Initial tokens (e.g. the prompt).
        """
        if not 1 <= min_n <= max_n or max_matches < 1:
            raise ValueError("need 1 <= min_n <= max_n and max_matches >= 1")
        self.min_n, self.max_n, self.max_matches = min_n, max_n, max_matches
        self.reset(tokens)

    def reset(self, tokens: Iterable[int] = ()) -> None:
        """Starts over with ``tokens`` (e.g. when a session is re-sent in full)."""
        self._tokens: list[int] = []
        self._lasts: _Lasts = [{} for _ in range(self.max_n - self.min_n + 1)]
        self._prevs: _Prevs = [array("q") for _ in self._lasts]
        self.extend(tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        """Appends committed tokens (ints that fit int64; pass a tensor's ``.tolist()``), O(len x levels)."""
        old = len(self._tokens)
        self._tokens.extend(map(int, tokens))
        _insert(self._tokens, old, len(self._tokens), self.min_n, self._lasts, self._prevs)

    def __len__(self) -> int:
        return len(self._tokens)

    @property
    def tokens(self) -> TokenView:
        """Read-only view of the indexed tokens."""
        return TokenView(self._tokens)

    def lookup(
        self, max_depth: int = 8, max_matches: int | None = None, backoff: bool = True
    ) -> list[Continuation]:
        """Returns continuations of the longest suffix that occurred earlier, most recent first.

        Args:
            max_depth: Most tokens per continuation.
            max_matches: Most continuations (default: the index's ``max_matches``).
            backoff: When the longest match gives fewer than ``max_matches``, add unused occurrences of
                shorter suffixes (longer first, each most recent first).

        Returns:
            The continuations, each with its match length ``n``; empty when no suffix matched.
        """
        toks = self._tokens
        end = len(toks) - 1
        want = self.max_matches if max_matches is None else max_matches
        out: list[Continuation] = []
        seen: set[int] = set()
        for lvl in range(len(self._prevs) - 1, -1, -1):
            n = self.min_n + lvl
            if len(out) >= want or (out and not backoff):
                break
            if end < n:
                continue
            prev, suffix = self._prevs[lvl], toks[end - n + 1 :]
            j, steps = prev[end], 0
            # Without hash collisions a level needs at most `want` steps (seen occurrences included).
            while j >= 0 and len(out) < want and steps < 2 * want:
                if j not in seen and toks[j - n + 1 : j + 1] == suffix:
                    seen.add(j)
                    out.append(Continuation(toks[j + 1 : j + 1 + max_depth], n))
                j, steps = prev[j], steps + 1
        return out

    def propose(self, budget: int = 16, max_depth: int = 8, scoring: Scoring | None = None) -> Proposal:
        """Proposes a draft tree from this index alone (see :func:`propose_from`)."""
        return propose_from(self, None, budget, max_depth, scoring)


@dataclass(slots=True)
class _Seq:
    tokens: list[int]
    prevs: _Prevs


class SuffixCache:
    """Bounded, thread-safe index of finished sequences (prompt + output) of earlier requests.

    Positions are ``(sequence id << 32) | offset``; ids only grow and eviction drops the oldest
    sequence first, so a chain link into an evicted sequence means everything further is evicted too.
    """

    def __init__(
        self,
        max_tokens: int = 100_000,
        min_n: int = 2,
        max_n: int = 8,
        max_matches: int = 8,
        min_len: int = 8,
    ) -> None:
        """Creates an empty cache.

        Args:
            max_tokens: Most tokens kept; whole sequences are evicted oldest first beyond it. Memory is
                at most about ``130 x levels`` bytes a token (all n-grams distinct): ~90 MB by default.
            min_n: Shortest suffix that may match (1-token matches across requests are mostly noise).
            max_n: Longest suffix tried.
            max_matches: Most continuations a lookup returns.
            min_len: Sequences shorter than this are ignored.
        """
        if not 1 <= min_n <= max_n or max_matches < 1 or max_tokens < 1:
            raise ValueError("need 1 <= min_n <= max_n, max_matches >= 1 and max_tokens >= 1")
        self.max_tokens, self.min_n, self.max_n = max_tokens, min_n, max_n
        self.max_matches, self.min_len = max_matches, min_len
        self._lasts: _Lasts = [{} for _ in range(max_n - min_n + 1)]
        self._seqs: OrderedDict[int, _Seq] = OrderedDict()
        self._next_id = 0
        self._size = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """Tokens held."""
        return self._size

    @property
    def num_sequences(self) -> int:
        """Sequences held."""
        return len(self._seqs)

    @property
    def num_keys(self) -> int:
        """Dict entries over all levels (bounded by ``len(self) x levels``)."""
        return sum(len(d) for d in self._lasts)

    def add(self, tokens: Iterable[int]) -> None:
        """Adds a finished sequence (its last ``max_tokens`` tokens), evicting the oldest as needed."""
        toks = [int(t) for t in tokens][-self.max_tokens :]
        if len(toks) < max(self.min_len, 2):
            return
        with self._lock:
            while self._seqs and self._size + len(toks) > self.max_tokens:
                self._evict_oldest()
            sid = self._next_id
            self._next_id += 1
            seq = _Seq(toks, [array("q") for _ in self._lasts])
            # The last position has no continuation, so it is not indexed.
            _insert(toks, 0, len(toks) - 1, self.min_n, self._lasts, seq.prevs, sid << _SEQ_BITS)
            self._seqs[sid] = seq
            self._size += len(toks)

    def _evict_oldest(self) -> None:
        sid, seq = self._seqs.popitem(last=False)
        self._size -= len(seq.tokens)
        t = np.asarray(seq.tokens[:-1], dtype=np.int64).view(np.uint64)
        base = sid << _SEQ_BITS
        for n, h in _level_hashes(t, self.max_n):
            if n < self.min_n:
                continue
            # Delete the dict entries whose most recent occurrence is in this sequence.
            last, keys = self._lasts[n - self.min_n], h.tolist()
            cur = np.fromiter(map(last.get, keys, repeat(-1)), np.int64, len(keys))
            mine = cur == np.arange(base + n - 1, base + n - 1 + len(keys), dtype=np.int64)
            for k in compress(keys, mine.tolist()):
                del last[k]

    def lookup(
        self, context: Sequence[int], max_depth: int = 8, max_matches: int | None = None, backoff: bool = True
    ) -> list[Continuation]:
        """Returns continuations of the longest suffix of ``context`` seen in cached sequences.

        Args:
            context: The committed context (only its last ``max_n`` tokens are read).
            max_depth: Most tokens per continuation (each stops at its own sequence's end).
            max_matches: Most continuations (default: the cache's ``max_matches``).
            backoff: As in :meth:`NgramIndex.lookup`.

        Returns:
            Continuations (``cached=True``), longest match first, each level most recent first.
        """
        tail, hashes, k = [int(t) for t in context[-self.max_n :]], [], 0
        for t in reversed(tail):  # hashes[n - 1]: the last n tokens, as in _insert
            k = (k * _B + t) & _M
            hashes.append(k)
        want = self.max_matches if max_matches is None else max_matches
        out: list[Continuation] = []
        seen: set[int] = set()
        mask = (1 << _SEQ_BITS) - 1
        with self._lock:
            for n in range(min(self.max_n, len(tail)), self.min_n - 1, -1):
                if len(out) >= want or (out and not backoff):
                    break
                lvl, suffix = n - self.min_n, tail[len(tail) - n :]
                g, steps = self._lasts[lvl].get(hashes[n - 1], -1), 0
                # A link into an evicted sequence ends the chain: everything older is evicted too.
                while g >= 0 and (seq := self._seqs.get(g >> _SEQ_BITS)) is not None:
                    if len(out) >= want or steps >= 2 * want:
                        break
                    toks, i = seq.tokens, g & mask
                    if g not in seen and toks[i - n + 1 : i + 1] == suffix:
                        seen.add(g)
                        out.append(Continuation(toks[i + 1 : i + 1 + max_depth], n, True))
                    g, steps = seq.prevs[lvl][i], steps + 1
        return out


def build_tree(
    items: Iterable[tuple[Sequence[int], float, float]], budget: int, max_depth: int, depth_decay: float = 1.0
) -> Proposal:
    """Merges continuations into a trie and returns its ``budget`` best-scored nodes.

    Args:
        items: ``(tokens, weight, confidence)`` in rank order (earlier wins ties between siblings);
            items with a non-positive weight or confidence are skipped, confidences above 1 count as 1.
        budget: Most nodes kept.
        max_depth: Most tokens used per continuation.
        depth_decay: Score factor per level below the roots, in (0, 1].

    Returns:
        The proposal; see the module docstring for the score formula.
    """
    tok: list[int] = []
    par: list[int] = []
    dep: list[int] = []
    mass: list[float] = []
    kids: list[dict[int, int]] = []
    roots: dict[int, int] = {}
    total = 0.0
    if not 0.0 < depth_decay <= 1.0:
        raise ValueError(f"depth_decay must be in (0, 1], got {depth_decay}")
    for tokens, w, c in items:
        if w <= 0.0 or c <= 0.0 or not tokens:
            continue
        total += w
        m, node, children = w * min(c, 1.0), -1, roots
        for d, t in enumerate(tokens[:max_depth], 1):
            k = children.get(t)
            if k is None:
                k = children[t] = len(tok)
                tok.append(t)
                par.append(node)
                dep.append(d)
                mass.append(m)
                kids.append({})
            else:
                # Float sums of non-negative terms in one order are monotone in the subset: child <= parent.
                mass[k] += m
            node, children = k, kids[k]
    if not tok or budget <= 0:
        return Proposal.empty()

    # Dicts keep creation order, which is the order of the first (best-ranked) continuation through
    # each child; a stable sort by mass (reverse keeps ties in order) puts recency second.
    order = sorted(roots.values(), key=mass.__getitem__, reverse=True)
    for k in order:  # the list grows while iterated: a BFS
        ch = kids[k]
        if len(ch) > 1:
            order.extend(sorted(ch.values(), key=mass.__getitem__, reverse=True))
        elif ch:
            order.extend(ch.values())
    # No clamping needed: with confidences <= 1, mass <= total; correctly rounded division and products
    # are monotone, and the decay powers, built by repeated multiplication, never grow.
    scores = [mass[k] / total for k in order]
    if depth_decay != 1.0:
        powers = list(accumulate(repeat(depth_decay, max_depth), mul, initial=1.0))
        scores = [s * powers[dep[k] - 1] for s, k in zip(scores, order, strict=True)]
    if len(order) > budget:  # Proposal.top on the BFS order, without building the whole proposal first
        keep = sorted(sorted(range(len(order)), key=scores.__getitem__, reverse=True)[:budget])
        order, scores = [order[i] for i in keep], [scores[i] for i in keep]
    new = {old: i for i, old in enumerate(order)}
    return Proposal(
        [tok[k] for k in order], [new.get(par[k], -1) for k in order], [dep[k] for k in order], scores
    )


def propose_from(
    index: NgramIndex,
    cache: SuffixCache | None = None,
    budget: int = 16,
    max_depth: int = 8,
    scoring: Scoring | None = None,
    extra: Sequence[Continuation] = (),
) -> Proposal:
    """Proposes a draft tree from a session's own index and, optionally, a cross-request cache.

    The session's continuations come first (they win rank ties) and keep weight 1; the cache's are
    weighted by ``scoring.cache_weight``. A continuation whose match is ``d`` tokens shorter than the
    longest match of either source is further weighted ``scoring.backoff_weight ** d``.

    Args:
        index: The session's index (its tokens are the committed context).
        cache: Finished sequences of earlier requests, or None.
        budget: Most nodes in the proposal.
        max_depth: Deepest node.
        scoring: Weights and priors (default :class:`Scoring()`).
        extra: more continuations of the context (a lookahead pool's), scored like the session's.

    Returns:
        The proposal (empty when nothing matched).
    """
    sc = scoring if scoring is not None else _DEFAULT_SCORING
    backoff = sc.backoff_weight > 0.0
    conts = index.lookup(max_depth, backoff=backoff)
    if cache is not None:
        conts += cache.lookup(index.tokens[-cache.max_n :], max_depth, backoff=backoff)
    conts += extra
    if not conts:
        return Proposal.empty()
    best = max(c.n for c in conts)
    items = [
        (c.tokens, (sc.cache_weight if c.cached else 1.0) * sc.backoff_weight ** (best - c.n), sc.prior(c.n))
        for c in conts
    ]
    return build_tree(items, budget, max_depth, sc.depth_decay)
