"""benchmarks/tree_sweep.py: shape parsing and the report of a saved run (the sweep itself needs real
weights and a GPU to mean anything)."""

from __future__ import annotations

import importlib.util
import json

import pytest
from conftest import load_benchmark

from specsplit.errors import ConfigError


def _sweep():
    return load_benchmark("tree_sweep")


def test_parse_shape():
    ts = _sweep()
    assert ts.parse_shape("target") is None
    chain = ts.parse_shape("chain:3")
    assert (chain.shape, chain.num_draft_tokens) == ("chain", 3)
    dyn = ts.parse_shape(" dynamic:8,4,32,7 ")
    assert (dyn.shape, dyn.topk, dyn.width, dyn.budget, dyn.max_depth) == ("dynamic", 8, 4, 32, 7)
    with pytest.raises(ValueError, match="bad shape"):
        ts.parse_shape("static:1")
    with pytest.raises(ValueError):
        ts.parse_shape("dynamic:4,4")
    with pytest.raises(ConfigError):
        ts.parse_shape("chain:-1")
    assert ts.shape_flags("dynamic:4,4,24,5/target-rounds") == {"target-rounds"}
    assert ts.parse_shape("dynamic:4,4,24,5/target-rounds").max_depth == 5
    assert ts.parse_shape("target/target-rounds") is None
    assert ts.shape_flags("chain:4") == set()
    with pytest.raises(ValueError, match="unknown shape flag"):
        ts.shape_flags("chain:4/turbo")
    for text in ts.DEFAULT_SHAPES.split(";"):
        ts.parse_shape(text)  # the defaults parse


def test_report_of_a_saved_run(tmp_path):
    ts = _sweep()
    doc = {
        "command": "python benchmarks/tree_sweep.py", "machine": "test", "torch": "x", "target": "t",
        "draft": "d", "dtype": "bfloat16", "prompts": ["a", "b"], "max_new_tokens": 8, "cuda_graphs": True,
        "compile": False, "note": "a note",
        "rows": [
            {"shape": "target", "tokens_per_s": 100.0, "tau": 1.0, "ms_per_round": 10.0, "x_target_only": 1.0,
             "same_tokens_as_target_only": 2},
            {"shape": "dynamic:4,4,24,5", "tokens_per_s": 150.0, "tau": 5.0, "ms_per_round": 33.3,
             "x_target_only": 1.5, "same_tokens_as_target_only": 1},
        ],
    }  # fmt: skip
    path = tmp_path / "tree_sweep-x.json"
    path.write_text(json.dumps(doc))
    ts.write_table(path)
    md = path.with_suffix(".md").read_text()
    assert "| `dynamic:4,4,24,5` | 150.0 | 1.50× | 5.00 | 33.30 | 1/2 |" in md
    assert "- note: a note" in md
    if importlib.util.find_spec("matplotlib") is not None:
        assert ts.plot(path) and path.with_suffix(".png").exists()


def test_report_with_profile_columns(tmp_path):
    ts = _sweep()
    tl = {
        "wall_ms": 15.0,
        "gpu_busy_ms": 11.0,
        "gpu_idle_ms": 4.0,
        "gpu_ms": {"draft.ingest": 1.5, "draft.grow": 6.0, "verify": 3.5},
    }
    doc = {
        "command": "c", "machine": "m", "torch": "x", "target": "t", "draft": "d", "dtype": "bfloat16",
        "prompts": ["a"], "max_new_tokens": 8, "cuda_graphs": True, "compile": True, "fuse_projections": True,
        "rows": [
            {"shape": "target", "tokens_per_s": 100.0, "tau": 1.0, "ms_per_round": 10.0, "timeline": None},
            {"shape": "dynamic:4,4,24,5/target-rounds", "tokens_per_s": 150.0, "tau": 5.0, "ms_per_round": 33.3,
             "timeline": tl},
        ],
    }  # fmt: skip
    path = tmp_path / "tree_sweep-p.json"
    path.write_text(json.dumps(doc))
    ts.write_table(path)
    md = path.with_suffix(".md").read_text()
    assert "| 15.00 | 11.00 / 4.00 | 1.50 / 6.00 / 3.50 |" in md
    assert "| `target` | 100.0 | – | 1.00 | 10.00 | – | – | – | – |" in md
    assert "fused q/k/v" in md
