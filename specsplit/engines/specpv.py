"""SpecPV switching policy: the strategy the TargetEngine calls around its verify forward.

Per session (state in :class:`~specsplit.engines.partial_kv.PartialSession`):

1. Context (cached + backlog + pending tokens) below ``partial_threshold``: full verification,
   exactly the engine's normal forward.
2. The first verification at or above it is full and *seeds* the view: the forward records the
   post-RoPE queries of the tree tokens; after the accepted path is kept, the view is built from
   the full cache (sink, retrieved blocks, window) with an empty speculative buffer.
3. Then partial verification: ONE forward over ``pending + tree`` against the view; the accepted
   tokens' KV stays in the speculative buffer and their ids join the backlog. The full cache
   does not move.
4. A full verification every ``full_refresh_interval`` partial steps, or when ``pending + tree``
   would overflow the buffer: it feeds ``backlog + pending + tree`` in ONE forward (recomputing the
   backlog's KV exactly), then rebuilds the view from the new queries.

Acceptance (greedy and stochastic) is the engine's, applied to whichever logits the step produced.
Any invariant failure on the partial path (view out of step with the cache, missing queries,
buffer overflow inside the forward, ...) falls back to a full verification of the same round,
logged once per engine, never raised.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from specsplit.config import SpecPVConfig
from specsplit.core.tree import TokenTree
from specsplit.core.tree_attention import build_verify_attention
from specsplit.engines.partial_kv import PartialSession, QueryRecorder
from specsplit.runtime.attention import RECORDER_KWARG
from specsplit.runtime.attention import install as install_attention
from specsplit.runtime.kv_cache import StaticKVCache
from specsplit.runtime.runner import ModelRunner, h2d

logger = logging.getLogger(__name__)

# Why a verification was full (or "partial").
REASONS = ("unhooked", "below_threshold", "seed", "interval", "overflow", "fallback", "rectify", "partial")
_NO_RECORDING = ("unhooked", "below_threshold")


@dataclass
class SpecPVStats:
    """Engine-wide SpecPV telemetry (all sessions).

    Verify times run from the start of the forward to the round's host read of the outcome
    (so they include the device work on GPU); ``refresh_s`` is the host time of view rebuilds.
    """

    full_steps: int = 0
    partial_steps: int = 0
    refreshes: int = 0  # views built (seed + interval + overflow + after a fallback)
    fallbacks: int = 0  # partial steps that failed an invariant and ran in full
    recomputed_tokens: int = 0  # backlog tokens re-fed by full verifications
    retrieved_blocks: int = 0  # blocks per layer and KV head in the last view built
    retrieved_blocks_total: int = 0  # summed over views built
    full_verify_s: float = 0.0
    partial_verify_s: float = 0.0
    refresh_s: float = 0.0
    reselections: int = 0  # retrieval re-selections between full verifications
    reselect_s: float = 0.0  # host time of those re-selections
    rectifications: int = 0  # partial steps discarded for a near-tie and verified in full
    rectify_discarded_s: float = 0.0  # time of those discarded partial steps
    full_reasons: dict[str, int] = field(default_factory=dict)

    @property
    def mean_full_verify_s(self) -> float:
        return self.full_verify_s / self.full_steps if self.full_steps else 0.0

    @property
    def mean_partial_verify_s(self) -> float:
        return self.partial_verify_s / self.partial_steps if self.partial_steps else 0.0

    def summary(self) -> dict[str, Any]:
        out = asdict(self)
        out["mean_full_verify_s"] = self.mean_full_verify_s
        out["mean_partial_verify_s"] = self.mean_partial_verify_s
        return out


@dataclass
class PVStep:
    """One verification forward as the policy ran it; handed back to :meth:`PartialVerifier.commit`."""

    partial: bool
    reason: str  # one of REASONS
    fed: list[int]  # committed tokens fed before the tree (backlog + pending on a full step)
    base: int  # slot of tree node 0 in the cache the forward wrote (full cache or view)
    logits: torch.Tensor  # [N + 1, vocab]
    recorder: QueryRecorder | None
    t0: float
    num_pending: int


class PartialVerifier:
    """SpecPV strategy of one TargetEngine.

    Args:
        config: SpecPV settings (``enabled`` is assumed).
        runner: the engine's model runner.
    """

    def __init__(self, config: SpecPVConfig, runner: ModelRunner):
        self.config = config
        self.runner = runner
        self.stats = SpecPVStats()
        self._installed: bool | None = None
        self._lock = threading.Lock()
        self._logged: set[str] = set()

    # ------------------------------------------------------------------ helpers
    def _log_once(self, key: str, msg: str, *args: object) -> None:
        if key in self._logged:
            logger.debug(msg, *args)
            return
        self._logged.add(key)
        logger.warning(msg, *args)

    def _ready_model(self) -> bool:
        if self._installed is None:
            self._installed = install_attention(self.runner.require())
            if not self._installed:
                self._log_once("install", "SpecPV disabled: the target model's attention cannot be hooked")
        return self._installed

    @staticmethod
    def session(state: Any) -> PartialSession:
        """The session's SpecPV state (created on first use; ``state`` is a KVCacheState)."""
        if state.pv is None:
            raise RuntimeError("session has no SpecPV state")
        return state.pv  # type: ignore[no-any-return]

    def _choose(self, pvs: PartialSession, context: int, fed_now: int) -> str:
        if not self._ready_model():
            return "unhooked"
        if context < self.config.partial_threshold:
            return "below_threshold"
        if not pvs.ready:
            return "seed"
        if pvs.steps_since_refresh >= self.config.full_refresh_interval:
            return "interval"
        if len(pvs.backlog) + fed_now > self.config.n_spec_tokens_buf:
            if fed_now > self.config.n_spec_tokens_buf:
                self._log_once(
                    "tree-too-large",
                    "SpecPV: %d pending + tree tokens never fit the %d-slot speculative buffer; "
                    "raise n_spec_tokens_buf (every round is verified in full)",
                    fed_now,
                    self.config.n_spec_tokens_buf,
                )
            return "overflow"
        return "partial"

    # ------------------------------------------------------------------ forward
    def forward(self, state: Any, pending: list[int], tree: TokenTree) -> PVStep:
        """Run the round's ONE forward, full or partial, as the policy decides.

        Args:
            state: the session's ``KVCacheState`` (its ``pv`` field is created here).
            pending: committed tokens without target KV (normally last round's next token).
            tree: the draft tree, on the engine's device.

        Returns:
            The step, with `[N + 1, vocab]` logits for row 0 (context) and each node.
        """
        if state.pv is None:
            state.pv = PartialSession(self.config)
        pvs: PartialSession = state.pv
        n, p = tree.num_nodes, len(pending)
        logical = state.cache.seq_len + len(pvs.backlog)
        reason = self._choose(pvs, logical + p, p + n)
        if reason == "partial":
            try:
                return self._partial(state.cache, pvs, pending, tree, logical)
            except Exception as e:  # noqa: BLE001 - any failure on the lossy path -> exact path
                self._fail(pvs, e)
                reason = "fallback"
        return self._full(state.cache, pvs, pending, tree, reason)

    def _partial(
        self, cache: StaticKVCache, pvs: PartialSession, pending: list[int], tree: TokenTree, logical: int
    ) -> PVStep:
        layout, view = pvs.layout, pvs.view
        if layout is None or view is None:
            raise RuntimeError("no partial view")
        if cache.seq_len != layout.full_len:
            raise RuntimeError(
                f"full cache holds {cache.seq_len} tokens, the view was built at {layout.full_len}"
            )
        if view.seq_len != layout.view_len + len(pvs.backlog):
            raise RuntimeError(
                f"speculative buffer holds {view.seq_len - layout.view_len} tokens, backlog {len(pvs.backlog)}"
            )
        t0 = time.perf_counter()
        plen, p, n = view.seq_len, len(pending), tree.num_nodes
        ids = self._ids(pending, tree)  # [P + N]
        mask, pos = build_verify_attention(tree.parents, plen, p, self.runner.dtype)
        pos = pos + (logical - plen)  # true absolute positions: the view is shorter than the context
        every = self.config.retrieval_refresh_interval
        recorder = None
        if every and pvs.selected and (pvs.steps_since_refresh + 1) % every == 0:
            recorder = QueryRecorder(rows=p + n)  # pending + tree; commit keeps the accepted rows
        extra = {RECORDER_KWARG: recorder} if recorder is not None else {}
        try:
            logits = self.runner.forward(ids[None], pos, mask, view, logits_to_keep=n + 1, **extra)
        except Exception:
            view.rollback(plen)
            raise
        return PVStep(True, "partial", list(pending), plen + p, logits, recorder, t0, p)

    def _full(
        self, cache: StaticKVCache, pvs: PartialSession, pending: list[int], tree: TokenTree, reason: str
    ) -> PVStep:
        t0 = time.perf_counter()
        fed = pvs.backlog + list(pending)
        length, f, n = cache.seq_len, len(fed), tree.num_nodes
        cache.ensure_capacity(length + f + n)
        ids = self._ids(fed, tree)  # [F + N]
        mask, pos = build_verify_attention(tree.parents, length, f, self.runner.dtype)
        recorder = QueryRecorder(rows=max(n, 1)) if reason not in _NO_RECORDING else None
        extra = {RECORDER_KWARG: recorder} if recorder is not None else {}
        try:
            try:
                logits = self.runner.forward(ids[None], pos, mask, cache, logits_to_keep=n + 1, **extra)
            except TypeError as e:
                if recorder is None:
                    raise
                # The model's forward does not pass the recorder on: SpecPV cannot work with it.
                cache.rollback(length)
                self._installed, recorder = False, None
                self._log_once(
                    "recorder", "SpecPV disabled: the model does not pass attention kwargs (%s)", e
                )
                logits = self.runner.forward(ids[None], pos, mask, cache, logits_to_keep=n + 1)
        except Exception:
            cache.rollback(length)
            raise
        return PVStep(False, reason, fed, length + f, logits, recorder, t0, len(pending))

    def rectify(self, state: Any, step: PVStep, pending: list[int], tree: TokenTree) -> PVStep:
        """Discard a partial ``step`` (its tree's KV leaves the speculative buffer) and verify the
        same round in full (see ``SpecPVConfig.rectify_margin``)."""
        pvs = self.session(state)
        if not step.partial or pvs.view is None:
            raise RuntimeError("only a partial step can be rectified")
        pvs.view.rollback(step.base - step.num_pending)
        with self._lock:
            self.stats.rectifications += 1
            self.stats.rectify_discarded_s += time.perf_counter() - step.t0
        return self._full(state.cache, pvs, pending, tree, "rectify")

    def _ids(self, fed: list[int], tree: TokenTree) -> torch.Tensor:
        dev = tree.token_ids.device
        head = h2d(torch.tensor(fed, dtype=torch.long), dev)
        return torch.cat([head, tree.token_ids])

    def _fail(self, pvs: PartialSession, err: Exception) -> None:
        pvs.invalidate()
        with self._lock:
            self.stats.fallbacks += 1
        self._log_once(
            "fallback",
            "SpecPV: partial verification failed (%s: %s); verifying in full",
            type(err).__name__,
            err,
        )

    # ------------------------------------------------------------------ commit
    def commit(self, state: Any, step: PVStep, nodes: list[int], tokens: list[int]) -> int:
        """Keep the accepted path after the round's host read; returns the new logical length.

        Args:
            state: the session's ``KVCacheState``.
            step: what :meth:`forward` returned.
            nodes: accepted tree node indices (root to leaf).
            tokens: their token ids.
        """
        pvs = self.session(state)
        dt = time.perf_counter() - step.t0
        if step.partial:
            assert pvs.view is not None
            pvs.view.keep_path(nodes, step.base)
            pvs.backlog.extend(step.fed + tokens)
            pvs.steps_since_refresh += 1
            with self._lock:
                self.stats.partial_steps += 1
                self.stats.partial_verify_s += dt
            if step.recorder is not None:
                self._reselect(state.cache, pvs, step, nodes)
            return state.cache.seq_len + len(pvs.backlog)
        cache: StaticKVCache = state.cache
        cache.keep_path(nodes, step.base)
        pvs.backlog = []
        with self._lock:
            s = self.stats
            s.full_steps += 1
            s.full_verify_s += dt
            s.recomputed_tokens += len(step.fed) - step.num_pending
            s.full_reasons[step.reason] = s.full_reasons.get(step.reason, 0) + 1
        if step.recorder is None:
            pvs.invalidate()
            return cache.seq_len
        t = time.perf_counter()
        try:
            layout = pvs.rebuild(cache, step.recorder.queries)
        except Exception as e:  # noqa: BLE001 - the round is already verified exactly
            self._fail(pvs, e)
        else:
            with self._lock:
                self.stats.refreshes += 1
                self.stats.retrieved_blocks = layout.retrieved_blocks
                self.stats.retrieved_blocks_total += layout.retrieved_blocks
        with self._lock:
            self.stats.refresh_s += time.perf_counter() - t
        return cache.seq_len

    def _reselect(self, cache: StaticKVCache, pvs: PartialSession, step: PVStep, nodes: list[int]) -> None:
        """Re-choose the retrieved blocks with the queries of the committed rows (pending + path)."""
        assert step.recorder is not None
        t = time.perf_counter()
        p, m = step.num_pending, len(nodes)
        if nodes == list(range(m)):
            queries = {i: q[:, :, : p + m] for i, q in step.recorder.queries.items()}
        else:
            rows = torch.tensor(list(range(p)) + [p + j for j in nodes], dtype=torch.long)
            on_dev: dict[torch.device, torch.Tensor] = {}
            queries = {}
            for i, q in step.recorder.queries.items():
                if q.device not in on_dev:
                    on_dev[q.device] = h2d(rows, q.device)
                queries[i] = q.index_select(2, on_dev[q.device])
        window = self.config.retrieval_query_window
        if window:  # score with the last `window` committed rows, not only this step's
            hist = pvs.query_history
            queries = {
                i: (torch.cat([hist[i], q], dim=2) if i in hist else q)[:, :, -window:]
                for i, q in queries.items()
            }
            pvs.query_history = queries
        try:
            done = pvs.reselect(cache, queries)
        except Exception as e:  # noqa: BLE001 - the round is verified; the next one runs in full
            self._fail(pvs, e)
            return
        with self._lock:
            self.stats.reselections += int(done)
            self.stats.reselect_s += time.perf_counter() - t
