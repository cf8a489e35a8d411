#!/usr/bin/env python
"""What a prompt's first round costs: the draft's prefill + first tree, the target's prefill + first
verification, by route (attention kernel; eager or padded CUDA-graph prefills) and by thread.

Those two calls run the only eager forwards of a round whose query rows exceed the folded kernel's
limit, so their attention goes to SDPA. On Hopper PyTorch ranks cuDNN first for bf16 there; cuDNN
builds an execution plan per problem shape and PyTorch keeps the plans per thread. This script
times each call (a device sync after it) on real bench prompts, each case on lengths no earlier
call of that route has seen in this process:

* ``new length``: the prompt's length is new to the process;
* ``same length, same thread``: the same prompt again right after (a fresh session, same thread);
* ``same length, new thread``: the same prompt again on a fresh thread (a gRPC worker serves each
  call on whichever pool thread is free).

Routes: ``cudnn-allowed`` (``specsplit.runtime.attention.AVOID_CUDNN = False``: the choice is PyTorch's),
``memory-efficient`` (the engines' default on CUDA) and ``prefill-graphs`` (memory-efficient, with
``DraftConfig/TargetConfig.prefill_graphs``: the prompt's forward padded to a bucket and replayed
from that bucket's CUDA graph; its ``new length`` case captures the graph when the bucket is new to
the process). ``--routes`` picks some. ``--profile`` adds a torch-profiler table of one ``new length``
verification per route (top host ops). On a CPU the engines run the same static path without
capture (a smoke test).

    python benchmarks/prefill_cost.py --draft qwen2.5-coder-0.5b --target qwen2.5-coder-1.5b \\
        --device cuda:0 --tag h200 --profile      # -> benchmarks/results/prefill_cost-h200.{json,md,png}
    python benchmarks/prefill_cost.py --rerender benchmarks/results/prefill_cost-h200.json
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import threading
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ROUTES = ("cudnn-allowed", "memory-efficient", "prefill-graphs")
CASES = ("new length", "same length, same thread", "same length, new thread")


def _first_round(draft: Any, target: Any, prompt: list[int], tree: Any, sync: Any) -> tuple[float, float]:
    """One prompt's first round on fresh sessions: (draft call ms, verify call ms)."""
    from specsplit.messages import DraftRequest, VerifyRequest

    sid = uuid.uuid4().hex
    cap = len(prompt) + 160
    try:
        t0 = time.perf_counter()
        res = draft.generate(DraftRequest(sid, prompt, 0, tree, capacity_hint=cap))
        sync()
        t1 = time.perf_counter()
        target.verify(VerifyRequest(sid, res.tree, prompt, 0, capacity_hint=cap))
        sync()
        t2 = time.perf_counter()
    finally:
        draft.end_session(sid)
        target.end_session(sid)
    return (t1 - t0) * 1e3, (t2 - t1) * 1e3


def _on_new_thread(fn: Any, *args: Any) -> Any:
    out: list[Any] = []
    th = threading.Thread(target=lambda: out.append(fn(*args)))
    th.start()
    th.join()
    return out[0]


def _profile(draft: Any, target: Any, prompt: list[int], tree: Any, sync: Any) -> str:
    """Key averages of one first round (host time), top rows."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _first_round(draft, target, prompt, tree, sync)
    return str(prof.key_averages().table(sort_by="cpu_time_total", row_limit=14, max_name_column_width=60))


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from specsplit.bench.run import DEFAULT_PROMPTS, load_prompts, tokenize_prompts
    from specsplit.config import DraftConfig, TargetConfig, TreeConfig
    from specsplit.engines.draft import DraftEngine
    from specsplit.engines.target import TargetEngine
    from specsplit.models import load_tokenizer
    from specsplit.runtime import attention

    topk, width, budget, depth = (int(x) for x in args.dynamic_tree.split(","))
    tree = TreeConfig(shape="dynamic", topk=topk, width=width, budget=budget, max_depth=depth)
    graphs = args.device.startswith("cuda")
    routes = [r for r in ROUTES if r in args.routes.split(",")]
    if not routes:
        raise SystemExit(f"--routes: none of {args.routes!r} is one of {', '.join(ROUTES)}")
    draft = DraftEngine(config=DraftConfig(model=args.draft, device=args.device, dtype=args.dtype,
                                           cuda_graphs=True))  # fmt: skip
    target = TargetEngine(config=TargetConfig(model=args.target, device=args.device, dtype=args.dtype,
                                              cuda_graphs=True))  # fmt: skip

    def use(route: str) -> None:
        attention.AVOID_CUDNN = route != "cudnn-allowed"
        draft.config.tuning.prefill_graphs = target.config.tuning.prefill_graphs = route == "prefill-graphs"

    draft.load_model()
    target.load_model()

    def sync() -> None:
        if graphs:
            torch.cuda.synchronize(args.device)

    tok = load_tokenizer(args.target)
    prompts = load_prompts(DEFAULT_PROMPTS, args.prompts_per_category)
    tokenize_prompts(prompts, tok)
    by_len: dict[int, list[int]] = {}
    for p in prompts:
        by_len.setdefault(len(p.input_ids), p.input_ids)
    pool = [by_len[k] for k in sorted(by_len)]
    warm, rest = pool[0], pool[1:]
    k = len(routes)  # each route gets lengths of its own: none seen before by that route
    sets = {r: rest[i::k][: len(rest) // k or None] for i, r in enumerate(routes)}
    for route in routes:  # kernels, graphs of the fixed-shape steps, libraries: loaded once, outside
        use(route)
        _first_round(draft, target, warm, tree, sync)
    result: dict[str, Any] = {"times_ms": {}, "lengths": {}, "profiles": {}}
    used: set[int] = set()
    for route in routes:
        use(route)
        rows: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for p in sets[route]:
            rows[CASES[0]].append(_first_round(draft, target, p, tree, sync))
            rows[CASES[1]].append(_first_round(draft, target, p, tree, sync))
            rows[CASES[2]].append(_on_new_thread(_first_round, draft, target, p, tree, sync))
        result["times_ms"][route] = {c: [list(x) for x in v] for c, v in rows.items()}
        result["lengths"][route] = [len(p) for p in sets[route]]
        if args.profile:  # one more length, new to the process: what its first round spends host time on
            cut = pool[-1][:-1]
            while len(cut) in by_len or len(cut) in used:
                cut = cut[:-1]
            used.add(len(cut))
            result["profiles"][route] = _profile(draft, target, cut, tree, sync)
    use("memory-efficient")
    draft.shutdown()
    target.shutdown()
    return result


def _table(res: dict[str, Any]) -> str:
    lines = [
        f"# A prompt's first round by route ({res['device']}, {res['tag'] or 'untagged'})",
        "",
        f"Command: `{res['command']}`",
        "",
        f"torch {res['torch']}; prompt lengths per route: "
        + "; ".join(f"{r}: {res['lengths'][r]}" for r in ROUTES if r in res["lengths"]),
        "",
        "Median ms per call (a device sync after each); the draft call is its prefill of the prompt and "
        "the first tree, the verify call the target's prefill of the prompt with that tree.",
        "",
        "| route | case | draft call | verify call | both |",
        "|---|---|---|---|---|",
    ]
    for route in ROUTES:
        for case, v in res["times_ms"].get(route, {}).items():
            d = statistics.median(x[0] for x in v)
            t = statistics.median(x[1] for x in v)
            both = statistics.median(x[0] + x[1] for x in v)
            lines.append(f"| {route} | {case} | {d:.2f} | {t:.2f} | {both:.2f} |")
    for route, table in res.get("profiles", {}).items():
        lines += ["", f"Host time of one first round at a new length, {route} (torch profiler):", "", "```",
                  table.rstrip(), "```"]  # fmt: skip
    return "\n".join(lines) + "\n"


def write_plot(res: dict[str, Any], path: Path) -> bool:
    from specsplit.bench.report import pyplot, save_figure

    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(9, 4.2))
    labels, draft_ms, verify_ms = [], [], []
    for route in ROUTES:
        for case, v in res["times_ms"].get(route, {}).items():
            labels.append(f"{route}\n{case}")
            draft_ms.append(statistics.median(x[0] for x in v))
            verify_ms.append(statistics.median(x[1] for x in v))
    ys = range(len(labels))
    ax.barh(ys, draft_ms, label="draft call (prefill + first tree)")
    ax.barh(ys, verify_ms, left=draft_ms, label="verify call (prefill + first verification)")
    ax.set_yticks(list(ys), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("ms (median)")
    ax.set_title(f"A prompt's first round by route: {res['device']}")
    ax.legend(fontsize=7)
    return save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    from specsplit.bench.report import add_pair_arguments, rerender, write_result

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--rerender"]:
        rerender(Path(argv[1]), _table, write_plot)
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_pair_arguments(ap, prompts_per_category=4)
    ap.add_argument("--profile", action="store_true", help="add a profiler table per route")
    ap.add_argument("--routes", default=",".join(ROUTES), help=f"comma-separated, of: {', '.join(ROUTES)}")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--tag", default="")
    args = ap.parse_args(argv)
    import torch

    result = run(args)
    result.update(
        command="python benchmarks/prefill_cost.py " + " ".join(argv),
        tag=args.tag,
        device=torch.cuda.get_device_name(args.device)
        if args.device.startswith("cuda")
        else platform.processor() or "cpu",
        torch=torch.__version__,
    )
    name = "prefill_cost" + (f"-{args.tag}" if args.tag else "")
    print(write_result(result, args.out, name, _table, write_plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
