"""``scripts/gpu_prepare.py plan``: device calls sized beside the working tree they also copy."""

from __future__ import annotations

import argparse
import importlib.util
import json

import pytest
from conftest import ROOT

_spec = importlib.util.spec_from_file_location("gpu_prepare", ROOT / "scripts" / "gpu_prepare.py")
assert _spec is not None and _spec.loader is not None
gp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gp)


def _manifest(tmp_path, chunk_mib: float, n: int = 3):
    models = tmp_path / "models"
    (models / "m").mkdir(parents=True, exist_ok=True)
    size = int(chunk_mib * gp.MIB)
    chunks = [{"name": f"f.part{i:03d}", "size": size, "sha256": "0"} for i in range(1, n + 1)]
    entry = {"alias": "m", "chunks": chunks}
    (models / gp.MANIFEST).write_text(json.dumps({"format": 1, "models": [entry]}))
    return argparse.Namespace(models_dir=str(models), wheels_dir=str(tmp_path / "none"), models="all",
                              budget_mib=None)  # fmt: skip


def test_the_working_tree_counts_against_each_call(tmp_path, capsys):
    tree = gp.tree_bytes()
    assert 0 < tree < gp.CALL_LIMIT  # the repository's own files, what every call copies
    room = (gp.CALL_LIMIT - tree) / gp.MIB - 1
    assert gp.cmd_plan(_manifest(tmp_path, room - 2)) == 0
    out = capsys.readouterr().out
    assert "3 calls" in out  # one chunk a call: two would not fit beside the tree
    with pytest.raises(SystemExit, match="smaller --chunk-mib"):
        gp.cmd_plan(_manifest(tmp_path, room + 1))
