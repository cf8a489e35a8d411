"""Configuration: the options users set, grouped, with one tuning section per level for A/B switches.

What most users set (see the README's "Options"): the models and their devices, the transport and
worker addresses, the tree shape and drafter, ``cuda_graphs`` / ``compile``, and session limits.
Everything in a ``tuning`` section (:class:`EngineTuning`, :class:`PipelineTuning`) exists to
compare implementations or to fit an unusual machine; its defaults are right otherwise.

Every field has an environment variable: ``SPECSPLIT_`` followed by the field's path in upper case,
``_``-joined (``SPECSPLIT_TRANSPORT=grpc``, ``SPECSPLIT_TARGET_DEVICE=cuda:1``,
``SPECSPLIT_TREE_SHAPE=dynamic``, ``SPECSPLIT_DRAFT_TUNING_GRAPH_ROUNDS=0``). A nested section may
also be given whole as JSON (``SPECSPLIT_TARGET_SPECPV='{"enabled": true}'``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from specsplit.core.sampling import SamplingParams as SamplingParams  # re-exported: users set it here
from specsplit.core.tree import (
    DEFAULT_STATIC_PATHS,
    StaticTreePlan,
    chain_plan,
    dynamic_level_widths,
    static_plan_from_paths,
)
from specsplit.errors import ConfigError

TreeShape = Literal["chain", "static", "dynamic"]
Drafter = Literal["model", "ngram", "suffix", "hybrid", "auto"]
DRAFTERS = ("model", "ngram", "suffix", "hybrid", "auto")
BATCH_LIMIT = 128  # most rows one batched round holds (the largest batch bucket)
_DTYPES = ("auto", "float32", "float16", "bfloat16")
_ATTENTION_KERNELS = ("auto", "math", "sdpa")  # see resolved_attention_kernel
DRAFT_QUANTIZE = ("auto", "int8", "none")  # DraftConfig.quantize


@dataclass
class SpecPVConfig:
    """SpecPV partial verification settings (target side; opt-in, lossy).

    Attributes:
        enabled: turn partial verification on (off: the engine behaves exactly as without it).
        block_size: tokens per retrieval block.
        n_sink_blocks: leading blocks always kept.
        n_retrieval_blocks: blocks retrieved per layer and KV head.
        n_window_blocks: most recent blocks always kept.
        n_spec_tokens_buf: speculative buffer slots: ``pending + tree`` of a round plus the tokens
            accepted since the last full verification.
        partial_threshold: contexts shorter than this many tokens are always verified in full.
        full_refresh_interval: partial steps between two full verifications.
        retrieval_reduce: ``"mean"`` or ``"max"``, how block scores are reduced over the tree's
            queries and over the query heads of a GQA group.
        retrieval_refresh_interval: re-choose the retrieved blocks every this many partial steps
            from the block summaries, scored with the post-RoPE queries of the step's committed
            tokens (pending + accepted path); no full forward, the window and buffer stay. ``0``
            (default): the retrieval changes only at full verifications.
        retrieval_query_window: with ``retrieval_refresh_interval``, score each re-selection with
            the queries of the last this many committed tokens since the view was built (the
            step's own rows and earlier partial steps' rows), not only the step's own ``pending +
            accepted`` rows. ``0`` (default): the step's own rows only. A few rows of the last
            step are a noisy proxy for what the next tokens attend to; a longer window averages it.
        rectify_margin: greedy only. When a partial step's logits decide a committed token (an
            accepted one or the round's next token) by a top-1 over top-2 margin below this many
            logits, the step is discarded and the round is verified in full (a *rectification*):
            the partial view perturbs logits slightly, which flips exactly such near-ties, and one
            flipped token makes the rest of the output differ. ``0.0`` (default): off. Costs one
            extra full forward per rectified round.
    """

    enabled: bool = False
    block_size: int = 16
    n_sink_blocks: int = 2
    n_retrieval_blocks: int = 256
    n_window_blocks: int = 8
    n_spec_tokens_buf: int = 128
    partial_threshold: int = 4096
    full_refresh_interval: int = 32
    retrieval_reduce: Literal["mean", "max"] = "mean"
    retrieval_refresh_interval: int = 0
    retrieval_query_window: int = 0
    rectify_margin: float = 0.0

    def __post_init__(self) -> None:
        for name, low in (
            ("block_size", 1),
            ("n_sink_blocks", 0),
            ("n_retrieval_blocks", 0),
            ("n_window_blocks", 0),
            ("n_spec_tokens_buf", 2),
            ("partial_threshold", 1),
            ("full_refresh_interval", 1),
            ("retrieval_refresh_interval", 0),
            ("retrieval_query_window", 0),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"specpv.{name} must be an integer >= {low}, got {value!r}")
        m = self.rectify_margin
        if isinstance(m, bool) or not isinstance(m, int | float) or not 0.0 <= m < float("inf"):
            raise ConfigError(f"specpv.rectify_margin must be a finite number >= 0, got {m!r}")
        if self.retrieval_reduce not in ("mean", "max"):
            raise ConfigError(
                f"specpv.retrieval_reduce must be 'mean' or 'max', got {self.retrieval_reduce!r}"
            )

    @property
    def view_tokens(self) -> int:
        """Most slots the sink + retrieval + window part can take (the window may start mid-block)."""
        return (self.n_sink_blocks + self.n_retrieval_blocks + self.n_window_blocks + 1) * self.block_size

    @property
    def budget(self) -> int:
        """Slots of the partial view per layer: view part plus speculative buffer."""
        return self.view_tokens + self.n_spec_tokens_buf

    @staticmethod
    def min_spec_tokens_buf(max_nodes: int, max_depth: int) -> int:
        """Smallest buffer that holds one round's ``pending + tree`` on top of the last round's
        accepted tokens (its pending token plus up to ``max_depth`` accepted ones)."""
        return (1 + max_depth) + (1 + max_nodes)

    def check_tree(self, max_nodes: int, max_depth: int) -> None:
        """Raise :class:`ConfigError` when the speculative buffer cannot serve trees this large.

        Args:
            max_nodes: the tree budget (largest number of drafted nodes per round).
            max_depth: the deepest drafted path.
        """
        need = self.min_spec_tokens_buf(max_nodes, max_depth)
        if self.enabled and self.n_spec_tokens_buf < need:
            raise ConfigError(
                f"specpv.n_spec_tokens_buf={self.n_spec_tokens_buf} cannot hold a tree of {max_nodes} nodes "
                f"and depth {max_depth}: a partial round needs the tree plus its pending token plus the "
                f"{max_depth + 1} tokens the previous round may commit, i.e. >= {need}; raise "
                "n_spec_tokens_buf or shrink the tree"
            )

    @classmethod
    def from_any(cls, value: SpecPVConfig | dict[str, Any] | None) -> SpecPVConfig:
        """Accept a config, a dict of its fields (config files, environment JSON) or ``None``."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            known = set(cls.__dataclass_fields__)
            bad = set(value) - known
            if bad:
                raise ConfigError(f"unknown keys in target.specpv: {sorted(bad)}; known: {sorted(known)}")
            return cls(**value)
        raise ConfigError(f"target.specpv must be a SpecPVConfig or a dict, got {type(value).__name__}")


@dataclass
class TreeConfig:
    """Shape of the draft tree.

    Attributes:
        shape: ``"chain"`` (K tokens in a line), ``"static"`` (fixed Medusa-style paths) or
            ``"dynamic"`` (EAGLE-2 style: expand the top-k children of the most probable frontier
            nodes by cumulative draft probability, within ``budget`` nodes and ``max_depth``).
        num_draft_tokens: chain length K.
        paths: static tree paths; ``None`` uses :data:`specsplit.core.tree.DEFAULT_STATIC_PATHS`.
        topk: dynamic tree: children proposed per expanded node.
        width: dynamic tree: frontier nodes expanded per level.
        budget: dynamic tree: maximum number of nodes.
        max_depth: dynamic tree: maximum depth.
        min_confidence: chain / static tree: the draft stops growing after a level whose main-path
            token it gave a probability below this (the levels so far are kept), so a round drafts
            deep where the draft is sure and shallow where it is not (like HF's
            ``assistant_confidence_threshold``). Each level then reads that probability on the host,
            a device sync per level on a GPU; batched rounds grow full chains. 0 (default): every
            level. Lossless either way: only the tree's size changes.
    """

    shape: TreeShape = "chain"
    num_draft_tokens: int = 4
    paths: list[list[int]] | None = None
    topk: int = 4
    width: int = 4
    budget: int = 24
    max_depth: int = 6
    min_confidence: float = 0.0

    def __post_init__(self) -> None:
        if self.shape not in ("chain", "static", "dynamic"):
            raise ConfigError(f"tree shape must be 'chain', 'static' or 'dynamic', got {self.shape!r}")
        if self.num_draft_tokens < 0:
            raise ConfigError(f"num_draft_tokens must be >= 0, got {self.num_draft_tokens}")
        for name in ("topk", "width", "budget", "max_depth"):
            if getattr(self, name) < 1:
                raise ConfigError(f"tree.{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.min_confidence < 1.0:
            raise ConfigError(f"tree.min_confidence must be in [0, 1), got {self.min_confidence}")
        if self.min_confidence > 0.0 and self.shape == "dynamic":
            raise ConfigError("tree.min_confidence sizes chain and static trees; a dynamic tree already "
                              "keeps the nodes the draft is surest of (budget, max_depth)")  # fmt: skip
        if self.shape == "static":
            try:
                self.static_plan()
            except ValueError as e:
                raise ConfigError(f"invalid static tree paths: {e}") from None

    def static_plan(self) -> StaticTreePlan:
        """The fixed plan for ``chain``/``static`` shapes."""
        if self.shape == "chain":
            return chain_plan(self.num_draft_tokens)
        if self.shape == "static":
            return static_plan_from_paths(self.paths if self.paths is not None else DEFAULT_STATIC_PATHS)
        raise ConfigError("a dynamic tree has no static plan")

    @property
    def max_nodes(self) -> int:
        """Upper bound on the node count (sizes caches and the verify budget)."""
        if self.shape == "dynamic":
            return self.budget
        return self.static_plan().num_nodes

    @property
    def draft_slots(self) -> int:
        """Cache slots a draft round may write past the committed context: the tree's nodes, or for
        a dynamic tree every forwarded frontier node when that is more than the budget."""
        if self.shape == "dynamic":
            return max(self.budget, sum(dynamic_level_widths(self.topk, self.width, self.max_depth)))
        return self.max_nodes

    @property
    def depth_limit(self) -> int:
        if self.shape == "dynamic":
            return self.max_depth
        return self.static_plan().depth


@dataclass
class EngineTuning:
    """How an engine runs its model: switches that exist to compare implementations.

    Attributes:
        graph_capacity: slots of the static workspace the CUDA-graph path runs over (the longest
            session served on that path; longer ones run eagerly).
        graph_rounds: with ``cuda_graphs``, a whole round replays as ONE graph: a dynamic tree's
            growth (every level's forward and the selection between them) on the draft, a greedy
            verification (mask, forward, acceptance, KV commit) on the target. Off: one graph per
            forward with eager ops between.
        prefill_graphs: with ``cuda_graphs``, a prompt's forward is padded to a bucket of 64, 128,
            192, 256, 384, ... 8192 tokens and replayed from one graph per bucket (captured on first
            use); eager PyTorch pays tens of microseconds of host time per op on such a forward.
            Exact. Off: eager prompt forwards.
        fold_gqa: tree forwards of a GQA model fold the head group into the query rows, reading
            each K/V head once instead of copying it to every query head. Off: transformers' SDPA.
        attention_kernel: ``"math"``: tree forwards attend through the folded matmul kernel at any
            prefix length; ``"sdpa"``: transformers' SDPA below 2,048 cached tokens, the folded
            kernels above; ``"auto"``: ``"math"`` with ``cuda_graphs``, else ``"sdpa"``.
        q_top_k: the draft, when sampling, draws from its top-``q_top_k`` tokens (renormalised), so
            the distribution it drew from is exact and small enough to send sparsely.
    """

    graph_capacity: int = 2048
    graph_rounds: bool = True
    prefill_graphs: bool = True
    fold_gqa: bool = True
    attention_kernel: str = "auto"
    q_top_k: int = 32

    def __post_init__(self) -> None:
        if self.attention_kernel not in _ATTENTION_KERNELS:
            raise ConfigError(
                f"tuning.attention_kernel must be one of {_ATTENTION_KERNELS}, got {self.attention_kernel!r}"
            )
        if self.q_top_k < 1:
            raise ConfigError(f"tuning.q_top_k must be >= 1, got {self.q_top_k}")
        if self.graph_capacity < 16:
            raise ConfigError(f"tuning.graph_capacity must be >= 16, got {self.graph_capacity}")


@dataclass
class DraftConfig:
    """The draft model and its engine.

    Attributes:
        model: alias, local directory or HF id of the draft model (``None`` in remote mode).
        device: torch device, e.g. ``"cuda:0"``; ``None`` picks cuda:0 if present, else the CPU.
        dtype: ``"auto"`` (bf16 on GPU, fp32 on CPU), ``"float32"``, ``"float16"``, ``"bfloat16"``.
        cuda_graphs: run fixed-shape steps over a preallocated workspace and replay them from CUDA
            graphs (on the CPU the same static path runs eagerly).
        compile: also fuse those steps with ``torch.compile`` before capture (the first rounds of
            each shape compile; minutes on a GPU host).
        fuse_projections: rewrite the loaded Llama/Qwen2 layers (in place, for every caller) to
            compute q/k/v with one GEMM and gate/up with one; same weights, no extra memory; the
            low-order bits of results may differ.
        pack_weights: pack every linear layer's weight once for the CPU's matmul
            (:mod:`specsplit.runtime.packed`): a forward of a few rows (a tree, a small batch) then
            costs about one row's. ``None`` (default): models the engine loads itself by name, when
            they are float32 on a CPU and ``compile`` is off (torch.compile cannot lower packed
            weights); ``True``: also a model object passed in (rewritten in place); ``False``:
            never. Low-order bits of results may differ from the unpacked model's.
        quantize: the draft's linear weights as int8 with a scale per output channel
            (:mod:`specsplit.runtime.int8`, CPU only): a draft step reads a quarter of the float32
            bytes, and where PyTorch has FBGEMM (x86) its inputs are quantized too, for int8 products
            in prompts as in steps. Lossless (the target verifies every token); it can only cost
            acceptance.
            ``"auto"`` (default): on a draft the engine loads itself on a CPU, where this machine's
            int8 kernel beats the dense one and ``compile`` is off; ``"int8"``: always (a model
            object passed in is rewritten in place); ``"none"``: never.
        max_sessions: live sessions kept; one more evicts the least recently used.
        session_ttl_s: idle sessions older than this are freed.
        max_tree_nodes / max_tree_depth / max_context: limits a request may not exceed.
        vocab_subset: score only this many tokens in the draft's output layer, the best-ranked ones
            (FR-Spec; :mod:`specsplit.runtime.vocab_subset`): a cheaper draft step where the output
            layer is a large part of the weights read, lossless, at the cost of the rounds whose next
            token lies outside the subset. ``None`` (default): the whole vocabulary.
        vocab_ranking: a JSON file of token ids, best first (``specsplit draft-vocab`` writes one from
            your texts); ``None``: token id order (merge order of a byte-level BPE vocabulary).
        tuning: A/B switches (:class:`EngineTuning`).
    """

    model: str | None = None
    device: str | None = None
    dtype: str = "auto"
    cuda_graphs: bool = False
    compile: bool = False
    fuse_projections: bool = False
    pack_weights: bool | None = None
    quantize: str = "auto"
    max_sessions: int = 64
    session_ttl_s: float = 600.0
    max_tree_nodes: int = 256
    max_tree_depth: int = 64
    max_context: int = 32768
    vocab_subset: int | None = None
    vocab_ranking: str | None = None
    tuning: EngineTuning = field(default_factory=EngineTuning)

    def __post_init__(self) -> None:
        _check_engine(self, "draft")
        if self.quantize not in DRAFT_QUANTIZE:
            raise ConfigError(f"draft.quantize must be one of {DRAFT_QUANTIZE}, got {self.quantize!r}")
        if self.quantize == "int8" and (self.fuse_projections or self.pack_weights):
            what = "fuse_projections" if self.fuse_projections else "pack_weights"
            raise ConfigError(f"draft.quantize='int8' and draft.{what} exclude each other: int8 replaces the "
                              "linear layers both would rewrite")  # fmt: skip
        if self.vocab_subset is not None and self.vocab_subset < 1:
            raise ConfigError(f"draft.vocab_subset must be >= 1, got {self.vocab_subset}")
        if self.vocab_ranking is not None and self.vocab_subset is None:
            raise ConfigError(
                "draft.vocab_ranking ranks the tokens of draft.vocab_subset: set vocab_subset too"
            )


@dataclass
class TargetConfig:
    """The target model and its engine.

    Attributes:
        model / device / dtype / cuda_graphs / compile / fuse_projections / pack_weights / max_sessions /
            session_ttl_s / tuning: as for :class:`DraftConfig`.
        device_map: accelerate device map (``"auto"`` or a dict) that spreads the target over
            several GPUs; takes precedence over ``device`` (such a target runs eagerly).
        max_tree_nodes / max_tree_depth: the largest tree a request may carry.
        max_context: most tokens a session (prompt and generation) may hold.
        stateless: keep no KV between requests (every request carries the full context).
        specpv: SpecPV partial verification for long contexts (opt-in, lossy; eager path only).
        draft_heads: a directory of draft heads trained for this target (``specsplit heads train``,
            :mod:`specsplit.runtime.heads`): after every verification the target also guesses the
            next tokens from its own hidden state, and the n-gram drafters' rounds verify those
            guesses too (lossless: they are only proposals). The target's output layer is wrapped in
            place to keep its hidden states. ``None``: no heads.
        draft_heads_nodes: tree nodes the heads' guesses take in a round.
        draft_heads_tree: ``"dynamic"``: each round's most probable rank paths under the heads' own
            probabilities, picked on the device; ``"static"``: the same paths every round, the most
            often right on held-out text (Medusa's tree).
    """

    model: str | None = None
    device: str | None = None
    device_map: str | dict[str, Any] | None = None
    dtype: str = "auto"
    cuda_graphs: bool = False
    compile: bool = False
    fuse_projections: bool = False
    pack_weights: bool | None = None
    max_sessions: int = 64
    session_ttl_s: float = 600.0
    max_tree_nodes: int = 256
    max_tree_depth: int = 64
    max_context: int = 32768
    stateless: bool = False
    specpv: SpecPVConfig = field(default_factory=SpecPVConfig)
    draft_heads: str | None = None
    draft_heads_nodes: int = 32
    draft_heads_tree: str = "dynamic"
    tuning: EngineTuning = field(default_factory=EngineTuning)

    def __post_init__(self) -> None:
        _check_engine(self, "target")
        self.specpv = SpecPVConfig.from_any(self.specpv)
        if self.max_context < 2:
            raise ConfigError(f"target.max_context must be >= 2, got {self.max_context}")
        top = self.max_tree_nodes if self.draft_heads is not None else self.draft_heads_nodes
        if not 1 <= self.draft_heads_nodes <= top:
            raise ConfigError(
                f"target.draft_heads_nodes must be in [1, max_tree_nodes={self.max_tree_nodes}], "
                f"got {self.draft_heads_nodes}"
            )
        if self.draft_heads_tree not in ("dynamic", "static"):
            raise ConfigError(
                f"target.draft_heads_tree must be 'dynamic' or 'static', got {self.draft_heads_tree!r}"
            )


# The lookahead window ``NgramConfig(lookahead="auto")`` runs where the target replays CUDA graphs, and
# the bench's ``-lookahead`` decoders unless told otherwise: 2 rows of 8 guesses (16 window nodes)
# beside 16 n-gram nodes fill a 32-node round. Of the splits of a 32-node round measured, this one
# kept more of the prompt's copies than 3 rows of 7 beside 11 and found as much new text
# (benchmarks/NOTES.md, "Lookahead").
DEFAULT_LOOKAHEAD = 8
DEFAULT_LOOKAHEAD_LEVELS = 2
DEFAULT_LOOKAHEAD_NODES = 16


@dataclass
class NgramConfig:
    """How n-gram and suffix drafters propose trees (:mod:`specsplit.engines.drafters`).

    Attributes:
        min_n / max_n: shortest and longest suffix of the committed context that is looked up.
        max_depth: deepest proposed node (long chains pay when a passage repeats).
        max_nodes: most nodes an n-gram tree holds.
        max_matches: earlier occurrences merged into one proposal.
        suffix_cache_tokens: tokens of earlier generations the ``suffix`` and ``auto`` drafters keep
            (per generator or worker; the oldest generations go first).
        lookahead: guesses a row of the lookahead window holds (0: no lookahead). With it, every
            round the n-gram drafters draft (under ``lookahead_policy``) verifies a
            window of ``lookahead * lookahead_levels`` Jacobi guesses beside the n-gram candidates,
            and the target's outputs on it fill a pool of n-grams the target wrote itself
            (:mod:`specsplit.core.lookahead`): proposals for text that never occurred before. Pays
            where a forward of a few dozen more rows costs little (a target replaying CUDA graphs
            on a GPU), not on a CPU. ``"auto"`` (the default): :data:`DEFAULT_LOOKAHEAD` wide where
            the target is known to replay CUDA graphs (a local target with ``cuda_graphs``, or a
            target worker running the rounds on its graphs) and the drafter is not ``"hybrid"``
            (which asks for the model's tree every round), none elsewhere (a CPU target, or a gRPC
            client loop, which cannot tell).
        lookahead_levels: rows of the window; pool n-grams are ``lookahead_levels + 1`` tokens.
        lookahead_pool: n-grams the pool keeps per first token, and proposes at most a round.
        lookahead_nodes: tree nodes a lookahead round gives the proposal (prompt matches and pool
            n-grams); the window's nodes come on top.
        lookahead_policy: ``"always"`` (the default) runs lookahead rounds whenever the n-gram
            drafter drafts; ``"adaptive"`` times lookahead rounds against the planner's (short
            probes of each, the faster held, re-probed ever less often), for a target where it is
            unknown whether the window pays. Its probes compare different stretches of text, and a
            probe of lookahead starts from a window that has not run, so on a GPU it can settle on
            the planner where lookahead pays (benchmarks/NOTES.md, "Lookahead").
        guess_policy: with a target that has draft heads: ``"always"`` (the default) grows their
            guesses in every round; ``"adaptive"`` grows them only where they have added tokens
            worth their cost (:class:`~specsplit.engines.ab_policy.GuessPolicy`: measured gain per
            context against the round time growing adds), so rounds that copy their context skip an
            EAGLE head's levels and only feed its cache.
        guess_cost_tokens: ``"adaptive"``'s cost of growing guesses, in committed tokens, instead of
            timing rounds with and without them (None: timed).
    """

    min_n: int = 1
    max_n: int = 6
    max_depth: int = 16
    max_nodes: int = 32
    max_matches: int = 8
    suffix_cache_tokens: int = 200_000
    lookahead: int | str = "auto"
    lookahead_levels: int = DEFAULT_LOOKAHEAD_LEVELS
    lookahead_pool: int = 7
    lookahead_nodes: int = DEFAULT_LOOKAHEAD_NODES
    lookahead_policy: str = "always"
    guess_policy: str = "always"
    guess_cost_tokens: float | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise ConfigError(f"ngram needs 1 <= min_n <= max_n, got {self.min_n}, {self.max_n}")
        for name in ("max_depth", "max_nodes", "max_matches"):
            if getattr(self, name) < 1:
                raise ConfigError(f"ngram.{name} must be >= 1, got {getattr(self, name)}")
        if self.suffix_cache_tokens < 0:
            raise ConfigError(f"ngram.suffix_cache_tokens must be >= 0, got {self.suffix_cache_tokens}")
        if self.lookahead != "auto" and not (
            isinstance(self.lookahead, int) and not isinstance(self.lookahead, bool) and self.lookahead >= 0
        ):
            raise ConfigError(
                f"ngram.lookahead must be 'auto' or an integer >= 0 (0: off), got {self.lookahead!r}"
            )
        for name in ("lookahead_levels", "lookahead_pool", "lookahead_nodes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"ngram.{name} must be >= 1, got {getattr(self, name)}")
        if self.lookahead_policy not in ("adaptive", "always"):
            raise ConfigError(
                f"ngram.lookahead_policy must be 'adaptive' or 'always', got {self.lookahead_policy!r}"
            )
        if self.guess_policy not in ("adaptive", "always"):
            raise ConfigError(f"ngram.guess_policy must be 'adaptive' or 'always', got {self.guess_policy!r}")
        if self.guess_cost_tokens is not None and not self.guess_cost_tokens >= 0:
            raise ConfigError(f"ngram.guess_cost_tokens must be >= 0 or None, got {self.guess_cost_tokens!r}")


@dataclass
class PipelineTuning:
    """How the round loop talks to the engines: switches that exist to compare implementations.

    Attributes:
        overlap_policy: with ``overlap``: ``"adaptive"`` times short probes with and without
            speculation and keeps whichever commits tokens faster, re-probing ever less often;
            ``"always"`` speculates every round.
        grpc_streams: send each round's draft and verify calls over long-lived gRPC streams
            (unary calls wherever a worker refuses or lacks them). Off: unary calls only.
        sync_timing: synchronise the device around each span so telemetry's draft/verify split
            is exact (costs a little speed on a GPU).
        draft_processors: the draft model applies the generation's logits processors
            (repetition penalty, bans, biases, custom processors in-process) to its own
            distribution, so its trees follow what the target accepts. Off: it drafts from raw
            logits and keeps its one-graph dynamic-tree round. Output is the same either way.
        ngram: how n-gram drafters propose trees (:class:`NgramConfig`).
    """

    overlap_policy: Literal["adaptive", "always"] = "adaptive"
    grpc_streams: bool = True
    sync_timing: bool = False
    draft_processors: bool = True
    ngram: NgramConfig = field(default_factory=NgramConfig)

    def __post_init__(self) -> None:
        if self.overlap_policy not in ("adaptive", "always"):
            raise ConfigError(f"overlap_policy must be 'adaptive' or 'always', got {self.overlap_policy!r}")


@dataclass
class SpecSplitConfig:
    """Top-level configuration.

    Attributes:
        transport: ``"local"`` (engines in this process) or ``"grpc"`` (remote workers).
        draft_address / target_address: ``host:port`` of the workers in gRPC mode.
        grpc_loop: where the rounds run in gRPC mode: ``"client"`` (this process calls the draft
            and the target worker every round: two hops a round) or ``"target"`` (one ``Generate``
            call; the target worker calls the draft worker it was started with: one hop a round,
            ``draft_address`` unused). Same tokens either way.
        timeout_s: deadline of each remote call.
        auth_token: bearer token sent to the workers (gRPC mode).
        tls_ca_file: CA certificate that signs the workers' TLS certificates (gRPC mode).
        drafter: what proposes each round's tree: ``"model"`` (the draft model), ``"ngram"``
            (prompt lookup over the prompt and the generated tokens: free to run, no draft model
            needed), ``"suffix"`` (n-gram lookup that also indexes earlier generations of this
            generator or worker), ``"hybrid"`` (n-gram candidates merged into the model's tree) or
            ``"auto"`` (a cost model measured online picks, each round, no speculation, an n-gram
            tree, the model's tree or both, whichever commits tokens fastest). Lossless in every
            mode.
        overlap: draft round N+1 while round N verifies (``drafter="model"`` only; pays only with
            draft and target on different devices or machines; the output is identical either way).
        max_batch: rows of a ``generate()`` batch verified together, in one target forward per
            round (continuous batching: rows that finish leave, waiting rows join). ``0`` or ``1``:
            rows decode one after another. Batched rows draft with n-grams (see the README).
        tree: shape of the draft model's tree.
        draft / target: the two engines.
        tuning: A/B switches of the round loop (:class:`PipelineTuning`).
    """

    transport: Literal["local", "grpc"] = "local"
    draft_address: str | None = None
    target_address: str | None = None
    grpc_loop: Literal["client", "target"] = "client"
    timeout_s: float = 60.0
    auth_token: str | None = None
    tls_ca_file: str | None = None
    drafter: Drafter = "model"
    overlap: bool = False
    max_batch: int = 16
    tree: TreeConfig = field(default_factory=TreeConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)
    target: TargetConfig = field(default_factory=TargetConfig)
    tuning: PipelineTuning = field(default_factory=PipelineTuning)

    def __post_init__(self) -> None:
        if self.transport not in ("local", "grpc"):
            raise ConfigError(f"transport must be 'local' or 'grpc', got {self.transport!r}")
        if self.transport == "grpc" and not self.target_address:
            raise ConfigError(
                "transport='grpc' needs target_address='host:port' (or SPECSPLIT_TARGET_ADDRESS); "
                "draft_address is optional (without it the client decodes target-only)"
            )
        if self.drafter not in DRAFTERS:
            raise ConfigError(f"drafter must be one of {DRAFTERS}, got {self.drafter!r}")
        if self.overlap and self.drafter != "model":
            raise ConfigError(f"overlap drafts the next round with the draft model: it needs drafter='model', "
                              f"got {self.drafter!r}")  # fmt: skip
        if self.grpc_loop not in ("client", "target"):
            raise ConfigError(f"grpc_loop must be 'client' or 'target', got {self.grpc_loop!r}")
        if self.grpc_loop == "target" and self.transport != "grpc":
            raise ConfigError(
                "grpc_loop='target' needs transport='grpc' (the rounds run on the target worker)"
            )
        if self.timeout_s <= 0:
            raise ConfigError(f"timeout_s must be > 0, got {self.timeout_s}")
        if not 0 <= self.max_batch <= BATCH_LIMIT:
            raise ConfigError(f"max_batch must be in 0..{BATCH_LIMIT}, got {self.max_batch}")
        self.target.specpv.check_tree(self.tree.max_nodes, self.tree.depth_limit)

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SpecSplitConfig:
        """Build from nested dicts (a config file); unknown keys are errors."""
        return _from_dict(cls, d, "")

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> SpecSplitConfig:
        """Load JSON (``.json``) or TOML (``.toml``), then apply environment overrides."""
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        if p.suffix == ".toml":
            import tomllib

            data = tomllib.loads(p.read_text())
        else:
            data = json.loads(p.read_text())
        return cls.from_env(base=cls.from_dict(data))

    @classmethod
    def from_env(
        cls, base: SpecSplitConfig | None = None, environ: dict[str, str] | None = None
    ) -> SpecSplitConfig:
        """``base`` (or defaults) with every ``SPECSPLIT_*`` variable applied."""
        env = os.environ if environ is None else environ
        d = (base or cls()).to_dict()
        _apply_env(cls, d, "SPECSPLIT", env)
        return cls.from_dict(d)


def _section_type(typ: Any) -> type | None:
    """The dataclass a field holds (``SpecPVConfig`` for ``SpecPVConfig``), or None."""
    if isinstance(typ, type) and dataclasses.is_dataclass(typ):
        return typ
    return None


def _fields(cls: type) -> dict[str, Any]:
    """Field name -> resolved type of a config dataclass."""
    return typing.get_type_hints(cls)


def _from_dict(cls: type, d: dict[str, Any], where: str) -> Any:
    if not isinstance(d, dict):
        raise ConfigError(f"config section {where or 'top level'} must be a mapping, got {type(d).__name__}")
    hints = _fields(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(d) - names
    if unknown:
        raise ConfigError(f"unknown config keys in {where or 'the top level'}: {sorted(unknown)}")
    kwargs = dict(d)
    for name, value in d.items():
        sec = _section_type(hints[name])
        if sec is not None and isinstance(value, dict):
            kwargs[name] = _from_dict(sec, value, f"{where}.{name}".lstrip("."))
    return cls(**kwargs)


def _apply_env(cls: type, d: dict[str, Any], prefix: str, env: Any) -> None:
    """Set ``d[name]`` from ``{prefix}_{NAME}`` for every field of ``cls``, recursing into sections."""
    for name, typ in _fields(cls).items():
        key = f"{prefix}_{name}".upper()
        sec = _section_type(typ)
        if sec is not None:
            sub = dataclasses.asdict(d[name]) if dataclasses.is_dataclass(d[name]) else dict(d[name])
            if key in env:
                try:
                    raw = json.loads(env[key])
                except json.JSONDecodeError:
                    raise ConfigError(f"environment variable {key} must be a JSON object") from None
                if not isinstance(raw, dict):
                    raise ConfigError(f"environment variable {key} must be a JSON object")
                sub.update(raw)
            _apply_env(sec, sub, key, env)
            d[name] = sub
        elif key in env:
            d[name] = _parse(env[key], typ, key)


def _parse(raw: str, typ: Any, key: str) -> Any:
    args = set(typing.get_args(typ)) if isinstance(typ, types.UnionType) or typing.get_origin(typ) else {typ}
    t = str(typ)
    if type(None) in args and raw.lower() == "none":
        return None
    try:
        if bool in args:
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if int in args:
            return int(raw)
        if float in args:
            return float(raw)
        if "list" in t or "dict" in t:
            if raw.strip().startswith(("[", "{")):
                return json.loads(raw)
            return raw
    except (ValueError, json.JSONDecodeError):
        raise ConfigError(f"environment variable {key}={raw!r} is not a valid {t}") from None
    return raw


def resolved_attention_kernel(kernel: str, cuda_graphs: bool) -> str:
    """``attention_kernel`` with ``"auto"`` resolved (``"math"`` on the static path, else ``"sdpa"``)."""
    if kernel == "auto":
        return "math" if cuda_graphs else "sdpa"
    return kernel


def _check_engine(cfg: DraftConfig | TargetConfig, section: str) -> None:
    if cfg.dtype not in _DTYPES:
        raise ConfigError(f"{section}.dtype must be one of {_DTYPES}, got {cfg.dtype!r}")
    if cfg.max_sessions < 1:
        raise ConfigError(f"{section}.max_sessions must be >= 1, got {cfg.max_sessions}")
    if cfg.session_ttl_s <= 0:
        raise ConfigError(f"{section}.session_ttl_s must be > 0, got {cfg.session_ttl_s}")
    if cfg.max_tree_nodes < 1 or cfg.max_tree_depth < 1:
        raise ConfigError(f"{section}.max_tree_nodes and {section}.max_tree_depth must be >= 1")
    if not isinstance(cfg.tuning, EngineTuning):
        cfg.tuning = _from_dict(EngineTuning, cfg.tuning, f"{section}.tuning")
    if cfg.pack_weights and cfg.fuse_projections:
        raise ConfigError(
            f"{section}.pack_weights (CPU) and {section}.fuse_projections (GPU) exclude each other"
        )
    if cfg.pack_weights and cfg.compile:
        raise ConfigError(
            f"{section}.pack_weights and {section}.compile exclude each other: torch.compile cannot "
            "lower packed oneDNN weights (on a CPU it packs the weights of what it compiles itself)"
        )
