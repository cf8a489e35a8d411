"""What the draft and the target engine share: lifecycle, sessions, limits and forward dispatch.

An engine owns one model (through a :class:`~specsplit.runtime.runner.ModelRunner`), a
:class:`~specsplit.engines.sessions.SessionStore` of per-session states, and one static workspace
(:class:`~specsplit.runtime.graphs.Workspace`) that the CUDA-graph path lends to one session at a
time. Subclasses add what each side does with a round (:class:`~specsplit.engines.draft.DraftEngine`
grows trees, :class:`~specsplit.engines.target.TargetEngine` verifies them).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import torch

from specsplit.config import DraftConfig, TargetConfig, resolved_attention_kernel
from specsplit.core.tree_attention import build_verify_attention
from specsplit.engines.sessions import KVBudget, SessionStore
from specsplit.errors import CacheDesyncError, ResourceExhausted
from specsplit.messages import WorkerInfo
from specsplit.runtime.graphs import GraphedRound, Workspace
from specsplit.runtime.kv_cache import GROW_CHUNK, StaticKVCache
from specsplit.runtime.runner import ModelRunner, sync_device
from specsplit.runtime.vocab_subset import load_ranking

logger = logging.getLogger(__name__)

S = TypeVar("S")  # a session's state

# Slots a caller's capacity hint may allocate beyond what its request needs now. An honest hint
# (prompt + max_new_tokens + tree) is then met by one allocation for most generations, while a
# hint far beyond need (a bug, or a caller asking for 10**9 tokens) costs at most this much; the
# cache grows by chunks as the session really grows.
HINT_AHEAD = 1024


def initial_capacity(need: int, hint: int) -> int:
    """Slots to allocate for a session that needs ``need`` now and announced ``hint`` in total."""
    return max(need, min(hint, need + HINT_AHEAD))


def check_capacity(total: int, max_context: int) -> None:
    """Raise :class:`ResourceExhausted` when a session would hold more than ``max_context`` tokens."""
    if total > max_context:
        raise ResourceExhausted(
            f"session would hold {total} tokens; the engine's max_context is {max_context}"
        )


def desync_error(role: str, session_id: str, held: int, expected: int) -> CacheDesyncError:
    """The error both engines raise when the caller's idea of a session's length is wrong."""
    return CacheDesyncError(
        f"{role} session {session_id!r} holds {held} tokens, caller expected {expected}; "
        "resend the full context",
        expected=expected,
        actual=held,
    )


class EngineBase(Generic[S]):
    """Model, sessions and static workspace of one engine.

    Args:
        role: ``"draft"`` or ``"target"`` (names sessions and errors).
        model: a loaded HF causal LM, or ``None`` to load ``config.model`` in :meth:`load_model`.
        config: the engine's settings.
        device_map: accelerate device map of the model (the target only).
    """

    role = "engine"

    def __init__(
        self, model: torch.nn.Module | None, config: DraftConfig | TargetConfig, device_map: Any = None
    ):
        self.config = config
        self.runner = ModelRunner(
            model,
            config.model,
            config.device,
            device_map,
            config.dtype,
            fold_gqa=config.tuning.fold_gqa,
            attention_kernel=resolved_attention_kernel(config.tuning.attention_kernel, config.cuda_graphs),
            fuse_projections=config.fuse_projections,
            # torch.compile cannot lower packed weights: compiled engines keep theirs unpacked
            pack_weights=False if config.compile and config.pack_weights is None else config.pack_weights,
            quantize=_quantize(config),
            **_vocab_subset(config),
        )
        self._store: SessionStore[S] = SessionStore(
            config.max_sessions, config.session_ttl_s, on_evict=self._on_evict, name=f"{self.role}-sessions"
        )
        self._store.start_purger()
        self._workspace = Workspace(
            self.runner, config.tuning.graph_capacity, use_graphs=True, compile=config.compile
        )
        self._rounds: dict[Any, GraphedRound] = {}  # whole rounds captured as one graph, by shape
        self.kv_budget: KVBudget | None = None  # set by limit_memory (workers serving untrusted callers)

    def _on_evict(self, session_id: str, state: S) -> None:
        self._workspace.release(session_id)
        if self.kv_budget is not None:
            self.kv_budget.release(session_id)

    # ------------------------------------------------------------------ memory limits
    def limit_memory(self, budget_bytes: int | None, evict_idle_s: float = 0.0) -> None:
        """Refuse what would pass a KV memory budget instead of taking memory from running sessions.

        Args:
            budget_bytes: the most bytes of KV cache all sessions may hold (the static workspace
                of the CUDA-graph path is the engine's own and not counted); ``None``: no budget.
            evict_idle_s: a full session store evicts only sessions idle this long and refuses
                new sessions otherwise (see :class:`~specsplit.engines.sessions.SessionStore`).
        """
        self._store.evict_idle_s = evict_idle_s
        self.kv_budget = None if budget_bytes is None else KVBudget(budget_bytes, self.kv_bytes_per_token)

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes one slot of a session costs (keys and values of every layer)."""
        model: Any = self.runner.require()
        cfg = getattr(model.config, "text_config", None) or model.config
        heads = int(cfg.num_attention_heads)
        kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
        itemsize = torch.empty(0, dtype=self.runner.dtype).element_size()
        return 2 * self.runner.num_layers * kv_heads * head_dim * itemsize

    def _open_session(self, session_id: str, capacity: int, create: Callable[[], S]) -> tuple[S, bool]:
        """``get_or_create`` of the store, with ``capacity`` slots reserved in the KV budget first.

        Raises:
            ResourceExhausted: no room in the budget or the store (nothing changed).
        """
        budget = self.kv_budget
        known = session_id in self._store
        if budget is not None:  # rounded as the cache grows: by whole chunks
            budget.reserve(session_id, -(-capacity // GROW_CHUNK) * GROW_CHUNK)
        try:
            return self._store.get_or_create(session_id, create)
        except BaseException:
            if budget is not None and not known:
                budget.release(session_id)
            raise

    def _settle_kv(self, session_id: str, cache: StaticKVCache, static: bool) -> None:
        """Record what a session's cache really holds after a request (the workspace: nothing)."""
        if self.kv_budget is None or session_id not in self._store:
            return
        if static:
            self.kv_budget.release(session_id)
        else:
            self.kv_budget.reserve(session_id, cache.capacity, force=True)

    # ------------------------------------------------------------------ lifecycle
    def load_model(self) -> None:
        self.runner.load_model()

    @property
    def is_loaded(self) -> bool:
        return self.runner.is_loaded

    @property
    def model_vocab_size(self) -> int:
        return self.runner.vocab_size

    @property
    def device(self) -> torch.device:
        """Where this engine's tensors live (overridden where input and output devices differ)."""
        return self.runner.output_device

    @property
    def active_sessions(self) -> int:
        return len(self._store)

    @property
    def forward_count(self) -> int:
        return self.runner.forward_count

    def has_session(self, session_id: str) -> bool:
        return session_id in self._store

    def end_session(self, session_id: str) -> bool:
        """Free a session (and the workspace it holds); False when it was not there."""
        return self._store.pop(session_id)

    def purge_stale_sessions(self, ttl_seconds: float | None = None) -> int:
        return self._store.purge_stale(ttl_seconds)

    def shutdown(self) -> None:
        """Stop the session purger and drop every session."""
        self._store.stop_purger()
        self._store.clear()

    def info(self) -> WorkerInfo:
        loaded = self.is_loaded
        return WorkerInfo(
            worker_type=self.role,
            model_name=self.runner.model_name,
            vocab_size=self.runner.vocab_size if loaded else 0,
            dtype=str(self.runner.dtype).replace("torch.", "") if loaded else "",
            device=str(self.device) if loaded else "",
            active_sessions=self.active_sessions,
        )

    def synchronize(self) -> None:
        sync_device(self.device)

    @property
    def replays_graphs(self) -> bool:
        """Steps replay CUDA graphs (``cuda_graphs`` on a CUDA device; elsewhere the same static
        path runs eagerly)."""
        return self.config.cuda_graphs and self.device.type == "cuda"

    def __repr__(self) -> str:
        return f"{type(self).__name__}(model={self.runner.model_name!r}, sessions={self.active_sessions})"

    # ------------------------------------------------------------------ forwards
    def _acquire_workspace(self, session_id: str, capacity: int) -> StaticKVCache | None:
        """The static workspace for a new session when the CUDA-graph path is on and it is free."""
        if not self.config.cuda_graphs:
            return None
        return self._workspace.acquire(session_id, capacity)

    def _round_graph(self, key: Any, build: Callable[[], GraphedRound]) -> GraphedRound:
        """The whole-round graph of ``key`` (a tree shape and KV bucket), built on first use."""
        rnd = self._rounds.get(key)
        if rnd is None:
            rnd = self._rounds[key] = build()
        return rnd

    def _prompt_forward(
        self,
        static: bool,
        cache: StaticKVCache,
        ids: torch.Tensor,
        num_pending: int,
        parents: torch.Tensor | None,
        reserve: int = 0,
        grow_to: int = 0,
    ) -> torch.Tensor:
        """One forward of ``num_pending`` committed tokens (causal), optionally followed by a tree.

        On the static path with ``prefill_graphs`` the forward is padded to a bucket and replayed
        from that bucket's graph; otherwise (or when no bucket fits) it runs eagerly.

        Args:
            static: the session holds the static workspace.
            cache: the session's cache (at its committed length).
            ids: `[P + N]` int64 committed tokens then tree tokens (host or device).
            num_pending: ``P``.
            parents: `[N]` the tree's parents, or None for no tree.
            reserve: slots the static path must leave free after the forward (a round's tree).
            grow_to: the eager path first grows the cache to at least this many slots.

        Returns:
            `[N + 1, V]` logits of the last committed token and of every tree node (a graph's
            buffer on the static path: clone what must outlive the next forward). The cache then
            holds ``length + P + N`` slots; the caller sets the committed length.
        """
        length = cache.seq_len
        n = 0 if parents is None else int(parents.shape[0])
        if static and self.config.tuning.prefill_graphs and length + ids.shape[0] + reserve <= cache.capacity:
            padded = self._workspace.static.run_prefill(ids, length, parents)
            if padded is not None:
                cache.set_length(length + ids.shape[0])
                return padded
        cache.ensure_capacity(max(grow_to, length + ids.shape[0]))
        tree_parents = parents if parents is not None else torch.zeros(0, dtype=torch.long)
        mask, pos2d = build_verify_attention(tree_parents, length, num_pending, self.runner.dtype)
        return self.runner.forward(ids.reshape(1, -1), pos2d, mask, cache, logits_to_keep=n + 1)


def _vocab_subset(config: DraftConfig | TargetConfig) -> dict[str, Any]:
    """The runner's restricted output layer, for a draft that asks for one (never for a target)."""
    size = getattr(config, "vocab_subset", None)
    if size is None:
        return {}
    path = getattr(config, "vocab_ranking", None)
    return {"vocab_subset": size, "vocab_ranking": load_ranking(path) if path else None}


def _quantize(config: DraftConfig | TargetConfig) -> str:
    """The runner's weight quantization: a draft's setting (``"auto"`` stays off under ``compile``);
    never a target's, whose logits decide the output."""
    mode = str(getattr(config, "quantize", "none"))
    return "none" if mode == "auto" and config.compile else mode
