"""TargetEngine: per-session KV caches and ONE-forward tree verification.

A round: check the caller's ``expected_prefix_length`` against the session cache, then hand the
round to the engine's verifier (:mod:`specsplit.engines.verifiers`): one forward over
``pending + tree`` with an additive tree mask (positions ``prefix + depth``), greedy or stochastic
acceptance read with one host copy, and the KV of the accepted path kept (a copy of the accepted
tree positions only, none at all for a chain). With ``config.specpv.enabled`` the verifier is
SpecPV's partial verification for long contexts (lossy, opt-in; eager path only).
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass

import torch

from specsplit.config import TargetConfig
from specsplit.core.sampling import SamplingParams
from specsplit.core.tree import TokenTree
from specsplit.engines.base import EngineBase, check_capacity, desync_error, initial_capacity
from specsplit.engines.partial_kv import PartialSession
from specsplit.engines.processing import TreeProcessors
from specsplit.engines.specpv import SpecPVStats
from specsplit.engines.verifiers import FullVerifier, SpecPVVerifier, Verifier
from specsplit.errors import CacheDesyncError, ConfigError, InvalidRequest, SessionNotFound
from specsplit.messages import VerifyRequest, VerifyResult, WorkerStats
from specsplit.runtime.heads import Guesser, load_target_heads
from specsplit.runtime.kv_cache import StaticKVCache

logger = logging.getLogger(__name__)


@dataclass
class KVCacheState:
    """A target session: the cache and, when known, the logits after its last token.

    Under SpecPV, tokens accepted by partial verification (``pv.backlog``) count as held although
    their exact KV is computed only at the next full verification.
    """

    cache: StaticKVCache
    next_root_logit: torch.Tensor | None = None  # [vocab]
    static: bool = False  # the cache is the engine's static workspace (CUDA-graph path)
    pv: PartialSession | None = None  # SpecPV state (None when SpecPV is off or not used yet)
    processors: TreeProcessors | None = None  # the generation's HF logits processors, if any
    # asked for draft-head guesses: a head with a cache of its own then ingests every round's commit,
    # including rounds that grow no guesses (Guesser.keeps_state)
    follows_head: bool = False

    @property
    def seq_len(self) -> int:
        return self.cache.seq_len + (len(self.pv.backlog) if self.pv is not None else 0)

    def reset(self) -> None:
        self.cache.reset()
        if self.pv is not None:
            self.pv.reset()

    def rollback(self, length: int) -> None:
        if self.pv is not None:
            self.pv.rollback(self.cache, length)
        else:
            self.cache.rollback(length)


class TargetEngine(EngineBase[KVCacheState]):
    """The target (verifier) side of speculative decoding.

    Args:
        model: a loaded HF causal LM (or ``None`` and ``config.model`` + :meth:`load_model`).
        config: engine settings (placement, limits, sessions).
    """

    role = "target"

    def __init__(self, model: torch.nn.Module | None = None, config: TargetConfig | None = None):
        self.config: TargetConfig = config or TargetConfig()
        super().__init__(model, self.config, self.config.device_map)
        pv_cfg = self.config.specpv
        self._verifier: Verifier = FullVerifier(self)
        self._specpv: SpecPVVerifier | None = None
        if pv_cfg.enabled and self.config.stateless:
            logger.warning("SpecPV needs session state; it is off on this stateless target")
        elif pv_cfg.enabled:
            self._verifier = self._specpv = SpecPVVerifier(self, pv_cfg)
            if self.config.cuda_graphs:
                logger.warning("SpecPV uses the eager verify path: cuda_graphs is ignored while SpecPV is on")
        self.heads: Guesser | None = None
        if self.runner.is_loaded:
            self._load_heads()

    def load_model(self) -> None:
        super().load_model()
        self._load_heads()

    def _load_heads(self) -> None:
        """The draft heads of ``config.draft_heads`` (before any forward is captured or compiled)."""
        path = self.config.draft_heads
        if path is None or self.heads is not None:
            return
        if self.runner.head is not None or self.config.device_map is not None:
            raise ConfigError("draft heads need a target on one device with its own output layer")
        cfg = self.config
        rows = cfg.max_tree_nodes + 1  # a round's rows: the pending token's and every node's
        self.heads = load_target_heads(
            self.runner.require(), path, cfg.draft_heads_nodes, rows, cfg.draft_heads_tree,
            cfg.tuning.graph_capacity, cfg.max_tree_depth, cfg.compile,
        )  # fmt: skip
        if self.heads.needs_static and not cfg.cuda_graphs:
            logger.warning("an EAGLE draft head runs on the static workspace path: it guesses only with "
                           "target.cuda_graphs on (on a CPU that path runs eagerly)")  # fmt: skip

    @property
    def device(self) -> torch.device:
        """Where trees should be sent (the device of the input embeddings)."""
        return self.runner.input_device

    @property
    def specpv_stats(self) -> SpecPVStats | None:
        """SpecPV telemetry over all sessions (``None`` when SpecPV is off)."""
        return self._specpv.policy.stats if self._specpv is not None else None

    def get_or_create_session(self, session_id: str, capacity: int = 0) -> tuple[KVCacheState, bool]:
        def factory() -> KVCacheState:
            ws = self._acquire_workspace(session_id, capacity) if self._specpv is None else None
            if ws is not None:
                return KVCacheState(ws, static=True)
            return KVCacheState(self.runner.new_cache(capacity))

        return self._open_session(session_id, capacity, factory)

    def has_usable_session(self, session_id: str) -> bool:
        try:
            return self._store.get(session_id).seq_len > 0
        except SessionNotFound:
            return False

    def rollback_cache(self, session_id: str, length: int) -> None:
        """Truncate a session's cache to ``length`` tokens (O(1))."""
        state = self._store.get(session_id)
        with self._store.locked(session_id):
            state.rollback(length)
            state.next_root_logit = None

    def verify_draft_tree(
        self,
        session_id: str,
        tree: TokenTree,
        pending_token_ids: list[int],
        expected_prefix_length: int,
        sampling: SamplingParams | None = None,
        seed: int | None = None,
    ) -> VerifyResult:
        """Keyword form of :meth:`verify` (the name of the original design documents)."""
        return self.verify(
            VerifyRequest(
                session_id,
                tree,
                list(pending_token_ids),
                expected_prefix_length,
                sampling or SamplingParams(),
                seed,
            )
        )

    def _set_processors(self, state: KVCacheState, req: VerifyRequest) -> None:
        """The session's processors for ``req.processing`` (built once per generation)."""
        spec = req.processing
        if spec is None:
            state.processors = None
            return
        if self._specpv is not None:
            raise ConfigError("logits processors are not applied under SpecPV verification; turn one off")
        if (
            state.processors is None
            or state.processors.key != spec.to_json()
            or req.expected_prefix_length == 0
        ):
            self.runner.check_token_ids(spec.prefix_token_ids, "processing prefix")
            state.processors = TreeProcessors(self.runner.model, spec, self.device)

    # ------------------------------------------------------------------ main entry
    @torch.inference_mode()
    def verify(self, req: VerifyRequest) -> VerifyResult:
        """Verify ``req.tree`` below ``req.pending_token_ids`` in one forward.

        Raises:
            InvalidRequest: bad ids, bad tree, empty pending.
            SessionNotFound: ``expected_prefix_length > 0`` for an unknown session.
            CacheDesyncError: ``expected_prefix_length`` disagrees with the cache (nothing changed).
            ResourceExhausted: the session would outgrow ``max_context``.
        """
        t0 = time.perf_counter()
        self.runner.require()
        tree = req.tree
        pending = req.pending_token_ids
        self.runner.check_token_ids(pending, "pending_token_ids")
        if not pending:
            raise InvalidRequest("pending_token_ids must hold at least one token (the last committed one)")
        if req.expected_prefix_length < 0:
            raise InvalidRequest(f"expected_prefix_length must be >= 0, got {req.expected_prefix_length}")
        if tree.device.type == "cpu" and not tree.trusted:  # from outside (gRPC/user): check it fully
            tree.validate(self.runner.vocab_size, self.config.max_tree_nodes, self.config.max_tree_depth)
        elif tree.num_nodes > self.config.max_tree_nodes:
            raise InvalidRequest(f"tree has {tree.num_nodes} nodes; limit is {self.config.max_tree_nodes}")
        tree.bounds()  # host-side bounds (read from the tree only if its producer did not set them)
        n, p = tree.num_nodes, len(pending)

        session_id = req.session_id
        if self.config.stateless:
            if req.expected_prefix_length != 0:
                raise CacheDesyncError(
                    "stateless target keeps no cache: send the full context with expected_prefix_length=0",
                    expected=req.expected_prefix_length,
                    actual=0,
                )
            session_id = f"__stateless__{uuid.uuid4().hex}"
        if req.expected_prefix_length > 0 and session_id not in self._store:
            raise SessionNotFound(f"target session {session_id!r} not found; resend the full context")
        check_capacity(req.expected_prefix_length + p + n, self.config.max_context)
        capacity = initial_capacity(req.expected_prefix_length + p + n + 8, req.capacity_hint)
        state, existed = self.get_or_create_session(session_id, capacity)
        stats = WorkerStats(device=str(self.device))
        try:
            with self._store.locked(session_id):
                if req.expected_prefix_length == 0:
                    state.reset()
                elif state.seq_len != req.expected_prefix_length:
                    raise desync_error("target", session_id, state.seq_len, req.expected_prefix_length)
                state.next_root_logit = None
                self._set_processors(state, req)
                result = self._verifier.verify(
                    state,
                    tree,
                    pending,
                    req.sampling,
                    req.seed,
                    stats,
                    (req.return_scores, req.return_logits),
                    req.return_choices,
                    req.return_guesses and self.heads is not None,
                )
            self._settle_kv(session_id, state.cache, state.static)
        finally:
            if self.config.stateless:
                self._store.pop(session_id)
        stats.wall_time_s = time.perf_counter() - t0
        result.stats = stats
        result.cache_hit = existed and req.expected_prefix_length > 0
        return result
