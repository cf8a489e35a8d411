"""Hugging Face logits processors applied to a verified tree, every row with its own context.

``model.generate()`` turns each step's logits into scores with a ``LogitsProcessorList`` built
from the generation options (penalties, n-gram bans, length rules, bad words, warpers, ...) and
the sequence so far. Under speculation one target forward scores a whole tree, so the same list
must see, for every row, the context that row stands for: the prompt (with its left padding),
the committed tokens and the row's path from the tree's root. Rows at the same depth have contexts
of the same length, so the tree is processed as one batch per depth level (HF processors work
row by row on ``[batch, length]`` inputs). Two kinds run once over all rows instead: processors that
ignore the context (temperature, top-k/p, min-p, typical, epsilon, eta, suppressed tokens,
renormalisation), and the repetition penalty, which depends only on the set of tokens in the
context: a `[rows, vocab]` token mask (the history's tokens, kept incrementally, or'd with each
row's path) and HF's own elementwise operations. A greedy round whose processors are only of these
kinds (and capture-safe) still replays as one CUDA graph. A draft growing a tree applies the same
list to each level it grows (:meth:`TreeProcessors.level_scores`): a level's rows all have contexts
of one length, so the list runs on them as one batch.

The processors are the ones ``generate()`` builds (``_get_logits_processor`` of the target model),
so their semantics and order are HF's by construction. User processors must, like HF's own, depend
on ``(input_ids, scores)`` row by row only; ones that keep state between calls are not supported.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import GenerationConfig
from transformers.generation import logits_process as lp

from specsplit.core.sampling import TIE_SLACK
from specsplit.core.tree import TokenTree
from specsplit.core.tree_attention import ancestor_matrix
from specsplit.errors import InvalidRequest
from specsplit.messages import LogitsProcessing
from specsplit.runtime.runner import h2d

# GenerationConfig fields that shape the scores of one sequence; the only ones a target accepts.
SCORE_FIELDS = (
    "do_sample",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "typical_p",
    "epsilon_cutoff",
    "eta_cutoff",
    "top_h",
    "repetition_penalty",
    "no_repeat_ngram_size",
    "bad_words_ids",
    "min_length",
    "min_new_tokens",
    "max_length",
    "sequence_bias",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "remove_invalid_values",
    "exponential_decay_length_penalty",
    "suppress_tokens",
    "begin_suppress_tokens",
    "renormalize_logits",
    "eos_token_id",
    "pad_token_id",
    "bos_token_id",
)
# Options whose processors SpecSplit's own sampling already applies (no processor pass needed).
PLAIN_FIELDS = frozenset({"do_sample", "temperature", "top_k", "top_p", "eos_token_id", "pad_token_id",
                          "bos_token_id", "max_length"})  # fmt: skip
# Processors that depend only on the set of tokens in the context (exact types: a subclass may not).
_SET_BASED = (lp.RepetitionPenaltyLogitsProcessor,)
# Context-free processors made of fixed-shape device ops only (no host read): a greedy round
# that applies only these and repetition penalties still replays as one CUDA graph.
_CAPTURE_SAFE = (lp.SuppressTokensLogitsProcessor, lp.LogitNormalization)
# Processors whose result does not depend on the context (applied once to all rows).
_CONTEXT_FREE = (
    lp.TemperatureLogitsWarper,
    lp.TopKLogitsWarper,
    lp.TopPLogitsWarper,
    lp.MinPLogitsWarper,
    lp.TypicalLogitsWarper,
    lp.EpsilonLogitsWarper,
    lp.EtaLogitsWarper,
    lp.TopHLogitsWarper,
    lp.SuppressTokensLogitsProcessor,
    lp.LogitNormalization,
    lp.InfNanRemoveLogitsProcessor,
)


def build_processors(model: Any, spec: LogitsProcessing, device: torch.device) -> lp.LogitsProcessorList:
    """The ``LogitsProcessorList`` ``model.generate()`` builds for ``spec``'s options.

    Raises:
        InvalidRequest: an option outside :data:`SCORE_FIELDS` or one HF rejects.
    """
    unknown = sorted(set(spec.options) - set(SCORE_FIELDS))
    if unknown:
        raise InvalidRequest(f"processing options not accepted by the target: {unknown}")
    try:
        gc = GenerationConfig(**spec.options)
        model._prepare_special_tokens(gc, True, device)
        procs: lp.LogitsProcessorList = model._get_logits_processor(
            generation_config=gc,
            input_ids_seq_length=spec.prompt_length,
            logits_processor=lp.LogitsProcessorList(spec.processors),
            device=device,
            model_kwargs={},
        )
    except (TypeError, ValueError) as e:
        raise InvalidRequest(f"bad processing options: {e}") from e
    return procs


class TokenHistory:
    """A session's tokens as the processors see them (left padding, prompt, committed), on device.

    One buffer grown by doubling; a round writes its pending tokens and, once decided, the
    accepted ones (small host-to-device copies)."""

    def __init__(self, prefix: list[int], device: torch.device, capacity: int = 256):
        self.prefix_len = len(prefix)
        self.buf = torch.zeros(max(capacity, self.prefix_len + 1), dtype=torch.long, device=device)
        if prefix:
            self.buf[: self.prefix_len] = h2d(torch.tensor(prefix, dtype=torch.long), device)

    def write(self, start: int, tokens: list[int]) -> None:
        end = start + len(tokens)
        if end > self.buf.shape[0]:
            grown = torch.zeros(max(end, 2 * self.buf.shape[0]), dtype=torch.long, device=self.buf.device)
            grown[:start] = self.buf[:start]
            self.buf = grown
        if tokens:
            self.buf[start:end] = h2d(torch.tensor(tokens, dtype=torch.long), self.buf.device)

    def view(self, length: int) -> torch.Tensor:
        return self.buf[:length]


class TreeProcessors:
    """A session's processors and token history: :meth:`scores` processes a verified tree (target),
    :meth:`level_scores` one level of a tree being grown (draft).

    Args:
        model: the target's HF model (its ``_get_logits_processor`` builds the list).
        spec: the generation's options.
        device: where the logits are.
    """

    def __init__(self, model: Any, spec: LogitsProcessing, device: torch.device):
        self.key = spec.to_json()
        hf_procs = build_processors(model, spec, device)
        # HF's top-k then top-p warpers as one pass over the best candidates (no full sort); the
        # exact stages keep HF's own pair for the rare round that has to be decided again.
        self.procs = _fuse_top_k_top_p(list(hf_procs))
        self._fused = [p for p in self.procs if isinstance(p, FastTopKTopP)]
        self.stages = _group(self.procs)
        self._exact_stages = _group(list(hf_procs)) if self._fused else self.stages
        self.history = TokenHistory(spec.prefix_token_ids, device)
        # Only per-depth batches need the tree's depths on the host (a read of a device tree).
        self.needs_depths = any(kind == "rows" for kind, _ in self.stages)
        self.context_free = all(kind == "free" for kind, _ in self.stages)
        # Set when every stage is fixed-shape device work given the presence mask: the key of
        # a whole-round graph that applies them (:func:`device_scores`); the options alone
        # define the processors then, so sessions with equal options share the graph.
        capturable = not spec.processors and all(
            kind == "penalty" or (kind == "free" and all(type(p) in _CAPTURE_SAFE for p in procs))
            for kind, procs in self.stages
        )
        self.graph_key = self.key if capturable else None
        self._present: torch.Tensor | None = None  # [V] bool: tokens in the history (penalty stages)
        self._present_len = 0

    def presence(self, vocab: int, length: int) -> torch.Tensor:
        """`[vocab]` bool: which tokens the first ``length`` tokens of the history hold. Updated
        with the tokens added since the last call; rebuilt after :meth:`record` rewrites tokens it
        already holds (a draft's speculative extension that turned out wrong)."""
        if self._present is None or self._present.shape[0] != vocab:
            self._present = torch.zeros(vocab, dtype=torch.bool, device=self.history.buf.device)
            self._present_len = 0
        if length > self._present_len:
            self._present.index_fill_(0, self.history.view(length)[self._present_len :], True)
            self._present_len = length
        return self._present

    def record(self, start: int, tokens: list[int]) -> None:
        """Write ``tokens`` at position ``start`` of the history."""
        if start < self._present_len and self._present is not None:
            self._present.zero_()
            self._present_len = 0
        self.history.write(start, tokens)

    def begin(self, cached: int, pending: list[int]) -> int:
        """Record a round's pending tokens after the ``cached`` tokens the target holds; returns the
        context length of row 0."""
        start = self.history.prefix_len + cached
        self.record(start, pending)
        return start + len(pending)

    def commit(self, length: int, tokens: list[int]) -> None:
        """Record the accepted tokens after row 0's context of ``length`` tokens."""
        self.record(length, tokens)

    def level_scores(self, logits: torch.Tensor, paths: torch.Tensor, length: int) -> torch.Tensor:
        """`[W, V]` float32 processed scores of ``W`` nodes at one depth of a tree being grown: each
        row's context is the first ``length`` tokens of the history followed by its path.

        All rows of a level have contexts of one length, so the whole list runs as one batch; a
        repetition penalty takes the token mask (the history's presence mask plus each path), so
        only per-row processors see the whole context.

        Args:
            logits: `[W, V]` the model's logits of the nodes (or of the context row: ``paths``
                `[1, 0]`).
            paths: `[W, d]` each row's tokens below the context, root first.
            length: the context's length in the history.
        """
        x = logits.to(torch.float32, copy=True)
        ctx = mask = None
        for kind, procs in self.stages:
            if kind == "free":
                x = _apply(procs, None, x)
            elif kind == "penalty":
                if mask is None:
                    mask = self.presence(x.shape[-1], length)[None].expand(x.shape[0], -1)
                    mask = mask.clone().scatter_(1, paths, True) if paths.shape[1] else mask
                x = _penalise(procs, mask, x)
            else:
                if ctx is None:
                    hist = self.history.view(length)[None].expand(x.shape[0], length)
                    ctx = torch.cat([hist, paths], dim=1)
                x = _apply(procs, ctx, x)
        return x

    def overflow(self) -> torch.Tensor | None:
        """`[1]` int64 device flag of the last :meth:`scores` call: 1 when a fused top-k + top-p
        pass may have missed tokens tying the k-th score (decide with ``scores(exact=True)``
        then); None when no pass is fused."""
        flags = [p.overflow for p in self._fused if p.overflow is not None]
        if not flags:
            return None
        return flags[0] if len(flags) == 1 else torch.stack(flags).amax(0)

    def scores(
        self, logits: torch.Tensor, tree: TokenTree, host_depths: list[int], length: int, exact: bool = False
    ) -> torch.Tensor:
        """`[N + 1, V]` float32 processed scores of the context row and every node.

        Args:
            logits: `[N + 1, V]` the target's logits.
            tree: the verified tree (on the logits' device).
            host_depths: the nodes' depths (host ints, 1 = a child of the context row); read
                only when :attr:`needs_depths`.
            length: row 0's context length (:meth:`begin`).
            exact: HF's own top-k and top-p warpers (full sort) instead of the fused pass.
        """
        stages = self._exact_stages if exact else self.stages
        x = logits.to(torch.float32, copy=True)  # processors may work in place; the logits stay raw
        if self.context_free:
            for _, procs in stages:
                x = _apply(procs, None, x)
            return x
        hist = self.history.view(length)
        levels: list[tuple[int, torch.Tensor]] | None = None
        path = sets = mask = None
        for kind, procs in stages:
            if kind == "free":
                x = _apply(procs, None, x)
            elif kind == "penalty":
                mask = mask if mask is not None else _penalty_mask(self.presence(x.shape[-1], length), tree)
                x = _penalise(procs, mask, x)
            elif kind == "set":
                sets = sets if sets is not None else _set_contexts(hist, tree)
                x = _apply(procs, sets, x)
            else:
                if levels is None or path is None:
                    levels = _levels(host_depths, x.device)
                    path = _path_tokens(tree, max(host_depths, default=0))
                out = torch.empty_like(x)
                for d, rows in levels:
                    ctx = hist[None].expand(rows.shape[0], length)
                    if d:
                        ctx = torch.cat([ctx, path.index_select(0, rows - 1)[:, :d]], dim=1)
                    out.index_copy_(0, rows, _apply(procs, ctx, x.index_select(0, rows)))
                x = out
        return x


def device_scores(
    stages: list[tuple[str, list[Any]]], logits: torch.Tensor, tree: TokenTree, present: torch.Tensor
) -> torch.Tensor:
    """:meth:`TreeProcessors.scores` for the stages of processors with a ``graph_key``: fixed-shape
    device ops only, so a whole round can be captured as one graph (``present``:
    :meth:`TreeProcessors.presence`)."""
    x = logits.to(torch.float32, copy=True)
    mask = None
    for kind, procs in stages:
        if kind == "penalty":
            mask = mask if mask is not None else _penalty_mask(present, tree)
            x = _penalise(procs, mask, x)
        else:
            x = _apply(procs, None, x)
    return x


class FastTopKTopP:
    """HF's ``TopKLogitsWarper`` followed by its ``TopPLogitsWarper``, computed over the
    ``top_k + TIE_SLACK`` best candidates instead of sorting the whole vocabulary (the same
    operations on the tokens that hold mass; everything else gets the filter value, as HF's pair
    gives it). ``overflow`` is the last call's `[1]` flag: more tokens may tie the k-th score than
    the candidates hold, and only HF's pair is exact then."""

    def __init__(self, top_k: lp.TopKLogitsWarper, top_p: lp.TopPLogitsWarper):
        self.pair = (top_k, top_p)
        self.overflow: torch.Tensor | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        top_k, top_p = self.pair
        k = min(top_k.top_k, scores.shape[-1])
        if k + TIE_SLACK >= scores.shape[-1]:
            self.overflow = None
            return top_p(input_ids, top_k(input_ids, scores))
        vals, ids = torch.topk(scores, k + TIE_SLACK, dim=-1)  # descending
        kth = vals[..., k - 1 : k]
        cand = vals.masked_fill(vals < kth, top_k.filter_value).flip(-1)  # ascending, as HF sorts
        remove = cand.softmax(dim=-1).cumsum(dim=-1) <= (1 - top_p.top_p)
        remove[..., -top_p.min_tokens_to_keep :] = False
        kept = cand.masked_fill(remove, top_p.filter_value).flip(-1)
        self.overflow = ((vals[..., -1:] >= kth) & (kth > -torch.inf)).any().long().view(1)
        return torch.full_like(scores, top_p.filter_value).scatter_(-1, ids, kept)


def _fuse_top_k_top_p(procs: list[Any]) -> list[Any]:
    """``procs`` with each HF top-k warper directly followed by a top-p warper made one
    :class:`FastTopKTopP` (exact types: a subclass may behave otherwise)."""
    out: list[Any] = []
    for proc in procs:
        if out and type(proc) is lp.TopPLogitsWarper and type(out[-1]) is lp.TopKLogitsWarper:
            out[-1] = FastTopKTopP(out[-1], proc)
        else:
            out.append(proc)
    return out


def _group(procs: list[Any]) -> list[tuple[str, list[Any]]]:
    """Consecutive processors of one kind grouped into stages ``(kind, processors)``: kind "free"
    (no context), "penalty" (a repetition penalty over the whole context: a token mask), "set"
    (the context's token set) or "rows" (one batch per depth level)."""
    stages: list[tuple[str, list[Any]]] = []
    for proc in procs:
        kind = _kind(proc)
        if stages and stages[-1][0] == kind:
            stages[-1][1].append(proc)
        else:
            stages.append((kind, [proc]))
    return stages


def _kind(proc: Any) -> str:
    if type(proc) in _CONTEXT_FREE or isinstance(proc, FastTopKTopP):
        return "free"
    if type(proc) in _SET_BASED:
        # HF's penalty cuts `prompt_ignore_length` tokens off the context: the generic set path.
        return "set" if getattr(proc, "prompt_ignore_length", None) else "penalty"
    return "rows"


def _penalty_mask(present: torch.Tensor, tree: TokenTree) -> torch.Tensor:
    """`[N + 1, V]` bool: the tokens in each row's context (the history's, plus the row's path);
    fixed-shape device ops only."""
    n, vocab = tree.num_nodes, present.shape[0]
    if n == 0:
        return present[None]
    anc = ancestor_matrix(tree.parents)  # [N, N] j is i or an ancestor of i
    cols = torch.where(anc, tree.token_ids[None, :], vocab)  # others: a spare column, dropped
    paths = torch.zeros(n, vocab + 1, dtype=torch.bool, device=present.device).scatter_(1, cols, True)
    return torch.cat([present[None], paths[:, :vocab] | present[None]], dim=0)


def _penalise(procs: list[Any], mask: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """HF's repetition penalty on the masked tokens (the same elementwise operations)."""
    for proc in procs:
        x = torch.where(mask, torch.where(x < 0, x * proc.penalty, x / proc.penalty), x)
    return x


def _set_contexts(hist: torch.Tensor, tree: TokenTree) -> torch.Tensor:
    """`[N + 1, L + N]` a context per row holding exactly that row's tokens (the history, the row's
    path), in any order, padded with the row's own last token; device ops only."""
    n = tree.num_nodes
    last = torch.cat([hist[-1:], tree.token_ids])  # [N + 1] each row's own last token
    if n:
        anc = ancestor_matrix(tree.parents)  # [N, N] j is i or an ancestor of i
        nodes = torch.where(anc, tree.token_ids[None, :], tree.token_ids[:, None])
        rows = torch.cat([last[:1, None].expand(1, n), nodes], dim=0)  # [N + 1, N]
    else:
        rows = last.new_zeros(1, 0)
    return torch.cat([hist[None].expand(n + 1, hist.shape[0]), rows], dim=1)


def _apply(procs: list[Any], input_ids: torch.Tensor | None, scores: torch.Tensor) -> torch.Tensor:
    ids = input_ids if input_ids is not None else scores.new_zeros((scores.shape[0], 0), dtype=torch.long)
    for proc in procs:
        scores = proc(ids, scores)
    return scores


def _levels(host_depths: list[int], device: torch.device) -> list[tuple[int, torch.Tensor]]:
    """Rows grouped by depth (row 0: depth 0; node i: row i + 1), as device index tensors made
    with one host-to-device copy."""
    depth = torch.tensor([0, *host_depths], dtype=torch.long)
    order = h2d(torch.argsort(depth, stable=True), device)
    counts = torch.bincount(depth).tolist()
    out, start = [], 0
    for d, n in enumerate(counts):  # one entry per depth level
        if n:
            out.append((d, order[start : start + n]))
            start += n
    return out


def _path_tokens(tree: TokenTree, max_depth: int) -> torch.Tensor:
    """`[N, max_depth]` the tokens on each node's path from the root (column k: depth k + 1;
    zeros past the node's own depth); device ops only."""
    n = tree.num_nodes
    dev = tree.token_ids.device
    wide = torch.zeros(n, max_depth + 1, dtype=torch.long, device=dev)
    if n == 0 or max_depth == 0:
        return wide[:, :max_depth]
    rows = torch.arange(n, device=dev)
    node = rows.clone()
    for _ in range(max_depth):
        valid = node >= 0
        safe = node.clamp_min(0)
        col = torch.where(valid, tree.depths[safe] - 1, max_depth)  # past the path: the spare column
        wide[rows, col] = tree.token_ids[safe]
        node = torch.where(valid, tree.parents[safe], -1)
    return wide[:, :max_depth]


def needs_processing(options: dict[str, Any]) -> bool:
    """Whether ``options`` (non-default fields only) need the processor pass: something beyond
    temperature / top-k / top-p, which SpecSplit's own sampling applies."""
    return any(k not in PLAIN_FIELDS for k in options)
