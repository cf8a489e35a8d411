"""benchmarks/round_kernels.py runs its rounds through a target engine's static path (on a CPU
without capture or profiling): plain steps and padded n-gram-shaped trees verify without error."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "round_kernels.py"


def test_round_kernels_runs_plain_and_tree_rounds_on_cpu(capsys):
    spec = importlib.util.spec_from_file_location("round_kernels", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.QWEN_1_5B = dict(mod.QWEN_1_5B, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=1000)  # fmt: skip
    assert mod.main(["--device", "cpu", "--sizes", "4,16", "--rounds", "2", "--context", "16"]) == 0
    out = capsys.readouterr().out
    assert "0:" in out and "16:" in out  # ms a round of each kind
