#!/usr/bin/env python
"""Where a tree round's extra GPU time goes: kernels of a plain step against a tree round.

A target engine on the CUDA-graph path (the bench's settings: graphs, fused projections, greedy
one-graph rounds) verifies, on one session, an empty tree (a plain step) and padded n-gram-shaped
trees of a few sizes; each kind is timed (wall clock over many synchronised rounds) and then profiled, and the
GPU time of each kernel name a round is listed side by side, largest growth first. The weights are
random with the Qwen2.5-Coder-1.5B shapes (no download or staging; acceptance does not matter for
the kernels a round runs). ``--eager-ops`` runs the same rounds on the static path without
capture and lists the GPU time by operator instead (a replayed graph's kernels carry no operator).
Each size's profile also splits a round's wall time on the device (:func:`timeline`): busy, idle
inside the round (launch gaps, dependencies) and idle between rounds (host work that no device
work overlaps); ``--trace`` keeps each profile's Chrome trace beside the report.

    python benchmarks/round_kernels.py --device cuda:0 [--sizes 4,16,32] [--compile] [--eager-ops] [--tag h200]
    python benchmarks/round_kernels.py --device cpu --strided
    python benchmarks/round_kernels.py --device cuda:0 --sizes 32 --compile --heads 16 --tag h200-heads

``--fold-max-rows N`` sets how many rows a tree forward may have and still fold GQA into its query
rows (:data:`specsplit.runtime.attention.FOLD_MAX_ROWS`), for an A/B of that limit.

``--heads N`` gives the target random token-conditioned draft heads (4 heads, 10 ranks, N guess nodes;
:mod:`specsplit.runtime.heads`): the trees stay the script's own, and each round also runs the heads'
work (the hidden-state copy, the blocks, the output-layer product, the top-k); compare its kernels
with the same run without it. ``--heads-kind eagle`` gives it a random EAGLE head instead
(:mod:`specsplit.runtime.eagle`, the training defaults' shapes): each round then also ingests the
committed positions and grows the head's tree, level by level, inside the round.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

OUT = Path(__file__).resolve().parent / "results"
QWEN_1_5B = dict(  # noqa: C408
    hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
    vocab_size=151936, max_position_embeddings=32768, rope_theta=1e6, tie_word_embeddings=True,
)  # fmt: skip


def _tree(size: int, device: torch.device):
    """A padded n-gram-shaped tree: a chain of ``size // 2`` and a second branch, as the drafters pad."""
    from specsplit.core.tree import TokenTree

    chain = max(size // 2, 1)
    parents = [-1] + list(range(chain - 1)) + [-1] * (size - chain)
    depths = list(range(1, chain + 1)) + [1] * (size - chain)
    tree = TokenTree(
        torch.randint(10, 1000, (size,)),
        torch.tensor(parents),
        torch.tensor(depths),
        torch.zeros(size),
    )
    tree.max_branch, tree.depth_bound = size, size  # the bounds padded n-gram trees carry
    return tree.to(device)


_VIEWS = {"view", "_unsafe_view", "select", "slice", "transpose", "t", "expand", "unsqueeze", "squeeze",
          "split", "split_with_sizes", "chunk", "as_strided", "reshape", "detach", "alias", "permute",
          "unbind", "narrow"}  # fmt: skip


def _random_heads(model: Any) -> str:
    """A directory of 4 random token-conditioned draft heads of ``model``'s shapes (10 ranks each)."""
    import tempfile

    from specsplit.runtime.heads import DraftHeads, HeadsInfo, save_heads

    w = model.get_output_embeddings().weight
    heads = DraftHeads(4, w.shape[1], token_input=True)
    acc = [[0.5 / (r + 1) / (k + 1) for r in range(10)] for k in range(4)]
    info = HeadsInfo(4, w.shape[1], w.shape[0], rank_accuracy=acc, token_input=True)
    return str(save_heads(heads, info, Path(tempfile.mkdtemp(prefix="specsplit-heads-"))))


def _random_eagle(model: Any, subset: int | None = None) -> str:
    """A directory of a random EAGLE head of ``model``'s shapes (the training defaults: a
    32,768-token subset, top-8 children, 8 wide, 5 deep; ``subset`` scored tokens instead)."""
    import tempfile

    from specsplit.runtime.eagle import EagleConfig, EagleLayer, save_eagle
    from specsplit.runtime.heads import HeadsInfo

    w = model.get_output_embeddings().weight
    cfg = EagleConfig.for_target(model, **({"vocab_subset": subset} if subset else {}))
    layer = EagleLayer(cfg).to(w.device, w.dtype)
    vocab = torch.randperm(w.shape[0])[: cfg.vocab_subset].sort().values
    info = HeadsInfo(cfg.depth, w.shape[1], w.shape[0])
    return str(save_eagle(layer, vocab, info, Path(tempfile.mkdtemp(prefix="specsplit-eagle-"))))


def _dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense: its dims in some order are a contiguous tensor (no gaps)."""
    expected = 1
    for stride, size in sorted(zip(t.stride(), t.shape, strict=True)):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


class _Strided(TorchDispatchMode):
    """Counts, per (operator, calling line), the non-view operators that get a tensor with gaps."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[tuple[str, str]] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        tensors = [x for x in args if isinstance(x, torch.Tensor) and x.dim() > 0]
        if name not in _VIEWS and not all(_dense(x) for x in tensors):
            frames = [
                f for f in traceback.extract_stack() if "specsplit" in f.filename or "modeling_" in f.filename
            ]
            where = f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else "?"
            self.calls[(name, where)] += 1
        return func(*args, **(kwargs or {}))


def timeline(events: list[tuple[float, float, str]]) -> dict[str, float]:
    """Where a round's wall time goes on the device, from profiled device activity.

    Rounds are split at their one device-to-host copy (the outcome read: an event whose name holds
    ``DtoH``). Over the complete rounds (the first starts after the first read), returns µs a round:
    ``busy`` (the union of kernels, copies and memsets), ``inside`` (the device idle between a round's
    first activity and the end of its read: launch gaps and dependencies inside the graph) and
    ``between`` (idle from one round's read to the next round's first activity: the host's work, which
    no device work overlaps), plus ``rounds``.

    Args:
        events: ``(start µs, end µs, name)`` of every device activity, in any order.
    """
    evs = sorted(events)
    reads = [i for i, (_, _, name) in enumerate(evs) if "DtoH" in name]
    out = {"busy": 0.0, "inside": 0.0, "between": 0.0, "rounds": 0.0}
    for prev, last in zip(reads, reads[1:], strict=False):
        body = evs[prev + 1 : last + 1]
        busy, cursor = 0.0, body[0][0]
        for start, end, _ in body:  # union of intervals, sorted by start
            if end > cursor:
                busy += end - max(start, cursor)
                cursor = end
        span = body[-1][1] - body[0][0]
        out["busy"] += busy
        out["inside"] += span - busy
        out["between"] += max(0.0, body[0][0] - evs[prev][1])
        out["rounds"] += 1
    n = out["rounds"] or 1.0
    return {k: (v if k == "rounds" else v / n) for k, v in out.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--sizes", default="4,16,32")
    p.add_argument("--context", type=int, default=256, help="tokens cached before the timed rounds")
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--eager-ops", action="store_true", help="no capture; GPU time by operator")
    p.add_argument(
        "--strided", action="store_true", help="no timing; the operators that get operands with gaps"
    )
    p.add_argument("--heads", type=int, default=0, help="random draft heads with N guess nodes (0: none)")
    p.add_argument("--heads-kind", choices=("medusa", "eagle"), default="medusa",
                   help="--heads: Medusa-style heads or an EAGLE head growing its tree in the round")  # fmt: skip
    p.add_argument(
        "--eagle-vocab", type=int, default=0, help="--heads-kind eagle: scored tokens (0: default)"
    )
    p.add_argument("--eagle-topk-chunk", type=int, default=-1,
                   help="--heads-kind eagle: eagle.TOPK_CHUNK (0: one torch.topk; -1: the default)")  # fmt: skip
    p.add_argument("--fold-max-rows", type=int, default=0,
                   help="attention.FOLD_MAX_ROWS for this run (0: the library's): the rows up to which a "
                   "tree forward folds GQA into its query rows")  # fmt: skip
    p.add_argument("--trace", action="store_true", help="also write each size's Chrome trace (.trace.json)")
    p.add_argument("--tag", default="")
    a = p.parse_args(argv)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from specsplit.config import TargetConfig
    from specsplit.core.tree import TokenTree
    from specsplit.engines.target import TargetEngine
    from specsplit.messages import VerifyRequest

    dev = torch.device(a.device)
    torch.manual_seed(0)
    with dev:
        model = Qwen2ForCausalLM(Qwen2Config(**QWEN_1_5B)).to(torch.bfloat16).eval()
    if a.fold_max_rows:
        from specsplit.runtime import attention

        attention.FOLD_MAX_ROWS = a.fold_max_rows
    if a.eagle_topk_chunk >= 0:
        from specsplit.runtime import eagle

        eagle.TOPK_CHUNK = a.eagle_topk_chunk or None
    eagle_dir = _random_eagle(model, a.eagle_vocab or None) if a.heads_kind == "eagle" else None
    heads = None if not a.heads else eagle_dir or _random_heads(model)
    # An EAGLE head follows the static workspace's session: on a CPU that path runs without capture.
    static = dev.type == "cuda" or (bool(a.heads) and a.heads_kind == "eagle")
    cfg = TargetConfig(cuda_graphs=static, compile=a.compile, fuse_projections=True,
                       draft_heads=heads, draft_heads_nodes=a.heads or 16)  # fmt: skip
    eng = TargetEngine(model, cfg)
    if a.eager_ops or a.strided:
        eng._workspace.static.use_graphs = False  # the same static-shape rounds, run op by op
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    sizes = [0] + [int(s) for s in a.sizes.split(",")]
    state = {"prefix": 0, "next": 1}
    prompt = torch.randint(10, 1000, (a.context,)).tolist()

    def round_(tree: TokenTree) -> None:
        pending = prompt if state["prefix"] == 0 else [state["next"]]
        req = VerifyRequest("s", tree, pending, state["prefix"], capacity_hint=a.context + 8 * a.rounds * 40,
                            return_guesses=bool(a.heads))  # fmt: skip
        res = eng.verify(req)
        state["prefix"], state["next"] = res.prefix_length, res.next_token_id

    round_(TokenTree.empty())
    if a.strided:
        for n in (0, max(sizes)):
            tree = TokenTree.empty() if n == 0 else _tree(n, dev)
            round_(tree)  # first rounds of a shape set things up
            with _Strided() as seen:
                round_(tree)
            print(f"{n} nodes: operators with operands that have gaps, calls a round (caller)")
            for (op, where), count in sorted(seen.calls.items(), key=lambda kv: -kv[1]):
                print(f"  {count:4d}  {op}  ({where})")
        return 0
    rows: dict[str, dict[str, float]] = {}
    times: dict[int, float] = {}
    split: dict[str, dict[str, float]] = {}
    stem = "round_kernels" + (f"-{a.tag}" if a.tag else "")
    for n in sizes:
        tree = TokenTree.empty() if n == 0 else _tree(n, dev)
        for _ in range(3):  # capture (and compile) this size's round graph outside the timing
            round_(tree)
        sync()
        t0 = time.perf_counter()
        for _ in range(a.rounds):
            round_(tree)
        sync()
        times[n] = (time.perf_counter() - t0) / a.rounds * 1e3
        if dev.type != "cuda":
            continue
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if a.eager_ops else [ProfilerActivity.CUDA]
        with profile(activities=acts) as prof:
            for _ in range(10):
                round_(tree)
            sync()
        per: dict[str, float] = defaultdict(float)
        if a.eager_ops:  # operators (aten::...) with the GPU time of the kernels they launched
            for e in prof.key_averages():
                if e.key.startswith("aten::") and e.device_time_total > 0:
                    per[e.key] += e.device_time_total / 10
        else:
            for e in prof.events():
                if e.device_type.name == "CUDA":
                    per[e.name[:90]] += e.device_time / 10  # microseconds a round
        rows[str(n)] = dict(per)
        device = [
            (e.time_range.start, e.time_range.end, e.name)
            for e in prof.events()
            if e.device_type.name == "CUDA"
        ]
        split[str(n)] = timeline(device)
        if a.trace:
            OUT.mkdir(exist_ok=True)
            prof.export_chrome_trace(str(OUT / f"{stem}-{n}.trace.json"))
        print(f"{n} nodes: {times[n]:.3f} ms a round; device µs a round {split[str(n)]}", flush=True)
    print({n: round(t, 3) for n, t in times.items()})
    if not rows:
        return 0
    big = str(max(sizes))
    names = sorted(
        set(rows["0"]) | set(rows[big]), key=lambda k: rows[big].get(k, 0) - rows["0"].get(k, 0), reverse=True
    )
    lines = [
        f"# Round kernels: plain step against tree rounds ({torch.cuda.get_device_name(dev)}, random Qwen2.5-1.5B shapes)",
        "",
        f"- command: `python benchmarks/round_kernels.py --device {a.device} --sizes {a.sizes} --context {a.context}"
        + f" --rounds {a.rounds}"
        + (" --compile" if a.compile else "")
        + (" --eager-ops" if a.eager_ops else "")
        + (f" --heads {a.heads}" if a.heads else "")
        + (f" --heads-kind {a.heads_kind}" if a.heads and a.heads_kind != "medusa" else "")
        + (f" --eagle-vocab {a.eagle_vocab}" if a.eagle_vocab else "")
        + (f" --eagle-topk-chunk {a.eagle_topk_chunk}" if a.eagle_topk_chunk >= 0 else "")
        + (f" --fold-max-rows {a.fold_max_rows}" if a.fold_max_rows else "")
        + (f" --tag {a.tag}" if a.tag else "")
        + "`",
        f"- date: {time.strftime('%Y-%m-%d')}; torch {torch.__version__}",
        "- ms a round (wall clock around many rounds, synchronised): "
        + ", ".join(f"{n} nodes {t:.3f}" for n, t in times.items()),
        "",
        "| "
        + ("operator (nested ones counted in each)" if a.eager_ops else "kernel")
        + " | "
        + " | ".join(f"{n} nodes µs" for n in sizes)
        + " |",
        "|---|" + "---:|" * len(sizes),
    ]
    lines += [
        f"| `{k}` | " + " | ".join(f"{rows[str(n)].get(k, 0.0):.1f}" for n in sizes) + " |"
        for k in names[:25]
    ]
    if not a.eager_ops:  # operators nest: their sum means nothing
        lines.append(
            "| **all kernels** | " + " | ".join(f"{sum(rows[str(n)].values()):.1f}" for n in sizes) + " |"
        )
    if split:
        lines += [
            "",
            "Device time a round (µs; rounds split at their one device-to-host read): busy, idle inside a "
            "round (launch gaps and dependencies), idle between rounds (host work nothing overlaps)",
            "",
            "| nodes | ms a round | busy | idle inside | idle between |",
            "|---:|---:|---:|---:|---:|",
        ]
        lines += [
            f"| {n} | {times[int(n)]:.3f} | {t['busy']:.1f} | {t['inside']:.1f} | {t['between']:.1f} |"
            for n, t in split.items()
        ]
    OUT.mkdir(exist_ok=True)
    (OUT / f"{stem}.md").write_text("\n".join(lines) + "\n")
    result = {"ms_a_round": times, "kernels_us": rows, "device_us_a_round": split}
    (OUT / f"{stem}.json").write_text(json.dumps(result, indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
