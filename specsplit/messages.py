"""The messages that cross a transport: requests, results and their telemetry.

Engines produce and consume these dataclasses; a transport only moves them (``LocalTransport``
in-process, ``GrpcTransport`` as protobuf). Nothing here knows which transport is in use, so
engines may import this module without importing any transport.

Round protocol (see DESIGN.md):

1. ``draft(DraftRequest)``: the draft session ingests ``new_token_ids`` (the committed tokens it
   has not seen; ``prefix_length`` says how many it must already hold, 0 = start over with the full
   context) and grows a :class:`~specsplit.core.tree.TokenTree`.
2. ``verify(VerifyRequest)``: the target runs ONE forward over ``pending_token_ids + tree``,
   verifies, keeps the KV of the accepted path and returns the accepted tokens plus one target
   token (the correction or bonus token), which becomes the next round's pending token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from specsplit.config import TreeConfig
from specsplit.core.sampling import SamplingParams
from specsplit.core.tree import TokenTree
from specsplit.telemetry import RoundStats


@dataclass
class WorkerStats:
    """Telemetry every engine response carries (also over gRPC)."""

    wall_time_s: float = 0.0  # whole request inside the engine
    model_time_s: float = 0.0  # model forwards only
    tokens_processed: int = 0  # tokens fed through the model
    forwards: int = 0  # model forward calls
    device: str = ""
    verify_mode: str = ""  # target with SpecPV on: "full" or "partial" ("" otherwise / draft)
    # Over gRPC: the worker's whole handling of the call, its conversions and the device sync that
    # serialising the result waits for included (an engine call may return before its GPU work
    # ends, so wall_time_s alone under-counts it); 0 in-process.
    server_time_s: float = 0.0

    @property
    def busy_s(self) -> float:
        """Time the call spent on the worker's side (engine, or whole handler over gRPC)."""
        return max(self.wall_time_s, self.server_time_s)


@dataclass
class LogitsProcessing:
    """Hugging Face generation options that reshape the target's scores, for the target to apply.

    The target builds the same ``LogitsProcessorList`` ``model.generate()`` would build from these
    options and applies it to every row of a verified tree with that row's own context (prompt,
    committed tokens, the row's path), so greedy verification compares against the processed
    argmax and sampling verification uses the processed distribution.

    Attributes:
        options: ``GenerationConfig`` fields that shape the scores (JSON values; see
            :data:`specsplit.engines.processing.SCORE_FIELDS`); lengths (``max_length``,
            ``min_length``) already counted from the start of the prompt as ``generate()`` does.
        prompt_length: the prompt's length as ``generate()`` counts it (left padding included).
        prefix_token_ids: the left padding ``generate()``'s processors see before this row's prompt.
        processors: user ``LogitsProcessor`` objects (in-process only: they cannot cross gRPC).
    """

    options: dict[str, Any]
    prompt_length: int
    prefix_token_ids: list[int] = field(default_factory=list)
    processors: list[Any] = field(default_factory=list)

    def to_json(self) -> str:
        """The wire form (without ``processors``); made once, since engines key their processors
        on it every round (a spec is not changed once made)."""
        text = self.__dict__.get("_json")
        if text is None:
            text = self.__dict__["_json"] = json.dumps(
                {
                    "options": self.options,
                    "prompt_length": self.prompt_length,
                    "prefix": self.prefix_token_ids,
                },
                sort_keys=True,
            )
        return text

    @classmethod
    def from_json(cls, text: str) -> LogitsProcessing:
        d = json.loads(text)
        if not isinstance(d, dict) or not isinstance(d.get("options"), dict):
            raise ValueError("processing must be a JSON object with an 'options' object")
        prefix = d.get("prefix", [])
        if not isinstance(prefix, list) or not all(isinstance(t, int) for t in prefix):
            raise ValueError("processing 'prefix' must be a list of token ids")
        length = d.get("prompt_length", 0)
        if not isinstance(length, int) or length < 0:
            raise ValueError("processing 'prompt_length' must be an int >= 0")
        return cls(d["options"], length, prefix)


@dataclass
class DraftRequest:
    """Ask the draft side for a tree.

    Attributes:
        session_id: conversation key; the draft keeps a KV cache per session.
        new_token_ids: committed tokens the draft has not ingested yet.
        prefix_length: how many tokens the draft session must already hold; 0 means
            ``new_token_ids`` is the full context (the engine still reuses a matching cached prefix).
        tree: shape of the tree to grow.
        sampling: sampling parameters (shared with the target).
        seed: seed for this round's draft randomness (sampling only).
        max_depth: cap on the tree depth this round (used near ``max_new_tokens``); ``None`` = shape's own.
            An engine on its static (CUDA-graph) path grows its usual shape anyway unless the cap
            is 0, so the end of a generation adds no new graph; the caller cuts the commit.
        capacity_hint: total tokens the session may reach (sizes the cache once).
        speculate: overlapped pipeline: instead of ingesting ``new_token_ids`` (which must be
            empty), extend the session by the main path of the tree it drafted last (first child
            at every level) plus the draft's own greedy next token, a guess of the target's bonus
            token, and grow the tree from there. The result's ``assumed_token_ids`` lists those
            tokens; ``max_depth`` then caps ``assumed + tree depth``. If the guess turns out wrong
            the caller sends a normal request with the pre-speculation ``prefix_length`` and the
            engine drops the speculative tail, reusing the part that matches.
        processing: HF logits processors the draft applies to its own distribution at every node
            (the target's options, so drafts follow what the target will accept; None: raw
            logits). Output never depends on it: ``q`` is exact about what was drawn either way.
    """

    session_id: str
    new_token_ids: list[int]
    prefix_length: int
    tree: TreeConfig = field(default_factory=TreeConfig)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int | None = None
    max_depth: int | None = None
    capacity_hint: int = 0
    speculate: bool = False
    processing: LogitsProcessing | None = None


@dataclass
class DraftResult:
    """A drafted tree and what the draft's cache holds after ingesting the new tokens."""

    tree: TokenTree
    prefix_length: int
    stats: WorkerStats = field(default_factory=WorkerStats)
    cache_hit: bool = False  # the session (or a matching prefix) was reused
    assumed_token_ids: list[int] = field(default_factory=list)  # speculate: the tokens assumed committed


@dataclass
class VerifyRequest:
    """Ask the target to verify a tree.

    Attributes:
        session_id: conversation key; the target keeps a KV cache per session.
        tree: the draft tree (may be empty: then this is a plain target decode step).
        pending_token_ids: committed tokens whose target KV does not exist yet (the whole prompt
            on the first round, then last round's correction/bonus token).
        expected_prefix_length: tokens the caller believes the target has cached; a mismatch
            raises ``CacheDesyncError`` (recover by resending the full context with 0).
        sampling: sampling parameters; ``do_sample=False`` = greedy verification.
        seed: seed for this round's verification randomness.
        capacity_hint: total tokens the session may reach (sizes the cache once).
        processing: HF logits processors to apply to every row (None: ``sampling`` alone).
        return_scores / return_logits: return the processed scores / raw logits of the rows that
            decided the committed tokens (``generate(output_scores=True / output_logits=True)``).
        return_choices: return the target's token after every row (``VerifyResult.choices``:
            lookahead drafting learns from them).
        return_guesses: return the target's draft-head guesses (``VerifyResult.guesses``; a target
            without heads returns none). A caller that would not use them leaves the heads' work
            undone; once a session has asked, an EAGLE head (a cache of its own) still takes each
            round's commit when a later round does not ask, so guesses asked for again see every
            position.
    """

    session_id: str
    tree: TokenTree
    pending_token_ids: list[int]
    expected_prefix_length: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int | None = None
    capacity_hint: int = 0
    processing: LogitsProcessing | None = None
    return_scores: bool = False
    return_logits: bool = False
    return_choices: bool = False
    return_guesses: bool = False


@dataclass
class HeadGuesses:
    """What the target's draft heads guess after a round's ``next_token_id``: tree nodes below it
    (:mod:`specsplit.runtime.heads`), for the next round's tree.

    Attributes:
        token_ids / parents / depths: the nodes (parents index this list; -1: below the next token).
    """

    token_ids: list[int]
    parents: list[int]
    depths: list[int]


@dataclass
class VerifyResult:
    """Outcome of one verification round.

    Attributes:
        accepted_token_ids: drafted tokens the target accepted, root to leaf.
        next_token_id: the target's own token after them (correction or bonus).
        accepted_node_indices: tree indices of the accepted nodes.
        prefix_length: target cache length afterwards (``next_token_id`` is not in it yet).
        num_drafted: length of the longest drafted path (depth of the tree).
        num_nodes: nodes in the verified tree.
        scores / logits: `[accepted + 1, vocab]` float32 processed scores / raw logits of the rows
            that decided ``accepted_token_ids + [next_token_id]`` (only when the request asked).
        choices: with ``return_choices``, `N + 1` token ids: the target's token after the last
            pending token, then after each node (its argmax; under sampling its position-keyed
            draw). None when not asked, or where a tree drawn from ``q`` was rejection-sampled.
        guesses: with ``return_guesses``, a target with draft heads (``TargetConfig.draft_heads``):
            their guesses after ``next_token_id``. None when not asked, without heads, and on paths
            that do not run them (SpecPV, batched rounds). They travel over gRPC as well
            (``VerifyResponse.guesses``).
    """

    accepted_token_ids: list[int]
    next_token_id: int
    accepted_node_indices: list[int]
    prefix_length: int
    num_drafted: int
    num_nodes: int
    stats: WorkerStats = field(default_factory=WorkerStats)
    cache_hit: bool = False
    scores: Any = None  # torch.Tensor | None
    logits: Any = None  # torch.Tensor | None
    choices: list[int] | None = None
    guesses: HeadGuesses | None = None

    @property
    def acceptance_rate(self) -> float:
        """Accepted tokens over the deepest drafted path (1.0 when nothing was drafted)."""
        return len(self.accepted_token_ids) / self.num_drafted if self.num_drafted else 1.0


# Name from the original design documents.
VerificationResult = VerifyResult


@dataclass
class GenerateRequest:
    """A whole generation whose rounds the target worker runs (``SpecSplitConfig.grpc_loop="target"``).

    The worker runs the same round loop as :func:`specsplit.pipeline.decode`, with its local target
    engine and the draft worker it was started with, and streams :class:`GenerateUpdate` s.

    Attributes:
        session_id: conversation key on both workers.
        prompt_token_ids: the prompt.
        max_new_tokens: tokens to generate at most.
        sampling: sampling parameters.
        tree: shape of the tree drafted every round.
        eos_token_ids: generation stops after the first of these (included).
        rng_state: sampling only: ``torch.Generator.get_state()`` bytes of the CPU generator the
            per-round seeds are drawn from (empty: a fresh nondeterministic generator).
        overlap / overlap_policy: as in :class:`~specsplit.config.SpecSplitConfig`.
        drafter: as ``SpecSplitConfig.drafter``; ``""``: the worker's default.
        processing: HF logits processors (options only: custom processors cannot cross gRPC).
    """

    session_id: str
    prompt_token_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    tree: TreeConfig = field(default_factory=TreeConfig)
    eos_token_ids: list[int] = field(default_factory=list)
    rng_state: bytes = b""
    overlap: bool = False
    overlap_policy: str = "adaptive"
    drafter: str = ""
    processing: LogitsProcessing | None = None


@dataclass
class GenerateUpdate:
    """Rounds a worker-run generation finished since its previous update.

    ``rounds`` pairs each round's committed tokens with its telemetry; the last update of a
    generation that ran to its end has ``done`` set and carries the totals.
    """

    rounds: list[tuple[list[int], RoundStats]] = field(default_factory=list)
    done: bool = False
    recoveries: int = 0
    draft_fallback: bool = False
    wall_time_s: float = 0.0


@dataclass
class WorkerInfo:
    """What a worker says about itself (``Ping``)."""

    worker_type: str  # "draft" | "target"
    model_name: str
    vocab_size: int
    dtype: str
    device: str
    protocol_version: str = ""  # a remote worker's wire protocol ("" in-process)
    active_sessions: int = 0
