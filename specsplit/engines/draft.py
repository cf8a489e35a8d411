"""DraftEngine: per-session draft KV caches and tree growth, one draft forward per tree level.

A round: ingest the committed tokens the session has not seen (one causal forward, which also
yields the distribution of the root's children), then grow the tree level by level — all nodes
of a level in ONE forward with tree attention — and finally roll the cache back to the committed
context (O(1)). Nothing here reads device values back to the host (a logits processor that does,
such as HF's n-gram ban, applied to the draft's levels, is the exception it brings).
"""

from __future__ import annotations

import logging
import time
from dataclasses import astuple, dataclass

import torch

from specsplit.config import DraftConfig, TreeConfig
from specsplit.core.growth import (
    DynamicShape,
    PlanTensors,
    ScoreProcess,
    grow_dynamic_tree,
    grow_static_tree,
    main_path,
)
from specsplit.core.sampling import SamplingParams, derive_seed, make_generator
from specsplit.core.tree import StaticTreePlan, TokenTree
from specsplit.core.tree_attention import bool_mask_to_float
from specsplit.engines.base import EngineBase, desync_error, initial_capacity
from specsplit.engines.processing import TreeProcessors
from specsplit.errors import ConfigError, InvalidRequest, ResourceExhausted, SessionNotFound
from specsplit.messages import DraftRequest, DraftResult, WorkerStats
from specsplit.runtime.graphs import GraphedRound, StaticForward, kv_bucket
from specsplit.runtime.kv_cache import StaticKVCache
from specsplit.runtime.runner import h2d

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
    processors: TreeProcessors | None = None  # the generation's logits processors, if any
    processors_key: str | None = None  # what they were built from (kept if that failed: no retry a round)

    @property
    def cached_prompt_len(self) -> int:
        return len(self.cached_prompt_ids)


class DraftEngine(EngineBase[DraftCacheState]):
    """The draft side of speculative decoding.

    Args:
        model: a loaded HF causal LM (or ``None`` and ``config.model`` + :meth:`load_model`).
        config: engine settings.
    """

    role = "draft"

    def __init__(self, model: torch.nn.Module | None = None, config: DraftConfig | None = None):
        self.config: DraftConfig = config or DraftConfig()
        super().__init__(model, self.config)
        self._plans: dict[StaticTreePlan, PlanTensors] = {}
        self._ingest_layouts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _new_state(self, session_id: str, capacity: int) -> DraftCacheState:
        ws = self._acquire_workspace(session_id, capacity)
        if ws is not None:
            return DraftCacheState(ws, [], static=True)
        return DraftCacheState(self.runner.new_cache(capacity), [])

    def reset_cache(self, session_id: str | None = None) -> None:
        """Forget one session's cache, or every session's."""
        if session_id is None:
            self._store.clear()
        else:
            self._store.pop(session_id)

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
            if self.config.tuning.q_top_k < req.tree.static_plan().max_branch:
                raise ConfigError(
                    f"draft.tuning.q_top_k={self.config.tuning.q_top_k} is smaller than the tree's widest fan-out "
                    f"({req.tree.static_plan().max_branch}); raise q_top_k"
                )
        stats = WorkerStats(device=str(self.device))
        extra = req.tree.depth_limit + 1 if req.speculate else 0  # main path + guessed bonus
        capacity = initial_capacity(
            req.prefix_length + len(req.new_token_ids) + extra + req.tree.draft_slots + 8,
            min(req.capacity_hint, self.config.max_context),
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
        state, existed = self._open_session(
            req.session_id, capacity, lambda: self._new_state(req.session_id, capacity)
        )
        with self._store.locked(req.session_id):
            self._set_processors(state, req)
            assumed: list[int] = []
            if req.speculate:
                root_logits, assumed = self._speculate(state, req, stats, capacity)
                hit = True
            else:
                root_logits, hit = self._ingest(state, req, stats, capacity)
                state.spec_base = None
            committed = state.kv_cache.seq_len
            # This round's draws depend on the generation's seed and the position only, so a round
            # drafted again at the same position (after a missed speculation) draws the same tree.
            seed = None if req.seed is None else derive_seed(req.seed, committed)
            gen = make_generator(self.device, seed) if req.sampling.do_sample else None
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
            self._settle_kv(req.session_id, state.kv_cache, state.static)
        stats.wall_time_s = time.perf_counter() - t0
        return DraftResult(
            tree=tree,
            prefix_length=state.cached_prompt_len,
            stats=stats,
            cache_hit=hit and existed,
            assumed_token_ids=assumed,
        )

    def _set_processors(self, state: DraftCacheState, req: DraftRequest) -> None:
        """The session's processors for ``req.processing`` (built once per generation, with the
        context the session holds; :meth:`_feed` appends to it)."""
        spec = req.processing
        if spec is None:
            state.processors = state.processors_key = None
            return
        key = spec.to_json() + repr([id(p) for p in spec.processors])
        if state.processors_key == key and req.prefix_length > 0:
            return
        state.processors_key, state.processors = key, None
        try:
            self.runner.check_token_ids(spec.prefix_token_ids, "processing prefix")
            proc = TreeProcessors(self.runner.model, spec, self.device)
        except InvalidRequest as e:
            # Drafting without them only lowers acceptance; the target applies them exactly.
            logger.warning("draft %s: logits processors not applied to drafts (%s)", req.session_id, e)
            return
        proc.record(proc.history.prefix_len, state.cached_prompt_ids)
        state.processors = proc

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
        else:  # a prompt: padded to a bucket and replayed from its graph, or eager
            grow_to = max(capacity, length + len(todo) + req.tree.draft_slots + 8)
            ids = torch.tensor(todo, dtype=torch.long)
            out = self._prompt_forward(
                state.static, cache, ids, len(todo), None, req.tree.draft_slots, grow_to
            )
            logits = out[-1].clone() if state.static else out[-1]  # [V]; a graph's buffer is reused
        stats.model_time_s += time.perf_counter() - t
        stats.tokens_processed += len(todo)
        stats.forwards += 1
        if state.processors is not None:
            state.processors.record(state.processors.history.prefix_len + length, todo)
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
        committed = state.kv_cache.seq_len
        sampling, process = req.sampling, None
        proc = state.processors
        if proc is not None:
            length = proc.history.prefix_len + committed

            def process(logits: torch.Tensor, paths: torch.Tensor) -> torch.Tensor:
                return proc.level_scores(logits, paths, length)

            sampling = SamplingParams(do_sample=sampling.do_sample)  # the warpers run as processors
        if req.tree.shape == "dynamic":
            return self._grow_dynamic(state, root_logits, req, depth, stats, sampling, process)
        plan = req.tree.static_plan().truncated(depth)
        pt = self._plans.get(plan)
        if pt is None:
            pt = self._plans[plan] = PlanTensors.build(plan, self.device)

        def level(d: int, tokens: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
            positions = torch.full((tokens.shape[0],), committed + d, dtype=torch.long, device=self.device)
            return self._level_forward(state, tokens, allowed, positions, committed, stats)

        q_top_k = self.config.tuning.q_top_k
        return grow_static_tree(
            root_logits, plan, pt, sampling, q_top_k, gen, level, process, req.tree.min_confidence
        )

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

    def _grow_dynamic(
        self,
        state: DraftCacheState,
        root_logits: torch.Tensor,
        req: DraftRequest,
        depth: int,
        stats: WorkerStats,
        sampling: SamplingParams,
        process: ScoreProcess | None,
    ) -> TokenTree:
        cfg: TreeConfig = req.tree
        committed = state.kv_cache.seq_len
        shape = DynamicShape(cfg.topk, cfg.width, cfg.budget, depth)
        t = time.perf_counter()
        if state.static and self.config.tuning.graph_rounds and depth > 1 and process is None:
            static = self._workspace.static
            end = committed + shape.forwarded
            if end > static.capacity:
                raise ResourceExhausted(
                    f"a tree round needs {end} draft slots; the workspace holds {static.capacity}"
                )
            bucket = kv_bucket(end, static.capacity)
            key = (shape, astuple(sampling) if sampling.do_sample else (), bucket)
            rnd = self._round_graph(
                key, lambda: self._tree_round(static, shape, sampling, bucket, root_logits)
            )
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

            tok, parent, dep, logq = grow_dynamic_tree(root_logits, shape, sampling, level, process)
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
