"""n-gram drafting over gRPC: the client loop sends n-gram trees to a target worker with no draft worker,
and a target worker running the rounds (``grpc_loop="target"``) drafts n-grams itself — no draft
worker, no draft hop. Same tokens as local mode; the rounds say what drafted them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("grpc")

import grpc  # noqa: E402
from remote_support import load_saved  # noqa: E402

from specsplit import SpecSplitConfig, SpecSplitGenerator, TargetEngine, TreeConfig  # noqa: E402
from specsplit.core.sampling import SamplingParams  # noqa: E402
from specsplit.remote import convert, serve_target  # noqa: E402
from specsplit.remote._generated import spec_decoding_pb2 as pb  # noqa: E402
from specsplit.remote._generated import spec_decoding_pb2_grpc as pb_grpc  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

# A prompt that repeats itself: prompt lookup finds matches from the first round on.
PROMPT = [5, 17, 33, 81, 9, 100, 5, 17, 33, 81, 9, 100, 5, 17]


@pytest.fixture(scope="module")
def target_model(model_dirs: tuple[Path, Path]) -> torch.nn.Module:
    return load_saved(model_dirs[0])


@pytest.mark.parametrize("loop", ["client", "target"])
@pytest.mark.parametrize("sampling", [{}, {"do_sample": True, "temperature": 0.8, "top_p": 0.95}])
def test_ngram_over_grpc_equals_local(target_model, loop: str, sampling: dict) -> None:
    ids = torch.tensor([PROMPT])
    kw = dict(max_new_tokens=32, return_dict_in_generate=True, **sampling)
    with SpecSplitGenerator(target_model, None, config=SpecSplitConfig(drafter="ngram")) as local:
        ref = local.generate(ids, generator=torch.Generator().manual_seed(5), **kw)
    with serve_target(TargetEngine(target_model)) as srv:  # no --draft-address: no draft worker at all
        cfg = SpecSplitConfig(transport="grpc", target_address=srv.address, drafter="ngram", grpc_loop=loop)
        with SpecSplitGenerator(config=cfg) as gen:
            out = gen.generate(ids, generator=torch.Generator().manual_seed(5), **kw)
    assert torch.equal(out.sequences, ref.sequences)
    by = out.spec_stats.rounds_by_drafter()
    assert by.get("ngram", 0) > 0, by  # trees were drafted (by the client, or by the worker itself)
    assert not out.spec_stats.draft_fallback


def test_worker_default_drafter_serves_requests_that_name_none(target_model) -> None:
    """``specsplit serve target --drafter ngram``: a ``Generate`` request with no drafter drafts n-grams."""
    with (
        serve_target(TargetEngine(target_model), drafter="ngram") as srv,
        grpc.insecure_channel(srv.address) as ch,
    ):
        stub = pb_grpc.TargetServiceStub(ch)
        greedy, chain = (
            convert.sampling_to_proto(SamplingParams()),
            convert.tree_config_to_proto(TreeConfig()),
        )
        req = pb.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=24, sampling=greedy, tree=chain)
        rounds = [r for resp in stub.Generate(req, timeout=60) for r in resp.rounds]
        with pytest.raises(grpc.RpcError) as err:
            list(
                stub.Generate(pb.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=4, drafter="magic"))
            )
    assert {r.drafter for r in rounds} >= {"ngram"}
    assert sum(len(r.token_ids) for r in rounds) == 24
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("loop", ["client", "target"])
def test_lookahead_over_grpc_equals_local(target_model, loop: str) -> None:
    """Lookahead rounds over gRPC: the client loop asks the target worker for its choices after
    every node (``VerifyRequest.return_choices``); a worker running the rounds keeps its own window
    (``specsplit serve target --lookahead``). Same tokens, rounds and accepted counts as the same
    lookahead generation in one process (and HF's greedy tokens)."""
    from specsplit.config import NgramConfig, PipelineTuning

    ngram = NgramConfig(lookahead=4, lookahead_levels=2, lookahead_policy="always")
    tuning = PipelineTuning(ngram=ngram)
    ids = torch.tensor([[44, 3, 19, 250, 61, 62, 63, 64, 9, 3, 19]])
    kw = dict(max_new_tokens=32, return_dict_in_generate=True)
    hf = target_model.generate(ids, max_new_tokens=32, do_sample=False, pad_token_id=0)
    with SpecSplitGenerator(
        target_model, None, config=SpecSplitConfig(drafter="ngram", tuning=tuning)
    ) as local:
        ref = local.generate(ids, **kw)
    with serve_target(TargetEngine(target_model), ngram=ngram) as srv:
        cfg = SpecSplitConfig(transport="grpc", target_address=srv.address, drafter="ngram", grpc_loop=loop,
                              tuning=tuning)  # fmt: skip
        with SpecSplitGenerator(config=cfg) as gen:
            out = gen.generate(ids, **kw)
    assert torch.equal(ref.sequences, hf) and torch.equal(out.sequences, ref.sequences)
    assert out.spec_stats.accepted_counts() == ref.spec_stats.accepted_counts()
    assert out.spec_stats.rounds_by_drafter() == ref.spec_stats.rounds_by_drafter()
    assert ref.spec_stats.rounds_by_drafter().get("lookahead", 0) > 0


@pytest.mark.parametrize("loop", ["client", "target"])
def test_a_target_worker_with_draft_heads(target_model, tmp_path, loop: str) -> None:
    """``specsplit serve target --draft-heads DIR``: the n-gram rounds verify the heads' guesses beside
    their own nodes (rounds say ``heads``), whether the worker runs the rounds or a client loop gets
    the guesses in its verify replies. Both commit HF greedy's tokens."""
    import copy

    from specsplit.config import TargetConfig
    from specsplit.runtime.heads import DraftHeads, HeadsInfo, save_heads

    w = target_model.get_output_embeddings().weight
    torch.manual_seed(0)
    heads = DraftHeads(2, w.shape[1])
    with torch.no_grad():
        heads.weight.normal_(0, 0.05)
    path = save_heads(
        heads, HeadsInfo(2, w.shape[1], w.shape[0], rank_accuracy=[[0.5, 0.2], [0.3, 0.1]]), tmp_path
    )
    ids = torch.tensor([PROMPT])
    ref = target_model.generate(ids, max_new_tokens=32, do_sample=False, pad_token_id=0)
    engine = TargetEngine(
        copy.deepcopy(target_model), TargetConfig(draft_heads=str(path), draft_heads_nodes=4)
    )
    with serve_target(engine) as srv:
        cfg = SpecSplitConfig(transport="grpc", target_address=srv.address, drafter="ngram", grpc_loop=loop)
        with SpecSplitGenerator(config=cfg) as gen:
            out = gen.generate(ids, max_new_tokens=32, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    by = out.spec_stats.rounds_by_drafter()
    assert by.get("heads", 0) > 0, by
