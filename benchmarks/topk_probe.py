#!/usr/bin/env python
"""Top-k of an EAGLE level on the GPU: one ``torch.topk`` over the scored subset against the two-stage
:func:`specsplit.runtime.eagle.chunked_topk`, each replayed from a CUDA graph as a round runs it.

A level of the EAGLE head takes the top 8 of each of its rows (1 row below the next token, 8 wide
later) over the 32,768 scored tokens. With so few, long rows ``torch.topk`` runs a multi-block radix
select of about ten kernels; two top-k's over short runs may take fewer. This times both for each
rows x subset size and chunk, and checks that both give the same values.

    python benchmarks/topk_probe.py --device cuda:0 --tag h200
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from specsplit.runtime.eagle import chunked_topk

OUT = Path(__file__).resolve().parent / "results"


def _graph_us(fn, x: torch.Tensor, replays: int) -> float:
    """Mean µs of one call of ``fn(x)``, replayed ``replays`` times from one CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn(x)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(replays):
            fn(x)
    g.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        g.replay()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best / replays * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--rows", default="1,8")
    p.add_argument("--sizes", default="16384,32768")
    p.add_argument("--chunks", default="256,512,1024,2048")
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--replays", type=int, default=200)
    p.add_argument("--tag", default="h200")
    a = p.parse_args()
    dev = torch.device(a.device)
    torch.manual_seed(0)
    rows_list = [int(v) for v in a.rows.split(",")]
    chunks: list[int | None] = [None] + [int(v) for v in a.chunks.split(",")]
    results = []
    for n in (int(v) for v in a.sizes.split(",")):
        for r in rows_list:
            x = torch.randn(r, n, device=dev)
            ref = x.topk(a.k, dim=-1).values
            for c in chunks:
                same = bool(torch.equal(chunked_topk(x, a.k, c)[0], ref))
                us = _graph_us(lambda t, c=c: chunked_topk(t, a.k, c), x, a.replays)
                results.append({"subset": n, "rows": r, "chunk": c, "us": round(us, 2), "same_values": same})
                print(f"subset {n} rows {r} chunk {c}: {us:.2f} µs, same values {same}", flush=True)
    cmd = (f"python benchmarks/topk_probe.py --device {a.device} --rows {a.rows} --sizes {a.sizes} "
           f"--chunks {a.chunks} --k {a.k} --replays {a.replays} --tag {a.tag}")  # fmt: skip
    meta = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "command": cmd,
            "date": time.strftime("%Y-%m-%d")}  # fmt: skip
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"topk_probe-{a.tag}.json").write_text(
        json.dumps({"meta": meta, "results": results}, indent=1) + "\n"
    )
    lines = [f"# EAGLE top-k on the GPU ({meta['device']})", "", f"- command: `{cmd}`",
             f"- date: {meta['date']}; torch {meta['torch']}; µs a call, replayed from a CUDA graph", "",
             "| subset | rows | chunk | µs | same values |", "|---:|---:|---:|---:|---|"]  # fmt: skip
    lines += [f"| {x['subset']} | {x['rows']} | {x['chunk'] or 'one topk'} | {x['us']:.2f} | {x['same_values']} |"
              for x in results]  # fmt: skip
    (OUT / f"topk_probe-{a.tag}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
