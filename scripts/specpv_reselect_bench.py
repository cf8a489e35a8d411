#!/usr/bin/env python
"""Time PartialSession.reselect (SpecPV retrieval refresh) on synthetic caches of a given shape.

python scripts/specpv_reselect_bench.py --device cuda:0 --context 32768 --budget 2048
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specsplit.config import SpecPVConfig
from specsplit.engines.partial_kv import PartialSession  # noqa: E402
from specsplit.runtime.kv_cache import StaticKVCache  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--n-retrieval", type=int, default=109)
    ap.add_argument("--rows", type=int, default=5)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    dev, dt = torch.device(a.device), torch.bfloat16 if a.device.startswith("cuda") else torch.float32
    cache = StaticKVCache(a.layers, a.context + 64)
    for i in range(a.layers):
        k = torch.randn(1, a.kv_heads, a.context, a.head_dim, device=dev, dtype=dt)
        cache.append(i, k, k)
    pvs = PartialSession(SpecPVConfig(enabled=True, n_retrieval_blocks=a.n_retrieval))

    def q() -> dict[int, torch.Tensor]:
        return {i: torch.randn(1, a.heads, a.rows, a.head_dim, device=dev, dtype=dt) for i in range(a.layers)}

    pvs.rebuild(cache, q())
    qs = [q() for _ in range(4)]
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    for r in range(5):
        pvs.reselect(cache, qs[r % 4])
    sync()
    t = time.perf_counter()
    for r in range(a.reps):
        pvs.reselect(cache, qs[r % 4])
    host = (time.perf_counter() - t) / a.reps
    sync()
    total = (time.perf_counter() - t) / a.reps
    print(f"reselect: host {1e3 * host:.2f} ms/call, host+device {1e3 * total:.2f} ms/call")
    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        with profile(activities=acts) as prof:
            for r in range(10):
                pvs.reselect(cache, qs[r % 4])
            sync()
        key = "cuda_time_total" if dev.type == "cuda" else "cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=12))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
