"""A target worker that runs whole generations itself (``TargetService.Generate``).

With ``SpecSplitConfig(grpc_loop="client")`` the client calls the draft worker and then the target
worker every round: two network hops, plus the client's own conversions, on every round's critical
path. With ``grpc_loop="target"`` the client makes one ``Generate`` call and the target worker runs
the SAME round loop (:func:`specsplit.pipeline.decode`) over :class:`TargetLoopTransport`: its own
engine in-process and the draft worker it was started with (``specsplit serve target
--draft-address``) over gRPC, one hop a round. The committed tokens stream back round by round.

The draft worker's address is configured on the target worker, never taken from a request, so a
client cannot make a worker open connections of its choosing.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from specsplit.config import DRAFTERS, NgramConfig
from specsplit.engines.cost_model import CostModels
from specsplit.engines.drafters import NgramDrafter
from specsplit.engines.processing import needs_processing
from specsplit.errors import ConfigError, InvalidRequest, ResourceExhausted, SpecSplitError, TransportError
from specsplit.messages import (
    DraftRequest,
    DraftResult,
    GenerateRequest,
    VerifyRequest,
    VerifyResult,
    WorkerInfo,
)
from specsplit.pipeline import DecodeParams, OverlapPolicies
from specsplit.remote.client import GrpcTransport
from specsplit.remote.tree_slots import (
    SlotDraftRequest,
    SlotDraftResult,
    TreeSlotImporter,
    host_id,
)

logger = logging.getLogger(__name__)

_RNG_STATE_BYTES = torch.Generator().get_state().numel()
_SLOTS = 8  # tree slots asked for: generations one target worker runs at once with slots
_RESHARE_S = 30.0  # after slots were refused or failed, how long trees travel in replies
_BY_REPLY_MAX = 4096  # sessions remembered as answered in replies (a forgotten one asks once more)


class TargetLoopTransport:
    """The :class:`~specsplit.transport.Transport` a target worker runs rounds over.

    Verification calls the worker's engine directly (trees from the draft worker arrive as host
    tensors and are validated by the engine, as in ``VerifyDrafts``); drafting goes to the draft
    worker through a draft-only :class:`GrpcTransport`, so a failing draft worker turns the rest of
    a generation into target-only steps exactly as in client-loop mode.

    With ``tree_slots`` and both workers on CUDA devices of one host, greedy rounds take their trees
    from the draft worker's GPU memory instead of the reply (:mod:`specsplit.remote.tree_slots`):
    one slot per running generation, asked for once (``ShareTreeSlots``). Trees travel in replies
    for good when the draft worker refuses slots or their handles do not open here; for
    ``_RESHARE_S`` when the call fails. A draft worker may answer a slot request with the tree
    itself: for a session whose trees it has left in the slot before, that means it restarted and
    lost the channel, and the slots are asked for again (at once, unless they were granted less
    than ``_RESHARE_S`` ago); for a session it never served through the slot (its batched chain
    drafts come back in replies), the session gives its slot back and asks for none again, and the
    channel stays. Slots that served trees before and served none for ``_RESHARE_S`` while sessions
    come back in replies are asked for again too (a restart no running session noticed).

    Args:
        engine: the worker's :class:`~specsplit.engines.target.TargetEngine`.
        draft: client of the draft worker, or ``None`` (every generation is target-only).
        clamp_capacity: the worker's clamp of capacity hints to its ``max_context``.
        tree_slots: use tree slots where possible (``specsplit serve target --tree-ipc``).
        compute: a turn of the worker's compute, taken around each verification (the draft call
            is the draft worker's compute, shared there); ``None``: none taken.
    """

    def __init__(
        self,
        engine: Any,
        draft: GrpcTransport | None,
        clamp_capacity: Callable[[int], int],
        tree_slots: bool = True,
        compute: Callable[[], AbstractContextManager[None]] | None = None,
    ):
        self.engine = engine
        self._compute = compute or nullcontext
        self._draft = draft
        self._clamp = clamp_capacity
        self._want_slots = tree_slots and draft is not None
        self._slots: TreeSlotImporter | None = None
        self._slot_of: dict[str, int] = {}  # session -> its slot in self._slots
        self._free: list[int] = []
        self._share_after = 0.0  # monotonic time before which no ShareTreeSlots is attempted
        self._shared_at = 0.0  # when the current slots were granted
        self._in_slot: set[str] = set()  # sessions that have had a tree in their slot
        self._by_reply: OrderedDict[str, None] = OrderedDict()  # sessions the draft worker answers in replies
        self._slot_tree_at: float | None = None  # when a tree last came through the current slots
        self._slots_lock = threading.Lock()

    @property
    def has_draft(self) -> bool:
        return self._draft is not None and self._draft.has_draft

    def draft(self, request: DraftRequest) -> DraftResult:
        if self._draft is None:
            raise TransportError("this target worker has no draft worker (serve it with --draft-address)")
        slots, channel = None, ""
        if self._want_slots and not request.speculate and not request.sampling.do_sample:
            slots, channel, slot = self._slot_for(request.session_id)
            if channel:
                request = SlotDraftRequest.of(request, channel, slot)
        res = self._draft.draft(request)
        in_slot = res.tree_in_slot if isinstance(res, SlotDraftResult) else None
        if in_slot is not None:
            if slots is None:
                raise TransportError("the draft worker answered with a tree slot nobody asked for")
            cfg = self.engine.config
            res.tree = slots.read(
                in_slot, self.engine.model_vocab_size, cfg.max_tree_nodes, cfg.max_tree_depth
            )
            with self._slots_lock:
                if self._slots is slots:
                    self._in_slot.add(request.session_id)
                    self._slot_tree_at = time.monotonic()
        elif slots is not None and channel:
            self._answered_in_reply(slots, request.session_id)
        return res

    def _answered_in_reply(self, slots: TreeSlotImporter, session_id: str) -> None:
        """The draft worker sent the tree of a slot request in its reply (see the class docstring)."""
        with self._slots_lock:
            if self._slots is not slots:
                return
            now = time.monotonic()
            lost = session_id in self._in_slot or (
                self._slot_tree_at is not None and now - self._slot_tree_at >= _RESHARE_S
            )
            if not lost:  # this session's trees come in replies: its slot goes back
                self._give_back_slot(session_id)
                self._by_reply[session_id] = None
                if len(self._by_reply) > _BY_REPLY_MAX:  # sessions never ended here are forgotten
                    self._by_reply.popitem(last=False)
                return
        self._drop_slots(slots, "the draft worker sent the tree in its reply (restarted?)")

    def _slot_for(self, session_id: str) -> tuple[TreeSlotImporter | None, str, int]:
        """The session's slot (taken on its first round); ``(None, "", 0)``: the tree comes in the reply."""
        with self._slots_lock:
            if session_id in self._by_reply:
                return None, "", 0
            if self._slots is None:
                if time.monotonic() < self._share_after:
                    return None, "", 0
                self._share()
            slots = self._slots
            if slots is None:
                return None, "", 0
            slot = self._slot_of.get(session_id)
            if slot is None:
                if not self._free:
                    return None, "", 0  # more generations at once than slots: this one uses replies
                slot = self._slot_of[session_id] = self._free.pop()
            return slots, slots.channel_id, slot

    def _share(self) -> None:
        """Ask the draft worker for slots (lock held); on failure retry after ``_RESHARE_S``."""
        self._share_after = time.monotonic() + _RESHARE_S
        device = self.engine.device
        if device.type != "cuda":
            self._want_slots = False
            logger.info("tree slots off: the target runs on %s", device)
            return
        assert self._draft is not None
        try:
            resp = self._draft.share_tree_slots(host_id(), _SLOTS)
        except SpecSplitError as e:  # unreachable now, or an older worker: trees travel in replies
            logger.info("tree slots unavailable (%s); trees travel in the draft worker's replies", e)
            return
        try:
            self._slots = TreeSlotImporter(resp, device)
        except TransportError as e:  # refused, or the handles do not open here: for good
            self._want_slots = False
            logger.info("tree slots off (%s); trees travel in the draft worker's replies", e)
            return
        self._shared_at = time.monotonic()
        self._free = list(range(self._slots.slots))[::-1]
        self._slot_of.clear()
        self._forget_sessions()
        logger.info("tree slots on: %d slots of %d nodes (channel %s)", self._slots.slots,
                    self._slots.slot_nodes, self._slots.channel_id[:8])  # fmt: skip

    def _drop_slots(self, slots: TreeSlotImporter, why: str) -> None:
        with self._slots_lock:
            if self._slots is slots:
                logger.info("tree slots dropped: %s", why)
                self._slots = None
                self._slot_of.clear()
                self._forget_sessions()
                # Ask again at the next round, unless these slots were new: then at most once per
                # _RESHARE_S, so a draft worker that keeps answering with trees costs no call a round.
                now = time.monotonic()
                self._share_after = now if now - self._shared_at >= _RESHARE_S else now + _RESHARE_S

    def _give_back_slot(self, session_id: str) -> None:
        """The session's slot, if it holds one, is free for the next generation (lock held)."""
        slot = self._slot_of.pop(session_id, None)
        if slot is not None:
            self._free.append(slot)

    def _forget_sessions(self) -> None:
        """New slots, or none: which sessions came through the old ones no longer says anything."""
        self._in_slot.clear()
        self._by_reply.clear()
        self._slot_tree_at = None

    def verify(self, request: VerifyRequest) -> VerifyResult:
        request.capacity_hint = self._clamp(request.capacity_hint)
        with self._compute():
            return self.engine.verify(request)

    def end_session(self, session_id: str) -> None:
        with self._slots_lock:
            self._give_back_slot(session_id)
            self._in_slot.discard(session_id)
            self._by_reply.pop(session_id, None)
        self.engine.end_session(session_id)
        if self._draft is not None:
            # Waited for: the draft worker lends its one graph workspace to one session at a time, so
            # the next generation's session must not arrive before this one has given it back.
            self._draft.end_session(session_id)

    def info(self) -> dict[str, WorkerInfo]:
        out = {"target": self.engine.info()}
        if self._draft is not None:
            out.update(self._draft.info())
        return out

    def close(self) -> None:
        with self._slots_lock:  # unmap the draft worker's slots (its memory is freed when it exits)
            self._slots, self._want_slots = None, False
            self._slot_of.clear()
        if self._draft is not None:
            self._draft.close()


class WorkerDrafting:
    """What a target worker running rounds drafts with, kept across its clients' generations: the
    default drafter, the n-gram drafters (one with the worker's suffix cache of earlier
    generations) and the round planners.

    Args:
        default: the drafter of requests that name none (``specsplit serve target --drafter``).
        ngram: how n-gram trees are proposed.
        padded: pad n-gram trees to a few sizes (the worker's target replays CUDA graphs).
    """

    def __init__(self, default: str = "model", ngram: NgramConfig | None = None, padded: bool = True):
        if default not in DRAFTERS:
            raise ConfigError(f"drafter must be one of {DRAFTERS}, got {default!r}")
        self.default = default
        self.padded = padded  # n-gram trees padded to a few sizes (a target on the CUDA-graph path)
        self.ngram = ngram or NgramConfig()
        self._plain = NgramDrafter(self.ngram, suffix=False, graphs=padded)
        self._suffix = NgramDrafter(self.ngram, suffix=True, graphs=padded)
        self.costs = CostModels()

    def drafter(self, mode: str) -> NgramDrafter:
        return self._suffix if mode in ("suffix", "auto") else self._plain


def decode_params(
    req: GenerateRequest,
    vocab_size: int,
    limits: Any,
    policies: OverlapPolicies,
    drafting: WorkerDrafting | None = None,
) -> DecodeParams:
    """Check a ``Generate`` request against the worker's limits and build the loop's parameters.

    Raises:
        InvalidRequest: empty prompt, token ids outside the vocabulary, negative
            ``max_new_tokens``, an unknown overlap policy or a malformed ``rng_state``.
        ResourceExhausted: a context beyond the worker's ``max_context`` (the tree's limits are
            checked on the raw message, ``server.check_tree_spec``).
    """
    prompt = req.prompt_token_ids
    if not prompt:
        raise InvalidRequest("prompt_token_ids must hold at least one token")
    lo, hi = min(prompt), max(prompt)
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise InvalidRequest(f"prompt_token_ids: token id {bad} is outside the vocabulary [0, {vocab_size})")
    if req.max_new_tokens < 0:
        raise InvalidRequest(f"max_new_tokens must be >= 0, got {req.max_new_tokens}")
    if len(prompt) + req.max_new_tokens > limits.max_context:
        raise ResourceExhausted(
            f"prompt ({len(prompt)}) + max_new_tokens ({req.max_new_tokens}) exceeds this worker's "
            f"max_context {limits.max_context}"
        )
    if req.overlap_policy not in ("adaptive", "always"):
        raise InvalidRequest(f"overlap_policy must be 'adaptive' or 'always', got {req.overlap_policy!r}")
    drafting = drafting or WorkerDrafting()
    mode = req.drafter or drafting.default
    if mode not in DRAFTERS:
        raise InvalidRequest(f"drafter must be one of {DRAFTERS} (or empty), got {req.drafter!r}")
    generator = None
    if req.sampling.do_sample:
        generator = torch.Generator()
        if not req.rng_state:
            generator.seed()
        elif len(req.rng_state) != _RNG_STATE_BYTES:
            raise InvalidRequest(
                f"rng_state must be a CPU torch.Generator state ({_RNG_STATE_BYTES} bytes), "
                f"got {len(req.rng_state)} bytes"
            )
        else:
            try:
                generator.set_state(torch.frombuffer(bytearray(req.rng_state), dtype=torch.uint8))
            except (RuntimeError, ValueError) as e:
                raise InvalidRequest(f"rng_state is not a CPU torch.Generator state: {e}") from None
    req.session_id = req.session_id or uuid.uuid4().hex
    always = req.overlap_policy == "always"
    return DecodeParams(
        max_new_tokens=req.max_new_tokens,
        sampling=req.sampling,
        tree=req.tree,
        eos_token_ids=frozenset(req.eos_token_ids),
        generator=generator,
        overlap=req.overlap,
        overlap_policy=req.overlap_policy,
        policy=policies.policy(req.tree, req.sampling.do_sample, always) if req.overlap else None,
        drafter=mode,
        ngram=drafting.drafter(mode),
        cost=drafting.costs.get(
            mode,
            repr(req.tree),
            req.tree.max_nodes,
            req.sampling.do_sample,
            drafting.ngram.max_nodes,
            drafting.padded,
        ),
        processing=req.processing,
        draft_processing=req.processing
        if req.processing and needs_processing(req.processing.options)
        else None,
    )
