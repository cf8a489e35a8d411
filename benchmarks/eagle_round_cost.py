#!/usr/bin/env python
"""What an EAGLE head adds to a compiled one-graph round, from ``round_kernels.py`` reports.

Each variant is a ``round_kernels.py --compile --heads 32 --heads-kind eagle`` report beside the
report of the same round without a head, measured in the same device call (a head's cost is only
read against its own baseline: round times drift between machines of one kind). For the 32-node
round it lists the wall ms a round, the head's added ms, the device-busy µs and the distinct
kernels, and writes a table and a bar chart:

    python benchmarks/eagle_round_cost.py --tag h200-2026-12-02
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specsplit.bench.report import pyplot, save_figure  # noqa: E402

OUT = Path(__file__).resolve().parent / "results"
# (label, the head's report, the baseline's report or its 32-node (ms, busy µs) where only the
# printed table came back) in the order the changes were made.
VARIANTS: list[tuple[str, str, str | tuple[float, float]]] = [
    ("as first compiled (5 products a pass, full ingest, one top-k)", "compiled-eagle", (2.879, 2144.7)),
    ("packed q/k/v and gate/up, last-row ingest, one top-k", "compiled-eagle-packed", "compiled-no-heads"),
    ("+ two-stage top-k (2048-token runs)", "compiled-eagle-packed-chunk2048", "compiled-no-heads"),
    ("+ two-stage top-k, a second call", "compiled-eagle-packed-chunk2048-2", "compiled-no-heads-2"),
    ("+ two-stage top-k, 16,384 scored tokens", "compiled-eagle-packed-16k", "compiled-no-heads"),
]


def _load(machine: str, stem: str) -> dict:
    return json.loads((OUT / f"round_kernels-{machine}-{stem}.json").read_text())


def rows(machine: str) -> list[dict]:
    out = []
    for label, head, base in VARIANTS:
        h = _load(machine, head)
        if isinstance(base, tuple):
            base_ms, base_busy = base
        else:
            b = _load(machine, base)
            base_ms, base_busy = b["ms_a_round"]["32"], b["device_us_a_round"]["32"]["busy"]
        ms, busy = h["ms_a_round"]["32"], h["device_us_a_round"]["32"]["busy"]
        out.append({"variant": label, "report": head, "ms": ms, "added_ms": ms - base_ms, "busy_us": busy,
                    "added_busy_us": busy - base_busy, "kernels": len(h["kernels_us"]["32"])})  # fmt: skip
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--machine", default="h200", help="the reports' machine tag")
    p.add_argument("--tag", default="h200-2026-12-02")
    a = p.parse_args()
    table = rows(a.machine)
    lines = ["# An EAGLE head's cost in a compiled 32-node round (random Qwen2.5-Coder-1.5B shapes)", "",
             "From `benchmarks/round_kernels.py --device cuda:0 --sizes 32 --compile --heads 32 --heads-kind eagle` "
             "against the same command without `--heads` in the same device call; "
             "`python benchmarks/eagle_round_cost.py` built this table.", "",
             "| variant | report | ms a round | head adds ms | busy µs | head adds busy µs | kernel names |",
             "|---|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    lines += [f"| {r['variant']} | `{r['report']}` | {r['ms']:.3f} | {r['added_ms']:.3f} | {r['busy_us']:.0f} | "
              f"{r['added_busy_us']:.0f} | {r['kernels']} |" for r in table]  # fmt: skip
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"eagle_round_cost-{a.tag}.md").write_text("\n".join(lines) + "\n")
    (OUT / f"eagle_round_cost-{a.tag}.json").write_text(json.dumps(table, indent=1) + "\n")
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(11, 3.6))
        ys = range(len(table))
        ax.barh([y + 0.2 for y in ys], [r["added_ms"] * 1000 for r in table], 0.4, label="wall µs added")
        ax.barh([y - 0.2 for y in ys], [r["added_busy_us"] for r in table], 0.4, label="device-busy µs added")
        ax.set_yticks(list(ys), [r["variant"] for r in table], fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("µs an EAGLE head adds to a compiled 32-node round")
        ax.legend(fontsize=8)
        save_figure(fig, OUT / f"eagle_round_cost-{a.tag}.png")


if __name__ == "__main__":
    main()
