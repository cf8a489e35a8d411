"""What one generation's round loop needs besides the prompt."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from specsplit.config import TreeConfig
from specsplit.core.sampling import SamplingParams
from specsplit.messages import LogitsProcessing

if TYPE_CHECKING:
    from specsplit.engines.cost_model import CostModel
    from specsplit.engines.drafters import NgramDrafter
    from specsplit.pipeline.overlap import OverlapPolicy

SEED_HIGH = 2**62


@dataclass
class DecodeParams:
    """What the loop needs besides the prompt."""

    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    tree: TreeConfig = field(default_factory=TreeConfig)
    eos_token_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    tokenizer: Any = None  # needed for stop strings
    generator: torch.Generator | None = None  # CPU RNG the generation's seeds are drawn from
    after_draft: Callable[[], None] | None = None  # e.g. a device sync for exact timing
    overlap: bool = False  # draft round N+1 (speculatively) while round N verifies
    overlap_policy: str = "adaptive"  # or "always" (see SpecSplitConfig.overlap_policy)
    policy: OverlapPolicy | None = None  # kept across calls by the caller; None: a fresh one
    loop: str = "client"  # "target": the target worker runs the rounds (GrpcTransport.generate_on_target)
    drafter: str = "model"  # "model" | "ngram" | "suffix" | "hybrid" | "auto" (SpecSplitConfig.drafter)
    ngram: NgramDrafter | None = None  # n-gram settings and suffix cache, kept across calls by the caller
    cost: CostModel | None = None  # the round planner, kept across calls by the caller; None: a fresh one
    processing: LogitsProcessing | None = None  # HF logits processors the target applies to every row
    draft_processing: LogitsProcessing | None = None  # what the draft applies to its own q (acceptance)
    return_scores: bool = False  # collect the processed scores of every committed token
    return_logits: bool = False  # collect the raw logits of every committed token
    stopping_criteria: list[Any] = field(default_factory=list)  # HF StoppingCriteria, checked per token
    criteria_prefix: list[int] = field(default_factory=list)  # what the criteria see before the prompt


@dataclass
class DecodeOutputs:
    """Per committed token, what ``generate(output_scores=True / output_logits=True)`` returns:
    `[vocab]` float32 rows (on the target's device in-process)."""

    scores: list[torch.Tensor] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)


def generation_seeds(params: DecodeParams) -> tuple[int | None, int | None]:
    """A generation's (draft, verify) seeds, drawn once from ``params.generator`` (sampling only).

    The engines derive each round's and each position's randomness from them and the absolute
    position (:func:`~specsplit.core.sampling.derive_seed`), so the committed tokens do not depend
    on how many rounds a generation took or what they drafted."""
    if not params.sampling.do_sample:
        return None, None
    s = torch.randint(0, SEED_HIGH, (2,), generator=params.generator).tolist()
    return int(s[0]), int(s[1])
