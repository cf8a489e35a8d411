"""Lookahead drafting: n-grams the target writes for itself, from Jacobi iterations in its own forwards.

Prompt lookup (:mod:`specsplit.core.ngram`) only proposes text that already occurred. Lookahead
decoding (Fu et al., 2024) also proposes text that did not: every round's verification forward
carries a small *window* of guesses beside the draft tree, and the target's outputs on the window
refine those guesses by Jacobi iteration. Along each column of the window the guesses and the
target's output form an n-gram the target itself would plausibly write; a *pool* keeps the recent
ones, keyed by their first token, and proposes them whenever the committed text ends with that
token. The forward costs a few more rows, which a GPU-bound forward at batch 1 barely notices.

The window is ``levels`` rows of ``width`` guesses and rides in the tree as extra nodes:

- row 0 is a chain hanging from the committed context (column ``c`` at depth ``c + 1``): the current
  guess of the next ``width`` tokens;
- row ``r`` continues each column: its column-``c`` node hangs from row ``r - 1``'s, one deeper.

So the node of row ``r``, column ``c`` sees the context, row 0 up to column ``c`` and the column's
rows above it, and the target's token after it is the guess for the next position. After a round,
column ``c`` yields the n-gram (row 0 .. row ``levels - 1`` of column ``c``, the target's token
after the last row); the rows move up one and the target's tokens become the new last row.

Window nodes are deterministic guesses like every n-gram node (``q`` one-hot), so verification stays
lossless, greedy and sampled; when the target agrees with row 0, its tokens are even accepted.
What a window learns depends on the target's tokens at every node of the round
(:attr:`~specsplit.messages.VerifyResult.choices`); a round that returns none leaves the window as
it was.
"""

from __future__ import annotations

from collections import OrderedDict

from specsplit.core.ngram import Continuation


class LookaheadWindow:
    """One generation's Jacobi window and n-gram pool (host lists; a few hundred tokens at most).

    Args:
        width: guesses a row holds (columns).
        levels: rows; the pool's n-grams are ``levels + 1`` tokens long.
        pool_size: continuations the pool keeps per first token (the least recently seen go first).
        seed_tokens: tokens the window starts from (the prompt's last ones: plausible text beats
            random ids for the first rounds' guesses).
    """

    def __init__(self, width: int, levels: int, pool_size: int, seed_tokens: list[int]):
        if width < 1 or levels < 1 or pool_size < 1:
            raise ValueError(
                f"lookahead needs width, levels and pool_size >= 1, got {width}, {levels}, {pool_size}"
            )
        self.width, self.levels, self.pool_size = width, levels, pool_size
        seed = list(seed_tokens[-width * levels :]) or [0]
        while len(seed) < width * levels:
            seed = seed + seed
        self.rows = [seed[r * width : (r + 1) * width] for r in range(levels)]
        self.pool: dict[int, OrderedDict[tuple[int, ...], None]] = {}
        # the window's shape never changes, only its tokens: parents and depths are built once
        self._parents = [c - 1 for c in range(width)] + [
            (r - 1) * width + c for r in range(1, levels) for c in range(width)
        ]
        self._depths = [r + c + 1 for r in range(levels) for c in range(width)]

    @property
    def num_nodes(self) -> int:
        """Nodes the window adds to a round's tree."""
        return self.width * self.levels

    @property
    def depth(self) -> int:
        """Depth of the window's deepest node below the committed context."""
        return self.width + self.levels - 1

    def nodes(self) -> tuple[list[int], list[int], list[int]]:
        """The window as tree nodes: ``(tokens, parents, depths)``, parents indexing these nodes
        (-1: the committed context), rows in order (row 0's chain first)."""
        return [t for row in self.rows for t in row], self._parents, self._depths

    def continuations(self, last_token: int, limit: int) -> list[Continuation]:
        """The pool's continuations of ``last_token``, most recently seen first (at most ``limit``)."""
        grams = self.pool.get(last_token)
        if not grams:
            return []
        out = []
        for gram in reversed(grams):
            out.append(Continuation(list(gram), 1))
            if len(out) >= limit:
                break
        return out

    def update(self, outputs: list[int]) -> None:
        """One Jacobi step from the target's tokens after each window node (the order of
        :meth:`nodes`): harvest each column's n-gram into the pool, move the rows up."""
        if len(outputs) != self.num_nodes:
            raise ValueError(f"expected {self.num_nodes} window outputs, got {len(outputs)}")
        w = self.width
        last = outputs[-w:]
        for c in range(w):
            gram = [row[c] for row in self.rows] + [last[c]]
            grams = self.pool.setdefault(gram[0], OrderedDict())
            key = tuple(gram[1:])
            grams[key] = None
            grams.move_to_end(key)
            if len(grams) > self.pool_size:
                grams.popitem(last=False)
        self.rows = self.rows[1:] + [list(last)]
