"""Draft heads on the target's own hidden states (Medusa style): guesses that cost one small product.

A *draft head* ``k`` (1-based) reads the target's last hidden state ``h_t`` (the input of its output
layer at the row that decided the next token ``x_{t+1}``) and guesses the token ``k`` places after
it, ``x_{t+1+k}``::

    z_k = h_t + SiLU(W_k h_t + U_k e(x_{t+1}) + b_k)   # one residual block per head  [K, H]
    logits_k = lm_head(z_k)                            # the target's own output layer, frozen

``e(x_{t+1})`` is the target's input embedding of the token that row decided (*token-conditioned*
heads, ``HeadsInfo.token_input``; Medusa's original heads have no ``U``). The hidden state only
implies that token through the output layer's argmax, which one block cannot compute; given the
token, head 1 no longer guesses the token after an unknown one (EAGLE's observation about features
and the shifted token). The token is on the device when the heads run, so this costs one gather.

All ``K`` heads run as one batched product on ONE row after each verification, so a round's
guesses for the next ``K`` tokens cost about one extra output-layer product, not ``K`` model steps.
Their top-``R`` tokens form a tree of *choices* (rank paths such as ``(0, 1)``: head 1's best token,
then head 2's second best), and the next round verifies that tree beside the n-gram drafters' nodes.
Which paths: the ``static`` tree is fixed once from the heads' measured rank accuracies
(:func:`choice_paths`, Medusa's rule); the ``dynamic`` tree (the default) is picked every round on
the device, among a pool of such paths, by this round's own probabilities (:func:`pick_guess_tree`,
EAGLE-2's rule): a confident head spends the nodes deep, an unsure one wide.

Lossless by construction: the heads only propose; the target verifies every node. A tree whose
guesses are all wrong costs a round that commits the target's own token, as a plain step does.

Heads are trained for one target (``specsplit heads train``, :mod:`specsplit.runtime.heads_training`)
and saved as a directory: ``heads.safetensors`` (``weight`` `[K, H, H]`, ``bias`` `[K, H]`) and
``heads.json`` (:class:`HeadsInfo`); token-conditioned heads add ``token_weight`` `[K, H, H]`.
"""

from __future__ import annotations

import heapq
import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol, cast

import torch
import torch.nn.functional as F

from specsplit.errors import ConfigError
from specsplit.runtime.runner import h2d

logger = logging.getLogger(__name__)

WEIGHTS_FILE = "heads.safetensors"
GUESS_TREES = ("dynamic", "static")
HEAD_KINDS = ("medusa", "eagle")
INFO_FILE = "heads.json"


@dataclass
class HeadsInfo:
    """What a heads directory was trained for, and how well its heads guess.

    Attributes:
        num_heads / hidden_size / vocab_size: the heads' shapes (checked against the target).
        base_model: the target they were trained on (its alias or path; informational).
        rank_accuracy: `[K][R]`, how often head ``k``'s rank-``r`` token was the target's token on
            held-out text; :func:`choice_paths` builds the guess tree from it.
        trained_on: how the training data was made (informational).
        token_input: the heads also read the embedding of the token the row decided (``U_k``).
        kind: ``"medusa"`` (these heads) or ``"eagle"`` (one autoregressive draft layer,
            :mod:`specsplit.runtime.eagle`; ``rank_accuracy`` then holds its accuracy by depth).
        eagle: an EAGLE head's :class:`~specsplit.runtime.eagle.EagleConfig` (empty otherwise).
    """

    num_heads: int
    hidden_size: int
    vocab_size: int
    base_model: str = ""
    rank_accuracy: list[list[float]] = field(default_factory=list)
    trained_on: dict[str, Any] = field(default_factory=dict)
    token_input: bool = False
    kind: str = "medusa"
    eagle: dict[str, Any] = field(default_factory=dict)


class DraftHeads(torch.nn.Module):
    """``K`` residual blocks on the target's hidden state, one per guessed position.

    Args:
        num_heads: ``K``, the tokens guessed after the target's next one.
        hidden_size: the target's hidden size ``H``.
        token_input: each block also reads the embedding of the decided token (``U_k``).
    """

    token_weight: torch.nn.Parameter | None

    def __init__(self, num_heads: int, hidden_size: int, token_input: bool = False):
        super().__init__()
        if num_heads < 1 or hidden_size < 1:
            raise ConfigError(
                f"draft heads need num_heads >= 1 and hidden_size >= 1, got {num_heads}, {hidden_size}"
            )
        # Zero blocks start every head as the identity: each first guesses the target's next token.
        self.weight = torch.nn.Parameter(torch.zeros(num_heads, hidden_size, hidden_size))  # [K, out, in]
        self.bias = torch.nn.Parameter(torch.zeros(num_heads, hidden_size))  # [K, H]
        if token_input:
            self.token_weight = torch.nn.Parameter(torch.zeros(num_heads, hidden_size, hidden_size))
        else:
            self.register_parameter("token_weight", None)

    @property
    def num_heads(self) -> int:
        return int(self.weight.shape[0])

    @property
    def token_input(self) -> bool:
        return self.token_weight is not None

    def _token(self, e: torch.Tensor | None) -> torch.Tensor:
        if e is None:
            raise ConfigError("token-conditioned draft heads need the decided tokens' embeddings")
        return e.to(self.weight.dtype)

    def forward(self, h: torch.Tensor, e: torch.Tensor | None = None) -> torch.Tensor:
        """`[M, H]` hidden states (and, for token-conditioned heads, `[M, H]` embeddings of the
        tokens their rows decided) → `[K, M, H]` each head's input of the output layer."""
        y = torch.einsum("mi,koi->kmo", h, self.weight) + self.bias[:, None]
        if self.token_weight is not None:
            y = y + torch.einsum("mi,koi->kmo", self._token(e), self.token_weight)
        return h.unsqueeze(0) + F.silu(y)

    def block(self, k: int, h: torch.Tensor, e: torch.Tensor | None = None) -> torch.Tensor:
        """Head ``k`` (0-based) alone: `[M, H]` → `[M, H]` (training computes heads one at a time)."""
        y = F.linear(h, self.weight[k], self.bias[k])
        if self.token_weight is not None:
            y = y + F.linear(self._token(e), self.token_weight[k])
        return h + F.silu(y)


def head_logits(
    heads: DraftHeads, lm_head: torch.Tensor, h: torch.Tensor, e: torch.Tensor | None = None
) -> torch.Tensor:
    """`[K, M, V]` the heads' logits for `[M, H]` hidden states (and the decided tokens' `[M, H]`
    embeddings ``e``), through the target's output layer ``lm_head`` (`[V, H]`, its dtype)."""
    z = heads(h.to(heads.weight.dtype), e)
    return F.linear(z.to(lm_head.dtype), lm_head)


def head_row_logits(
    heads: DraftHeads,
    out_layer: torch.nn.Module,
    h: torch.Tensor,
    dtype: torch.dtype,
    e: torch.Tensor | None = None,
) -> torch.Tensor:
    """`[K, V]` the heads' logits for ONE hidden state ``h`` (`[1, H]`; ``e``: the decided token's
    `[1, H]` embedding), through the target's output layer module ``out_layer`` (whatever form its
    weight takes: packed for the CPU, say) in its ``dtype``; device ops only (this runs inside a
    captured round)."""
    z = heads(h.to(heads.weight.dtype), e)[:, 0]  # [K, H]
    out: torch.Tensor = out_layer(z.to(dtype))
    return out


def choice_paths(rank_accuracy: list[list[float]], budget: int) -> list[tuple[int, ...]]:
    """The ``budget`` rank paths most likely to be accepted, best first and closed under prefixes.

    A path ``(r_1, ..., r_d)`` guesses head 1's rank-``r_1`` token, then head 2's rank-``r_2`` one,
    and so on; its score is the product of those ranks' accuracies (heads taken as independent, as
    Medusa's trees are). Best-first expansion from the root keeps every path's prefix ahead of it.

    Args:
        rank_accuracy: `[K][R]` accuracies in [0, 1].
        budget: most paths (tree nodes) returned.
    """
    if budget <= 0 or not rank_accuracy or not rank_accuracy[0]:
        return []
    heap: list[tuple[float, int, tuple[int, ...]]] = []
    order = 0  # ties: the earlier pushed (shallower, better ranked) first
    for r, acc in enumerate(rank_accuracy[0]):
        heapq.heappush(heap, (-acc, order, (r,)))
        order += 1
    out: list[tuple[int, ...]] = []
    while heap and len(out) < budget:
        neg, _, path = heapq.heappop(heap)
        out.append(path)
        d = len(path)
        if d < len(rank_accuracy):
            for r, acc in enumerate(rank_accuracy[d]):
                heapq.heappush(heap, (neg * acc, order, path + (r,)))
                order += 1
    return out


def choice_layout(ranks: int, paths: list[tuple[int, ...]]) -> tuple[list[int], list[int], list[int]]:
    """The guess tree of the choice ``paths`` (prefix-closed, in order), once for every round:
    ``(slots, parents, depths)``, ``slots[i]`` being where node ``i``'s token sits in a round's
    guesses (``K * ranks`` ids: each head's top tokens, head by head, best first)."""
    index: dict[tuple[int, ...], int] = {}
    slots: list[int] = []
    parents: list[int] = []
    depths: list[int] = []
    for path in paths:
        d = len(path)
        index[path] = len(slots)
        slots.append((d - 1) * ranks + path[-1])
        parents.append(index[path[:-1]] if d > 1 else -1)
        depths.append(d)
    return slots, parents, depths


def paths_to_nodes(
    guesses: list[int], ranks: int, paths: list[tuple[int, ...]]
) -> tuple[list[int], list[int], list[int]]:
    """Tree nodes ``(tokens, parents, depths)`` of the choice ``paths`` for one round's ``guesses``."""
    slots, parents, depths = choice_layout(ranks, paths)
    return [guesses[i] for i in slots], parents, depths


# The dynamic tree picks its nodes among this many times as many rank paths (the best-scored under the
# held-out accuracies): enough that a round's own probabilities rarely want a path outside the pool.
POOL_PER_NODE = 8


@dataclass
class GuessPool:
    """The rank paths a dynamic guess tree picks from, as device tensors (built once, at load).

    Attributes:
        rank: `[K, C]` the rank each path takes at head ``k`` (0 past its end).
        on: `[K, C]` 1.0 where the path reaches head ``k``.
        slot: `[C]` where the path's last token sits in a round's `[K * ranks]` top tokens.
        parent: `[C]` the path's prefix in the pool (-1: one head long).
        depth: `[C]` the path's length.
    """

    rank: torch.Tensor
    on: torch.Tensor
    slot: torch.Tensor
    parent: torch.Tensor
    depth: torch.Tensor

    @classmethod
    def build(cls, paths: list[tuple[int, ...]], heads: int, ranks: int, device: torch.device) -> GuessPool:
        """``paths`` prefix-closed and in order (a prefix before its extensions)."""
        slots, parents, depths = choice_layout(ranks, paths)
        rank = torch.zeros(heads, len(paths), dtype=torch.long)
        on = torch.zeros(heads, len(paths))
        for c, path in enumerate(paths):
            rank[: len(path), c] = torch.tensor(path)
            on[: len(path), c] = 1.0
        return cls(*(t.to(device) for t in (rank, on, torch.tensor(slots), torch.tensor(parents),
                                             torch.tensor(depths))))  # fmt: skip


# A path's score loses this much per token besides its log-probabilities, so a path always scores
# strictly below its prefix (even where a head's probability rounds to 1) and the top scores are closed
# under prefixes; small against any log-probability that matters.
_DEPTH_TIEBREAK = 1e-4


def pick_guess_tree(logits: torch.Tensor, top: torch.Tensor, pool: GuessPool, nodes: int) -> torch.Tensor:
    """This round's guess tree: the ``nodes`` pool paths of highest probability under the heads' own
    distributions (heads taken as independent), as `[3 * nodes]` int64 ``tokens, parents, depths``
    (parents index the returned nodes; -1: below the next token). Device ops only.

    A path's log-probability is the sum of its tokens' log-softmax over each head's whole vocabulary;
    as it only falls along a path, the best ``nodes`` scores include every prefix of each path they
    hold, and sorted by pool index (prefixes come first there) they are a tree in topological order.

    Args:
        logits: `[K, V]` the heads' logits.
        top: `[K, ranks]` their top tokens, best first (``logits.topk``'s indices).
        pool: the candidate paths.
        nodes: the tree's size (at most the pool's).
    """
    k = logits.shape[0]
    vals = logits.gather(1, top).float()  # [K, R]
    logp = vals - logits.float().logsumexp(-1, keepdim=True)
    score = (logp.gather(1, pool.rank) * pool.on).sum(0) - _DEPTH_TIEBREAK * pool.depth  # [C]
    pick = score.topk(nodes).indices.sort().values  # [N], prefixes first
    at = torch.full_like(pool.parent, -1).index_copy(0, pick, torch.arange(nodes, device=pick.device))
    parent = pool.parent.index_select(0, pick)
    parents = torch.where(parent >= 0, at.index_select(0, parent.clamp_min(0)), parent)
    tokens = top.reshape(k * top.shape[1]).index_select(0, pool.slot.index_select(0, pick))
    return torch.cat([tokens, parents, pool.depth.index_select(0, pick)])


class HiddenTap(torch.nn.Module):
    """The target's output layer, which also keeps the hidden states it was given.

    Every forward writes the rows whose logits it computes (the kept rows, in order) into ``rows``
    (`[capacity, H]`), so row ``i`` of a forward's logits has its hidden state in ``rows[i]``. It is
    a device copy, so it is captured in CUDA graphs and traced by ``torch.compile`` like the rest of
    the forward. Forwards of more rows than ``capacity``, or of several sequences, are not kept.
    One buffer serves the engine: a forward of another session between a round's forward and its
    heads would only make that round's guesses worse, never its output (guesses are proposals).

    Args:
        inner: the model's output layer (an ``nn.Linear``).
        capacity: most rows kept (a tree's nodes and the pending row).
    """

    rows: torch.Tensor

    def __init__(self, inner: torch.nn.Module, capacity: int):
        super().__init__()
        self.inner = inner
        w = cast(torch.Tensor, inner.weight)  # (a packed layer unpacks a copy here, once)
        with torch.inference_mode(False):  # a normal tensor: the model stays deep-copyable
            rows = torch.zeros(capacity, w.shape[1], dtype=w.dtype, device=w.device)
        self.register_buffer("rows", rows)

    @property
    def weight(self) -> torch.Tensor:
        return cast(torch.Tensor, self.inner.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, q, H]
        if x.shape[0] == 1 and x.shape[1] <= self.rows.shape[0]:
            self.rows[: x.shape[1]].copy_(x[0])
        out: torch.Tensor = self.inner(x)
        return out


def install_tap(model: Any, capacity: int) -> HiddenTap:
    """Wrap ``model``'s output layer in a :class:`HiddenTap` (once; returns the existing one)."""
    head = model.get_output_embeddings()
    if isinstance(head, HiddenTap):
        return head
    w = getattr(head, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or getattr(head, "bias", None) is not None:
        raise ConfigError(
            f"draft heads need a linear output layer without bias, this model has {type(head).__name__}"
        )
    tap = HiddenTap(head, capacity)
    model.set_output_embeddings(tap)
    return tap


def save_heads(heads: DraftHeads, info: HeadsInfo, out_dir: str | Path) -> Path:
    """Write ``heads`` (bf16) and ``info`` into ``out_dir``; returns the directory."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {n: p.detach().to("cpu", torch.bfloat16).contiguous() for n, p in heads.named_parameters()}
    save_file(tensors, str(out / WEIGHTS_FILE))
    (out / INFO_FILE).write_text(json.dumps(asdict(info), indent=1) + "\n")
    return out


def read_info(path: str | Path) -> HeadsInfo:
    """The description of a heads directory (Medusa heads or an EAGLE head).

    Raises:
        ConfigError: the directory is missing, incomplete, or its description is not one.
    """
    d = Path(path)
    if not (d / WEIGHTS_FILE).is_file() or not (d / INFO_FILE).is_file():
        raise ConfigError(f"draft heads: {d} holds no {WEIGHTS_FILE} and {INFO_FILE} (train them with "
                          "`specsplit heads train`)")  # fmt: skip
    raw = json.loads((d / INFO_FILE).read_text())
    try:
        info = HeadsInfo(**raw)
    except TypeError as e:
        raise ConfigError(f"draft heads: {d / INFO_FILE} is not a heads description ({e})") from None
    if info.kind not in HEAD_KINDS:
        raise ConfigError(f"draft heads: {d / INFO_FILE} is of kind {info.kind!r}; known: {HEAD_KINDS}")
    return info


def load_heads(
    path: str | Path, device: torch.device | str, dtype: torch.dtype
) -> tuple[DraftHeads, HeadsInfo]:
    """Load a Medusa heads directory written by :func:`save_heads` onto ``device`` in ``dtype``.

    Raises:
        ConfigError: the directory is missing, of another kind, or its files do not match each other.
    """
    from safetensors.torch import load_file

    d = Path(path)
    info = read_info(d)
    if info.kind != "medusa":
        raise ConfigError(f"draft heads: {d} holds an {info.kind} head, not Medusa heads")
    tensors = load_file(str(d / WEIGHTS_FILE))
    heads = DraftHeads(info.num_heads, info.hidden_size, info.token_input)
    try:
        heads.load_state_dict(tensors)
    except RuntimeError as e:
        raise ConfigError(f"draft heads: {d / WEIGHTS_FILE} does not match {INFO_FILE} ({e})") from None
    heads.requires_grad_(False)
    return heads.to(device=device, dtype=dtype).eval(), info


class Guesser(Protocol):
    """What a target engine calls on its draft heads (:class:`TargetHeads`, or an EAGLE head,
    :class:`~specsplit.runtime.eagle.TargetEagle`): guesses after a round's next token, as a tree."""

    needs_static: bool  # guesses only for the session holding the static workspace
    # a cache of its own that must see every committed position, so a round that asks for no guesses
    # still ingests them (``round_ingest`` / ``eager_guesses(grow=False)``)
    keeps_state: bool
    num_nodes: int

    def round_guesses(
        self, rows: torch.Tensor, decided: torch.Tensor, count: torch.Tensor, ctx: torch.Tensor
    ) -> torch.Tensor: ...

    def round_ingest(
        self, rows: torch.Tensor, decided: torch.Tensor, count: torch.Tensor, ctx: torch.Tensor
    ) -> None: ...

    def eager_guesses(
        self, pending: list[int], tree_nodes: int, nodes: list[int], tokens: list[int], next_token: int,
        length: int, static: bool, grow: bool = True,
    ) -> torch.Tensor | None: ...  # fmt: skip

    def nodes(self, guesses: list[int]) -> tuple[list[int], list[int], list[int]]: ...


class TargetHeads:
    """A target's draft heads, ready for rounds: the heads, the output-layer tap and the guess tree.

    Args:
        model: the target (its output layer is wrapped in a :class:`HiddenTap`).
        path: the heads directory.
        nodes: tree nodes the guesses take.
        max_rows: most logits rows a verification computes (the tap's capacity).
        tree: ``"dynamic"`` (each round's most probable rank paths, :func:`pick_guess_tree`) or
            ``"static"`` (the ``nodes`` best rank paths under the held-out accuracies, every round).

    Raises:
        ConfigError: the heads do not fit this target, or ``tree`` is neither.
    """

    def __init__(self, model: Any, path: str | Path, nodes: int, max_rows: int, tree: str = "dynamic"):
        if tree not in GUESS_TREES:
            raise ConfigError(f"draft heads' tree must be one of {GUESS_TREES}, got {tree!r}")
        out = model.get_output_embeddings()
        w = out.weight
        heads, info = load_heads(path, w.device, w.dtype)
        if info.hidden_size != w.shape[1] or info.vocab_size != w.shape[0]:
            raise ConfigError(
                f"draft heads in {path} were trained for hidden size {info.hidden_size} and vocabulary "
                f"{info.vocab_size}; this target has {w.shape[1]} and {w.shape[0]}"
            )
        if not info.rank_accuracy:
            raise ConfigError(f"draft heads in {path} carry no rank accuracies to build their tree from")
        self.heads, self.info = heads, info
        self.dtype = w.dtype
        self.ranks = len(info.rank_accuracy[0])
        self.tree = tree
        self.paths = choice_paths(info.rank_accuracy, nodes * (POOL_PER_NODE if tree == "dynamic" else 1))
        self.num_nodes = min(nodes, len(self.paths))
        self._slots, self._parents, self._depths = choice_layout(self.ranks, self.paths)
        self.pool = (
            GuessPool.build(self.paths, info.num_heads, self.ranks, w.device) if tree == "dynamic" else None
        )
        self.embed = model.get_input_embeddings() if info.token_input else None
        self.tap = install_tap(model, max_rows)
        logger.info(
            "draft heads: %d%s heads from %s, a %s tree of %d guess nodes a round",
            info.num_heads,
            " token-conditioned" if info.token_input else "",
            path,
            tree,
            self.num_nodes,
        )

    needs_static = False  # the heads read one row of the round's forward, whatever the session
    keeps_state = False  # nothing to ingest: a round without guesses skips the heads

    def round_guesses(
        self, rows: torch.Tensor, decided: torch.Tensor, count: torch.Tensor, ctx: torch.Tensor
    ) -> torch.Tensor:
        """A one-graph round's guesses from the last real one of the committed rows (``rows``
        `[M]` logits rows, ``decided`` `[M]` their tokens, ``count`` `[]` real ones; ``ctx``
        unused); device ops only."""
        last = (count - 1).clamp_min(0).view(1)
        return self.guesses(rows.index_select(0, last), decided.index_select(0, last))

    def round_ingest(
        self, rows: torch.Tensor, decided: torch.Tensor, count: torch.Tensor, ctx: torch.Tensor
    ) -> None:
        """Nothing: the heads keep no state between rounds."""

    def eager_guesses(
        self, pending: list[int], tree_nodes: int, nodes: list[int], tokens: list[int], next_token: int,
        length: int, static: bool, grow: bool = True,
    ) -> torch.Tensor | None:  # fmt: skip
        """An eager round's guesses (a device tensor the caller reads) from the logits row that
        decided ``next_token``: the last accepted node's, else the last pending token's (row 0).
        None without ``grow``."""
        if not grow:
            return None
        at = h2d(
            torch.tensor([nodes[-1] + 1 if nodes else 0, next_token], dtype=torch.long), self.tap.rows.device
        )
        return self.guesses(at[:1], at[1:])

    def guesses(self, row: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        """The round's guesses, int64 on the device, from the hidden state of logits row ``row``
        (`[1]` int64, on the device) of the last forward, which decided ``token`` (`[1]` int64, on
        the device): the tree itself (`[3 * nodes]`, :func:`pick_guess_tree`) for a dynamic tree,
        the heads' top tokens (`[K * ranks]`) for a static one; device ops only."""
        h = self.tap.rows.index_select(0, row)  # [1, H]
        e = None if self.embed is None else self.embed(token.view(1))  # [1, H]
        logits = head_row_logits(self.heads, self.tap.inner, h, self.dtype, e)  # [K, V]
        top = logits.topk(self.ranks, dim=-1).indices  # [K, R], best first
        if self.pool is None:
            return top.reshape(-1)
        return pick_guess_tree(logits, top, self.pool, self.num_nodes)

    def nodes(self, guesses: list[int]) -> tuple[list[int], list[int], list[int]]:
        """The guess tree's ``(tokens, parents, depths)`` from one round's guesses read to the host
        (a static tree has the same shape every round: only its tokens are picked)."""
        if self.pool is not None:
            n = self.num_nodes
            return guesses[:n], guesses[n : 2 * n], guesses[2 * n : 3 * n]
        return [guesses[i] for i in self._slots], self._parents, self._depths


def load_target_heads(
    model: Any, path: str | Path, nodes: int, max_rows: int, tree: str, capacity: int, max_depth: int,
    compile: bool = False,
) -> Any:  # fmt: skip
    """The guesser of a heads directory: :class:`TargetHeads` for Medusa heads,
    :class:`~specsplit.runtime.eagle.TargetEagle` for an EAGLE head (``tree`` applies to Medusa
    heads only; ``capacity``, ``max_depth`` and ``compile`` to an EAGLE head)."""
    info = read_info(path)
    if info.kind == "eagle":
        from specsplit.runtime.eagle import TargetEagle

        return TargetEagle(model, path, info, nodes, capacity, max_depth, compile)
    return TargetHeads(model, path, nodes, max_rows, tree)
