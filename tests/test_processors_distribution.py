"""Sampling with HF logits processors stays lossless: the committed tokens are distributed exactly as
``generate()``'s processed distribution, whatever the tree.

The processors here depend on each row's own context (a repetition penalty on the prompt and the
row's path, an n-gram ban), followed by warpers (temperature, min-p), so a tree whose rows were
processed with the wrong context, or not at all, gives a different joint. Same statistical bound
as ``test_lossless_sampling`` (20,000 seeded rounds, TV < 0.04 over the first two tokens); the
negative control shows that verifying without the processors fails it.
"""

from __future__ import annotations

import pytest
import torch
from test_lossless_sampling import PROMPT, RUNS, V, tv
from test_lossless_sampling import _model as model

from specsplit import DraftEngine, DraftRequest, TargetEngine, TreeConfig, VerifyRequest
from specsplit.config import DraftConfig, EngineTuning, SamplingParams
from specsplit.engines.drafters import proposal_tree
from specsplit.messages import LogitsProcessing

OPTIONS = {"do_sample": True, "temperature": 0.8, "repetition_penalty": 5.0, "no_repeat_ngram_size": 2,
           "min_p": 0.02}  # fmt: skip
SAMPLING = SamplingParams(do_sample=True, temperature=0.8)


@pytest.fixture(scope="module")
def pair():
    return model(0, 6.0), model(7, 20.0)


def processed_probs(target, contexts: list[list[int]]) -> torch.Tensor:
    """`[len(contexts), V]` what ``generate()`` samples from after each context (HF's processors)."""
    from transformers import GenerationConfig

    gc = GenerationConfig(**OPTIONS, max_length=64)
    target._prepare_special_tokens(gc, True, torch.device("cpu"))
    procs = target._get_logits_processor(gc, input_ids_seq_length=len(PROMPT), device="cpu", model_kwargs={})
    out = []
    with torch.no_grad():
        for c in contexts:
            ids = torch.tensor([c])
            scores = procs(ids, target(ids).logits[:, -1].float())
            out.append(torch.softmax(scores, -1)[0])
    return torch.stack(out)


def exact_joint(target) -> torch.Tensor:
    p1 = processed_probs(target, [PROMPT])[0]
    p2 = processed_probs(target, [PROMPT + [x] for x in range(V)])
    return p1[:, None] * p2


def unprocessed_joint(target) -> torch.Tensor:
    """The joint without the processors (temperature alone)."""
    from specsplit.core.sampling import logits_to_probs

    with torch.no_grad():
        p1 = logits_to_probs(target(torch.tensor([PROMPT])).logits[0, -1], SAMPLING)
        p2 = logits_to_probs(target(torch.tensor([PROMPT + [x] for x in range(V)])).logits[:, -1], SAMPLING)
    return p1[:, None] * p2


def empirical_joint(
    target, draft, tree: TreeConfig | None, processing: bool = True, runs: int = RUNS, on_draft: bool = False
):
    """The first two committed tokens of ``runs`` seeded rounds through the real engines: a sampled
    model tree (``tree``; ``on_draft``: drawn from the draft's own processed distribution) or,
    with ``tree=None``, a fixed deterministic branching tree."""
    draft_engine = DraftEngine(draft, DraftConfig(tuning=EngineTuning(q_top_k=V)))
    target_engine = TargetEngine(target)
    spec = LogitsProcessing({**OPTIONS, "max_length": 64}, len(PROMPT)) if processing else None
    cond2 = exact_joint(target)
    cond2 = cond2 / cond2.sum(1, keepdim=True).clamp_min(1e-30)
    fixed = None
    if tree is None:
        from specsplit.core.ngram import Proposal

        prop = Proposal(
            [2, 5, 1, 4, 6, 2], [-1, -1, -1, 0, 0, 1], [1, 1, 1, 2, 2, 2], [0.5, 0.3, 0.2, 0.3, 0.2, 0.1]
        )
        fixed, _ = proposal_tree(prop, 8, depth_bound=2, fixed_bounds=False)
    counts = torch.zeros(V, V)
    g = torch.Generator().manual_seed(99)
    with torch.inference_mode():
        for _ in range(runs):
            s_draft, s_verify, s_next = torch.randint(0, 2**62, (3,), generator=g).tolist()
            if tree is not None:
                req = DraftRequest("s", PROMPT, 0, tree, SAMPLING, s_draft, max_depth=2,
                                   processing=spec if on_draft else None)  # fmt: skip
                tr = draft_engine.generate(req).tree
            else:
                assert fixed is not None
                tr = fixed
            res = target_engine.verify(VerifyRequest("s", tr, PROMPT, 0, SAMPLING, s_verify, processing=spec))
            toks = res.accepted_token_ids + [res.next_token_id]
            if len(toks) < 2:
                toks.append(
                    int(torch.multinomial(cond2[toks[0]], 1, generator=torch.Generator().manual_seed(s_next)))
                )
            counts[toks[0], toks[1]] += 1
    draft_engine.shutdown()
    target_engine.shutdown()
    return counts / runs


@pytest.fixture(scope="module")
def one_thread_here():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # thousands of tiny ops: a thread pool only adds its hand-offs
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
@pytest.mark.parametrize(
    "tree",
    ["chain", "processed-chain", "fixed"],
    ids=["sampled-chain", "processed-draft", "deterministic-tree"],
)
def test_processed_distribution_is_exact(pair, one_thread_here, tree: str) -> None:
    target, draft = pair
    exact = exact_joint(target)
    assert tv(exact, unprocessed_joint(target)) > 0.15  # the processors matter here
    cfg = TreeConfig(shape="chain", num_draft_tokens=2) if tree != "fixed" else None
    emp = empirical_joint(target, draft, cfg, on_draft=tree == "processed-chain")
    assert tv(emp, exact) < 0.04, f"TV={tv(emp, exact):.4f}"
    assert tv(emp.sum(1), exact.sum(1)) < 0.02


def test_negative_control_without_processors_fails(pair, one_thread_here) -> None:
    target, draft = pair
    emp = empirical_joint(target, draft, None, processing=False, runs=3000)
    assert tv(emp, exact_joint(target)) > 0.1
