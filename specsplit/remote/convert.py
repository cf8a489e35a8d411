"""Protobuf <-> dataclass conversion: the ONE place that knows both forms.

Everything above this module speaks the dataclasses of :mod:`specsplit.transport`; everything
below it speaks the messages of ``proto/specsplit/v1/spec_decoding.proto``. Trees are converted
field by field between the flat BFS tensors of :class:`~specsplit.core.tree.TokenTree` and the packed
repeated fields of ``specsplit.v1.TokenTree`` (see the mapping comment in the .proto file), so a
round trip is exact: int64 ids stay int64 and float32 probabilities stay bit-identical.

``*_from_proto`` functions check only what the wire format itself can get wrong (array lengths,
enum values, field ranges the dataclasses reject) and raise :class:`InvalidRequest`; the engines
validate the content (vocabulary, parents, probabilities) exactly as in local mode.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

import numpy as np
import torch

from specsplit.config import TreeConfig, TreeShape
from specsplit.core.sampling import SamplingParams
from specsplit.core.tree import TokenTree
from specsplit.errors import ConfigError, InvalidRequest
from specsplit.messages import (
    DraftRequest,
    DraftResult,
    GenerateRequest,
    GenerateUpdate,
    HeadGuesses,
    LogitsProcessing,
    VerifyRequest,
    VerifyResult,
    WorkerInfo,
    WorkerStats,
)
from specsplit.remote._generated import spec_decoding_pb2 as pb
from specsplit.remote.protocol import PROTOCOL_VERSION
from specsplit.remote.tree_slots import SlotDraftRequest, SlotDraftResult, TreeSlotRef
from specsplit.telemetry import RoundStats

MAX_PROCESSING_BYTES = 1 << 16  # a client's processing options (bad words, biases) at most

_SHAPE_TO_PB: dict[TreeShape, pb.TreeShape] = {
    "chain": pb.TREE_SHAPE_CHAIN,
    "static": pb.TREE_SHAPE_STATIC,
    "dynamic": pb.TREE_SHAPE_DYNAMIC,
}
_SHAPE_FROM_PB = {v: k for k, v in _SHAPE_TO_PB.items()}
_WORKER_TO_PB = {"draft": pb.WORKER_TYPE_DRAFT, "target": pb.WORKER_TYPE_TARGET}
_WORKER_FROM_PB = {v: k for k, v in _WORKER_TO_PB.items()}
_U64 = 1 << 64

# Largest message either side accepts by default (a 32k-token context is ~100 KiB; a 256-node tree
# with Kq=32 is ~60 KiB): generous, but bounded so a bad peer cannot make a worker buffer gigabytes.
DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024

T = TypeVar("T")


def _checked(make: Callable[[], T]) -> T:
    """Build a dataclass from wire values; its own validation errors become ``InvalidRequest``."""
    try:
        return make()
    except ConfigError as e:
        raise InvalidRequest(str(e)) from None


# ---------------------------------------------------------------------- small messages
def sampling_to_proto(s: SamplingParams) -> pb.SamplingParams:
    return pb.SamplingParams(do_sample=s.do_sample, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p)


def sampling_from_proto(m: pb.SamplingParams) -> SamplingParams:
    return _checked(
        lambda: SamplingParams(do_sample=m.do_sample, temperature=m.temperature, top_k=m.top_k, top_p=m.top_p)
    )


def tree_config_to_proto(t: TreeConfig) -> pb.TreeSpec:
    m = pb.TreeSpec(
        shape=_SHAPE_TO_PB[t.shape],
        num_draft_tokens=t.num_draft_tokens,
        topk=t.topk,
        width=t.width,
        budget=t.budget,
        max_depth=t.max_depth,
        min_confidence=t.min_confidence,
    )
    if t.paths is not None:
        m.static_paths.SetInParent()  # present even when empty: "no paths" differs from "default"
        for p in t.paths:
            m.static_paths.paths.add(ranks=p)
    return m


@dataclass(frozen=True)
class DynamicFields:
    """The dynamic-tree fields of a ``TreeSpec``, unset (0) ones at their ``TreeConfig`` defaults."""

    topk: int
    width: int
    budget: int
    max_depth: int


_TREE_DEFAULTS = TreeConfig()


def tree_defaults(m: pb.TreeSpec) -> DynamicFields:
    """``m``'s dynamic fields; proto3 cannot tell 0 from unset, and 0 is never valid for them."""
    return DynamicFields(
        *(getattr(m, f) or getattr(_TREE_DEFAULTS, f) for f in ("topk", "width", "budget", "max_depth"))
    )


def tree_config_from_proto(m: pb.TreeSpec) -> TreeConfig:
    """The ``TreeConfig`` of a ``TreeSpec``; unset dynamic-only fields take their defaults (a chain
    or static spec need not set them)."""
    shape = _SHAPE_FROM_PB.get(m.shape)
    if shape is None:
        raise InvalidRequest(f"tree.shape must be CHAIN, STATIC or DYNAMIC, got enum value {m.shape}")
    paths = [list(p.ranks) for p in m.static_paths.paths] if m.HasField("static_paths") else None
    d = tree_defaults(m)
    return _checked(
        lambda: TreeConfig(
            shape=shape,
            num_draft_tokens=m.num_draft_tokens,
            paths=paths,
            topk=d.topk,
            width=d.width,
            budget=d.budget,
            max_depth=d.max_depth,
            min_confidence=m.min_confidence,
        )
    )


def stats_to_proto(s: WorkerStats) -> pb.Telemetry:
    return pb.Telemetry(
        wall_time_s=s.wall_time_s,
        model_time_s=s.model_time_s,
        tokens_processed=s.tokens_processed,
        forwards=s.forwards,
        device=s.device,
        server_time_s=s.server_time_s,
        verify_mode=s.verify_mode,
    )


def stats_from_proto(m: pb.Telemetry) -> WorkerStats:
    return WorkerStats(
        wall_time_s=m.wall_time_s,
        model_time_s=m.model_time_s,
        tokens_processed=m.tokens_processed,
        forwards=m.forwards,
        device=m.device,
        verify_mode=m.verify_mode,
        server_time_s=m.server_time_s,
    )


def worker_info_to_proto(i: WorkerInfo) -> pb.PingResponse:
    return pb.PingResponse(
        worker_type=_WORKER_TO_PB.get(i.worker_type, pb.WORKER_TYPE_UNSPECIFIED),
        model_name=i.model_name,
        vocab_size=i.vocab_size,
        dtype=i.dtype,
        device=i.device,
        protocol_version=i.protocol_version or PROTOCOL_VERSION,  # an engine's own info leaves it empty
        active_sessions=i.active_sessions,
    )


def worker_info_from_proto(m: pb.PingResponse) -> WorkerInfo:
    return WorkerInfo(
        worker_type=_WORKER_FROM_PB.get(m.worker_type, "unknown"),
        model_name=m.model_name,
        vocab_size=m.vocab_size,
        dtype=m.dtype,
        device=m.device,
        protocol_version=m.protocol_version,
        active_sessions=m.active_sessions,
    )


def _seed_to_proto(seed: int | None, kwargs: dict[str, Any]) -> None:
    if seed is not None:
        # torch seeds are 64-bit; negative seeds are the same generator state as seed mod 2**64,
        # but we refuse to change the value silently.
        if not 0 <= seed < _U64:
            raise InvalidRequest(f"seed must be in [0, 2**64) to travel over gRPC, got {seed}")
        kwargs["seed"] = seed


# ---------------------------------------------------------------------- trees
def tree_to_proto(tree: TokenTree) -> pb.TokenTree:
    """Flatten a tree (on any device) into packed repeated fields."""
    m = pb.TokenTree(
        token_ids=tree.token_ids.detach().cpu().tolist(),
        parents=tree.parents.detach().cpu().tolist(),
        depths=tree.depths.detach().cpu().tolist(),
        log_probs=tree.log_probs.detach().float().cpu().tolist(),
    )
    if tree.max_branch is not None:
        m.max_branch = tree.max_branch
    if tree.depth_bound is not None:
        m.depth_bound = tree.depth_bound
    if tree.q_ids is not None and tree.q_probs is not None:
        m.has_q = True
        m.q_width = int(tree.q_ids.shape[-1]) if tree.q_ids.dim() == 2 else 0
        m.q_ids.extend(tree.q_ids.detach().cpu().reshape(-1).tolist())
        m.q_probs.extend(tree.q_probs.detach().float().cpu().reshape(-1).tolist())
    return m


def _tensor(values: Any, dtype: Any) -> torch.Tensor:
    # numpy reads protobuf's repeated fields in one call (~50x faster than building a list first).
    return torch.from_numpy(np.array(values, dtype=dtype))


def tree_from_proto(m: pb.TokenTree) -> TokenTree:
    """Rebuild a CPU :class:`TokenTree`; raises :class:`InvalidRequest` on inconsistent lengths."""
    n = len(m.token_ids)
    for name in ("parents", "depths", "log_probs"):
        if len(getattr(m, name)) != n:
            raise InvalidRequest(f"tree.{name} has {len(getattr(m, name))} entries, tree.token_ids has {n}")
    tree = TokenTree(
        token_ids=_tensor(m.token_ids, np.int64),
        parents=_tensor(m.parents, np.int64),
        depths=_tensor(m.depths, np.int64),
        log_probs=_tensor(m.log_probs, np.float32),
    )
    _check_bounds(m, tree)
    if m.has_q:
        if m.q_width < 0:
            raise InvalidRequest(f"tree.q_width must be >= 0, got {m.q_width}")
        size = n * m.q_width
        if len(m.q_ids) != size or len(m.q_probs) != size:
            raise InvalidRequest(
                f"tree.q_ids / q_probs must have nodes * q_width = {n} * {m.q_width} = {size} entries, "
                f"got {len(m.q_ids)} and {len(m.q_probs)}"
            )
        tree.q_ids = _tensor(m.q_ids, np.int64).reshape(n, m.q_width)
        tree.q_probs = _tensor(m.q_probs, np.float32).reshape(n, m.q_width)
    elif len(m.q_ids) or len(m.q_probs) or m.q_width:
        raise InvalidRequest("tree.q_ids / q_probs / q_width are set but tree.has_q is false")
    return tree


def _check_bounds(m: pb.TokenTree, tree: TokenTree) -> None:
    """Adopt the producer's host-side bounds only if they really bound the tree.

    Verification sizes its loops and child tables with them, so a bound below the real fan-out or
    depth would be wrong; the real values are computed from the lists (no tensor reads). Upper
    limits are the target engine's business (``max_tree_depth``), checked by the servicer.
    """
    has_branch, has_depth = m.HasField("max_branch"), m.HasField("depth_bound")
    if not (has_branch or has_depth):
        return
    n = len(m.token_ids)
    branch = max(Counter(m.parents).values(), default=0)
    depth = max(m.depths, default=0)
    if has_branch:
        if m.max_branch < branch:
            raise InvalidRequest(f"tree.max_branch={m.max_branch} is below the tree's fan-out {branch}")
        tree.max_branch = m.max_branch
    if has_depth:
        if m.depth_bound < depth or (n == 0 and m.depth_bound != 0):
            raise InvalidRequest(f"tree.depth_bound={m.depth_bound} is below the tree's depth {depth}")
        tree.depth_bound = m.depth_bound


# ---------------------------------------------------------------------- requests and results
def draft_request_to_proto(r: DraftRequest) -> pb.DraftRequest:
    kwargs: dict[str, Any] = {}
    _seed_to_proto(r.seed, kwargs)
    if r.max_depth is not None:
        kwargs["max_depth"] = r.max_depth
    return pb.DraftRequest(
        session_id=r.session_id,
        new_token_ids=r.new_token_ids,
        prefix_length=r.prefix_length,
        tree=tree_config_to_proto(r.tree),
        sampling=sampling_to_proto(r.sampling),
        capacity_hint=r.capacity_hint,
        speculate=r.speculate,
        tree_channel=getattr(r, "tree_channel", ""),
        tree_slot=getattr(r, "tree_slot", 0),
        # Custom processors stay where the loop runs; the options alone still steer the drafts.
        processing=processing_to_wire(r.processing, custom="drop"),
        **kwargs,
    )


def draft_request_from_proto(m: pb.DraftRequest) -> DraftRequest:
    """A :class:`SlotDraftRequest` when the request names a tree slot, else a plain one."""
    fields: dict[str, Any] = {}
    if m.tree_channel:
        fields = {"tree_channel": m.tree_channel, "tree_slot": m.tree_slot}
    return (SlotDraftRequest if fields else DraftRequest)(
        session_id=m.session_id,
        new_token_ids=list(m.new_token_ids),
        prefix_length=m.prefix_length,
        tree=tree_config_from_proto(m.tree),
        sampling=sampling_from_proto(m.sampling),
        seed=m.seed if m.HasField("seed") else None,
        max_depth=m.max_depth if m.HasField("max_depth") else None,
        capacity_hint=m.capacity_hint,
        speculate=m.speculate,
        processing=processing_from_wire(m.processing),
        **fields,
    )


def draft_result_to_proto(r: DraftResult) -> pb.DraftResponse:
    """The tree travels in the message unless it was left in a tree slot (no device read then)."""
    m = pb.DraftResponse(
        prefix_length=r.prefix_length,
        cache_hit=r.cache_hit,
        telemetry=stats_to_proto(r.stats),
        assumed_token_ids=r.assumed_token_ids,
    )
    in_slot = getattr(r, "tree_in_slot", None)
    if in_slot is not None:
        m.tree_in_slot.CopyFrom(pb.TreeSlotRef(**asdict(in_slot)))
    else:
        m.tree.CopyFrom(tree_to_proto(r.tree))
    return m


def draft_result_from_proto(m: pb.DraftResponse) -> DraftResult:
    in_slot = m.HasField("tree_in_slot")
    if in_slot and len(m.tree.token_ids):
        raise InvalidRequest("a draft response carries both a tree and a tree slot")
    tree = TokenTree.empty() if in_slot else tree_from_proto(m.tree)
    res = DraftResult(
        tree, m.prefix_length, stats_from_proto(m.telemetry), m.cache_hit, list(m.assumed_token_ids)
    )
    if in_slot:
        return SlotDraftResult(**vars(res), tree_in_slot=_slot_ref(m.tree_in_slot))
    return res


def _slot_ref(m: pb.TreeSlotRef) -> TreeSlotRef:
    return TreeSlotRef(m.channel_id, m.slot, m.num_nodes, m.max_branch, m.depth_bound)


def verify_request_to_proto(r: VerifyRequest) -> pb.VerifyRequest:
    kwargs: dict[str, Any] = {}
    _seed_to_proto(r.seed, kwargs)
    return pb.VerifyRequest(
        session_id=r.session_id,
        tree=tree_to_proto(r.tree),
        pending_token_ids=r.pending_token_ids,
        expected_prefix_length=r.expected_prefix_length,
        sampling=sampling_to_proto(r.sampling),
        capacity_hint=r.capacity_hint,
        processing=processing_to_wire(r.processing),
        return_scores=r.return_scores,
        return_logits=r.return_logits,
        return_choices=r.return_choices,
        return_guesses=r.return_guesses,
        **kwargs,
    )


def processing_to_wire(p: LogitsProcessing | None, custom: str = "refuse") -> str:
    """The JSON form of the processing options; custom processors cannot be sent: refused
    (``ConfigError``), or left out with ``custom="drop"``."""
    if p is None:
        return ""
    if p.processors and custom != "drop":
        raise ConfigError(
            "custom logits processors run where the target verifies and cannot be sent to a remote "
            "target worker: use transport='local', or express them as generation options"
        )
    return p.to_json()


def processing_from_wire(text: str) -> LogitsProcessing | None:
    """A client's processing options (size and shape checked; the engine checks the values)."""
    if not text:
        return None
    if len(text) > MAX_PROCESSING_BYTES:
        raise InvalidRequest(f"processing options are {len(text)} bytes; the limit is {MAX_PROCESSING_BYTES}")
    try:
        return LogitsProcessing.from_json(text)
    except ValueError as e:  # json.JSONDecodeError included
        raise InvalidRequest(f"bad processing options: {e}") from None


def _rows_to_bytes(t: torch.Tensor | None) -> bytes:
    return b"" if t is None else t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()


def _rows_from_bytes(data: bytes, rows: int) -> torch.Tensor | None:
    if not data:
        return None
    flat = torch.frombuffer(bytearray(data), dtype=torch.float32)
    return flat.view(rows, -1)


def verify_request_from_proto(m: pb.VerifyRequest) -> VerifyRequest:
    return VerifyRequest(
        session_id=m.session_id,
        tree=tree_from_proto(m.tree),
        pending_token_ids=list(m.pending_token_ids),
        expected_prefix_length=m.expected_prefix_length,
        sampling=sampling_from_proto(m.sampling),
        seed=m.seed if m.HasField("seed") else None,
        capacity_hint=m.capacity_hint,
        processing=processing_from_wire(m.processing),
        return_scores=m.return_scores,
        return_logits=m.return_logits,
        return_choices=m.return_choices,
        return_guesses=m.return_guesses,
    )


def guesses_to_proto(g: HeadGuesses) -> pb.HeadGuesses:
    return pb.HeadGuesses(token_ids=g.token_ids, parents=g.parents, depths=g.depths)


def guesses_from_proto(m: pb.HeadGuesses) -> HeadGuesses:
    """The heads' nodes; raises :class:`InvalidRequest` when the three lists differ in length."""
    n = len(m.token_ids)
    if len(m.parents) != n or len(m.depths) != n:
        raise InvalidRequest(
            f"guesses have {n} token_ids, {len(m.parents)} parents and {len(m.depths)} depths"
        )
    return HeadGuesses(list(m.token_ids), list(m.parents), list(m.depths))


def verify_result_to_proto(r: VerifyResult) -> pb.VerifyResponse:
    """``guesses=None`` leaves the message's ``guesses`` absent."""
    m = pb.VerifyResponse(
        accepted_token_ids=r.accepted_token_ids,
        next_token_id=r.next_token_id,
        accepted_node_indices=r.accepted_node_indices,
        prefix_length=r.prefix_length,
        num_drafted=r.num_drafted,
        num_nodes=r.num_nodes,
        cache_hit=r.cache_hit,
        telemetry=stats_to_proto(r.stats),
        scores=_rows_to_bytes(r.scores),
        logits=_rows_to_bytes(r.logits),
        choices=r.choices or [],
    )
    if r.guesses is not None:
        m.guesses.CopyFrom(guesses_to_proto(r.guesses))
    return m


def verify_result_from_proto(m: pb.VerifyResponse) -> VerifyResult:
    return VerifyResult(
        accepted_token_ids=list(m.accepted_token_ids),
        next_token_id=m.next_token_id,
        accepted_node_indices=list(m.accepted_node_indices),
        prefix_length=m.prefix_length,
        num_drafted=m.num_drafted,
        num_nodes=m.num_nodes,
        stats=stats_from_proto(m.telemetry),
        cache_hit=m.cache_hit,
        scores=_rows_from_bytes(m.scores, len(m.accepted_token_ids) + 1),
        logits=_rows_from_bytes(m.logits, len(m.accepted_token_ids) + 1),
        choices=list(m.choices) or None,
        guesses=guesses_from_proto(m.guesses) if m.HasField("guesses") else None,
    )


# ---------------------------------------------------------------------- worker-run generation
def generate_request_to_proto(r: GenerateRequest) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        session_id=r.session_id,
        prompt_token_ids=r.prompt_token_ids,
        max_new_tokens=r.max_new_tokens,
        sampling=sampling_to_proto(r.sampling),
        tree=tree_config_to_proto(r.tree),
        eos_token_ids=r.eos_token_ids,
        rng_state=r.rng_state,
        overlap=r.overlap,
        overlap_policy=r.overlap_policy,
        drafter=r.drafter,
        processing=processing_to_wire(r.processing),
    )


def generate_request_from_proto(m: pb.GenerateRequest) -> GenerateRequest:
    return GenerateRequest(
        session_id=m.session_id,
        prompt_token_ids=list(m.prompt_token_ids),
        max_new_tokens=m.max_new_tokens,
        sampling=sampling_from_proto(m.sampling),
        tree=tree_config_from_proto(m.tree),
        eos_token_ids=list(m.eos_token_ids),
        rng_state=bytes(m.rng_state),
        overlap=m.overlap,
        overlap_policy=m.overlap_policy or "adaptive",
        drafter=m.drafter,
        processing=processing_from_wire(m.processing),
    )


def generate_round_to_proto(tokens: list[int], r: RoundStats) -> pb.GenerateRound:
    m = pb.GenerateRound(
        token_ids=tokens,
        accepted=r.accepted,
        drafted_depth=r.drafted_depth,
        tree_nodes=r.tree_nodes,
        draft_s=r.draft_s,
        verify_s=r.verify_s,
        host_s=r.host_s,
        transport_s=r.transport_s,
        draft_model_s=r.draft_model_s,
        verify_model_s=r.verify_model_s,
        overlap_draft_s=r.overlap_draft_s,
        drafter=r.drafter,
    )
    if r.spec_hit is not None:
        m.spec_hit = r.spec_hit
    return m


def generate_update_to_proto(u: GenerateUpdate) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        rounds=[generate_round_to_proto(t, r) for t, r in u.rounds],
        done=u.done,
        recoveries=u.recoveries,
        draft_fallback=u.draft_fallback,
        wall_time_s=u.wall_time_s,
    )


def generate_update_from_proto(m: pb.GenerateResponse) -> GenerateUpdate:
    rounds = [
        (
            list(r.token_ids),
            RoundStats(
                accepted=r.accepted,
                committed=len(r.token_ids),
                drafted_depth=r.drafted_depth,
                tree_nodes=r.tree_nodes,
                draft_s=r.draft_s,
                verify_s=r.verify_s,
                host_s=r.host_s,
                transport_s=r.transport_s,
                draft_model_s=r.draft_model_s,
                verify_model_s=r.verify_model_s,
                overlap_draft_s=r.overlap_draft_s,
                drafter=r.drafter,
                spec_hit=r.spec_hit if r.HasField("spec_hit") else None,
            ),
        )
        for r in m.rounds
    ]
    return GenerateUpdate(rounds, m.done, m.recoveries, m.draft_fallback, m.wall_time_s)
