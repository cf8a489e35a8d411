"""The per-round timeline: trace reduction on a hand-built trace, and a real profiled generation."""

from __future__ import annotations

import pytest
import torch
from conftest import noisy_copy

from specsplit import SpecSplitConfig, SpecSplitGenerator, TreeConfig
from specsplit.bench.profiling import (
    analyze_trace,
    format_summary,
    host_times,
    merge_profiles,
    profiles_markdown,
    round_timeline,
)


def _x(name, cat, ts, dur, corr=None):
    ev = {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur}
    if corr is not None:
        ev["args"] = {"correlation": corr}
    return ev


def test_analyze_trace_splits_rounds_phases_and_idle():
    a = "user_annotation"
    events = [
        # round 0: draft [0, 100) with ingest [0, 30) and grow [30, 90); verify [100, 200)
        _x("specsplit.draft", a, 0, 100),
        _x("specsplit.draft.ingest", a, 0, 30),
        _x("specsplit.draft.grow", a, 30, 60),
        _x("specsplit.verify", a, 100, 100),
        _x("cudaGraphLaunch", "cuda_runtime", 10, 5, corr=1),  # in ingest
        _x("cudaGraphLaunch", "cuda_runtime", 40, 5, corr=2),  # in grow
        _x("cudaGraphLaunch", "cuda_runtime", 110, 5, corr=3),  # in verify
        _x("cudaStreamSynchronize", "cuda_runtime", 120, 70),  # verify waits
        _x("k_ingest", "kernel", 20, 40, corr=1),  # GPU [20, 60)
        _x("k_grow", "kernel", 60, 80, corr=2),  # GPU [60, 140)
        _x("k_verify", "kernel", 140, 50, corr=3),  # GPU [140, 190)
        # round 1: starts at 250 (glue 200..250 idles the GPU), verify only on device
        _x("specsplit.draft", a, 250, 20),
        _x("specsplit.verify", a, 270, 30),
        _x("cudaLaunchKernel", "cuda_runtime", 275, 2, corr=4),
        _x("k_v2", "kernel", 280, 10, corr=4),
    ]
    s = analyze_trace(events)
    r0, r1 = s["rounds"]
    assert r0["wall_ms"] == pytest.approx(0.25)
    assert r0["gpu_busy_ms"] == pytest.approx(0.17)  # [20, 190)
    assert r0["gpu_idle_ms"] == pytest.approx(0.08)
    assert r0["gpu_ms"] == pytest.approx({"draft.ingest": 0.04, "draft.grow": 0.08, "verify": 0.05})
    # idle [0,20) while ingesting, [190,200) in verify, [200,250) in the loop's glue
    assert r0["idle_ms"] == pytest.approx({"draft.ingest": 0.02, "verify": 0.01, "glue": 0.05})
    assert r0["sync_ms"] == pytest.approx({"verify": 0.07})
    assert r1["wall_ms"] == pytest.approx(0.05)  # until the last call's end
    assert r1["gpu_busy_ms"] == pytest.approx(0.01)
    assert s["mean"]["rounds"] == 2
    assert s["mean"]["gpu_ms"]["verify"] == pytest.approx((0.05 + 0.01) / 2)
    assert "GPU busy" in format_summary(s)
    # GPU time a round by kernel name over the whole generation, largest first
    kernels = s["mean"]["kernels_ms"]
    assert list(kernels) == ["k_grow", "k_verify", "k_ingest", "k_v2"]
    assert kernels == pytest.approx({"k_grow": 0.04, "k_verify": 0.025, "k_ingest": 0.02, "k_v2": 0.005})


def _summary(rounds, wall, busy, gpu_ms, kernels):
    return {"mean": {"rounds": rounds, "wall_ms": wall, "gpu_busy_ms": busy, "gpu_idle_ms": wall - busy,
                     "gpu_ms": gpu_ms, "idle_ms": {}, "sync_ms": {}, "kernels_ms": kernels}}  # fmt: skip


def test_merge_profiles_weights_each_generation_by_its_rounds():
    a = _summary(1, 4.0, 2.0, {"verify": 2.0}, {"gemm": 1.5, "topk": 0.5})
    b = _summary(3, 2.0, 1.0, {"verify": 1.0, "draft": 0.2}, {"gemm": 0.5})
    m = merge_profiles([a, b], ["p1", "p2"])
    assert (m["prompts"], m["rounds"]) == (["p1", "p2"], 4)
    assert m["wall_ms"] == pytest.approx((4.0 + 3 * 2.0) / 4)
    assert m["gpu_busy_ms"] == pytest.approx((2.0 + 3 * 1.0) / 4)
    assert m["gpu_idle_ms"] == pytest.approx(m["wall_ms"] - m["gpu_busy_ms"])
    assert m["gpu_ms"] == pytest.approx({"verify": 1.25, "draft": 0.15})
    assert m["kernels_ms"] == pytest.approx({"gemm": 0.75, "topk": 0.125})
    assert list(m["kernels_ms"]) == ["gemm", "topk"]


def test_profiles_markdown_lists_rounds_kernels_and_failures():
    m = merge_profiles([_summary(2, 3.0, 2.5, {"verify": 2.5}, {"void gemm<a|b>": 1.2})], ["code-01"])
    md = profiles_markdown({"specsplit-x": m, "specsplit-y": "profiling failed: RuntimeError: boom"})
    assert "## Profiled rounds" in md
    assert "| `specsplit-x` | code-01 | 2 | 3.00 | 2.50 | 0.50 | verify 2.50 |" in md
    assert "profiling failed: RuntimeError: boom" in md
    assert "| `specsplit-x` | `void gemm<a/b>` | 1200.0 |" in md  # a '|' would break the table
    cpu = merge_profiles([_summary(2, 3.0, 0.0, {}, {})], ["chat-01"])
    assert "No GPU kernels were recorded" in profiles_markdown({"specsplit-x": cpu})
    assert profiles_markdown(None) == "" and profiles_markdown({}) == ""


def test_analyze_trace_needs_annotations():
    with pytest.raises(ValueError, match="annotated"):
        analyze_trace([_x("k", "kernel", 0, 1, corr=1)])


def test_round_timeline_profiles_a_real_generation(llama_target):
    """On CPU the trace has no GPU work, but the rounds and phases must match the generation's."""
    draft = noisy_copy(llama_target, 0.001, seed=3)
    cfg = SpecSplitConfig(tree=TreeConfig(shape="dynamic", topk=3, width=3, budget=12, max_depth=4))
    ids = torch.tensor([[5, 17, 33, 81, 9, 100]])
    with SpecSplitGenerator(llama_target, draft, config=cfg) as gen:
        ref = gen.generate(ids, max_new_tokens=24, return_dict_in_generate=True)
        s = round_timeline(gen, ids, max_new_tokens=24)
        assert gen.transport.draft_engine.__dict__.get("_feed") is None  # the patches are gone
        again = gen.generate(ids, max_new_tokens=24, return_dict_in_generate=True)
    assert s["mean"]["rounds"] == len(ref.spec_stats.rounds)
    assert all(r["wall_ms"] > 0 for r in s["rounds"])
    assert torch.equal(again.sequences, ref.sequences)


def test_host_times_counts_the_phases_and_unpatches(llama_target):
    draft = noisy_copy(llama_target, 0.001, seed=3)
    cfg = SpecSplitConfig(tree=TreeConfig(shape="chain", num_draft_tokens=3))
    ids = torch.tensor([[5, 17, 33, 81, 9, 100]])
    with SpecSplitGenerator(llama_target, draft, config=cfg) as gen:
        with host_times(gen) as acc:
            out = gen.generate(ids, max_new_tokens=16, return_dict_in_generate=True)
        rounds = len(out.spec_stats.rounds)
        assert acc["verify"][1] == rounds and acc["verify.locked"][1] == rounds
        assert acc["draft"][1] == acc["draft.ingest"][1] == acc["draft.grow"][1] > 0
        assert acc["draft"][0] >= acc["draft.grow"][0] > 0
        assert "verify" not in gen.transport.__dict__
        # timing an eager generator must not build the static workspaces it does not use
        assert gen.transport.draft_engine._workspace._static is None
        assert gen.transport.target_engine._workspace._static is None
