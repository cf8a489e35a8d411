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

import uuid
from collections.abc import Callable
from typing import Any

import torch

from specsplit.errors import InvalidRequest, ResourceExhausted, TransportError
from specsplit.pipeline import DecodeParams, OverlapPolicies
from specsplit.remote.client import GrpcTransport
from specsplit.transport import (
    DraftRequest,
    DraftResult,
    GenerateRequest,
    VerifyRequest,
    VerifyResult,
    WorkerInfo,
)

_RNG_STATE_BYTES = torch.Generator().get_state().numel()


class TargetLoopTransport:
    """The :class:`~specsplit.transport.Transport` a target worker runs rounds over.

    Verification calls the worker's engine directly (trees from the draft worker arrive as host
    tensors and are validated by the engine, as in ``VerifyDrafts``); drafting goes to the draft
    worker through a draft-only :class:`GrpcTransport`, so a failing draft worker turns the rest of
    a generation into target-only steps exactly as in client-loop mode.

    Args:
        engine: the worker's :class:`~specsplit.target.TargetEngine`.
        draft: client of the draft worker, or ``None`` (every generation is target-only).
        clamp_capacity: the worker's clamp of capacity hints to its ``max_context``.
    """

    def __init__(self, engine: Any, draft: GrpcTransport | None, clamp_capacity: Callable[[int], int]):
        self.engine = engine
        self._draft = draft
        self._clamp = clamp_capacity

    @property
    def has_draft(self) -> bool:
        return self._draft is not None and self._draft.has_draft

    def draft(self, request: DraftRequest) -> DraftResult:
        if self._draft is None:
            raise TransportError("this target worker has no draft worker (serve it with --draft-address)")
        return self._draft.draft(request)

    def verify(self, request: VerifyRequest) -> VerifyResult:
        request.capacity_hint = self._clamp(request.capacity_hint)
        return self.engine.verify(request)

    def end_session(self, session_id: str) -> None:
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
        if self._draft is not None:
            self._draft.close()


def decode_params(
    req: GenerateRequest, vocab_size: int, limits: Any, policies: OverlapPolicies
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
    )
