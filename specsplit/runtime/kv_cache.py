"""A preallocated, position-indexed KV cache that HF Llama/Qwen2 models write into.

Each layer owns `[batch, kv_heads, capacity, head_dim]` key and value buffers, allocated once (on
the layer's own device, so accelerate device maps work) and sized to need: prompt +
``max_new_tokens`` + tree budget, never ``max_position_embeddings``. A forward appends by slice
assignment; ``rollback`` only moves the length (rejected slots are overwritten next time), and
``compact`` keeps an accepted tree branch by copying just the accepted positions.
"""

from __future__ import annotations

import logging

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from specsplit.core.pinned import pin

logger = logging.getLogger(__name__)

GROW_CHUNK = 256  # tokens added per growth step when a session outgrows its estimate


class _StaticKVLayer(CacheLayerMixin):
    """One layer's buffers; allocated lazily on the first update (device/dtype from the model)."""

    is_sliding = False
    is_compileable = False
    is_croppable = True

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity
        self.length = 0
        # Static-shape mode (CUDA graphs): write at these slots, attend over the whole buffer.
        self.write_pos: torch.Tensor | None = None
        self.read_len: int | None = None  # static mode: attend over the first read_len slots only
        self.pinned = False  # buffers captured by CUDA graphs must never be reallocated

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = torch.zeros(b, h, self.capacity, d, dtype=key_states.dtype, device=key_states.device)
        self.values = torch.zeros(
            b, h, self.capacity, value_states.shape[-1], dtype=value_states.dtype, device=value_states.device
        )
        self.is_initialized = True

    def _grow(self, needed: int) -> None:
        if self.pinned:
            from specsplit.errors import ResourceExhausted

            raise ResourceExhausted(
                f"the static workspace holds {self.capacity} tokens and {needed} are needed; "
                "raise graph_capacity"
            )
        new_cap = ((needed + GROW_CHUNK - 1) // GROW_CHUNK) * GROW_CHUNK
        assert self.keys is not None and self.values is not None
        logger.debug("growing KV layer from %d to %d slots", self.capacity, new_cap)
        k = self.keys.new_zeros(*self.keys.shape[:2], new_cap, self.keys.shape[-1])
        v = self.values.new_zeros(*self.values.shape[:2], new_cap, self.values.shape[-1])
        k[:, :, : self.length] = self.keys[:, :, : self.length]
        v[:, :, : self.length] = self.values[:, :, : self.length]
        self.keys, self.values, self.capacity = k, v, new_cap

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        assert self.keys is not None and self.values is not None
        if self.write_pos is not None:
            self.keys.index_copy_(2, self.write_pos, key_states)
            self.values.index_copy_(2, self.write_pos, value_states)
            if self.read_len is not None:
                return self.keys[:, :, : self.read_len], self.values[:, :, : self.read_len]
            return self.keys, self.values
        q = key_states.shape[-2]
        end = self.length + q
        if end > self.capacity:
            self._grow(end)
        self.keys[:, :, self.length : end] = key_states
        self.values[:, :, self.length : end] = value_states
        self.length = end
        # Attend over the valid prefix only, not the whole preallocated buffer.
        return self.keys[:, :, :end], self.values[:, :, :end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.capacity

    def crop(self, max_length: int) -> None:
        if max_length < 0:
            max_length = self.length + max_length
        self.length = max(0, min(self.length, max_length))

    def reset(self) -> None:
        self.length = 0


class StaticKVCache(Cache):
    """Preallocated KV cache with O(1) rollback and accepted-branch compaction.

    Args:
        num_layers: decoder layers of the model.
        capacity: initial slots per layer; grows by ``GROW_CHUNK`` if ever exceeded.

    Use :meth:`for_model` to size it from a model.
    """

    def __init__(self, num_layers: int, capacity: int):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        super().__init__(layers=[_StaticKVLayer(capacity) for _ in range(num_layers)])
        self._kv: torch.Tensor | None = None  # [layers, 2, B, H, capacity, D] when allocated at once

    @classmethod
    def for_model(cls, model: torch.nn.Module, capacity: int) -> StaticKVCache:
        cfg = getattr(model, "config", None)
        cfg = getattr(cfg, "text_config", None) or cfg
        n = getattr(cfg, "num_hidden_layers", None)
        if n is None:
            raise ValueError("model.config has no num_hidden_layers; cannot size a StaticKVCache")
        return cls(int(n), capacity)

    # ------------------------------------------------------------------ lengths
    @property
    def _static_layers(self) -> list[_StaticKVLayer]:
        return self.layers  # type: ignore[return-value]

    @property
    def seq_len(self) -> int:
        return self._static_layers[0].length

    @property
    def capacity(self) -> int:
        return self._static_layers[0].capacity

    @property
    def remaining_capacity(self) -> int:
        return self.capacity - self.seq_len

    @property
    def is_full(self) -> bool:
        return self.seq_len >= self.capacity

    def allocate(
        self, batch: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        """Allocate every layer's buffers now (static-shape mode needs them before capture).

        All layers are views of ONE buffer, so compacting an accepted branch is two kernels for
        the whole model instead of four per layer."""
        layers = self._static_layers
        if not any(layer.is_initialized for layer in layers):
            cap = layers[0].capacity
            kv = torch.zeros(len(layers), 2, batch, kv_heads, cap, head_dim, dtype=dtype, device=device)
            for i, layer in enumerate(layers):
                layer.keys, layer.values = kv[i, 0], kv[i, 1]
                layer.dtype, layer.device = dtype, device
                layer.is_initialized = True
            self._kv = kv
        for layer in layers:
            if not layer.is_initialized:
                empty = torch.empty(batch, kv_heads, 0, head_dim, dtype=dtype, device=device)
                layer.lazy_initialization(empty, empty)
            layer.pinned = True

    def set_write_positions(self, positions: torch.Tensor | None, read_len: int | None = None) -> None:
        """Switch to static-shape writes at ``positions`` (`[q]` slots) or back (``None``).

        ``read_len``: attention then reads only the first ``read_len`` slots (a fixed bucket that
        covers the valid prefix), not the whole preallocated buffer."""
        for layer in self._static_layers:
            layer.write_pos = positions
            layer.read_len = read_len if positions is not None else None

    def set_length(self, length: int) -> None:
        """Set the valid length (static-shape forwards do not move it themselves)."""
        if not 0 <= length <= self.capacity:
            raise ValueError(f"length {length} outside [0, {self.capacity}]")
        for layer in self._static_layers:
            layer.length = length

    def ensure_capacity(self, total: int) -> None:
        """Make room for ``total`` tokens now (one growth instead of several small ones)."""
        for layer in self._static_layers:
            if total > layer.capacity:
                if layer.is_initialized:
                    layer._grow(total)
                else:
                    layer.capacity = total

    # ------------------------------------------------------------------ editing
    def rollback(self, accepted_length: int) -> None:
        """Keep the first ``accepted_length`` tokens (O(1): only the length moves)."""
        if not 0 <= accepted_length <= self.seq_len:
            raise ValueError(f"cannot roll back to {accepted_length}; cache holds {self.seq_len}")
        for layer in self._static_layers:
            layer.length = accepted_length

    def crop(self, max_length: int) -> None:
        """HF semantics: positive keeps that many tokens, negative removes that many."""
        for layer in self._static_layers:
            layer.crop(max_length)

    def reset(self) -> None:
        for layer in self._static_layers:
            layer.length = 0

    def compact(self, keep_indices: torch.Tensor, start: int) -> None:
        """Move the slots ``keep_indices`` (ascending, all >= ``start``) to ``start, start+1, ...``.

        Used after verification: the accepted tree positions follow the committed prefix; the
        cache length becomes ``start + len(keep_indices)``. Copies only the kept positions.

        Args:
            keep_indices: `[m]` int64 absolute slot indices, ascending.
            start: first destination slot.
        """
        m = int(keep_indices.shape[0])
        if self._kv is not None:  # one buffer for all layers: gather once, write once
            if m:
                pinned = pin(keep_indices) if self._kv.device.type == "cuda" else keep_indices
                slots = pinned.to(self._kv.device, non_blocking=True)
                self._kv[:, :, :, :, start : start + m] = self._kv.index_select(4, slots)
            for layer in self._static_layers:
                layer.length = start + m
            return
        on_device: dict[torch.device, torch.Tensor] = {}
        for layer in self._static_layers:
            if m and layer.is_initialized:
                assert layer.keys is not None and layer.values is not None
                idx = on_device.get(layer.keys.device)
                if idx is None:
                    src = pin(keep_indices) if layer.keys.device.type == "cuda" else keep_indices
                    idx = on_device[layer.keys.device] = src.to(layer.keys.device, non_blocking=True)
                # Gather first: sources and destinations may overlap.
                k = layer.keys.index_select(2, idx)
                v = layer.values.index_select(2, idx)
                layer.keys[:, :, start : start + m] = k
                layer.values[:, :, start : start + m] = v
            layer.length = start + m

    def keep_path(self, nodes: list[int], base: int) -> None:
        """Keep the accepted tree nodes ``nodes`` (indices of tree slots after ``base``, root to leaf)
        right after ``base``: a copy of those slots only, none for a chain's accepted prefix."""
        m = len(nodes)
        if nodes != list(range(m)):
            self.compact(torch.tensor(nodes, dtype=torch.long) + base, base)
        else:
            self.rollback(base + m)

    @property
    def single_buffer(self) -> bool:
        """Every layer is a view of one buffer (:meth:`allocate`): :meth:`move_slots` works."""
        return self._kv is not None

    def move_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy slots ``src`` to slots ``dst`` (`[m]` device int64 each) in every layer, reading all
        sources before writing: device ops only, so a captured graph can commit an accepted branch
        whose slots it does not know on the host. Needs the one-buffer layout (:meth:`allocate`);
        lengths are left alone."""
        if self._kv is None:
            raise RuntimeError("move_slots needs the single-buffer layout of allocate()")
        self._kv.index_copy_(4, dst, self._kv.index_select(4, src))

    def append(self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Append without attending (e.g. to preload a prefix computed elsewhere)."""
        self._static_layers[layer_idx].update(key_states, value_states)

    def get_kv_for_layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The valid `[B, H, seq_len, D]` keys and values of one layer."""
        layer = self._static_layers[layer_idx]
        if not layer.is_initialized:
            raise ValueError(f"layer {layer_idx} holds nothing yet")
        assert layer.keys is not None and layer.values is not None
        return layer.keys[:, :, : layer.length], layer.values[:, :, : layer.length]

    def memory_bytes(self) -> int:
        total = 0
        for layer in self._static_layers:
            if layer.is_initialized:
                assert layer.keys is not None and layer.values is not None
                total += layer.keys.numel() * layer.keys.element_size() * 2
        return total
