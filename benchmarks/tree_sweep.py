"""Which tree shape decodes fastest? Tree shapes side by side in ONE process over ONE generator.

The generator's engines (and, with ``--compile``, their fused steps) are built once; each shape
is selected by changing ``generator.config.tree`` between runs, then warmed up on every prompt
(graph capture and compilation stay out of the timed calls) and timed on every prompt. Shapes with
the same width and budget reuse the same compiled steps, so a depth or top-k sweep costs no
recompilation. Target-only decoding (no draft) on the same engines is the reference.

    python benchmarks/tree_sweep.py --device cuda:0 --compile --prompts-per-category 1 \\
        --shapes "target;chain:4;dynamic:4,4,24,6;dynamic:4,4,24,8" --out benchmarks/results

A shape is ``target`` (no draft), ``chain:K`` or ``dynamic:topk,width,budget,depth``, optionally
followed by ``/target-rounds`` (the target verifies a greedy round as one graph,
``TargetConfig.graph_rounds``). ``--timeline`` also profiles one generation per shape and splits
its rounds into GPU time per phase and GPU idle time (:mod:`specsplit.bench.profiling`).
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specsplit import SpecSplitConfig, SpecSplitGenerator, TreeConfig
from specsplit.bench.decoders import load_models
from specsplit.bench.profiling import format_summary, round_timeline
from specsplit.bench.report import pyplot
from specsplit.bench.run import DEFAULT_PROMPTS, load_prompts, tokenize_prompts
from specsplit.config import DraftConfig, EngineTuning, TargetConfig

DEFAULT_SHAPES = (
    "target;chain:4;dynamic:4,4,24,4;dynamic:4,4,24,5;dynamic:4,4,24,6;dynamic:4,4,24,7;dynamic:8,4,24,6"
)


FLAGS = ("target-rounds",)


def shape_flags(text: str) -> set[str]:
    """The ``/flag`` suffixes of a shape."""
    flags = {f.strip() for f in text.split("/")[1:]}
    bad = flags - set(FLAGS)
    if bad:
        raise ValueError(f"unknown shape flag(s) {sorted(bad)} in {text!r}; known: {FLAGS}")
    return flags


def parse_shape(text: str) -> TreeConfig | None:
    """``target`` -> ``None`` (no draft); ``chain:K``; ``dynamic:topk,width,budget,depth``."""
    kind, _, rest = text.split("/")[0].strip().partition(":")
    if kind == "target":
        return None
    if kind == "chain":
        return TreeConfig(shape="chain", num_draft_tokens=int(rest))
    if kind == "dynamic":
        topk, width, budget, depth = (int(x) for x in rest.split(","))
        return TreeConfig(shape="dynamic", topk=topk, width=width, budget=budget, max_depth=depth)
    raise ValueError(f"bad shape {text!r}: use target, chain:K or dynamic:topk,width,budget,depth")


def sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def run_shape(
    gen: SpecSplitGenerator,
    tree: TreeConfig | None,
    prompts: list[Any],
    a: argparse.Namespace,
    flags: set[str] | None = None,
) -> dict:
    if tree is not None:
        gen.config.tree = tree
    gen.transport.target_engine.config.tuning.graph_rounds = "target-rounds" in (flags or set())
    kw: dict[str, Any] = dict(max_new_tokens=a.max_new_tokens, eos_token_id=[], return_dict_in_generate=True)
    for p in prompts:  # warm-up: every prompt at full length (captures, compiles)
        gen.generate(torch.tensor([p.input_ids]), **kw)
    tokens, seconds, rounds, per_prompt = 0, 0.0, 0, []
    outputs = []
    for p in prompts:
        sync(a.device)
        t0 = time.perf_counter()
        out = gen.generate(torch.tensor([p.input_ids]), **kw)
        sync(a.device)
        dt = time.perf_counter() - t0
        n = out.sequences.shape[1] - len(p.input_ids)
        tokens += n
        seconds += dt
        rounds += len(out.spec_stats.rounds)
        per_prompt.append(n / dt)
        outputs.append(out.sequences[0, len(p.input_ids) :].tolist())
    timeline = None
    if a.timeline:  # after the timed runs: the profiler must not slow them down
        ids = torch.tensor([prompts[0].input_ids])
        timeline = round_timeline(gen, ids, **{**kw, "return_dict_in_generate": False})
        print(format_summary(timeline))
        timeline = timeline["mean"]
    return {
        "timeline": timeline,
        "tokens_per_s": tokens / seconds,
        "median_prompt_tokens_per_s": statistics.median(per_prompt),
        "tau": tokens / max(rounds, 1),
        "ms_per_round": 1e3 * seconds / max(rounds, 1),
        "outputs": outputs,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--draft-device", default=None)
    ap.add_argument("--target", default=None)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--compile", action="store_true", help="fuse the graph steps with torch.compile")
    ap.add_argument("--no-cuda-graphs", action="store_true")
    ap.add_argument("--prompts-per-category", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--shapes", default=DEFAULT_SHAPES)
    ap.add_argument("--fuse", action="store_true", help="fused q/k/v and gate/up projections (both models)")
    ap.add_argument(
        "--attention-kernel", choices=("auto", "math", "sdpa"), default="auto", help="both engines' attention"
    )
    ap.add_argument(
        "--timeline", action="store_true", help="profile one generation per shape: GPU time per phase, idle"
    )
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--tag", default="")
    ap.add_argument(
        "--from-json", type=Path, default=None, help="only redraw the plot and table of a saved run"
    )
    a = ap.parse_args()
    if a.from_json:
        write_table(a.from_json)
        plot(a.from_json)
        return
    shapes = [s for s in a.shapes.split(";") if s.strip()]
    trees = [parse_shape(s) for s in shapes]
    flags = [shape_flags(s) for s in shapes]
    m = load_models(False, a.device, a.draft_device, a.target, a.draft, a.dtype)
    prompts = load_prompts(DEFAULT_PROMPTS, a.prompts_per_category)
    tokenize_prompts(prompts, m.tokenizer)
    graphs = not a.no_cuda_graphs
    cfg = SpecSplitConfig(
        draft=DraftConfig(
            cuda_graphs=graphs,
            compile=a.compile,
            fuse_projections=a.fuse,
            tuning=EngineTuning(attention_kernel=a.attention_kernel),
        ),
        target=TargetConfig(
            cuda_graphs=graphs,
            compile=a.compile,
            fuse_projections=a.fuse,
            tuning=EngineTuning(attention_kernel=a.attention_kernel),
        ),
    )
    rows = []
    drafted = SpecSplitGenerator(m.target, m.draft, tokenizer=m.tokenizer, config=cfg)
    target_only = SpecSplitGenerator(m.target, None, tokenizer=m.tokenizer, config=copy.deepcopy(cfg))
    try:
        for text, tree, fl in zip(shapes, trees, flags, strict=True):
            t0 = time.perf_counter()
            r = run_shape(drafted if tree is not None else target_only, tree, prompts, a, fl)
            r["shape"] = text
            r["sweep_s"] = time.perf_counter() - t0
            rows.append(r)
            print(
                f"{text:28s} {r['tokens_per_s']:8.1f} tok/s  tau {r['tau']:.2f}  {r['ms_per_round']:.2f} ms/round"
            )
    finally:
        drafted.close()
        target_only.close()
    ref = next((r for r, t in zip(rows, trees, strict=True) if t is None), None)
    ref_outputs = ref["outputs"] if ref is not None else None
    for r in rows:
        outs = r.pop("outputs")
        if ref is not None and ref_outputs is not None:
            r["x_target_only"] = r["tokens_per_s"] / ref["tokens_per_s"]
            r["same_tokens_as_target_only"] = sum(o == g for o, g in zip(outs, ref_outputs, strict=True))
    dev = torch.device(a.device)
    machine = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu"
    doc = {
        "command": "python benchmarks/tree_sweep.py "
        + " ".join(
            f"--{k.replace('_', '-')}"
            + ("" if v is True else f" {json.dumps(v) if isinstance(v, str) and ';' in v else v}")
            for k, v in vars(a).items()
            if v not in (None, False) and k != "from_json"
        ),  # fmt: skip
        "machine": machine,
        "torch": torch.__version__,
        "target": m.target_name,
        "draft": m.draft_name,
        "dtype": m.dtype,
        "prompts": [p.id for p in prompts],
        "max_new_tokens": a.max_new_tokens,
        "cuda_graphs": graphs,
        "compile": a.compile,
        "fuse_projections": a.fuse,
        "attention_kernel": a.attention_kernel,
        "rows": rows,
    }
    a.out.mkdir(parents=True, exist_ok=True)
    path = a.out / f"tree_sweep{'-' + a.tag if a.tag else ''}.json"
    path.write_text(json.dumps(doc, indent=1))
    write_table(path)
    plot(path)
    print(f"wrote {path}")


def write_table(path: Path) -> None:
    doc = json.loads(path.read_text())
    lines = [
        f"# Tree shapes side by side: {doc['target']} + {doc['draft']}, {doc['machine']}",
        "",
        f"- command: `{doc['command']}`",
        f"- {len(doc['prompts'])} prompts ({', '.join(doc['prompts'])}), {doc['max_new_tokens']} new tokens, "
        f"greedy, batch 1, {doc['dtype']}, CUDA graphs {'on' if doc['cuda_graphs'] else 'off'}, "
        f"torch.compile {'on' if doc['compile'] else 'off'}; torch {doc['torch']}",
        "- one process, one generator; warm-up on every prompt, then one timed run per prompt; "
        "tokens/s = all new tokens / all timed seconds",
        *([f"- note: {doc['note']}"] if doc.get("note") else []),
        "",
    ]
    timed = any(r.get("timeline") for r in doc["rows"])
    if doc.get("fuse_projections"):
        lines.insert(-1, "- fused q/k/v and gate/up projections in both models")
    if doc.get("attention_kernel", "auto") != "auto":
        lines.insert(-1, f"- attention kernel `{doc['attention_kernel']}` in both engines")
    if timed:
        lines += [
            "- profile columns: one more generation of the first prompt under the torch profiler "
            "(`specsplit.bench.profiling`), means per round: GPU busy / idle ms in the round's wall time, then GPU "
            "ms of the work launched by the draft's ingest, the draft's tree growth and the verification "
            "(idle is an upper bound: the profiler slows the host)",
            "",
        ]
    head = "| shape | tokens/s | × target-only | tau | ms/round | prompts equal to target-only |"
    rule = "|---|---|---|---|---|---|"
    if timed:
        head += " profiled ms/round | GPU busy / idle | ingest / grow / verify GPU ms |"
        rule += "---|---|---|"
    lines += [head, rule]
    for r in doc["rows"]:
        x = f"{r['x_target_only']:.2f}×" if "x_target_only" in r else "–"
        same = (
            f"{r['same_tokens_as_target_only']}/{len(doc['prompts'])}"
            if "same_tokens_as_target_only" in r
            else "–"
        )
        row = f"| `{r['shape']}` | {r['tokens_per_s']:.1f} | {x} | {r['tau']:.2f} | {r['ms_per_round']:.2f} | {same} |"
        t = r.get("timeline")
        if timed and t:
            g = t["gpu_ms"]
            row += (
                f" {t['wall_ms']:.2f} | {t['gpu_busy_ms']:.2f} / {t['gpu_idle_ms']:.2f} |"
                f" {g.get('draft.ingest', 0):.2f} / {g.get('draft.grow', 0):.2f} / {g.get('verify', 0):.2f} |"
            )
        elif timed:
            row += " – | – | – |"
        lines.append(row)
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")


def plot(path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    doc = json.loads(path.read_text())
    rows = doc["rows"]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar(range(len(rows)), [r["tokens_per_s"] for r in rows], color="tab:blue")
    for i, r in enumerate(rows):
        ax.text(i, r["tokens_per_s"], f"tau {r['tau']:.2f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(rows)), [r["shape"] for r in rows], rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("tokens/s")
    ax.set_title(f"Tree shapes, {doc['machine']}, compile {'on' if doc['compile'] else 'off'}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=110)
    plt.close(fig)
    return True


if __name__ == "__main__":
    main()
