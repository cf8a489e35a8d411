"""One decoder projection's matmul by row count on the CPU: what a batched decode step costs there.

    python benchmarks/small_gemm.py [--threads 2] [--shape 1536,8960]

A batch of B sequences makes every projection of a decode step a `[B, hidden] x [hidden, out]` matmul.
On a GPU that is weight-read bound up to large B; on a CPU the BLAS kernel for a few rows can cost
much more than one row's (see benchmarks/RESULTS.md, "Batched generation"), which bounds what
batching gains there. Prints milliseconds per matmul for each row count, median of the repeats, for
the plain weight and for the same weight packed once (specsplit.runtime.packed, where available).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specsplit.runtime import packed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--shape", default="1536,8960", help="hidden,out (default: Qwen2.5-1.5B's MLP up projection)"
    )
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--repeats", type=int, default=50)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    hidden, out = (int(x) for x in args.shape.split(","))
    lin = torch.nn.Linear(hidden, out, bias=False)
    layers = {"plain": lin}
    if packed.available():
        layers["packed"] = packed.PackedLinear(lin)
    print(f"float32 [rows, {hidden}] x [{hidden}, {out}], {args.threads} threads")
    with torch.inference_mode():
        for m in (int(x) for x in args.rows.split(",")):
            x = torch.randn(m, hidden)
            cells = []
            for name, layer in layers.items():
                layer(x)
                times = []
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    layer(x)
                    times.append(time.perf_counter() - t0)
                ms = 1e3 * statistics.median(times)
                cells.append(f"{name} {ms:6.2f} ms ({ms / m:5.2f} a row)")
            print(f"rows {m:3d}: " + "   ".join(cells))


if __name__ == "__main__":
    main()
