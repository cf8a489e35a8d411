"""Padded prefills over the static workspace (``prefill_graphs``): a prompt's forward padded to a
bucket must give exactly what the eager forward gives. On CPU it runs without capture; on a GPU
each bucket replays one CUDA graph (``tests/test_gpu.py``)."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_same_sampling

from specsplit import SpecSplitConfig, SpecSplitGenerator, TreeConfig
from specsplit.config import DraftConfig, EngineTuning, TargetConfig
from specsplit.core.tree_attention import build_verify_attention
from specsplit.runtime.graphs import PREFILL_BUCKETS, StaticForward, prefill_bucket
from specsplit.runtime.runner import ModelRunner


def _cfg(shape: str, prefill: bool, capacity: int = 512) -> SpecSplitConfig:
    return SpecSplitConfig(
        tree=TreeConfig(shape=shape),
        draft=DraftConfig(
            cuda_graphs=True, tuning=EngineTuning(graph_capacity=capacity, prefill_graphs=prefill)
        ),
        target=TargetConfig(
            cuda_graphs=True, tuning=EngineTuning(graph_capacity=capacity, prefill_graphs=prefill)
        ),
    )


@pytest.fixture
def prefills(monkeypatch):
    """``(layers of the model, bucket)`` of each padded prefill (bucket None: none fitted, the
    caller ran eagerly)."""
    seen: list[tuple[int, int | None]] = []
    orig = StaticForward.run_prefill

    def spy(self, ids, ctx, parents=None):
        out = orig(self, ids, ctx, parents)
        seen.append((self.runner.num_layers, None if out is None else prefill_bucket(int(ids.shape[0]))))
        return out

    monkeypatch.setattr(StaticForward, "run_prefill", spy)
    return seen


def _prompt(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 256, (1, n), generator=torch.Generator().manual_seed(seed))


def test_buckets():
    assert [prefill_bucket(q) for q in (1, 64, 65, 200, 8192)] == [64, 64, 128, 256, 8192]
    assert prefill_bucket(PREFILL_BUCKETS[-1] + 1) is None
    assert list(PREFILL_BUCKETS) == sorted(PREFILL_BUCKETS)


@pytest.mark.parametrize("tree", [False, True])
def test_padded_forward_equals_the_eager_forward(llama_target, tree):
    """Logits of the kept rows and the KV of the real slots, after 7 committed tokens."""
    runner = ModelRunner(llama_target, None, None, None, "auto")
    sf = StaticForward(runner, 512, use_graphs=False)
    g = torch.Generator().manual_seed(1)
    head = torch.randint(3, 256, (7,), generator=g)
    body = torch.randint(3, 256, (90,), generator=g)
    parents = torch.tensor([-1, 0, 0, 1, -1, 4]) if tree else None
    nodes = torch.randint(3, 256, (6,), generator=g) if tree else torch.zeros(0, dtype=torch.long)
    ids = torch.cat([body, nodes])
    sf.run(head, torch.arange(7), 0, torch.ones(7, 7, dtype=torch.bool).tril())  # 7 committed slots
    got = sf.run_prefill(ids, 7, parents).clone()
    assert sf.cache.seq_len == 7 + 128  # the bucket; the caller commits the real length

    eager = runner.new_cache(512)
    runner.forward(head[None], torch.arange(7)[None], build_verify_attention(torch.zeros(0, dtype=torch.long), 0, 7)[0],
                   eager, logits_to_keep=1)  # fmt: skip
    par = parents if tree else torch.zeros(0, dtype=torch.long)
    mask, pos = build_verify_attention(par, 7, 90)
    want = runner.forward(ids[None], pos, mask, eager, logits_to_keep=par.shape[0] + 1)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for layer in range(runner.num_layers):
        k, v = sf.cache.get_kv_for_layer(layer)
        ek, ev = eager.get_kv_for_layer(layer)
        torch.testing.assert_close(k[:, :, : 7 + 90], ek[:, :, : 7 + 90], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v[:, :, : 7 + 90], ev[:, :, : 7 + 90], rtol=1e-5, atol=1e-5)


def test_no_bucket_fits_the_workspace(llama_target):
    sf = StaticForward(ModelRunner(llama_target, None, None, None, "auto"), 300, use_graphs=False)
    ids = _prompt(260)[0]
    assert sf.run_prefill(ids[:200], 60) is None  # bucket 256 after 60 committed slots: 316 > 300
    assert sf.run_prefill(ids, 0) is None  # bucket 384 > 300
    assert sf.run_prefill(ids[:200], 0) is not None
    assert sf.run_prefill(ids[:3], 0, torch.tensor([-1, 0, 1])) is None  # no committed token: not a prompt


@pytest.mark.parametrize("shape", ["chain", "dynamic"])
@pytest.mark.parametrize("length", [6, 150])
def test_generation_is_exact(llama_target, llama_draft_random, shape, length, prefills):
    ids = _prompt(length)
    ref = llama_target.generate(ids, max_new_tokens=30, do_sample=False)
    with SpecSplitGenerator(llama_target, llama_draft_random, config=_cfg(shape, True)) as gen:
        for _ in range(2):  # the second generation reuses the buckets
            before = gen.target_engine.forward_count
            out = gen.generate(ids, max_new_tokens=30, return_dict_in_generate=True)
            assert torch.equal(out.sequences, ref)
            # One target forward a round, the padded first one included (prompt and tree together).
            assert gen.target_engine.forward_count - before == len(out.spec_stats.rounds)
    layers = [n for n, bucket in prefills if bucket is not None]
    # Every generation's first target round; the draft's prompt too unless a round-sized ingest
    # graph (at most 8 tokens here) takes it.
    t = llama_target.config.num_hidden_layers
    assert sorted(layers) == sorted([t, t] + ([1, 1] if length > 8 else []))
    assert len(layers) == len(prefills)


def test_on_by_default_with_cuda_graphs(llama_target, llama_draft_random, prefills):
    """On by default wherever the engines have CUDA graphs; ``prefill_graphs=False`` or no graphs:
    eager prompt forwards (the ``prefills`` spy sees no call)."""
    cfg = SpecSplitConfig(draft=DraftConfig(cuda_graphs=True), target=TargetConfig(cuda_graphs=True))
    with SpecSplitGenerator(llama_target, llama_draft_random, config=cfg) as gen:
        gen.generate(_prompt(100), max_new_tokens=8)
    assert sorted(bucket for _, bucket in prefills) == [128, 128]  # draft and target, padded
    prefills.clear()
    for draft, target in (
        (
            DraftConfig(cuda_graphs=True, tuning=EngineTuning(prefill_graphs=False)),
            TargetConfig(cuda_graphs=True, tuning=EngineTuning(prefill_graphs=False)),
        ),
        (DraftConfig(), TargetConfig()),  # no graphs: the flag has nothing to pad
    ):
        with SpecSplitGenerator(
            llama_target, llama_draft_random, config=SpecSplitConfig(draft=draft, target=target)
        ) as gen:
            gen.generate(_prompt(100), max_new_tokens=8)
    assert prefills == []


def test_sampling_matches_the_eager_prefill(qwen_target, qwen_draft_random, prefills):
    cfgs = [_cfg("static", prefill) for prefill in (False, True)]
    assert_same_sampling(qwen_target, qwen_draft_random, _prompt(80, seed=2), cfgs, seed=5, max_new_tokens=24)
    assert len(prefills) == 2 and all(bucket == 128 for _, bucket in prefills)  # draft and target, padded


def test_prompt_longer_than_a_free_bucket_runs_eagerly(llama_target, llama_draft_random, prefills):
    """A 260-token prompt pads to 384 slots, more than the 320-slot workspace that holds its
    session: both engines run it eagerly, exactly."""
    ids = _prompt(260, seed=3)
    ref = llama_target.generate(ids, max_new_tokens=30, do_sample=False)
    with SpecSplitGenerator(
        llama_target, llama_draft_random, config=_cfg("chain", True, capacity=320)
    ) as gen:
        assert torch.equal(gen.generate(ids, max_new_tokens=30), ref)
        assert gen.target_engine._workspace.owner is None
    assert sorted(prefills) == [(1, None), (llama_target.config.num_hidden_layers, None)]
