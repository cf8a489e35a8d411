#!/usr/bin/env python
"""What joining a batch costs: the batched prefill of the rows that join, against a decode round.

Concurrent clients of one target worker all wait for the prompts of the rows that join with them
before their first token, and the rows already decoding wait too: every prefill forward stops the
rounds. This script times :meth:`BatchedTarget.prefill` (a device sync after it) on a random-weight
model of Qwen2.5-1.5B's shapes for prompt lengths given on the command line (the bench prompts'
token counts by default): in eager groups (as on a CPU, padding within a quarter of the real
tokens), in graphed groups (CUDA graphs of bucketed shapes, all captured first, as a worker does
at start), all rows in one eager forward, one small eager row; and one plain round of the same
batch for scale. Times depend on shapes only.

    python benchmarks/batch_prefill.py --device cuda:0
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from benchmarks.round_kernels import QWEN_1_5B

# Token counts of the first 16 prompts of the chat, code, math, qa, summarization and translation
# sets in interleaved order (category by category), as the concurrency bench hands them out.
BENCH_16 = (154, 78, 91, 227, 165, 81, 168, 87, 94, 171, 190, 102, 144, 110, 59, 190)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--lengths", default=",".join(map(str, BENCH_16)))
    p.add_argument("--copies", default="1,4", help="the lengths repeated this many times (64 rows: 4)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--profile", action="store_true", help="a profiler table of one small prefill (host ops)")
    a = p.parse_args(argv)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from specsplit.config import TargetConfig
    from specsplit.engines import batched as B
    from specsplit.engines.target import TargetEngine

    dev = torch.device(a.device)
    torch.manual_seed(0)
    with dev:
        model = Qwen2ForCausalLM(Qwen2Config(**QWEN_1_5B)).to(torch.bfloat16).eval()
    eng = TargetEngine(model, TargetConfig(cuda_graphs=dev.type == "cuda", fuse_projections=True))
    base = [int(x) for x in a.lengths.split(",")]
    copies = [int(x) for x in a.copies.split(",")]
    slots = len(base) * max(copies)
    pool = B.BatchedTarget(eng.runner, slots, 512, use_graphs=dev.type == "cuda")
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def timed(fn) -> float:
        with torch.inference_mode():
            return _timed(fn)

    def _timed(fn) -> float:
        fn()
        sync()
        ts = []
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            fn()
            sync()
            ts.append(time.perf_counter() - t0)
        return 1e3 * statistics.median(ts)

    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        small = [torch.randint(10, 1000, (8,)).tolist()]
        timed(lambda: pool._prefill_group(0, small, 8))
        with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
            pool._prefill_group(0, small, 8)
            sync()
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=40))
    captured = pool.capture_prefills()
    print(f"captured {captured} prompt-forward graphs")
    for c in copies:
        lengths = sorted(base * c)
        _case(pool, [torch.randint(10, 1000, (n,)).tolist() for n in lengths], timed)
    return 0


def _case(pool: Any, prompts: list[list[int]], timed: Any) -> None:
    """One batch of prompts (sorted by length): the eager groups, the graphed groups, one eager
    forward over all of them, one small eager row, and a plain round of the batch."""
    from specsplit.core.sampling import SamplingParams
    from specsplit.engines.batched import RowTree

    lengths = [len(p) for p in prompts]
    width = max(lengths)

    def eager() -> None:
        pool.bucketed_prefill = False
        try:
            pool.prefill(0, prompts)
        finally:
            pool.bucketed_prefill = pool.use_graphs

    groups = pool._graph_groups(lengths)
    cases = {
        "eager groups": timed(eager),
        (
            f"graphed groups ({len(groups)}: {[g[2:] for g in groups]})"
            if pool.use_graphs
            else "the pool's groups"
        ): timed(lambda: pool.prefill(0, prompts)),
        f"one eager forward ({len(prompts) * width} padded)": timed(
            lambda: pool._prefill_group(0, prompts, width)
        ),
        "one 8-token eager row": timed(lambda: pool._prefill_group(0, [prompts[0][:8]], 8)),
        "a plain round of the batch": timed(
            lambda: pool.round([RowTree(n, 5) for n in lengths], SamplingParams(), 0)
        ),
    }
    print(f"{len(prompts)} rows ({sum(lengths)} tokens, longest {width}):")
    for name, ms in cases.items():
        print(f"  {name}: {ms:.2f} ms")


if __name__ == "__main__":
    raise SystemExit(main())
