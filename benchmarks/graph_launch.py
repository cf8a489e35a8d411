"""Where does a replayed step's time go: the host's graph launch or the GPU's kernels?

For the draft and target shapes of the default pair (random weights: only shapes matter), with
plain captured graphs and with ``torch.compile``-fused ones, one static forward of ``q`` tokens is
captured through :class:`~specsplit.runtime.graphs.StaticForward` and then timed four ways:

- ``launch_ms``: host time of ``graph.replay()`` (cudaGraphLaunch) with the GPU idle;
- ``single_ms``: one replay from an idle GPU to its end (CUDA events around it);
- ``gpu_ms``: per replay over 20 queued back to back (the GPU's own time when launches keep up);
- ``wall_ms``: host wall time per replay of those 20, synchronised at the end.

If ``single_ms`` is close to ``launch_ms + gpu_ms``, the GPU waits for the whole launch before it
starts, and every replay that follows a host sync (one per decoding round) pays the launch in full.
The whole dynamic-tree round graph of the draft (``DraftConfig.graph_rounds``) is timed the same way.

    python benchmarks/graph_launch.py --device cuda:0 --out benchmarks/results --tag h100
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specsplit.bench.report import pyplot  # noqa: E402
from specsplit.config import DraftConfig, EngineTuning, SamplingParams, TreeConfig  # noqa: E402
from specsplit.engines.draft import DraftEngine  # noqa: E402
from specsplit.messages import DraftRequest  # noqa: E402
from specsplit.runtime.fused import fuse_projections  # noqa: E402
from specsplit.runtime.graphs import StaticForward  # noqa: E402
from specsplit.runtime.runner import ModelRunner  # noqa: E402

# Qwen2.5-Coder-0.5B / 1.5B-Instruct shapes (their config.json).
SHAPES = {
    "draft-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                       num_key_value_heads=2, tie_word_embeddings=True),
    "target-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                        num_key_value_heads=2, tie_word_embeddings=True),
}  # fmt: skip


def build(name: str, device: str) -> Any:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=151936, max_position_embeddings=32768, rope_theta=1e6, **SHAPES[name])
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg).to(device=device, dtype=torch.bfloat16).eval()


def time_replays(replay: Any, device: torch.device, reps: int = 20) -> dict[str, float]:
    sync = lambda: torch.cuda.synchronize(device)  # noqa: E731
    for _ in range(3):
        replay()
    sync()
    launch = []
    single = []
    for _ in range(5):
        sync()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        replay()
        launch.append(time.perf_counter() - t0)
        end.record()
        sync()
        single.append(start.elapsed_time(end))
    sync()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    for _ in range(reps):
        replay()
    end.record()
    sync()
    wall = (time.perf_counter() - t0) / reps
    return {
        "launch_ms": 1e3 * min(launch),
        "single_ms": min(single),
        "gpu_ms": start.elapsed_time(end) / reps,
        "wall_ms": 1e3 * wall,
    }


def step_rows(name: str, model: Any, q: int, compile: bool, device: torch.device) -> dict[str, Any]:
    runner = ModelRunner(model, None, str(device), None, "bfloat16")
    sf = StaticForward(runner, 512, use_graphs=True, compile=compile)
    ids = torch.randint(3, 1000, (q,), device=device)
    ctx = 200
    pos = torch.arange(ctx, ctx + q, device=device)
    block = torch.ones(q, q, dtype=torch.bool, device=device).tril()
    sf.run(ids, pos, ctx, block)  # captures
    b = next(v for v in sf._bufs.values() if v.graph is not None)
    graph = b.graph
    row = {"model": name, "kind": f"step q={q}", "compile": compile}
    row.update(time_replays(graph.replay, device))
    return row


def round_row(
    model: Any, compile: bool, device: torch.device, shape: tuple[int, int, int, int]
) -> dict[str, Any]:
    eng = DraftEngine(
        model,
        DraftConfig(
            device=str(device), cuda_graphs=True, compile=compile, tuning=EngineTuning(graph_capacity=512)
        ),
    )
    topk, width, budget, depth = shape
    tree = TreeConfig("dynamic", topk=topk, width=width, budget=budget, max_depth=depth)
    prompt = torch.randint(3, 1000, (200,)).tolist()
    eng.generate(DraftRequest("s", prompt, 0, tree=tree, sampling=SamplingParams()))
    (rnd,) = eng._rounds.values()
    row = {
        "model": "draft-0.5b",
        "kind": f"dynamic round {topk},{width},{budget},{depth}",
        "compile": compile,
    }
    row.update(time_replays(rnd.graph.replay, device))
    eng.shutdown()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--tag", default="")
    ap.add_argument("--no-compile", action="store_true", help="plain graphs only (compiling takes minutes)")
    ap.add_argument("--fuse", action="store_true", help="also time the models with fused projections")
    ap.add_argument(
        "--from-json", type=Path, default=None, help="only redraw the table and plot of a saved run"
    )
    a = ap.parse_args()
    if a.from_json:
        report(a.from_json)
        return
    device = torch.device(a.device)
    torch.cuda.set_device(device)  # CUDA events record on the current device: make it this one
    rows: list[dict[str, Any]] = []
    modes = [False] if a.no_compile else [False, True]
    fusions = [False, True] if a.fuse else [False]
    for fuse in fusions:
        draft, target = build("draft-0.5b", a.device), build("target-1.5b", a.device)
        if fuse:
            fuse_projections(draft)
            fuse_projections(target)
        for compile in modes:
            steps = [("draft-0.5b", draft, (1, 4)), ("target-1.5b", target, (1, 25))]
            if compile:  # each compiled shape costs about a minute: the two steps a round repeats most
                steps = [("draft-0.5b", draft, (4,)), ("target-1.5b", target, (1,))]
            for name, model, qs in steps:
                for q in qs:
                    rows.append({**step_rows(name, model, q, compile, device), "fused": fuse})
                    print(json.dumps(rows[-1]), flush=True)
            if not (compile and fuse):
                rows.append({**round_row(draft, compile, device, (4, 4, 24, 5)), "fused": fuse})
                print(json.dumps(rows[-1]), flush=True)
        del draft, target
        torch.cuda.empty_cache()
    doc = {
        "command": "python benchmarks/graph_launch.py " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items() if v not in (None, False, "")),
        "machine": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "rows": rows,
    }  # fmt: skip
    a.out.mkdir(parents=True, exist_ok=True)
    path = a.out / f"graph_launch{'-' + a.tag if a.tag else ''}.json"
    path.write_text(json.dumps(doc, indent=1))
    report(path)


def report(path: Path) -> None:
    """The Markdown table and the PNG plot of a saved run."""
    doc = json.loads(path.read_text())
    rows = doc["rows"]
    lines = [
        f"# Graph launch vs GPU time per replay, {doc['machine']} (random weights, bf16, batch 1)",
        "",
        f"- command: `{doc['command']}`; torch {doc['torch']}",
        "- launch: host time of `replay()` from an idle GPU; single: one replay from an idle GPU, CUDA events; "
        "gpu: per replay, 20 queued back to back; wall: host wall per replay of those 20",
        "",
        "| model | forward | compile | fused q/k/v, gate/up | launch ms | single ms | gpu ms | wall ms | single − gpu |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['kind']} | {'yes' if r['compile'] else 'no'} | "
            f"{'yes' if r.get('fused') else 'no'} | {r['launch_ms']:.3f} | "
            f"{r['single_ms']:.3f} | {r['gpu_ms']:.3f} | {r['wall_ms']:.3f} | {r['single_ms'] - r['gpu_ms']:.3f} |"
        )
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plt = pyplot()
    if plt is None:
        return
    labels = [
        f"{r['model']}\n{r['kind']}\n{'compiled' if r['compile'] else 'graph'}{' fused' if r.get('fused') else ''}"
        for r in rows
    ]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.bar([i - 0.2 for i in x], [r["gpu_ms"] for r in rows], 0.4, label="GPU time per replay")
    ax.bar([i + 0.2 for i in x], [r["launch_ms"] for r in rows], 0.4, label="host launch (cudaGraphLaunch)")
    ax.set_xticks(list(x), labels, fontsize=6)
    ax.set_ylabel("ms")
    ax.set_title(f"Graph replay: launch vs GPU time, {doc['machine']}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
