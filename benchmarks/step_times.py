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

from specsplit.bench.roofline import copy_bandwidth, weight_bytes  # noqa: E402


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
    kinds: list[str],
) -> dict:
    from specsplit.runtime.graphs import StaticForward
    from specsplit.runtime.runner import ModelRunner

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
    runners = {
        False: ModelRunner(model, name, None, None, "auto"),  # transformers' SDPA (repeat_kv under a mask)
        True: ModelRunner(
            model, name, None, None, "auto", fold_gqa=True
        ),  # specsplit.runtime.attention's GQA fold
    }
    # "compiled": the same captured steps, their forwards fused by torch.compile first
    variants = [
        (
            k,
            StaticForward(
                runners[k.endswith("-fold")], ctx + 128, use_graphs=True, compile=k.startswith("compiled")
            ),
        )
        for k in kinds
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
        print(
            f"{name} ctx {ctx} {kind} q={q}: {ms:.3f} ms = {ms / out['bound_ms']:.2f}x the bound", flush=True
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--context", default="512", help="comma-separated cached-prefix lengths")
    ap.add_argument("--qs", default="1,5,17,33")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--draft-qs", default=None, help="the draft's query lengths (default: --qs)")
    ap.add_argument("--compile", action="store_true", help="also time the torch.compile-fused captured step")
    ap.add_argument(
        "--variants",
        default=None,
        help=f"comma-separated subset of {','.join(KINDS)} (default: the graph ones, plus the compiled ones with --compile)",
    )
    ap.add_argument(
        "--fuse-projections",
        action="store_true",
        help="time copies with fused q/k/v and gate/up projections (specsplit.runtime.fused, as `bench --fuse-projections`)",
    )
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
    role_qs = {"target": qs, "draft": [int(x) for x in args.draft_qs.split(",")] if args.draft_qs else qs}
    kinds = _kinds(args)
    rows = []
    contexts = [int(x) for x in args.context.split(",")]
    for role, name in (("target", args.target), ("draft", args.draft)):
        model = load_model(name, dtype=torch.bfloat16, device=str(device))
        if args.fuse_projections:
            from specsplit.runtime.fused import fuse_projections

            print(f"{name}: fused the projections of {fuse_projections(model)} modules", flush=True)
        for ctx in contexts:
            r = measure(model, name, device, ctx, role_qs[role], bw, kinds)
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
        "fused_projections": args.fuse_projections,
        "rows": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    slug = gpu.lower().replace("nvidia ", "").split()[0] + (f"-{args.tag}" if args.tag else "")
    (out / f"step_times-{slug}.json").write_text(json.dumps(result, indent=2))
    lines = [
        f"# Step times on {gpu} (bf16, context {args.context}; copy bandwidth {bw / 1e9:.0f} GB/s)",
        "",
        f"- command: `{result['command']}`",
        "- one model step at batch 1 over a static cache: eager HF, and our static step replayed from a"
        " CUDA graph (`compiled`: its forward fused by torch.compile before capture); bound = weight"
        " bytes / copy bandwidth"
        + ("; q/k/v and gate/up projections fused (`--fuse-projections`)" if args.fuse_projections else ""),
        "- `-fold`: attention through `specsplit.runtime.attention` (GQA folded into the query rows, the engines'"
        " default); without: transformers' SDPA (`repeat_kv` under a mask)",
        "",
        "| model | context | weights GB | bound ms | eager HF step ms | step | q | ms | x bound |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        for k in kinds:
            for q in role_qs[r["role"]]:
                lines.append(
                    f"| {r['role']} {r['model']} | {r['context']} | {r['weight_bytes'] / 1e9:.2f} | "
                    f"{r['bound_ms']:.2f} | {r['eager_step_ms']:.2f} | {k} | {q} | {r[f'{k}_q{q}_ms']:.2f} | "
                    f"{r[f'{k}_q{q}_over_bound']:.2f} |"
                )
    (out / f"step_times-{slug}.md").write_text("\n".join(lines) + "\n")
    plot(out / f"step_times-{slug}.json")
    print("\n".join(lines))


def plot(json_path: Path) -> bool:
    """Step ms against the cached tokens, per model and step kind (needs matplotlib)."""
    from specsplit.bench.report import pyplot

    plt = pyplot()
    if plt is None:
        return False
    doc = json.loads(json_path.read_text())
    rows = doc["rows"]
    roles = sorted({r["role"] for r in rows}, reverse=True)  # target, draft
    fig, axes = plt.subplots(1, len(roles), figsize=(6 * len(roles), 4), squeeze=False)
    for ax, role in zip(axes[0], roles, strict=True):
        mine = sorted((r for r in rows if r["role"] == role), key=lambda r: r["context"])
        ctx = [r["context"] for r in mine]
        keys = sorted({k[: -len("_ms")] for r in mine for k in r if k.endswith("_ms") and "_q" in k})
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


KINDS = ("graph", "graph-fold", "compiled", "compiled-fold")


def _kinds(args: argparse.Namespace) -> list[str]:
    """The step variants to time: ``--variants``, else the graph ones (+ compiled with ``--compile``)."""
    if args.variants is None:
        return list(KINDS if args.compile else KINDS[:2])
    kinds = [k.strip() for k in args.variants.split(",") if k.strip()]
    bad = sorted(set(kinds) - set(KINDS))
    if bad or not kinds:
        raise SystemExit(f"--variants: unknown {bad or 'empty list'}; choose from {', '.join(KINDS)}")
    return kinds


def _command(args: argparse.Namespace) -> str:
    """The command line that reproduces this run (flags as flags, not ``--flag True``)."""
    parts = ["python benchmarks/step_times.py"]
    for k, v in vars(args).items():
        flag = "--" + k.replace("_", "-")
        if isinstance(v, bool):
            parts += [flag] if v else []
        elif v is not None:
            parts.append(f"{flag} {v}")
    return " ".join(parts)


if __name__ == "__main__":
    main()
