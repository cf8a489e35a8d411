"""TargetEngine: per-session static KV caches and ONE-forward tree verification.

A round: check the caller's ``expected_prefix_length`` against the session cache, run one forward
over ``pending + tree`` with an additive tree mask (positions ``prefix + depth``), verify greedily
or by recursive rejection sampling, read the outcome with one host copy, and keep the KV of the
accepted path (a copy of the accepted tree positions only, none at all for a chain).

With ``config.specpv.enabled`` the forward and the KV bookkeeping of each round go through a
:class:`~specsplit.engines.specpv.PartialVerifier` (SpecPV partial verification for long contexts, lossy,
opt-in). SpecPV sessions always take the eager path: CUDA graphs and SpecPV are exclusive for now.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass

import torch

from specsplit.config import SamplingParams, TargetConfig, resolved_attention_kernel
from specsplit.core.sampling import logits_to_probs, make_generator
from specsplit.core.tree import TokenTree
from specsplit.core.tree_attention import ancestor_matrix, build_verify_attention
from specsplit.core.verification import VerifyOutcome, verify_greedy, verify_stochastic
from specsplit.engines.partial_kv import PartialSession
from specsplit.engines.specpv import PartialVerifier, SpecPVStats
from specsplit.errors import CacheDesyncError, InvalidRequest, ResourceExhausted, SessionNotFound
from specsplit.runtime.graphs import GraphedRound, StaticForward, Workspace, kv_bucket
from specsplit.runtime.kv_cache import StaticKVCache
from specsplit.runtime.runner import (
    PROTOCOL_VERSION,
    ModelRunner,
    check_capacity,
    desync_error,
    h2d,
    make_store,
    sync_device,
)
from specsplit.transport import VerifyRequest, VerifyResult, WorkerInfo, WorkerStats

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


class TargetEngine:
    """The target (verifier) side of speculative decoding.

    Args:
        model: a loaded HF causal LM (or ``None`` and ``config.model`` + :meth:`load_model`).
        config: engine settings (placement, limits, sessions).
    """

    def __init__(self, model: torch.nn.Module | None = None, config: TargetConfig | None = None):
        self.config = config or TargetConfig()
        self.runner = ModelRunner(
            model,
            self.config.model,
            self.config.device,
            self.config.device_map,
            self.config.dtype,
            fold_gqa=self.config.fold_gqa,
            attention_kernel=resolved_attention_kernel(self.config.attention_kernel, self.config.cuda_graphs),
            fuse_projections=self.config.fuse_projections,
        )
        self._store = make_store(
            self.config.max_sessions, self.config.session_ttl_s, "target-sessions", self._on_evict
        )
        self._workspace = Workspace(
            self.runner, self.config.graph_capacity, use_graphs=True, compile=self.config.compile
        )
        self._rounds: dict[tuple[int, int, int, int], GraphedRound] = {}  # see _verify_one_graph
        pv_cfg = self.config.specpv
        use_pv = pv_cfg.enabled and not self.config.stateless
        self._specpv = PartialVerifier(pv_cfg, self.runner) if use_pv else None
        if pv_cfg.enabled and self.config.stateless:
            logger.warning("SpecPV needs session state; it is off on this stateless target")
        if self._specpv is not None and self.config.cuda_graphs:
            logger.warning("SpecPV uses the eager verify path: cuda_graphs is ignored while SpecPV is on")

    def _on_evict(self, session_id: str, state: KVCacheState) -> None:
        self._workspace.release(session_id)

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
        """Where trees should be sent (the device of the input embeddings)."""
        return self.runner.input_device

    @property
    def active_sessions(self) -> int:
        return len(self._store)

    @property
    def forward_count(self) -> int:
        return self.runner.forward_count

    @property
    def specpv_stats(self) -> SpecPVStats | None:
        """SpecPV telemetry over all sessions (``None`` when SpecPV is off)."""
        return self._specpv.stats if self._specpv is not None else None

    def get_or_create_session(self, session_id: str, capacity: int = 0) -> tuple[KVCacheState, bool]:
        def factory() -> KVCacheState:
            if self.config.cuda_graphs and self._specpv is None:
                ws = self._workspace.acquire(session_id, capacity)
                if ws is not None:
                    return KVCacheState(ws, static=True)
            return KVCacheState(self.runner.new_cache(capacity))

        return self._store.get_or_create(session_id, factory)

    def has_session(self, session_id: str) -> bool:
        return session_id in self._store

    def has_usable_session(self, session_id: str) -> bool:
        try:
            return self._store.get(session_id).seq_len > 0
        except SessionNotFound:
            return False

    def end_session(self, session_id: str) -> bool:
        return self._store.pop(session_id)

    def purge_stale_sessions(self, ttl_seconds: float | None = None) -> int:
        return self._store.purge_stale(ttl_seconds)

    def rollback_cache(self, session_id: str, length: int) -> None:
        """Truncate a session's cache to ``length`` tokens (O(1))."""
        state = self._store.get(session_id)
        with self._store.locked(session_id):
            state.rollback(length)
            state.next_root_logit = None

    def shutdown(self) -> None:
        self._store.stop_purger()
        self._store.clear()

    def info(self) -> WorkerInfo:
        return WorkerInfo(
            worker_type="target",
            model_name=self.runner.model_name,
            vocab_size=self.runner.vocab_size if self.is_loaded else 0,
            dtype=str(self.runner.dtype).replace("torch.", "") if self.is_loaded else "",
            device=str(self.device) if self.is_loaded else "",
            protocol_version=PROTOCOL_VERSION,
            active_sessions=self.active_sessions,
        )

    # ------------------------------------------------------------------ original-design name
    def verify_draft_tree(
        self,
        session_id: str,
        tree: TokenTree,
        pending_token_ids: list[int],
        expected_prefix_length: int,
        sampling: SamplingParams | None = None,
        seed: int | None = None,
    ) -> VerifyResult:
        """Keyword form of :meth:`verify`."""
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
        if tree.device.type == "cpu":  # arrived from outside (gRPC/user): check it fully
            tree.validate(self.runner.vocab_size, self.config.max_tree_nodes, self.config.max_tree_depth)
        elif tree.num_nodes > self.config.max_tree_nodes:
            raise InvalidRequest(f"tree has {tree.num_nodes} nodes; limit is {self.config.max_tree_nodes}")
        max_branch, max_depth = tree.bounds()
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
        capacity = max(req.capacity_hint, req.expected_prefix_length + p + n + 8)
        state, existed = self.get_or_create_session(session_id, capacity)
        stats = WorkerStats(device=str(self.device))
        try:
            with self._store.locked(session_id):
                if req.expected_prefix_length == 0:
                    state.reset()
                elif state.seq_len != req.expected_prefix_length:
                    raise desync_error("target", session_id, state.seq_len, req.expected_prefix_length)
                result = self._verify_locked(state, tree, pending, req, max_branch, max_depth, stats)
        finally:
            if self.config.stateless:
                self._store.pop(session_id)
        stats.wall_time_s = time.perf_counter() - t0
        result.stats = stats
        result.cache_hit = existed and req.expected_prefix_length > 0
        return result

    def _verify_locked(
        self,
        state: KVCacheState,
        tree: TokenTree,
        pending: list[int],
        req: VerifyRequest,
        max_branch: int,
        max_depth: int,
        stats: WorkerStats,
    ) -> VerifyResult:
        cache = state.cache
        length = cache.seq_len
        n, p = tree.num_nodes, len(pending)
        cache.ensure_capacity(length + p + n)
        if (
            state.static
            and p == 1
            and self.config.graph_rounds
            and not req.sampling.do_sample
            and self._specpv is None
            and isinstance(cache, StaticKVCache)
            and cache.single_buffer
        ):
            return self._verify_one_graph(cache, tree, pending, max_branch, max_depth, stats)
        dev = self.device
        tree = tree.to(dev)
        pend = h2d(torch.tensor(pending, dtype=torch.long), dev)
        ids = torch.cat([pend, tree.token_ids])  # [P + N]
        t = time.perf_counter()
        pv_step = None
        try:
            if self._specpv is not None and not state.static:  # SpecPV: full or partial, policy's choice
                pv_step = self._specpv.forward(state, pending, tree)
                logits = pv_step.logits
            elif state.static and p == 1:  # steady state: fixed shape, replayed from a CUDA graph
                pos, block = _one_pending_layout(tree.parents, tree.depths, length)
                logits = self._workspace.static.run(ids, pos, length, block)  # [N + 1, V]
            elif (
                state.static
                and self.config.prefill_graphs
                and (padded := self._workspace.static.run_prefill(ids, length, tree.parents)) is not None
            ):  # a prompt: padded to a bucket, replayed from that bucket's graph
                logits = padded
            else:
                mask, pos2d = build_verify_attention(tree.parents, length, p, self.runner.dtype)
                logits = self.runner.forward(ids[None], pos2d, mask, cache, logits_to_keep=n + 1)
        except Exception:
            cache.rollback(length)
            raise
        tree = tree.to(logits.device)
        if req.sampling.do_sample:
            gen = make_generator(logits.device, req.seed)
            probs = logits_to_probs(logits, req.sampling)
            outcome = verify_stochastic(probs, tree, max_depth, max_branch, gen)
        else:
            outcome = verify_greedy(logits, tree, max_depth, max_branch)
        margin = self._specpv.config.rectify_margin if self._specpv is not None else 0.0
        if pv_step is not None and pv_step.partial and margin > 0 and not req.sampling.do_sample:
            # SpecPV near-tie guard: the flag rides on the round's one host read.
            flag = outcome.min_margin_below(logits, margin)
            nodes, tokens, next_token = outcome.to_host(tree.token_ids, extra=flag)
            if outcome.extra_host[0]:
                pv_step = self._specpv.rectify(state, pv_step, pending, tree)  # type: ignore[union-attr]
                outcome = verify_greedy(pv_step.logits, tree, max_depth, max_branch)
                nodes, tokens, next_token = outcome.to_host(tree.token_ids)
        else:
            nodes, tokens, next_token = outcome.to_host(tree.token_ids)  # the round's one host sync
        stats.model_time_s += time.perf_counter() - t
        stats.tokens_processed += (len(pv_step.fed) if pv_step is not None else p) + n
        stats.forwards += 1
        state.next_root_logit = None
        if pv_step is not None:
            stats.verify_mode = "partial" if pv_step.partial else "full"
            prefix = self._specpv.commit(state, pv_step, nodes, tokens)  # type: ignore[union-attr]
            return VerifyResult(tokens, next_token, nodes, prefix, max_depth, n)
        m = len(nodes)
        base = length + p
        if nodes != list(range(m)):  # a chain's accepted prefix is already in place
            keep = torch.tensor(nodes, dtype=torch.long) + base
            cache.compact(keep, base)
        else:
            cache.rollback(base + m)
        state.next_root_logit = None
        return VerifyResult(
            accepted_token_ids=tokens,
            next_token_id=next_token,
            accepted_node_indices=nodes,
            prefix_length=base + m,
            num_drafted=max_depth,
            num_nodes=n,
        )

    # ------------------------------------------------------------------ one-graph greedy round
    def _verify_one_graph(
        self,
        cache: StaticKVCache,
        tree: TokenTree,
        pending: list[int],
        max_branch: int,
        max_depth: int,
        stats: WorkerStats,
    ) -> VerifyResult:
        """A greedy round (mask, forward, acceptance, KV commit) replayed as one graph
        (``TargetConfig.graph_rounds``); the same tensor functions as the eager path."""
        static = self._workspace.static
        length, n = cache.seq_len, tree.num_nodes
        end = length + 1 + n
        if end > static.capacity:
            raise ResourceExhausted(
                f"a verify round needs {end} slots; the workspace holds {static.capacity}"
            )
        key = (n, max_depth, max_branch, kv_bucket(end, static.capacity))
        rnd = self._rounds.get(key)
        t = time.perf_counter()
        if rnd is None:
            rnd = self._rounds[key] = self._verify_round(static, cache, n, max_depth, max_branch, key[3])
        forwards = self.runner.forward_count
        path, count, nxt = rnd(pending[0], tree.token_ids, tree.parents, tree.depths, length)
        if rnd.graph is not None:  # a replay (after a capture that ran the body 3 times): one forward
            self.runner.forward_count = forwards + 1
        nodes, tokens, next_token = VerifyOutcome(path, count, nxt).to_host(rnd.inputs[1])  # the one sync
        m = len(nodes)
        cache.set_length(length + 1 + m)  # the graph moved the accepted slots behind the pending one
        stats.model_time_s += time.perf_counter() - t
        stats.tokens_processed += 1 + n
        stats.forwards += 1
        return VerifyResult(
            accepted_token_ids=tokens,
            next_token_id=next_token,
            accepted_node_indices=nodes,
            prefix_length=length + 1 + m,
            num_drafted=max_depth,
            num_nodes=n,
        )

    def _verify_round(
        self,
        static: StaticForward,
        cache: StaticKVCache,
        n: int,
        max_depth: int,
        max_branch: int,
        bucket: int,
    ) -> GraphedRound:
        buf = static.new_buffers(1 + n, bucket)
        dev = self.device
        steps = torch.arange(max_depth, device=dev)

        def body(
            pend: torch.Tensor, tok: torch.Tensor, par: torch.Tensor, dep: torch.Tensor, ctx: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            pos, block = _one_pending_layout(par, dep, ctx)
            logits = static.forward_at(buf, torch.cat([pend, tok]), pos, ctx, block)
            outcome = verify_greedy(logits, TokenTree(tok, par, dep, torch.zeros(n, device=dev)), max_depth,
                                    max_branch)  # fmt: skip
            if max_depth:  # the accepted nodes' slots follow the pending token's (padding: beyond)
                cache.move_slots(ctx + 1 + outcome.path.clamp_min(0), ctx + 1 + steps)
            return outcome.path, outcome.num_accepted, outcome.next_token

        empty = torch.zeros(n, dtype=torch.long, device=dev)
        ctx = torch.zeros((), dtype=torch.long)
        return GraphedRound(static, body, [torch.zeros(1, dtype=torch.long), empty, empty, empty, ctx])

    def synchronize(self) -> None:
        sync_device(self.device)

    def __repr__(self) -> str:
        return f"TargetEngine(model={self.runner.model_name!r}, sessions={self.active_sessions})"


def _one_pending_layout(
    parents: torch.Tensor, depths: torch.Tensor, ctx: int | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions and the `[1 + N, 1 + N]` visibility block of one pending token followed by a tree
    (the pending token at ``ctx``, a node at ``ctx`` + its depth, each row seeing the pending token,
    itself and its ancestors); device ops only, ``ctx`` a host int or a device scalar."""
    n = parents.shape[0]
    block = torch.zeros(1 + n, 1 + n, dtype=torch.bool, device=parents.device)
    block[:, 0] = True
    if n:
        block[1:, 1:] = ancestor_matrix(parents)
    pos = torch.cat([depths.new_zeros(1), depths]) + ctx
    return pos, block
