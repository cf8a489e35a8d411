"""A KV store for many sequences at once: one slot per sequence in one preallocated pool.

Every layer's keys and values are views of ONE buffer ``[layers, 2, slots, kv_heads, capacity,
head_dim]``. A batched forward covers the first ``B`` slots (the batch keeps its live sequences
packed at the front: a sequence that leaves hands its slot to the last one, see :meth:`move_slot`),
writes each row's ``q`` new tokens at that row's own positions (``write_pos``, `[B, q]`, a scatter,
so rows of different lengths share one static-shape forward) and attends over the first
``read_len`` slots of every row; the caller's additive mask hides, per row, whatever is not that
row's context or tree. Lengths live with the caller (the batch scheduler), so rollback is free:
slots past a row's committed length are simply overwritten by its next forward.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from specsplit.errors import ResourceExhausted


class _PoolLayer(CacheLayerMixin):
    """One layer's view of the pool; ``update`` scatters a batched forward's keys and values."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, owner: BatchedKVCache, keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        self.owner = owner
        self.pool_keys, self.pool_values = keys, values  # [slots, H, capacity, D]
        self.keys, self.values = keys, values
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise RuntimeError("the pool is allocated up front")

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        o = self.owner
        wpos = o.write_pos
        if wpos is None:
            raise RuntimeError("BatchedKVCache.bind() must set the write positions before a forward")
        if o.slot_ids is not None:  # fresh prompts: rows of any slots, attending to their own tokens
            where = (o.slot_ids[:, None, None], o.heads[None, :, None], wpos[:, None, :])
            self.pool_keys.index_put_(where, key_states)
            self.pool_values.index_put_(where, value_states)
            return key_states, value_states
        lo = o.first_slot
        b, h, q, d = key_states.shape
        keys, values = self.pool_keys[lo : lo + b], self.pool_values[lo : lo + b]
        idx = wpos[:, None, :, None].expand(b, h, q, d)
        keys.scatter_(2, idx, key_states)
        values.scatter_(2, idx, value_states)
        return keys[:, :, : o.read_len], values[:, :, : o.read_len]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if self.owner.slot_ids is not None:
            return query_length, 0
        return self.owner.read_len, 0

    def get_seq_length(self) -> int:
        return 0

    def get_max_length(self) -> int:
        return int(self.pool_keys.shape[2])


class BatchedKVCache(Cache):
    """``slots`` sequences of up to ``capacity`` tokens each, in one allocation.

    Args:
        num_layers / kv_heads / head_dim / dtype / device: the model's KV geometry.
        slots: sequences held at once (the largest batch).
        capacity: tokens per sequence (prompt + new tokens + the largest tree).
    """

    def __init__(
        self,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        slots: int,
        capacity: int,
    ):
        if slots < 1 or capacity < 1:
            raise ValueError(f"slots and capacity must be >= 1 (got {slots}, {capacity})")
        try:
            kv = torch.zeros(num_layers, 2, slots, kv_heads, capacity, head_dim, dtype=dtype, device=device)
        except torch.OutOfMemoryError as e:
            raise ResourceExhausted(
                f"no memory for a KV pool of {slots} sequences x {capacity} tokens: lower the batch size "
                "or max_new_tokens"
            ) from e
        self.kv = kv
        self.heads = torch.arange(kv_heads, device=device)  # head indices of fresh-prompt writes
        self.slots, self.capacity = slots, capacity
        self.write_pos: torch.Tensor | None = None  # [B, q] slot positions of a forward's tokens
        self.read_len = capacity
        self.first_slot = 0
        self.slot_ids: torch.Tensor | None = None  # fresh-prompt forwards: each row's slot (bind_fresh)
        super().__init__(layers=[_PoolLayer(self, kv[i, 0], kv[i, 1]) for i in range(num_layers)])

    @classmethod
    def for_model(
        cls, model: Any, dtype: torch.dtype, device: torch.device, slots: int, capacity: int
    ) -> BatchedKVCache:
        """A pool shaped for ``model`` (an HF causal LM config with the usual field names)."""
        cfg = getattr(model.config, "text_config", None) or model.config
        heads = int(cfg.num_attention_heads)
        kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
        return cls(int(cfg.num_hidden_layers), kv_heads, head_dim, dtype, device, slots, capacity)

    def bind(self, write_pos: torch.Tensor | None, read_len: int = 0, first_slot: int = 0) -> None:
        """Set where the next forward writes (`[B, q]` positions of slots ``first_slot ..
        first_slot + B - 1``) and how many positions of each slot it attends over."""
        if write_pos is not None and not 0 < read_len <= self.capacity:
            raise ValueError(f"read_len {read_len} outside (0, {self.capacity}]")
        if write_pos is not None and first_slot + write_pos.shape[0] > self.slots:
            raise ValueError(f"rows {first_slot}..{first_slot + write_pos.shape[0]} past {self.slots} slots")
        self.write_pos, self.read_len, self.first_slot = write_pos, read_len or self.capacity, first_slot
        self.slot_ids = None

    def bind_fresh(self, write_pos: torch.Tensor, slot_ids: torch.Tensor) -> None:
        """Set up a forward of fresh prompts: row ``b`` writes its tokens at positions
        ``write_pos[b]`` of slot ``slot_ids[b]`` (`[B]` device int64, any slots, repeats allowed for
        rows whose keys are never read) and attends to the forward's own tokens only (the slots'
        earlier contents are neither read nor needed). Static shapes: a CUDA graph can hold it."""
        self.write_pos, self.read_len, self.first_slot, self.slot_ids = (
            write_pos,
            write_pos.shape[1],
            0,
            slot_ids,
        )

    def move_slot(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` positions of slot ``src`` into slot ``dst`` (every layer)."""
        if src != dst and length:
            self.kv[:, :, dst, :, :length] = self.kv[:, :, src, :, :length]

    def keep_paths(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Per row ``b`` of the batch, copy positions ``src[b]`` to ``dst[b]`` (`[B, m]` device int64,
        every layer; all sources are read before anything is written). Entries with ``src == dst``
        are no-ops, so rows that accepted fewer nodes pad with them."""
        b = src.shape[0]
        rows = torch.arange(b, device=src.device)[:, None].expand_as(src)
        view = self.kv[:, :, :b]  # [L, 2, B, H, C, D]
        moved = view[:, :, rows, :, src]  # [B, m, L, 2, H, D]
        view[:, :, rows, :, dst] = moved

    def memory_bytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0
