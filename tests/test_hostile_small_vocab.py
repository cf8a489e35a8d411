"""A vocabulary smaller than the draft's sampled support (``q_top_k``, 32 by default) works.

The draft samples from its top-``q_top_k`` tokens; with fewer tokens than that in the vocabulary
the support is the whole vocabulary, for every tree shape, locally and over gRPC.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama

from specsplit import (
    DraftEngine,
    LocalTransport,
    SpecSplitConfig,
    SpecSplitGenerator,
    TargetEngine,
    TreeConfig,
)

SMALL = 20  # below the default q_top_k of 32


@pytest.mark.parametrize("shape", ["chain", "static", "dynamic"])
def test_sampling_with_a_vocabulary_below_q_top_k(shape: str) -> None:
    target, draft = tiny_llama(0, vocab=SMALL), tiny_llama(1, vocab=SMALL)
    cfg = SpecSplitConfig(tree=TreeConfig(shape=shape))
    assert cfg.draft.tuning.q_top_k > SMALL
    gen = SpecSplitGenerator(transport=LocalTransport(DraftEngine(draft), TargetEngine(target)), config=cfg)
    ids = torch.randint(3, SMALL, (1, 6), generator=torch.Generator().manual_seed(0))
    out = gen.generate(ids, max_new_tokens=24, do_sample=True, temperature=1.0,
                       generator=torch.Generator().manual_seed(1), return_dict_in_generate=True)  # fmt: skip
    assert out.sequences.shape == (1, 6 + 24)
    assert int(out.sequences.max()) < SMALL
    assert sum(r.drafted_depth for r in out.spec_stats.rounds) > 0  # the draft really drafted


def test_sampling_with_a_small_vocabulary_over_grpc() -> None:
    pytest.importorskip("grpc")
    from specsplit.remote import GrpcTransport, serve_draft, serve_target

    draft, target = DraftEngine(tiny_llama(1, vocab=SMALL)), TargetEngine(tiny_llama(0, vocab=SMALL))
    with serve_draft(draft) as d, serve_target(target) as t:
        gen = SpecSplitGenerator(transport=GrpcTransport(t.address, d.address, timeout_s=30))
        ids = torch.randint(3, SMALL, (1, 6), generator=torch.Generator().manual_seed(0))
        out = gen.generate(ids, max_new_tokens=16, do_sample=True, generator=torch.Generator().manual_seed(2))
        gen.close()
    assert out.shape == (1, 22) and int(out.max()) < SMALL
