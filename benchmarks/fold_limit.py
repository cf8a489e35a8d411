#!/usr/bin/env python
"""What the GQA fold limit costs a 64-node round, from ``round_kernels.py`` reports.

A one-graph round of the largest padded tree (64 nodes and the pending token: 65 rows) folds GQA
into its query rows only while ``attention.FOLD_MAX_ROWS`` covers 65 rows; past it the round's
attention falls back to PyTorch's memory-efficient kernel. This lists, for compiled rounds with and
without a random EAGLE head, the wall ms of a 64-node round, its device-busy µs and the µs of the
memory-efficient attention kernel, at each limit, and writes a table, JSON and a bar chart:

    python benchmarks/round_kernels.py --device cuda:0 --sizes 48,64 --rounds 100 --compile \\
        [--heads 32 --heads-kind eagle] --fold-max-rows 64|128 --tag h200-compiled[-eagle]-fold64|128
    python benchmarks/fold_limit.py --machine h200
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specsplit.bench.report import pyplot, save_figure  # noqa: E402

OUT = Path(__file__).resolve().parent / "results"
SIZE = "64"
LIMITS = (64, 128)
KINDS = (("no head", "compiled"), ("random EAGLE head", "compiled-eagle"))


def rows(machine: str) -> list[dict]:
    out = []
    for kind, stem in KINDS:
        for limit in LIMITS:
            report = f"round_kernels-{machine}-{stem}-fold{limit}"
            r = json.loads((OUT / f"{report}.json").read_text())
            kernels = r["kernels_us"][SIZE]
            out.append({
                "round": kind, "fold_max_rows": limit, "report": report, "ms": r["ms_a_round"][SIZE],
                "plain_step_ms": r["ms_a_round"]["0"], "busy_us": r["device_us_a_round"][SIZE]["busy"],
                "mem_efficient_attention_us": sum(v for k, v in kernels.items() if "fmha" in k),
            })  # fmt: skip
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--machine", default="h200", help="the reports' machine tag")
    a = p.parse_args()
    table = rows(a.machine)
    lines = [f"# A compiled {SIZE}-node round and the GQA fold limit (random Qwen2.5-Coder-1.5B shapes)", "",
             "From `benchmarks/round_kernels.py --sizes 48,64 --rounds 100 --compile [--heads 32 --heads-kind "
             "eagle]` with the fold limit at 64 and 128 rows; `python benchmarks/fold_limit.py` built this table.",
             "", "| round | FOLD_MAX_ROWS | ms a round | plain step ms | device-busy µs | memory-efficient attention µs |",
             "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    lines += [f"| {r['round']} | {r['fold_max_rows']} | {r['ms']:.3f} | {r['plain_step_ms']:.3f} | "
              f"{r['busy_us']:.0f} | {r['mem_efficient_attention_us']:.0f} |" for r in table]  # fmt: skip
    stem = f"fold_limit-{a.machine}"
    (OUT / f"{stem}.md").write_text("\n".join(lines) + "\n")
    (OUT / f"{stem}.json").write_text(json.dumps(table, indent=1) + "\n")
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 3.6))
    xs = range(len(KINDS))
    for i, limit in enumerate(LIMITS):
        ms = [r["ms"] for r in table if r["fold_max_rows"] == limit]
        ax.bar([x + (i - 0.5) * 0.38 for x in xs], ms, 0.38, label=f"fold up to {limit} rows")
    ax.set_xticks(list(xs), [k for k, _ in KINDS])
    ax.set_ylabel(f"ms a compiled {SIZE}-node round")
    ax.legend(fontsize=8)
    save_figure(fig, OUT / f"{stem}.png")


if __name__ == "__main__":
    main()
