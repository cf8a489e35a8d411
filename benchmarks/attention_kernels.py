"""Tree-attention kernels over a long KV prefix: how much of a verify step is attention?

One layer of the target's attention (Qwen2.5-Coder-1.5B shapes by default: 12 query heads, 2 KV
heads, head_dim 128) for ``q`` tree rows against ``kv`` cached tokens with an additive tree mask,
timed per kernel choice, next to the time it takes to read that layer's K and V once:

- ``hf-sdpa``: what transformers' SDPA integration does with a mask and GQA: ``repeat_kv`` copies
  K and V to every query head, then SDPA (default backend choice);
- ``gqa-sdpa``: SDPA with ``enable_gqa=True`` and the mask (PyTorch picks the backend);
- ``fold-sdpa``: :func:`specsplit.runtime.attention.folded_attention` with SDPA: the GQA group folded into
  the query rows (`[1, kv_heads, group * q, d]`, K/V read once), the mask repeated over the group;
- ``fold-math``: the same fold with two matmuls and a float32 softmax (cuBLAS splits the long KV
  dimension across the GPU; SDPA's kernels parallelise over heads and query blocks, of which a
  batch-1 verify has few). SpecSplit picks it from ``specsplit.runtime.attention.MATH_MIN_KV`` tokens on.

Every variant's output is checked against a float32 reference before it is timed.

    python benchmarks/attention_kernels.py --device cuda:0 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from step_times import copy_bandwidth  # noqa: E402

from specsplit.bench.report import pyplot  # noqa: E402
from specsplit.runtime.attention import folded_attention  # noqa: E402

Attn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def tree_mask(q: int, kv: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`[1, 1, q, kv]` additive mask: the prefix is visible, the last ``q`` rows see a chain."""
    m = torch.zeros(q, kv, dtype=dtype, device=device)
    tail = torch.ones(q, q, dtype=torch.bool, device=device).triu(1)
    m[:, kv - q :].masked_fill_(tail, torch.finfo(dtype).min)
    return m.view(1, 1, q, kv)


def hf_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def gqa_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


VARIANTS: dict[str, Attn] = {
    "hf-sdpa": hf_sdpa,
    "gqa-sdpa": gqa_sdpa,
    "fold-sdpa": lambda q, k, v, m: folded_attention(q, k, v, m, kernel="sdpa").transpose(1, 2),
    "fold-math": lambda q, k, v, m: folded_attention(q, k, v, m, kernel="math").transpose(1, 2),
}


def time_us(fn: Callable[[], torch.Tensor], device: torch.device, reps: int) -> float:
    for _ in range(3):
        fn()
    if device.type != "cuda":
        import time

        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) / reps * 1e6
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) / reps * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=28, help="layers per forward (for the per-step total)")
    ap.add_argument("--rows", default="5,17", help="comma-separated tree sizes q")
    ap.add_argument("--contexts", default="2048,4096,8192,16384,32768")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", default=None, help="results directory (writes attention_kernels-<tag>.json/.md)")
    ap.add_argument("--tag", default=None)
    ap.add_argument(
        "--from-json", default=None, help="run nothing: rewrite the .md and .png of a results .json"
    )
    a = ap.parse_args(argv)
    if a.from_json:
        src = Path(a.from_json)
        doc = json.loads(src.read_text())
        src.with_suffix(".md").write_text(render(doc["meta"], doc["rows"]))
        plot(src.with_suffix(".png"), doc["meta"], doc["rows"])
        return 0

    dev = torch.device(a.device)
    dtype = getattr(torch, a.dtype)
    gen = torch.Generator(device=dev).manual_seed(0)
    bw = copy_bandwidth(dev) if dev.type == "cuda" else None
    rows: list[dict[str, object]] = []
    for n in (int(x) for x in a.rows.split(",")):
        for kv in (int(x) for x in a.contexts.split(",")):
            q = torch.randn(1, a.heads, n, a.head_dim, device=dev, dtype=dtype, generator=gen)
            k = torch.randn(1, a.kv_heads, kv, a.head_dim, device=dev, dtype=dtype, generator=gen)
            v = torch.randn(1, a.kv_heads, kv, a.head_dim, device=dev, dtype=dtype, generator=gen)
            mask = tree_mask(n, kv, dtype, dev)
            ref = hf_sdpa(q.float(), k.float(), v.float(), tree_mask(n, kv, torch.float32, dev))
            kv_bytes = 2 * k.numel() * k.element_size()
            row: dict[str, object] = {"q": n, "kv": kv, "kv_read_us": (kv_bytes / bw * 1e6) if bw else None}
            for name, fn in VARIANTS.items():
                try:
                    out = fn(q, k, v, mask)
                except RuntimeError as e:  # a backend that refuses this shape/mask
                    row[name] = None
                    row[f"{name}_error"] = str(e).splitlines()[0][:200]
                    continue
                err = (out.float() - ref).abs().max().item()
                tol = 1e-4 if dtype == torch.float32 else 5e-2
                if not err <= tol:
                    raise SystemExit(f"{name} q={n} kv={kv}: max error {err:.3g} > {tol}")
                row[name] = time_us(functools.partial(fn, q, k, v, mask), dev, a.reps)
            rows.append(row)
            print(json.dumps(row), flush=True)

    dev_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu"
    meta = {
        "device": dev_name,
        "dtype": a.dtype,
        "shapes": {"heads": a.heads, "kv_heads": a.kv_heads, "head_dim": a.head_dim, "layers": a.layers},
        "copy_bandwidth_GBps": bw / 1e9 if bw else None,
        "torch": torch.__version__,
        "command": "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
    }
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        tag = a.tag or ("h200" if "H200" in dev_name else "h100" if "H100" in dev_name else dev.type)
        (out / f"attention_kernels-{tag}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        (out / f"attention_kernels-{tag}.md").write_text(render(meta, rows))
        plot(out / f"attention_kernels-{tag}.png", meta, rows)
    return 0


def plot(path: Path, meta: dict[str, object], rows: list[dict[str, object]]) -> bool:
    """Microseconds per layer against the cached tokens, one panel per tree size (needs matplotlib)."""
    plt = pyplot()
    if plt is None:
        return False
    qs = sorted({int(str(r["q"])) for r in rows})
    fig, axes = plt.subplots(1, len(qs), figsize=(5.5 * len(qs), 4), squeeze=False)
    for ax, q in zip(axes[0], qs, strict=True):
        mine = [r for r in rows if r["q"] == q]
        kv = [int(str(r["kv"])) for r in mine]
        for name in [*VARIANTS, "kv_read_us"]:
            ys = [r.get(name) for r in mine]
            if all(isinstance(y, float) for y in ys):
                style = ":" if name == "kv_read_us" else "-"
                ax.plot(kv, ys, style, marker="o", label="one K/V read" if name == "kv_read_us" else name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("cached tokens")
        ax.set_ylabel("µs per layer")
        ax.set_title(f"{q} tree rows")
        ax.legend(fontsize=8)
    fig.suptitle(f"Masked GQA tree attention, one layer ({meta['device']}, {meta['dtype']}, eager)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def render(meta: dict[str, object], rows: list[dict[str, object]]) -> str:
    s = meta["shapes"]
    assert isinstance(s, dict)
    layers = int(s["layers"])
    lines = [
        f"# Tree attention over a long prefix, one layer ({meta['device']}, {meta['dtype']})",
        "",
        f"Shapes: {s['heads']} query heads, {s['kv_heads']} KV heads, head_dim {s['head_dim']} "
        f"(Qwen2.5-Coder-1.5B); additive tree mask. Times are microseconds per layer (CUDA events, "
        f"mean of the repetitions); *x{layers}* is the per-step total over {layers} layers. "
        f"*KV read* is one read of the layer's K and V at the measured copy bandwidth "
        f"({meta['copy_bandwidth_GBps'] or 0:.0f} GB/s).",
        "",
        f"Command: `{meta['command']}` (torch {meta['torch']})",
        "",
        "| q | kv | KV read | " + " | ".join(VARIANTS) + f" | best x{layers} (ms) | hf-sdpa x{layers} (ms) |",
        "|---|---|---|" + "---|" * len(VARIANTS) + "---|---|",
    ]
    for r in rows:
        vals = {n: r.get(n) for n in VARIANTS}
        ok = [v for v in vals.values() if isinstance(v, float)]
        best = min(ok) if ok else None
        cells = [f"{v:.1f}" if isinstance(v, float) else "n/a" for v in vals.values()]
        kvr = r.get("kv_read_us")
        hf = vals["hf-sdpa"]
        kv_cell = f"{kvr:.1f}" if isinstance(kvr, float) else "n/a"
        best_cell = "n/a" if best is None else f"{best * layers / 1e3:.2f}"
        hf_cell = f"{hf * layers / 1e3:.2f}" if isinstance(hf, float) else "n/a"
        lines.append(
            f"| {r['q']} | {r['kv']} | {kv_cell} | " + " | ".join(cells) + f" | {best_cell} | {hf_cell} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
