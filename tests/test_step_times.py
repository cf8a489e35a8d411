"""benchmarks/step_times.py: variant choice, per-role query lengths, fused copies and the report.

The timing itself needs a GPU (CUDA events and graphs); here ``measure`` is replaced by a recorder,
so what is checked is what main() asks it to time and how the answers are written.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import load_benchmark, tiny_qwen2

import specsplit.models


def _step_times():
    return load_benchmark("step_times")


def _run(monkeypatch, tmp_path: Path, *argv: str):
    st = _step_times()
    calls: list[tuple[str, int, list[int], list[str], bool]] = []
    models: dict[str, torch.nn.Module] = {}

    def load_model(name: str, **_: object) -> torch.nn.Module:
        models[name] = tiny_qwen2(seed=len(models))
        return models[name]

    def measure(model, name, device, ctx, qs, bw, kinds):
        layer = model.model.layers[0]
        fused = all(getattr(m, "_specsplit_fused", False) for m in (layer.mlp, layer.self_attn))
        calls.append((name, ctx, list(qs), list(kinds), fused))
        out = {"model": name, "weight_bytes": 2e9, "context": ctx, "bound_ms": 0.5, "eager_step_ms": 9.0}
        for k in kinds:
            for q in qs:
                out[f"{k}_q{q}_ms"] = 1.0 + q / 10
                out[f"{k}_q{q}_over_bound"] = (1.0 + q / 10) / 0.5
        return out

    monkeypatch.setattr(specsplit.models, "load_model", load_model)
    monkeypatch.setattr(st, "measure", measure)
    monkeypatch.setattr(st, "copy_bandwidth", lambda device, nbytes: 4e12)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(sys, "argv", ["step_times.py", "--out", str(tmp_path), *argv])
    st.main()
    return calls


def test_variants_per_role_query_lengths_and_fused_copies(monkeypatch, tmp_path):
    calls = _run(
        monkeypatch, tmp_path, "--target", "t", "--draft", "d", "--qs", "1,25", "--draft-qs", "1,4",
        "--variants", "compiled-fold", "--fuse-projections", "--tag", "x",
    )  # fmt: skip
    assert all(c[4] for c in calls)  # both models were fused before they were timed
    assert [c[:4] for c in calls] == [
        ("t", 512, [1, 25], ["compiled-fold"]),
        ("d", 512, [1, 4], ["compiled-fold"]),
    ]
    md = (tmp_path / "step_times-h200-x.md").read_text()
    rows = [line for line in md.splitlines() if line.startswith("| target") or line.startswith("| draft")]
    assert [r.split(" | ")[5:7] for r in rows] == [
        ["compiled-fold", "1"], ["compiled-fold", "25"], ["compiled-fold", "1"], ["compiled-fold", "4"]
    ]  # fmt: skip
    assert "| draft d | 512 | 2.00 | 0.50 | 9.00 | compiled-fold | 4 | 1.40 | 2.80 |" in rows
    assert "--draft-qs 1,4 --variants compiled-fold --fuse-projections" in md
    doc = json.loads((tmp_path / "step_times-h200-x.json").read_text())
    assert doc["fused_projections"] is True


def test_fuse_projections_fuses_the_models_it_times(monkeypatch, tmp_path, capsys):
    _run(monkeypatch, tmp_path, "--target", "t", "--draft", "d", "--variants", "graph", "--fuse-projections")
    out = capsys.readouterr().out
    assert "t: fused the projections of" in out and "d: fused the projections of" in out
    assert "0 modules" not in out


def test_default_variants_and_bad_ones(monkeypatch, tmp_path):
    calls = _run(monkeypatch, tmp_path, "--target", "t", "--draft", "d", "--qs", "1")
    assert calls[0][3] == ["graph", "graph-fold"]
    assert calls[0][4] is False  # no --fuse-projections: the loaded model is timed as it is
    calls = _run(monkeypatch, tmp_path, "--target", "t", "--draft", "d", "--qs", "1", "--compile")
    assert calls[0][3] == ["graph", "graph-fold", "compiled", "compiled-fold"]
    with pytest.raises(SystemExit, match="unknown"):
        _run(monkeypatch, tmp_path, "--variants", "graph,bogus")
