"""The static-shape path (workspace cache, index writes, full-buffer masks; CUDA graphs on GPU)
must give exactly what the eager path gives. On CPU it runs without capture."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_same_sampling

from specsplit import SpecSplitConfig, SpecSplitGenerator, TreeConfig
from specsplit.config import DraftConfig, EngineTuning, TargetConfig
from specsplit.errors import ResourceExhausted
from specsplit.runtime.graphs import StaticForward

PROMPT = [5, 17, 33, 81, 9, 100]


def _cfg(shape: str, graphs: bool, capacity: int = 256) -> SpecSplitConfig:
    return SpecSplitConfig(
        tree=TreeConfig(shape=shape),
        draft=DraftConfig(cuda_graphs=graphs, tuning=EngineTuning(graph_capacity=capacity)),
        target=TargetConfig(cuda_graphs=graphs, tuning=EngineTuning(graph_capacity=capacity)),
    )


@pytest.fixture
def static_calls(monkeypatch):
    calls = {"n": 0}
    orig = StaticForward.run

    def counting(self, *a, **k):
        calls["n"] += 1
        return orig(self, *a, **k)

    monkeypatch.setattr(StaticForward, "run", counting)
    return calls


@pytest.mark.parametrize("shape", ["chain", "static", "dynamic"])
@pytest.mark.parametrize("draft_kind", ["same", "random"])
def test_static_path_greedy_exact(llama_target, llama_draft_random, shape, draft_kind, static_calls):
    draft = llama_target if draft_kind == "same" else llama_draft_random
    ids = torch.tensor([PROMPT])
    ref = llama_target.generate(ids, max_new_tokens=40, do_sample=False)
    with SpecSplitGenerator(llama_target, draft, config=_cfg(shape, True)) as gen:
        for _ in range(2):  # second run reuses the workspace (and, on GPU, its graphs)
            out = gen.generate(ids, max_new_tokens=40, return_dict_in_generate=True)
            assert torch.equal(out.sequences, ref)
        assert gen.target_engine._workspace.owner is None  # released at session end
    assert static_calls["n"] > 0


def test_static_path_matches_eager_under_sampling(qwen_target, qwen_draft_random):
    cfgs = [_cfg("static", graphs) for graphs in (False, True)]
    assert_same_sampling(
        qwen_target, qwen_draft_random, torch.tensor([PROMPT]), cfgs, seed=3, max_new_tokens=30
    )


def test_sessions_beyond_the_workspace_fall_back_to_eager(llama_target):
    ids = torch.tensor([PROMPT])
    ref = llama_target.generate(ids, max_new_tokens=30, do_sample=False)
    with SpecSplitGenerator(llama_target, llama_target, config=_cfg("chain", True, capacity=20)) as gen:
        assert torch.equal(gen.generate(ids, max_new_tokens=30), ref)  # too long for 20 slots
        assert gen.target_engine._workspace.owner is None


def test_pinned_workspace_never_reallocates(llama_target):
    from specsplit.runtime.runner import ModelRunner

    sf = StaticForward(ModelRunner(llama_target, None, None, None, "auto"), 16, use_graphs=False)
    with pytest.raises(ResourceExhausted, match="graph_capacity"):
        sf.cache.ensure_capacity(64)


def test_kv_buckets_follow_the_context(llama_target, llama_draft_random, monkeypatch):
    """Attention reads a power-of-two bucket covering the valid prefix, not the whole workspace:
    a generation that crosses the 256-slot bucket boundary uses two buckets and stays exact."""
    from specsplit.runtime.graphs import kv_bucket

    assert [kv_bucket(e, 4096) for e in (1, 256, 257, 1000, 5000)] == [256, 256, 512, 1024, 4096]
    seen: set[int] = set()
    orig = StaticForward._forward

    def spy(self, b):
        seen.add(int(b.mask.shape[-1]))
        return orig(self, b)

    monkeypatch.setattr(StaticForward, "_forward", spy)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 256, (1, 236), generator=g)
    ref = llama_target.generate(ids, max_new_tokens=40, do_sample=False)
    with SpecSplitGenerator(
        llama_target, llama_draft_random, config=_cfg("static", True, capacity=1024)
    ) as gen:
        out = gen.generate(ids, max_new_tokens=40)
    assert torch.equal(out, ref)
    assert seen == {256, 512}


@pytest.mark.large  # Inductor compiles C++ kernels on CPU: about a minute on 2 cores
def test_compiled_static_path_is_exact(llama_target, llama_draft_random):
    """``compile=True`` fuses the static-path forward with torch.compile; tokens stay exact."""
    cfg = SpecSplitConfig(
        tree=TreeConfig(shape="static"),
        draft=DraftConfig(cuda_graphs=True, compile=True, tuning=EngineTuning(graph_capacity=256)),
        target=TargetConfig(cuda_graphs=True, compile=True, tuning=EngineTuning(graph_capacity=256)),
    )
    ids = torch.tensor([PROMPT])
    ref = llama_target.generate(ids, max_new_tokens=24, do_sample=False)
    with SpecSplitGenerator(llama_target, llama_draft_random, config=cfg) as gen:
        assert torch.equal(gen.generate(ids, max_new_tokens=24), ref)
        assert gen.target_engine._workspace.static._step is not None


@pytest.mark.parametrize("do_sample", [False, True])
def test_dynamic_round_in_one_step_equals_level_by_level(qwen_draft_random, do_sample):
    """``graph_rounds``: a dynamic tree grown by one device-only round (one CUDA graph on a GPU)
    is the tree grown level by level, bit for bit, on a fresh context and after new tokens."""
    from specsplit import DraftEngine, SamplingParams
    from specsplit.messages import DraftRequest

    tree = TreeConfig(shape="dynamic", topk=3, width=2, budget=10, max_depth=5)
    sampling = SamplingParams(do_sample=do_sample, temperature=0.7, top_p=0.9)
    grown = []
    for rounds in (True, False):
        eng = DraftEngine(
            qwen_draft_random,
            DraftConfig(cuda_graphs=True, tuning=EngineTuning(graph_capacity=256, graph_rounds=rounds)),
        )
        trees = [eng.generate(DraftRequest("s", PROMPT, 0, tree=tree, sampling=sampling)).tree]
        trees.append(eng.generate(DraftRequest("s", [7, 8], len(PROMPT), tree=tree, sampling=sampling)).tree)
        assert len(eng._rounds) == (1 if rounds else 0)
        grown.append(trees)
    for a, b in zip(*grown, strict=True):
        assert a.num_nodes == 10
        for name in ("token_ids", "parents", "depths", "log_probs"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_dynamic_shape_widths():
    from specsplit.engines.draft import DynamicShape

    assert DynamicShape(topk=2, width=5, budget=20, depth=5).widths == (2, 4, 5, 5)
    assert DynamicShape(topk=4, width=4, budget=24, depth=6).forwarded == 20
    assert DynamicShape(topk=4, width=4, budget=24, depth=1).widths == ()


def test_dynamic_tree_wider_than_its_budget_fits_the_workspace(llama_target, llama_draft_random):
    """A dynamic tree forwards more frontier nodes (here 56) than it keeps (budget 4): the workspace
    must be sized for the forwarded ones, or rounds near the end of a session overflow it."""
    tree = TreeConfig(shape="dynamic", topk=8, width=8, budget=4, max_depth=8)
    assert tree.draft_slots == 56 and tree.max_nodes == 4
    ids = torch.tensor([PROMPT])
    ref = llama_target.generate(ids, max_new_tokens=40, do_sample=False)
    for capacity in (len(PROMPT) + 40 + 4 + 8, 256):  # too small for 56 slots: eager; roomy: static
        cfg = SpecSplitConfig(
            tree=tree,
            draft=DraftConfig(cuda_graphs=True, tuning=EngineTuning(graph_capacity=capacity)),
            target=TargetConfig(cuda_graphs=True, tuning=EngineTuning(graph_capacity=capacity)),
        )
        with SpecSplitGenerator(llama_target, llama_draft_random, config=cfg) as gen:
            assert torch.equal(gen.generate(ids, max_new_tokens=40), ref)


@pytest.mark.parametrize("shape", ["chain", "dynamic"])
def test_end_of_generation_adds_no_new_shapes(llama_target, llama_draft_random, shape, monkeypatch):
    """Near max_new_tokens the static path keeps the tree's usual shape (a shallower tree would be a
    new graph, and a new compile, for one round); the output still stops exactly at the limit."""
    shapes: dict[str, set[int]] = {"draft": set(), "target": set()}
    orig = StaticForward.run

    def recording(self, ids, pos, ctx, block):
        role = "target" if self.runner is gen.target_engine.runner else "draft"
        shapes[role].add(int(block.shape[0]))
        return orig(self, ids, pos, ctx, block)

    monkeypatch.setattr(StaticForward, "run", recording)
    tree = TreeConfig(shape=shape, num_draft_tokens=4, topk=2, width=2, budget=6, max_depth=4)
    cfg = SpecSplitConfig(
        tree=tree,
        draft=DraftConfig(cuda_graphs=True, tuning=EngineTuning(graph_capacity=256, graph_rounds=False)),
        target=TargetConfig(cuda_graphs=True, tuning=EngineTuning(graph_capacity=256)),
    )
    ids = torch.tensor([PROMPT])
    with SpecSplitGenerator(llama_target, llama_target, config=cfg) as gen:
        for n in (9, 10, 11, 12):  # every remainder modulo a full round (5 tokens) at the end
            ref = llama_target.generate(ids, max_new_tokens=n, do_sample=False)
            out = gen.generate(ids, max_new_tokens=n, return_dict_in_generate=True)
            assert torch.equal(out.sequences, ref), n
            assert sum(r.committed for r in out.spec_stats.rounds) == n
        shapes["target"] |= {1 + n for n, *_ in gen.target_engine._rounds}  # one-graph greedy rounds
    full = tree.draft_slots if shape == "dynamic" else tree.num_draft_tokens
    # the target verifies one tree shape (pending + the full tree); a generation whose last round
    # has one token left takes the target-only step (no tree), the one other shape
    assert 1 + (tree.budget if shape == "dynamic" else full) in shapes["target"], shapes
    assert shapes["target"] <= {1, 1 + (tree.budget if shape == "dynamic" else full)}, shapes
    # the draft: the padded ingest (8 rows) and its level widths only (chain: 1; dynamic: the width)
    assert shapes["draft"] <= {8, 1, tree.width}, shapes


@pytest.mark.parametrize("shape", ["chain", "static", "dynamic"])
def test_one_graph_verify_round_equals_the_eager_acceptance(llama_target, shape):
    """``TargetConfig.graph_rounds``: a greedy round's mask, forward, acceptance and KV commit run
    as one device-only computation (one CUDA graph on a GPU). Same tokens and acceptance as the
    static path with eager acceptance and as HF ``generate()``, over several sessions, with a
    draft that is accepted only in part (the accepted nodes must be moved, not just kept)."""
    from conftest import noisy_copy

    draft = noisy_copy(llama_target, 0.02, seed=11)
    prompts = [PROMPT, [44, 3, 19, 250, 61, 62, 63, 64, 9]]
    runs = {}
    for rounds in (False, True):
        cfg = SpecSplitConfig(
            tree=TreeConfig(shape=shape),
            draft=DraftConfig(cuda_graphs=True, tuning=EngineTuning(graph_capacity=256)),
            target=TargetConfig(
                cuda_graphs=True, tuning=EngineTuning(graph_capacity=256, graph_rounds=rounds)
            ),
        )
        with SpecSplitGenerator(llama_target, draft, config=cfg) as gen:
            before = gen.target_engine.forward_count
            outs = [gen.generate(torch.tensor([p]), max_new_tokens=40, return_dict_in_generate=True)
                    for p in prompts]  # fmt: skip
            assert bool(gen.target_engine._rounds) == rounds
            # one target forward per round (the prefill included), replayed or eager
            assert gen.target_engine.forward_count - before == sum(len(o.spec_stats.rounds) for o in outs)
            runs[rounds] = outs
    moved = 0
    for p, eager, graphed in zip(prompts, runs[False], runs[True], strict=True):
        ref = llama_target.generate(torch.tensor([p]), max_new_tokens=40, do_sample=False)
        assert torch.equal(graphed.sequences, ref) and torch.equal(eager.sequences, ref)
        assert graphed.spec_stats.accepted_counts() == eager.spec_stats.accepted_counts()
        for r in graphed.spec_stats.rounds:
            moved += 0 < r.accepted < r.drafted_depth  # partly accepted rounds
    assert moved > 0  # the commit had to keep a branch that was not the whole tree


def test_one_graph_verify_round_is_off_under_sampling(qwen_target, qwen_draft_random):
    """Sampling keeps the eager acceptance (its random draws are not captured)."""
    cfg = SpecSplitConfig(
        tree=TreeConfig(shape="static"),
        draft=DraftConfig(cuda_graphs=True, tuning=EngineTuning(graph_capacity=256)),
        target=TargetConfig(cuda_graphs=True, tuning=EngineTuning(graph_capacity=256, graph_rounds=True)),
    )
    with SpecSplitGenerator(qwen_target, qwen_draft_random, config=cfg) as gen:
        gen.generate(
            torch.tensor([PROMPT]),
            max_new_tokens=12,
            do_sample=True,
            generator=torch.Generator().manual_seed(1),
        )
        assert not gen.target_engine._rounds
        gen.generate(torch.tensor([PROMPT]), max_new_tokens=12)
        assert gen.target_engine._rounds
