"""The overlapped pipeline: drafting round N+1 while round N verifies, and when that pays.

While the target verifies round N, the draft side drafts round N+1 assuming round N accepts the
draft's main path and the target's next token equals the draft's own guess
(``DraftRequest.speculate``). On a hit the next tree is ready when verification returns; on a miss
it is dropped. :class:`OverlapPolicy` measures whether speculating commits tokens faster than not.
"""

from __future__ import annotations

import logging
import threading
import time

from specsplit.config import TreeConfig
from specsplit.engines.ab_policy import OverlapPolicy
from specsplit.errors import CacheDesyncError, SessionNotFound, TransportError
from specsplit.messages import DraftRequest, DraftResult
from specsplit.pipeline.params import DecodeParams
from specsplit.transport import Transport

logger = logging.getLogger(__name__)


class OverlapPolicies(dict):
    """``{(tree shape repr, do_sample): OverlapPolicy}``, kept across generations.

    What a policy measured on earlier prompts holds for the next ones on the same machine and
    pair, so a generator (and a target worker running rounds for its clients) keeps one per tree
    shape and sampling mode here instead of probing again on every prompt.
    """

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()

    def policy(self, tree: TreeConfig, do_sample: bool, always: bool) -> OverlapPolicy:
        key = (repr(tree), do_sample)
        with self._lock:
            policy = self.get(key)
            if policy is None or policy.always != always:
                policy = self[key] = OverlapPolicy(always=always)
            return policy


def speculate(
    transport: Transport,
    sid: str,
    prefix: int,
    params: DecodeParams,
    seed: int | None,
    budget: int | None,
    capacity: int,
) -> tuple[DraftResult | None, float]:
    """Draft the next round assuming this one accepts the main path (runs beside verification).

    Any failure only costs the speculation: the next round drafts from the committed context.
    """
    t = time.perf_counter()
    req = DraftRequest(sid, [], prefix, params.tree, params.sampling, seed, budget, capacity, speculate=True,
                       processing=params.draft_processing)  # fmt: skip
    try:
        res: DraftResult | None = transport.draft(req)
    except (TransportError, CacheDesyncError, SessionNotFound) as e:
        logger.info("speculative draft failed (%s); the next round drafts normally", e)
        res = None
    return res, time.perf_counter() - t
