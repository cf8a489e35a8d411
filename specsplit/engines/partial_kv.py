"""SpecPV partial KV view: sink / retrieval / window / speculative buffer, and block retrieval.

Long-context verification reads the whole KV cache in every layer; SpecPV (opt-in, lossy) verifies
against a small *partial view* of it instead and rectifies with a periodic full verification
(the switching policy lives in :mod:`specsplit.engines.specpv`).

Vocabulary:

- *block*: ``block_size`` consecutive cached tokens; block ``b`` covers positions
  ``[b * block_size, (b + 1) * block_size)``.
- *sink*: the first ``n_sink_blocks`` blocks, always in the view (attention sinks).
- *window*: the most recent tokens, from the block boundary at or before
  ``full_len - n_window_blocks * block_size`` to the end of the full cache.
- *candidates*: the complete blocks between the sink and the window; the view holds the
  ``n_retrieval_blocks`` of them that score highest, chosen per layer and KV head.
- *speculative buffer*: the tail of the view, where partial verification forwards write the KV of
  ``pending + tree`` tokens; the accepted ones stay there (the *backlog*) until the next full
  verification recomputes them exactly in the full cache.
- *summaries*: per layer and KV head, the elementwise max ``Kmax`` and min ``Kmin`` of the
  post-RoPE keys of each complete block past the sink; block score
  ``s = max(q . Kmax, q . Kmin)`` for the post-RoPE query ``q`` of a tree token, reduced over the
  tree's queries and over the query heads that share the KV head (``retrieval_reduce``).

Keys are cached post-RoPE, so any subset of them can be attended without re-rotation; queries keep
their true absolute positions. The view is one contiguous ``[batch, kv_heads, budget, head_dim]``
buffer per layer held in a :class:`~specsplit.runtime.kv_cache.StaticKVCache`, so a partial forward is an
ordinary cached forward over that cache (the model's ``past_key_values.update`` returns the view).
The post-RoPE queries come from a custom attention function registered through transformers'
``AttentionInterface`` (:mod:`specsplit.runtime.attention`) that records them on demand.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from specsplit.config import SpecPVConfig
from specsplit.core.specpv_view import (
    ViewLayout,
    block_token_index,
    gather_tokens,
    plan_layout,
    score_blocks,
    select_blocks,
)
from specsplit.runtime.kv_cache import StaticKVCache

logger = logging.getLogger(__name__)


@dataclass
class QueryRecorder:
    """Collects the trailing ``rows`` post-RoPE query rows of each layer during one forward.

    Attributes:
        rows: how many trailing query positions to keep (the tree tokens).
        queries: ``layer_idx -> [batch, heads, rows, head_dim]`` copies.
    """

    rows: int
    queries: dict[int, torch.Tensor] = field(default_factory=dict)

    def record(self, layer_idx: int, query: torch.Tensor) -> None:
        # A copy, not a view: a view would keep a prefill-sized query tensor alive per layer.
        self.queries[layer_idx] = (
            query[:, :, -self.rows :].detach().clone(memory_format=torch.contiguous_format)
        )


# ---------------------------------------------------------------------- block summaries and scores
class BlockSummaries:
    """Kmax/Kmin of the complete blocks past the sink, per layer and KV head, kept incrementally.

    Entries for blocks ``< first_block`` (the sink) are never computed. Each layer holds
    ``kmax``/``kmin`` of shape `[batch, kv_heads, slots, head_dim]`, grown by doubling.

    Args:
        block_size: tokens per block.
        first_block: first summarised block (``n_sink_blocks``).
    """

    def __init__(self, block_size: int, first_block: int):
        self.block_size = block_size
        self.first_block = first_block
        self.kmax: list[torch.Tensor] = []
        self.kmin: list[torch.Tensor] = []
        self.n_blocks = 0  # blocks [first_block, n_blocks) are valid

    def truncate(self, length: int) -> None:
        """Forget blocks that are no longer complete after the cache shrank to ``length``."""
        self.n_blocks = min(self.n_blocks, length // self.block_size)

    def update(self, cache: StaticKVCache) -> int:
        """Summarise the blocks completed since the last call; returns how many were added."""
        bs = self.block_size
        lo = max(self.n_blocks, self.first_block)
        hi = cache.seq_len // bs
        if hi <= lo:
            return 0
        for i, layer in enumerate(_layers(cache)):
            keys = layer.keys  # [B, kvH, capacity, D]
            assert keys is not None
            if i == len(self.kmax):
                empty = keys.new_zeros(*keys.shape[:2], 0, keys.shape[-1])
                self.kmax.append(empty)
                self.kmin.append(empty.clone())
            if self.kmax[i].shape[2] < hi:
                self.kmax[i] = _grow_blocks(self.kmax[i], hi)
                self.kmin[i] = _grow_blocks(self.kmin[i], hi)
            blocks = keys[:, :, lo * bs : hi * bs].unflatten(2, (hi - lo, bs))  # [B, kvH, nb, bs, D]
            self.kmax[i][:, :, lo:hi] = blocks.amax(dim=3)
            self.kmin[i][:, :, lo:hi] = blocks.amin(dim=3)
        added = hi - lo
        self.n_blocks = hi
        return added


def _layers(cache: StaticKVCache) -> list[Any]:
    """The per-layer buffers (``keys``/``values`` `[B, kv_heads, capacity, D]`, ``length``)."""
    return list(cache.layers)


def _grow_blocks(t: torch.Tensor, need: int) -> torch.Tensor:
    out = t.new_zeros(*t.shape[:2], max(need, 2 * t.shape[2]), t.shape[-1])
    out[:, :, : t.shape[2]] = t
    return out


class PartialSession:
    """SpecPV state of one target session: summaries, the partial view, the backlog.

    Attributes:
        view: the partial cache (``None`` until the first refresh); its valid length is
            ``layout.view_len + len(backlog)`` between rounds.
        layout: the last refresh's layout (``None`` when the view is not usable).
        backlog: committed token ids whose KV exists only in the speculative buffer (accepted
            under partial verification); the next full verification feeds them first.
        steps_since_refresh: partial verifications since the view was built.
    """

    def __init__(self, cfg: SpecPVConfig):
        self.cfg = cfg
        self.summaries = BlockSummaries(cfg.block_size, cfg.n_sink_blocks)
        self.view: StaticKVCache | None = None
        self.layout: ViewLayout | None = None
        self.backlog: list[int] = []
        self.steps_since_refresh = 0
        # per layer: `[B, kv_heads, k]` retrieved block ids of the current view (empty list when
        # every candidate fits or there are none)
        self.selected: list[torch.Tensor] = []
        self._stacked: tuple[torch.Tensor, torch.Tensor] | None = None  # reselect's stacked summaries
        # per layer: `[B, H, <= retrieval_query_window, D]` committed rows' queries since the view was
        # built (only with retrieval_query_window)
        self.query_history: dict[int, torch.Tensor] = {}

    @property
    def ready(self) -> bool:
        return self.layout is not None

    def invalidate(self) -> None:
        """Drop the view (the next verification is full); the backlog is kept."""
        self.layout = None
        self.steps_since_refresh = 0

    def reset(self) -> None:
        """The full cache was emptied: forget everything."""
        self.invalidate()
        self.backlog = []
        self.summaries.truncate(0)

    def rollback(self, cache: StaticKVCache, length: int) -> None:
        """Keep the first ``length`` tokens of the logical sequence (full cache + backlog)."""
        full = cache.seq_len
        if length >= full:
            keep = length - full
            if keep > len(self.backlog):
                raise ValueError(f"cannot roll back to {length}; session holds {full + len(self.backlog)}")
            self.backlog = self.backlog[:keep]
            if self.layout is not None and self.view is not None:
                self.view.rollback(self.layout.view_len + keep)
            return
        self.backlog = []
        self.invalidate()
        self.summaries.truncate(length)
        cache.rollback(length)

    def rebuild(self, cache: StaticKVCache, queries: dict[int, torch.Tensor] | None) -> ViewLayout:
        """Refresh summaries, retrieval and window from the full cache; empty the buffer.

        Args:
            cache: the full cache (exact KV of every committed token; no backlog).
            queries: ``layer -> [B, H, nq, D]`` post-RoPE tree queries of the last full forward;
                only needed when there are more candidate blocks than retrieval slots.

        Raises:
            RuntimeError: an invariant does not hold (missing queries, layer mismatch); the caller
                falls back to full verification.
        """
        self.invalidate()
        self.query_history = {}
        cfg = self.cfg
        layout, n_cand = plan_layout(cfg, cache.seq_len)
        k, bs = layout.retrieved_blocks, cfg.block_size
        select = 0 < k < n_cand
        if select:
            self.summaries.update(cache)
            if self.summaries.n_blocks < cfg.n_sink_blocks + n_cand:
                raise RuntimeError("block summaries do not cover the retrieval candidates")
        view = self._view_for(cache)
        self.selected = []
        self._stacked = None
        for i, (layer, vlayer) in enumerate(zip(_layers(cache), _layers(view), strict=True)):
            keys, values = layer.keys, layer.values  # [B, kvH, capacity, D]
            vk, vv = vlayer.keys, vlayer.values  # [B, kvH, budget, D]
            vk[:, :, : layout.sink] = keys[:, :, : layout.sink]
            vv[:, :, : layout.sink] = values[:, :, : layout.sink]
            lo, hi = layout.sink, layout.sink + k * bs
            if select:
                q = (queries or {}).get(i)
                if q is None:
                    raise RuntimeError(f"no recorded queries for layer {i}")
                first, last = cfg.n_sink_blocks, cfg.n_sink_blocks + n_cand
                scores = score_blocks(
                    q.to(keys.device),
                    self.summaries.kmax[i][:, :, first:last],
                    self.summaries.kmin[i][:, :, first:last],
                    cfg.retrieval_reduce,
                )  # [B, kvH, C]
                blocks = select_blocks(scores, k, first)  # [B, kvH, k]
                self.selected.append(blocks)
                idx = block_token_index(blocks, bs)  # [B, kvH, k * bs]
                vk[:, :, lo:hi] = gather_tokens(keys, idx)
                vv[:, :, lo:hi] = gather_tokens(values, idx)
            elif k:  # every candidate fits: copy them all, in order
                vk[:, :, lo:hi] = keys[:, :, lo:hi]
                vv[:, :, lo:hi] = values[:, :, lo:hi]
            win = layout.full_len - layout.window_start
            vk[:, :, hi : hi + win] = keys[:, :, layout.window_start : layout.full_len]
            vv[:, :, hi : hi + win] = values[:, :, layout.window_start : layout.full_len]
        view.set_length(layout.view_len)
        self.backlog = []
        self.layout = layout
        return layout

    def reselect(self, cache: StaticKVCache, queries: dict[int, torch.Tensor]) -> bool:
        """Re-choose the retrieved blocks with new queries; sink, window and buffer stay.

        Between full verifications the full cache does not move, so the summaries still cover the
        candidates of the current layout and the retrieved slots can be re-gathered from it.

        Args:
            cache: the full cache the view was built from.
            queries: ``layer -> [B, H, nq, D]`` post-RoPE queries (e.g. the last partial step's).

        Returns:
            False when the view has no selection to refresh (every candidate fits, or no view).

        Raises:
            RuntimeError: missing queries or a view out of step with the cache.
        """
        lay, view, cfg = self.layout, self.view, self.cfg
        if lay is None or view is None or not self.selected:
            return False
        if cache.seq_len != lay.full_len:
            raise RuntimeError(
                f"full cache holds {cache.seq_len} tokens, the view was built at {lay.full_len}"
            )
        bs, k = cfg.block_size, lay.retrieved_blocks
        first, last = cfg.n_sink_blocks, lay.window_start // bs
        lo, hi = lay.sink, lay.sink + k * bs
        layers, vlayers = _layers(cache), _layers(view)
        missing = [i for i in range(len(layers)) if i not in queries]
        if missing:
            raise RuntimeError(f"no recorded queries for layer {missing[0]}")
        qs = [queries[i] for i in range(len(layers))]
        if self._stacked is None and len({(q.device, q.shape) for q in qs}) == 1:
            # one scoring for all layers (a few kernels instead of a few per layer): stack the
            # candidates' summaries once per view
            self._stacked = (
                torch.stack([t[:, :, first:last] for t in self.summaries.kmax[: len(layers)]]),
                torch.stack([t[:, :, first:last] for t in self.summaries.kmin[: len(layers)]]),
            )  # [L, B, kvH, C, D]
        if self._stacked is not None:
            kmax, kmin = self._stacked
            n, b = kmax.shape[0], kmax.shape[1]
            q = torch.stack(qs).to(kmax.device).flatten(0, 1)  # [L * B, H, nq, D]
            scores = score_blocks(q, kmax.flatten(0, 1), kmin.flatten(0, 1), cfg.retrieval_reduce)
            all_blocks = select_blocks(scores, k, first).unflatten(0, (n, b))  # [L, B, kvH, k]
            per_layer = list(all_blocks.unbind(0))
        else:  # layers on several devices (device map): score layer by layer
            per_layer = []
            for i, layer in enumerate(layers):
                scores = score_blocks(
                    qs[i].to(layer.keys.device),
                    self.summaries.kmax[i][:, :, first:last],
                    self.summaries.kmin[i][:, :, first:last],
                    cfg.retrieval_reduce,
                )
                per_layer.append(select_blocks(scores, k, first))
        for i, (layer, vlayer, blocks) in enumerate(zip(layers, vlayers, per_layer, strict=True)):
            blocks = blocks.to(layer.keys.device)
            idx = block_token_index(blocks, bs)
            vlayer.keys[:, :, lo:hi] = gather_tokens(layer.keys, idx)
            vlayer.values[:, :, lo:hi] = gather_tokens(layer.values, idx)
            self.selected[i] = blocks
        return True

    def _view_for(self, cache: StaticKVCache) -> StaticKVCache:
        if self.view is None:
            self.view = StaticKVCache(len(cache.layers), self.cfg.budget)
        for layer, vlayer in zip(_layers(cache), _layers(self.view), strict=True):
            if layer.keys is None or not layer.is_initialized:
                raise RuntimeError("the full cache has an uninitialised layer")
            if not vlayer.is_initialized:
                vlayer.lazy_initialization(layer.keys[:, :, :0], layer.values[:, :, :0])
                vlayer.pinned = True  # never grows: an overflow raises instead (-> full verification)
        return self.view

    def memory_bytes(self) -> int:
        total = self.view.memory_bytes() if self.view is not None else 0
        for t in self.summaries.kmax + self.summaries.kmin:
            total += t.numel() * t.element_size()
        return total
