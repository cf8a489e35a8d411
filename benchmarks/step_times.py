"""Per-step costs on a GPU against the weight-read bound (DESIGN.md, "Performance model").

For the target and the draft: an eager HF decode step (DynamicCache), our static-shape step
replayed from a CUDA graph for 1 token (target-only decoding) and for a verify/level of ``q``
tokens, each next to ``weight bytes / measured copy bandwidth``. One process, one device.

    python benchmarks/step_times.py --device cuda:0 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's specsplit

from specsplit.roofline import copy_bandwidth, weight_bytes  # noqa: E402


def time_ms(fn, reps: int = 50) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


@torch.inference_mode()
def measure(
    model: torch.nn.Module,
    name: str,
    device: torch.device,
    ctx: int,
    qs: list[int],
    bw: float,
    compile: bool = False,
) -> dict:
    from specsplit.engine_common import ModelRunner
    from specsplit.graphs import StaticForward

    vocab = model.get_output_embeddings().weight.shape[0]
    prompt = torch.randint(0, vocab, (1, ctx), device=device)
    # eager HF decode step
    dyn = DynamicCache(config=model.config)
    model(prompt, past_key_values=dyn)
    tok = prompt[:, -1:]

    def eager_step() -> None:
        model(tok, past_key_values=dyn)
        dyn.crop(ctx)

    out = {"model": name, "weight_bytes": weight_bytes(model), "context": ctx}
    out["bound_ms"] = out["weight_bytes"] / bw * 1e3
    out["eager_step_ms"] = time_ms(eager_step)
    plain = ModelRunner(model, name, None, None, "auto")  # transformers' SDPA (repeat_kv under a mask)
    fold = ModelRunner(model, name, None, None, "auto", fold_gqa=True)  # specsplit.attention's GQA fold
    variants = [
        ("graph", StaticForward(plain, ctx + 128, use_graphs=True)),
        ("graph-fold", StaticForward(fold, ctx + 128, use_graphs=True)),
    ]
    if compile:  # the same captured steps, their forwards fused by torch.compile first
        variants += [
            ("compiled", StaticForward(plain, ctx + 128, use_graphs=True, compile=True)),
            ("compiled-fold", StaticForward(fold, ctx + 128, use_graphs=True, compile=True)),
        ]
    for (kind, sf), q in ((v, q) for v in variants for q in qs):
        ids = torch.randint(0, vocab, (q,), device=device)
        pos = torch.arange(ctx, ctx + q, device=device)
        block = torch.ones(q, q, dtype=torch.bool, device=device).tril()
        sf.cache.set_length(ctx)

        def step(
            ids: torch.Tensor = ids,
            pos: torch.Tensor = pos,
            block: torch.Tensor = block,
            sf: StaticForward = sf,
        ) -> None:
            sf.run(ids, pos, ctx, block)
            sf.cache.set_length(ctx)

        t0 = time.perf_counter()
        step()  # capture (and compile) outside the timing
        out[f"{kind}_q{q}_setup_s"] = time.perf_counter() - t0
        ms = time_ms(step)
        out[f"{kind}_q{q}_ms"] = ms
        out[f"{kind}_q{q}_over_bound"] = ms / out["bound_ms"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--context", default="512", help="comma-separated cached-prefix lengths")
    ap.add_argument("--qs", default="1,5,17,33")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--compile", action="store_true", help="also time the torch.compile-fused captured step")
    ap.add_argument("--tag", default="", help="suffix for the result file names")
    ap.add_argument("--from-json", default=None, help="run nothing: draw the .png of a results .json")
    args = ap.parse_args()
    if args.from_json:
        plot(Path(args.from_json))
        return
    from specsplit.models import load_model

    device = torch.device(args.device)
    bw = copy_bandwidth(device, nbytes=2 << 30)
    qs = [int(x) for x in args.qs.split(",")]
    rows = []
    contexts = [int(x) for x in args.context.split(",")]
    for role, name in (("target", args.target), ("draft", args.draft)):
        model = load_model(name, dtype=torch.bfloat16, device=str(device))
        for ctx in contexts:
            r = measure(model, name, device, ctx, qs, bw, args.compile)
            r["role"] = role
            rows.append(r)
        del model
        torch.cuda.empty_cache()
    gpu = torch.cuda.get_device_name(device)
    result = {
        "machine": gpu,
        "copy_bandwidth_GBps": bw / 1e9,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
        "command": _command(args),
        "rows": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    slug = gpu.lower().replace("nvidia ", "").split()[0] + (f"-{args.tag}" if args.tag else "")
    (out / f"step_times-{slug}.json").write_text(json.dumps(result, indent=2))
    kinds = ["graph", "graph-fold"] + (["compiled", "compiled-fold"] if args.compile else [])
    lines = [
        f"# Step times on {gpu} (bf16, context {args.context}; copy bandwidth {bw / 1e9:.0f} GB/s)",
        "",
        f"- command: `{result['command']}`",
        "- one model step at batch 1 over a static cache: eager HF, the captured CUDA graph"
        + (", and the graph of the torch.compile-fused step" if args.compile else "")
        + "; bound = weight bytes / copy bandwidth",
        "- `-fold`: attention through `specsplit.attention` (GQA folded into the query rows, the engines'"
        " default); without: transformers' SDPA (`repeat_kv` under a mask)",
        "",
        "| model | context | weights GB | bound ms | eager HF step ms | "
        + " | ".join(f"{k} q={q} ms (x bound)" for k in kinds for q in qs)
        + " |",
        "|---|---|---|---|---|" + "---|" * (len(qs) * len(kinds)),
    ]
    for r in rows:
        cells = " | ".join(
            f"{r[f'{k}_q{q}_ms']:.2f} ({r[f'{k}_q{q}_over_bound']:.1f}x)" for k in kinds for q in qs
        )
        lines.append(
            f"| {r['role']} {r['model']} | {r['context']} | {r['weight_bytes'] / 1e9:.2f} | {r['bound_ms']:.2f} | "
            f"{r['eager_step_ms']:.2f} | {cells} |"
        )
    (out / f"step_times-{slug}.md").write_text("\n".join(lines) + "\n")
    plot(out / f"step_times-{slug}.json")
    print("\n".join(lines))


def plot(json_path: Path) -> bool:
    """Step ms against the cached tokens, per model and step kind (needs matplotlib)."""
    from specsplit.bench_report import pyplot

    plt = pyplot()
    if plt is None:
        return False
    doc = json.loads(json_path.read_text())
    rows = doc["rows"]
    roles = sorted({r["role"] for r in rows}, reverse=True)  # target, draft
    keys = sorted({k[: -len("_ms")] for r in rows for k in r if k.endswith("_ms") and "_q" in k})
    fig, axes = plt.subplots(1, len(roles), figsize=(6 * len(roles), 4), squeeze=False)
    for ax, role in zip(axes[0], roles, strict=True):
        mine = sorted((r for r in rows if r["role"] == role), key=lambda r: r["context"])
        ctx = [r["context"] for r in mine]
        for k in keys:
            ax.plot(ctx, [r[f"{k}_ms"] for r in mine], marker="o", label=k.replace("_", " "))
        ax.plot(ctx, [r["bound_ms"] for r in mine], ":", color="gray", label="weight-read bound")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("cached tokens")
        ax.set_ylabel("ms per step")
        ax.set_title(f"{role} {mine[0]['model']}")
        ax.legend(fontsize=7)
    fig.suptitle(f"Step times, {doc['machine']}, bf16, batch 1")
    fig.tight_layout()
    fig.savefig(json_path.with_suffix(".png"), dpi=110)
    plt.close(fig)
    return True


def _command(args: argparse.Namespace) -> str:
    """The command line that reproduces this run (flags as flags, not ``--flag True``)."""
    parts = ["python benchmarks/step_times.py"]
    for k, v in vars(args).items():
        if isinstance(v, bool):
            parts += [f"--{k}"] if v else []
        else:
            parts.append(f"--{k} {v}")
    return " ".join(parts)


if __name__ == "__main__":
    main()
