"""The round loop run by the target worker (``grpc_loop="target"``): one network hop a round."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

import torch

from specsplit.errors import ConfigError, TransportError
from specsplit.messages import GenerateRequest
from specsplit.pipeline.params import DecodeParams, generation_seeds
from specsplit.pipeline.stop import StopChecker
from specsplit.telemetry import SpecStats
from specsplit.transport import Transport


def decode_on_target(
    transport: Transport,
    prompt: list[int],
    params: DecodeParams,
    on_tokens: Callable[[list[int]], None] | None,
    session_id: str | None,
) -> tuple[list[int], SpecStats]:
    """:func:`decode` with the round loop on the target worker: one network hop a round.

    The worker cuts at EOS and ``max_new_tokens``; stop strings are checked here on the streamed
    tokens, and the call is cancelled at the first match (the worker may have run one round
    more, which is dropped). Sampling seeds: the worker draws them from a copy of this call's
    generator state as :func:`decode` does, and afterwards this generator is advanced by the same
    draw, so tokens and generator state equal client-loop mode's.
    """
    run = getattr(transport, "generate_on_target", None)
    if run is None:
        raise ConfigError(
            f"loop='target' needs a transport that runs rounds on the target worker (GrpcTransport), "
            f"got {type(transport).__name__}"
        )
    stats = SpecStats(prompt_tokens=len(prompt))
    stopper = StopChecker(params, prompt)
    out: list[int] = []
    rng_state = b""
    if params.sampling.do_sample:
        gen = params.generator if params.generator is not None else torch.default_generator
        rng_state = gen.get_state().numpy().tobytes()
    req = GenerateRequest(
        session_id=session_id or uuid.uuid4().hex,
        prompt_token_ids=list(prompt),
        max_new_tokens=params.max_new_tokens,
        sampling=params.sampling,
        tree=params.tree,
        eos_token_ids=sorted(params.eos_token_ids),
        rng_state=rng_state,
        overlap=params.overlap,
        overlap_policy=params.overlap_policy,
        drafter=params.drafter,
        processing=params.processing,
    )
    t_start = time.perf_counter()
    stream = run(req)
    finished = stopped = False
    try:
        for update in stream:
            for tokens, rs in update.rounds:
                kept, stopped = stopper.cut(out, tokens)
                rs.committed = len(kept)
                out.extend(kept)
                stats.rounds.append(rs)
                if rs.spec_hit is not None:
                    stats.spec_rounds += 1
                    stats.spec_hits += rs.spec_hit
                if on_tokens is not None:
                    on_tokens(kept)
                if stopped:
                    break
            if update.done:
                stats.recoveries, stats.draft_fallback = update.recoveries, update.draft_fallback
                finished = True
            if stopped or update.done:
                break
        if not (finished or stopped):
            raise TransportError("the target worker ended the generation stream before its end")
    finally:
        if not finished:
            stream.cancel()  # a stop string, an error here, or the worker failing: stop it there too
        stats.wall_time_s = time.perf_counter() - t_start
    generation_seeds(params)  # the draw decode() makes (none under greedy)
    return out, stats
