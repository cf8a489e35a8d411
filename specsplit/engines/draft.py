"""DraftEngine: per-session draft KV caches and tree growth, one draft forward per tree level.

A round: ingest the committed tokens the session has not seen (one causal forward, which also
yields the distribution of the root's children), then grow the tree level by level — all nodes
of a level in ONE forward with tree attention — and finally roll the cache back to the committed
context (O(1)). Nothing here reads device values back to the host.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import astuple, dataclass

import torch

from specsplit.config import DraftConfig, SamplingParams, TreeConfig, resolved_attention_kernel
from specsplit.core.sampling import (
    logits_to_probs,
    make_generator,
    sample_without_replacement,
    truncate_top_k,
)
from specsplit.core.tree import StaticTreePlan, TokenTree, dynamic_level_widths
from specsplit.core.tree_attention import ancestor_matrix, bool_mask_to_float, build_verify_attention
from specsplit.errors import ConfigError, InvalidRequest, ResourceExhausted, SessionNotFound
from specsplit.runtime.graphs import GraphedRound, StaticForward, Workspace, kv_bucket
from specsplit.runtime.kv_cache import StaticKVCache
from specsplit.runtime.runner import (
    PROTOCOL_VERSION,
    ModelRunner,
    desync_error,
    h2d,
    make_store,
    sync_device,
)
from specsplit.transport import DraftRequest, DraftResult, WorkerInfo, WorkerStats

logger = logging.getLogger(__name__)


@dataclass
class DraftCacheState:
    """A draft session: its KV cache, the ids it holds, and the logits after the last one."""

    kv_cache: StaticKVCache
    cached_prompt_ids: list[int]
    cached_last_logits: torch.Tensor | None = None  # [vocab]
    static: bool = False  # the cache is the engine's static workspace (CUDA-graph path)
    last_tree: TokenTree | None = None  # the tree drafted last (speculation extends its main path)
    spec_base: int | None = None  # length confirmed by the caller before a speculative extension

    @property
    def cached_prompt_len(self) -> int:
        return len(self.cached_prompt_ids)


@dataclass(frozen=True)
class _PlanTensors:
    parents: torch.Tensor  # [N]
    depths: torch.Tensor  # [N]
    anc: torch.Tensor  # [N, N] bool
    levels: tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int, int], ...]
    # per level: (local parent index [W], rank [W], node index [W], start, end, kmax)


class DraftEngine:
    """The draft side of speculative decoding.

    Args:
        model: a loaded HF causal LM (or ``None`` and ``config.model`` + :meth:`load_model`).
        config: engine settings.
    """

    def __init__(self, model: torch.nn.Module | None = None, config: DraftConfig | None = None):
        self.config = config or DraftConfig()
        self.runner = ModelRunner(
            model,
            self.config.model,
            self.config.device,
            None,
            self.config.dtype,
            fold_gqa=self.config.fold_gqa,
            attention_kernel=resolved_attention_kernel(self.config.attention_kernel, self.config.cuda_graphs),
            fuse_projections=self.config.fuse_projections,
        )
        self._store = make_store(
            self.config.max_sessions, self.config.session_ttl_s, "draft-sessions", self._on_evict
        )
        self._plans: dict[tuple[StaticTreePlan, str], _PlanTensors] = {}
        self._rounds: dict[tuple[DynamicShape, tuple[object, ...], int], GraphedRound] = {}
        self._ingest_layouts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._workspace = Workspace(
            self.runner, self.config.graph_capacity, use_graphs=True, compile=self.config.compile
        )

    def _on_evict(self, session_id: str, state: DraftCacheState) -> None:
        self._workspace.release(session_id)

    def _new_state(self, session_id: str, capacity: int) -> DraftCacheState:
        if self.config.cuda_graphs:
            ws = self._workspace.acquire(session_id, capacity)
            if ws is not None:
                return DraftCacheState(ws, [], static=True)
        return DraftCacheState(self.runner.new_cache(capacity), [])

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
        return self.runner.output_device

    @property
    def active_sessions(self) -> int:
        return len(self._store)

    def end_session(self, session_id: str) -> bool:
        return self._store.pop(session_id)

    def reset_cache(self, session_id: str | None = None) -> None:
        """Forget one session's cache, or every session's."""
        if session_id is None:
            self._store.clear()
        else:
            self._store.pop(session_id)

    def purge_stale_sessions(self, ttl_seconds: float | None = None) -> int:
        return self._store.purge_stale(ttl_seconds)

    def shutdown(self) -> None:
        self._store.stop_purger()
        self._store.clear()

    def info(self) -> WorkerInfo:
        return WorkerInfo(
            worker_type="draft",
            model_name=self.runner.model_name,
            vocab_size=self.runner.vocab_size if self.is_loaded else 0,
            dtype=str(self.runner.dtype).replace("torch.", "") if self.is_loaded else "",
            device=str(self.device) if self.is_loaded else "",
            protocol_version=PROTOCOL_VERSION,
            active_sessions=self.active_sessions,
        )

    # ------------------------------------------------------------------ legacy convenience
    def generate_draft_tree(
        self,
        prompt_ids: list[int],
        k: int = 4,
        num_beams: int = 1,
        temperature: float = 0.0,
        session_id: str = "default",
    ) -> TokenTree:
        """Original-design entry point: a chain of ``k`` (``num_beams == 1``) or a static tree
        ``num_beams`` wide at the root; ``temperature > 0`` samples. ``prompt_ids`` is the full context."""
        if num_beams <= 1:
            tree = TreeConfig(shape="chain", num_draft_tokens=k)
        else:
            paths = [[b] for b in range(num_beams)] + [[0] * d for d in range(2, k + 1)]
            tree = TreeConfig(shape="static", paths=paths)
        sampling = SamplingParams(do_sample=temperature > 0, temperature=temperature or 1.0)
        req = DraftRequest(session_id, list(prompt_ids), 0, tree=tree, sampling=sampling)
        return self.generate(req).tree

    # ------------------------------------------------------------------ main entry
    @torch.inference_mode()
    def generate(self, req: DraftRequest) -> DraftResult:
        """Ingest ``req.new_token_ids`` and grow a tree; see :class:`DraftRequest`.

        Raises:
            InvalidRequest: bad token ids or tree settings.
            SessionNotFound: ``prefix_length > 0`` for a session the engine does not hold.
            CacheDesyncError: ``prefix_length`` disagrees with the session's cache.
        """
        t0 = time.perf_counter()
        self.runner.require()
        self.runner.check_token_ids(req.new_token_ids, "new_token_ids")
        if req.prefix_length < 0:
            raise InvalidRequest(f"prefix_length must be >= 0, got {req.prefix_length}")
        if req.tree.shape != "dynamic" and req.sampling.do_sample:
            if self.config.q_top_k < req.tree.static_plan().max_branch:
                raise ConfigError(
                    f"draft.q_top_k={self.config.q_top_k} is smaller than the tree's widest fan-out "
                    f"({req.tree.static_plan().max_branch}); raise q_top_k"
                )
        stats = WorkerStats(device=str(self.device))
        extra = req.tree.depth_limit + 1 if req.speculate else 0  # main path + guessed bonus
        capacity = max(
            min(req.capacity_hint, self.config.max_context),
            req.prefix_length + len(req.new_token_ids) + extra + req.tree.draft_slots + 8,
        )
        if req.speculate and (req.new_token_ids or req.prefix_length <= 0):
            raise InvalidRequest("a speculative draft request extends an existing session: "
                                 "new_token_ids must be empty and prefix_length > 0")  # fmt: skip
        if req.prefix_length == 0 and not req.new_token_ids:
            raise InvalidRequest("new_token_ids is empty: a new context needs at least one token")
        if (
            req.tree.max_nodes > self.config.max_tree_nodes
            or req.tree.depth_limit > self.config.max_tree_depth
        ):
            raise ResourceExhausted(
                f"tree of {req.tree.max_nodes} nodes / depth {req.tree.depth_limit} exceeds this draft's "
                f"limits ({self.config.max_tree_nodes} nodes, depth {self.config.max_tree_depth})"
            )
        if (
            req.prefix_length + len(req.new_token_ids) + extra + req.tree.draft_slots
            > self.config.max_context
        ):
            raise ResourceExhausted(f"context would exceed the draft's max_context={self.config.max_context}")
        if req.prefix_length > 0 and req.session_id not in self._store:
            raise SessionNotFound(f"draft session {req.session_id!r} not found; resend the full context")
        state, existed = self._store.get_or_create(
            req.session_id, lambda: self._new_state(req.session_id, capacity)
        )
        with self._store.locked(req.session_id):
            assumed: list[int] = []
            if req.speculate:
                root_logits, assumed = self._speculate(state, req, stats, capacity)
                hit = True
            else:
                root_logits, hit = self._ingest(state, req, stats, capacity)
                state.spec_base = None
            gen = make_generator(self.device, req.seed) if req.sampling.do_sample else None
            committed = state.kv_cache.seq_len
            depth = req.tree.depth_limit
            if req.max_depth is not None:
                left = req.max_depth - len(assumed)
                # On the static path a shallower tree is a new shape for a round or two at the end of
                # a generation: a graph capture (and a compile under torch.compile) on both sides.
                # Grow the usual shape there; the caller commits no more than it asked for.
                depth = min(depth, left) if left <= 0 or not state.static else depth
            try:
                tree = self._grow(state, root_logits, req, gen, stats, depth)
            finally:
                state.kv_cache.rollback(committed)
            state.last_tree = tree
        stats.wall_time_s = time.perf_counter() - t0
        return DraftResult(
            tree=tree,
            prefix_length=state.cached_prompt_len,
            stats=stats,
            cache_hit=hit and existed,
            assumed_token_ids=assumed,
        )

    # ------------------------------------------------------------------ speculation (overlap)
    def _speculate(
        self, state: DraftCacheState, req: DraftRequest, stats: WorkerStats, capacity: int
    ) -> tuple[torch.Tensor, list[int]]:
        """Extend the session by its last tree's main path and its own next token (see DraftRequest)."""
        _require_length(state, req)
        if state.cached_last_logits is None:
            raise InvalidRequest("nothing to speculate from: the session has no pending logits")
        path = main_path(state.last_tree) if state.last_tree is not None else []
        state.spec_base = req.prefix_length
        logits = self._feed(state, path, req, stats, capacity) if path else state.cached_last_logits
        guess = int(logits.argmax())  # one host read, overlapped with the target's verification
        return self._feed(state, [guess], req, stats, capacity), path + [guess]

    # ------------------------------------------------------------------ ingest
    def _ingest(
        self, state: DraftCacheState, req: DraftRequest, stats: WorkerStats, capacity: int
    ) -> tuple[torch.Tensor, bool]:
        new = req.new_token_ids
        if req.prefix_length == 0:
            # Full context: reuse the longest cached prefix with identical ids.
            if new == state.cached_prompt_ids and state.cached_last_logits is not None:
                return state.cached_last_logits, True
            if not new:
                raise InvalidRequest("new_token_ids is empty: a new context needs at least one token")
            todo = _reuse_prefix(state, 0, new)
            hit = len(todo) < len(new)
        elif state.spec_base is not None and req.prefix_length == state.spec_base < state.cached_prompt_len:
            # The guess of a speculative extension was wrong: keep the part of it that matches.
            if not new:
                raise InvalidRequest("new_token_ids is empty after a speculative extension")
            todo, hit = _reuse_prefix(state, req.prefix_length, new), True
        else:
            _require_length(state, req)
            if not new:
                if state.cached_last_logits is None:
                    raise InvalidRequest("new_token_ids is empty and the session has no pending logits")
                return state.cached_last_logits, True
            todo, hit = new, True
        return self._feed(state, todo, req, stats, capacity), hit

    def _feed(
        self, state: DraftCacheState, todo: list[int], req: DraftRequest, stats: WorkerStats, capacity: int
    ) -> torch.Tensor:
        """Append ``todo`` to the session (one causal forward); the logits after its last token."""
        cache = state.kv_cache
        length = cache.seq_len
        # The most a round commits (accepted + 1), rounded up to 8 so nearby depths share one graph.
        n_in = -(-(req.tree.depth_limit + 1) // 8) * 8
        t = time.perf_counter()
        if state.static and len(todo) <= n_in and length + n_in + req.tree.draft_slots <= cache.capacity:
            # Padded to a fixed size so the step replays one graph; padding rows see only
            # themselves and write beyond the valid length, where nothing reads them. The GPU idles
            # until this forward is launched (the last round's verification drained it), so its
            # inputs are one host-to-device copy of the ids; the rest is cached on the device.
            steps, blocks = self._ingest_layout(n_in)
            ids = h2d(torch.tensor(todo + [0] * (n_in - len(todo)), dtype=torch.long), self.device)
            out = self._workspace.static.run(ids, steps + length, length, blocks[len(todo)])
            logits = out[len(todo) - 1].clone()  # [V]; the graph's buffer is reused
            cache.set_length(length + len(todo))
        elif (
            state.static
            and self.config.prefill_graphs
            and length + len(todo) + req.tree.draft_slots <= cache.capacity
            and (padded := self._workspace.static.run_prefill(torch.tensor(todo, dtype=torch.long), length))
            is not None
        ):  # a prompt: padded to a bucket, replayed from that bucket's graph
            logits = padded[0].clone()  # [V]
            cache.set_length(length + len(todo))
        else:
            cache.ensure_capacity(max(capacity, length + len(todo) + req.tree.draft_slots + 8))
            ids = torch.tensor([todo], dtype=torch.long)
            empty = torch.zeros(0, dtype=torch.long)
            mask, pos2d = build_verify_attention(empty, length, len(todo), self.runner.dtype)
            logits = self.runner.forward(ids, pos2d, mask, cache, logits_to_keep=1)[-1]  # [V]
        stats.model_time_s += time.perf_counter() - t
        stats.tokens_processed += len(todo)
        stats.forwards += 1
        state.cached_prompt_ids.extend(todo)
        state.cached_last_logits = logits
        return logits

    def _ingest_layout(self, n_in: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Device tensors of a padded ``n_in``-token ingest: ``arange(n_in)`` and, for every real
        length ``n``, the `[n_in, n_in]` visibility block (causal among the ``n`` real tokens; a
        padding row sees itself only)."""
        cached = self._ingest_layouts.get(n_in)
        if cached is None:
            real = torch.arange(n_in)[None, :] < torch.arange(n_in + 1)[:, None]  # [n_in + 1, n_in]
            causal = torch.ones(n_in, n_in, dtype=torch.bool).tril()
            blocks = (causal[None] & real[:, None, :]) | torch.eye(n_in, dtype=torch.bool)[None]
            cached = (h2d(torch.arange(n_in), self.device), h2d(blocks, self.device))
            self._ingest_layouts[n_in] = cached
        return cached

    # ------------------------------------------------------------------ tree growth
    def _grow(
        self,
        state: DraftCacheState,
        root_logits: torch.Tensor,
        req: DraftRequest,
        gen: torch.Generator | None,
        stats: WorkerStats,
        depth: int,
    ) -> TokenTree:
        if depth <= 0:
            return TokenTree.empty(self.device)
        if req.tree.shape == "dynamic":
            return self._grow_dynamic(state, root_logits, req, depth, stats)
        plan = req.tree.static_plan().truncated(depth)
        return self._grow_static(state, root_logits, plan, req.sampling, gen, stats)

    def _plan_tensors(self, plan: StaticTreePlan) -> _PlanTensors:
        key = (plan, str(self.device))
        pt = self._plans.get(key)
        if pt is None:
            dev = self.device

            def on_dev(values: list[int] | tuple[int, ...]) -> torch.Tensor:
                return h2d(torch.tensor(values, dtype=torch.long), dev)  # pinned: no host sync

            parents = on_dev(plan.parents)
            levels = []
            prev: tuple[int, ...] = (-1,)
            for idx, par, rank in plan.levels:
                local = on_dev([prev.index(p) for p in par])
                levels.append((local, on_dev(rank), on_dev(idx), idx[0], idx[-1] + 1, max(rank) + 1))
                prev = idx
            pt = _PlanTensors(parents, on_dev(plan.depths), ancestor_matrix(parents), tuple(levels))
            self._plans[key] = pt
        return pt

    def _level_forward(
        self,
        state: DraftCacheState,
        tokens: torch.Tensor,
        allowed: torch.Tensor,
        positions: torch.Tensor,
        ctx: int,
        stats: WorkerStats,
    ) -> torch.Tensor:
        """Forward one level of ``W`` nodes below ``ctx`` committed tokens.

        ``allowed``: `[W, n_tree_kv]` bool over the tree slots written so far (this level last).
        """
        cache = state.kv_cache
        t = time.perf_counter()
        if state.static:
            logits = self._workspace.static.run(tokens, positions, ctx, allowed)
        else:
            ones = torch.ones(allowed.shape[0], ctx, dtype=torch.bool, device=allowed.device)
            mask = bool_mask_to_float(torch.cat([ones, allowed], 1)[None, None], self.runner.dtype)
            logits = self.runner.forward(
                tokens[None], positions[None], mask, cache, logits_to_keep=tokens.shape[0]
            )
        stats.model_time_s += time.perf_counter() - t
        stats.tokens_processed += tokens.shape[0]
        stats.forwards += 1
        return logits  # [W, V]

    def _grow_static(
        self,
        state: DraftCacheState,
        root_logits: torch.Tensor,
        plan: StaticTreePlan,
        sampling: SamplingParams,
        gen: torch.Generator | None,
        stats: WorkerStats,
    ) -> TokenTree:
        dev = self.device
        pt = self._plan_tensors(plan)
        n = plan.num_nodes
        committed = state.kv_cache.seq_len
        tokens = torch.zeros(n, dtype=torch.long, device=dev)
        logq = torch.zeros(n, dtype=torch.float32, device=dev)
        kq = self.config.q_top_k
        q_ids = torch.zeros(n, kq, dtype=torch.long, device=dev) if sampling.do_sample else None
        q_probs = torch.zeros(n, kq, dtype=torch.float32, device=dev) if sampling.do_sample else None
        parent_logits = root_logits[None]  # [P, V]
        for d, (local, rank, _idx, start, end, kmax) in enumerate(pt.levels):
            probs = logits_to_probs(parent_logits, sampling)  # [P, V]
            if q_ids is None or q_probs is None:
                vals, ids = torch.topk(probs, kmax, dim=-1)  # deterministic top-k expansion
                tok = ids[local, rank]
                logq[start:end] = vals[local, rank].clamp_min(1e-30).log()
            else:
                sids, sprobs = truncate_top_k(probs, kq)  # [P, Kq]
                order = sample_without_replacement(sprobs, kmax, gen)  # [P, kmax] draw order
                # q of the r-th sibling: the truncated q without siblings drawn before it.
                drawn = torch.nn.functional.one_hot(order, sprobs.shape[-1]).bool()  # [P, kmax, Kq]
                earlier = (drawn.cumsum(1) - drawn.long()) > 0
                qs = sprobs[:, None, :].masked_fill(earlier, 0.0)
                qs = qs / qs.sum(-1, keepdim=True).clamp_min(1e-30)  # exhausted rows stay 0
                pos = order[local, rank]  # [W]
                tok = sids[local, pos]
                q_ids[start:end] = sids[local]
                q_probs[start:end] = qs[local, rank]
                logq[start:end] = qs[local, rank].gather(1, pos[:, None]).squeeze(1).clamp_min(1e-30).log()
            tokens[start:end] = tok
            if d + 1 < len(pt.levels):
                positions = torch.full((end - start,), committed + d, dtype=torch.long, device=dev)
                parent_logits = self._level_forward(
                    state, tok, pt.anc[start:end, :end], positions, committed, stats
                )
        return TokenTree(tokens, pt.parents, pt.depths, logq, q_ids, q_probs, plan.max_branch, plan.depth)

    def _grow_dynamic(
        self,
        state: DraftCacheState,
        root_logits: torch.Tensor,
        req: DraftRequest,
        depth: int,
        stats: WorkerStats,
    ) -> TokenTree:
        cfg: TreeConfig = req.tree
        committed = state.kv_cache.seq_len
        shape = DynamicShape(cfg.topk, cfg.width, cfg.budget, depth)
        t = time.perf_counter()
        if state.static and self.config.graph_rounds and depth > 1:
            static = self._workspace.static
            end = committed + shape.forwarded
            if end > static.capacity:
                raise ResourceExhausted(
                    f"a tree round needs {end} draft slots; the workspace holds {static.capacity}"
                )
            bucket = kv_bucket(end, static.capacity)
            key = (shape, astuple(req.sampling) if req.sampling.do_sample else (), bucket)
            rnd = self._rounds.get(key)
            if rnd is None:
                rnd = self._tree_round(static, shape, req.sampling, bucket, root_logits)
                self._rounds[key] = rnd
            packed, logq = rnd(root_logits, committed)
            packed, logq = packed.clone(), logq.clone()  # the graph's outputs are reused next round
            tok, parent, dep = packed.unbind(0)
            self.runner.forward_count += depth - 1
            stats.model_time_s += time.perf_counter() - t
            stats.forwards += depth - 1
            stats.tokens_processed += shape.forwarded
        else:

            def level(d: int, tokens: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
                positions = torch.full(
                    (tokens.shape[0],), committed + d - 1, dtype=torch.long, device=self.device
                )
                return self._level_forward(state, tokens, allowed, positions, committed, stats)

            tok, parent, dep, logq = grow_dynamic_tree(root_logits, shape, req.sampling, level)
        return TokenTree(tok, parent, dep, logq, None, None, cfg.topk, depth)

    def _tree_round(
        self,
        static: StaticForward,
        shape: DynamicShape,
        sampling: SamplingParams,
        bucket: int,
        root: torch.Tensor,
    ) -> GraphedRound:
        """A whole dynamic-tree round (every level's forward and the selection) as one graph."""
        bufs = {w: static.new_buffers(w, bucket) for w in set(shape.widths)}

        def body(root_logits: torch.Tensor, ctx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            def level(d: int, tokens: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
                pos = (ctx + (d - 1)).expand(tokens.shape[0])
                return static.forward_at(bufs[tokens.shape[0]], tokens, pos, ctx, allowed)

            tok, parent, dep, logq = grow_dynamic_tree(root_logits, shape, sampling, level)
            return torch.stack([tok, parent, dep]), logq

        ctx = torch.zeros((), dtype=torch.long)
        return GraphedRound(static, body, [root, ctx])

    # ------------------------------------------------------------------ misc
    def synchronize(self) -> None:
        sync_device(self.device)

    def __repr__(self) -> str:
        return f"DraftEngine(model={self.runner.model_name!r}, sessions={self.active_sessions})"


def _require_length(state: DraftCacheState, req: DraftRequest) -> None:
    if req.prefix_length != state.cached_prompt_len:
        raise desync_error("draft", req.session_id, state.cached_prompt_len, req.prefix_length)


def _reuse_prefix(state: DraftCacheState, base: int, new: list[int]) -> list[int]:
    """Keep the cached ids after ``base`` that match ``new`` (never all of ``new``: the last token is
    fed again for its logits), roll the cache back to them, and return what is left to feed.
    Runs on a full-context resend or a wrong speculative guess, not every round."""
    lcp = 0
    for a, b in zip(state.cached_prompt_ids[base:], new, strict=False):
        if a != b:
            break
        lcp += 1
    keep = base + min(lcp, len(new) - 1)
    state.kv_cache.rollback(keep)
    del state.cached_prompt_ids[keep:]
    return new[keep - base :]


def main_path(tree: TokenTree) -> list[int]:
    """Token ids along the first child of every level, root to leaf (the draft's likeliest path:
    children are stored best first). One small host read of the tree."""
    if tree.num_nodes == 0:
        return []
    n = tree.num_nodes
    idx = torch.arange(n, device=tree.device)
    first = torch.full((n + 1,), n, dtype=torch.long, device=tree.device)
    first.scatter_reduce_(0, tree.parents + 1, idx, reduce="amin")  # first child of each node (+1)
    packed = torch.cat([first, tree.token_ids]).tolist()
    first_child, tokens = packed[: n + 1], packed[n + 1 :]
    path, node = [], first_child[0]
    while node < n:  # at most the tree depth
        path.append(tokens[node])
        node = first_child[node + 1]
    return path


@dataclass(frozen=True)
class DynamicShape:
    """The fixed shape of a dynamic tree round: top-``topk`` children per expanded node, the
    ``width`` best nodes of each level expanded, ``budget`` nodes kept, ``depth`` levels."""

    topk: int
    width: int
    budget: int
    depth: int

    @property
    def widths(self) -> tuple[int, ...]:
        """Nodes forwarded at levels 1 .. depth - 1."""
        return dynamic_level_widths(self.topk, self.width, self.depth)

    @property
    def forwarded(self) -> int:
        return sum(self.widths)


def grow_dynamic_tree(
    root_logits: torch.Tensor,
    shape: DynamicShape,
    sampling: SamplingParams,
    level: Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """EAGLE-2 style: expand the top-``width`` candidates of each level by cumulative draft
    log-probability, then keep the ``budget`` best nodes overall (always a valid tree, since a
    child's cumulative score never exceeds its parent's). Expansion is deterministic top-k, so
    ``q`` is one-hot and verification stays lossless under sampling.

    Device ops only, with shapes fixed by ``shape``: the same code runs eagerly or captured as one
    graph. ``level(d, tokens [W], allowed [W, n])`` forwards the ``W`` frontier nodes at depth ``d``
    (``allowed``: their ancestors among the ``n`` nodes forwarded so far, this level last) and
    returns their `[W, V]` logits.

    Returns:
        ``(tokens, parents, depths, log_q)``, each `[min(budget, pool)]`, in BFS order.
    """
    dev = root_logits.device
    k = shape.topk
    probs = logits_to_probs(root_logits[None], sampling)  # [1, V]
    vals, ids = torch.topk(probs, k, dim=-1)
    pool_tok = [ids[0]]
    pool_score = [vals[0].clamp_min(1e-30).log()]
    pool_logq = [pool_score[0]]
    pool_parent = [torch.full((k,), -1, dtype=torch.long, device=dev)]
    pool_depth = [torch.ones(k, dtype=torch.long, device=dev)]
    size = k  # pool size so far (host int: shapes are static)
    level_start, level_len = 0, k
    fw_slot = torch.full((k + shape.forwarded * k,), -1, dtype=torch.long, device=dev)
    fw_anc = torch.zeros(0, 0, dtype=torch.bool, device=dev)
    n_fw = 0
    for d, width in enumerate(shape.widths, start=1):
        cat_score = torch.cat(pool_score)
        front = level_start + torch.topk(cat_score[level_start : level_start + level_len], width).indices
        # Ancestors of the frontier among forwarded nodes: the parent's row plus itself.
        par = torch.cat(pool_parent)[front]
        par_slot = torch.where(par >= 0, fw_slot[par.clamp_min(0)], -1)
        grown = torch.zeros(n_fw + width, n_fw + width, dtype=torch.bool, device=dev)
        grown[:n_fw, :n_fw] = fw_anc
        if n_fw:
            grown[n_fw:, :n_fw] = fw_anc[par_slot.clamp_min(0)] & (par_slot >= 0)[:, None]
        grown[n_fw:, n_fw:] = torch.eye(width, dtype=torch.bool, device=dev)
        fw_anc = grown
        fw_slot[front] = torch.arange(n_fw, n_fw + width, device=dev)
        n_fw += width
        logits = level(d, torch.cat(pool_tok)[front], fw_anc[n_fw - width :])
        probs = logits_to_probs(logits, sampling)  # [W, V]
        vals, ids = torch.topk(probs, k, dim=-1)  # [W, K]
        lq = vals.clamp_min(1e-30).log()
        pool_tok.append(ids.reshape(-1))
        pool_logq.append(lq.reshape(-1))
        pool_score.append((cat_score[front][:, None] + lq).reshape(-1))
        pool_parent.append(front[:, None].expand(width, k).reshape(-1))
        pool_depth.append(torch.full((width * k,), d + 1, dtype=torch.long, device=dev))
        level_start, level_len = size, width * k
        size += width * k
    score = torch.cat(pool_score)
    tok = torch.cat(pool_tok)
    logq = torch.cat(pool_logq)
    parent = torch.cat(pool_parent)
    dep = torch.cat(pool_depth)
    budget = min(shape.budget, size)
    # Best `budget` by score; ties go to the shallower node so parents rank before children.
    by_depth = torch.sort(dep, stable=True).indices
    by_score = by_depth[torch.sort(score[by_depth], descending=True, stable=True).indices]
    chosen = by_score[:budget]
    bfs = chosen[torch.sort(dep[chosen] * size + chosen).indices]  # BFS order
    new_index = torch.full((size,), -1, dtype=torch.long, device=dev)
    new_index[bfs] = torch.arange(budget, device=dev)
    par = parent[bfs]
    new_par = torch.where(par >= 0, new_index[par.clamp_min(0)], -1)
    return tok[bfs], new_par, dep[bfs], logq[bfs]
