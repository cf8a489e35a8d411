"""Count the host-side glue of a decoding round: aten ops dispatched OUTSIDE the model forwards.

At batch 1 on a GPU every such op is a kernel launch (or a small host op) of ~5-20 us of host time
that the CUDA-graph replays do not cover; a few hundred of them per round are milliseconds on the
critical path. This runs the static (CUDA-graph) path eagerly on CPU with tiny random models and
counts, per round, the ops issued by the draft engine, the target engine and the rest (pipeline,
transport), excluding everything inside a model forward and inside a whole-round graph
(:class:`~specsplit.runtime.graphs.GraphedRound`: a dynamic tree's growth, one replay on a GPU). The counts
are the same on a GPU, since shapes and control flow do not depend on the device.

    python scripts/round_ops.py                 # chain, static, dynamic; table on stdout
    python scripts/round_ops.py --json out.json --top 15
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from conftest import noisy_copy, tiny_llama  # noqa: E402

from specsplit import DraftConfig, SpecSplitConfig, SpecSplitGenerator, TargetConfig, TreeConfig  # noqa: E402
from specsplit.config import EngineTuning  # noqa: E402
from specsplit.runtime import graphs as graphs_mod  # noqa: E402
from specsplit.runtime.runner import ModelRunner  # noqa: E402

TREES = {
    "chain": TreeConfig(shape="chain", num_draft_tokens=4),
    "static": TreeConfig(shape="static"),
    "dynamic": TreeConfig(shape="dynamic"),
}


class OpCounter(TorchDispatchMode):
    """Counts aten ops by the component active when they run (model forwards and what a GPU run
    captures in a graph are not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.where = "other"
        self.in_model = 0
        self.counts: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not self.in_model:
            self.counts[self.where][str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def _wrap(counter: OpCounter, obj: Any, name: str, *, where: str | None = None, model: bool = False) -> None:
    orig = getattr(obj, name)

    def wrapped(*a: Any, **k: Any) -> Any:
        prev = counter.where
        if where is not None:
            counter.where = where
        counter.in_model += model
        try:
            return orig(*a, **k)
        finally:
            counter.in_model -= model
            counter.where = prev

    setattr(obj, name, wrapped)


_PLAIN_INIT = graphs_mod.GraphedRound.__init__


def _captured_rounds(counter: OpCounter) -> None:
    """Count nothing inside a :class:`GraphedRound`'s body: on a GPU it replays from one graph (a
    dynamic tree's whole growth); only the copies of its inputs are launched one by one."""

    def init(self: Any, static: Any, fn: Any, inputs: Any) -> None:
        def captured(*a: Any) -> Any:
            counter.in_model += 1
            try:
                return fn(*a)
            finally:
                counter.in_model -= 1

        _PLAIN_INIT(self, static, captured, inputs)

    graphs_mod.GraphedRound.__init__ = init  # type: ignore[method-assign]


def count(shape: str, new_tokens: int, seed: int, noise: float, target_rounds: bool = True) -> dict[str, Any]:
    target = tiny_llama(seed)
    draft = noisy_copy(target, noise, seed + 1)
    cfg = SpecSplitConfig(
        draft=DraftConfig(cuda_graphs=True, tuning=EngineTuning(graph_capacity=512)),
        target=TargetConfig(
            cuda_graphs=True, tuning=EngineTuning(graph_capacity=512, graph_rounds=target_rounds)
        ),
        tree=TREES[shape],
    )
    counter = OpCounter()
    _captured_rounds(counter)  # before the warm-up, which builds the round graphs
    gen = SpecSplitGenerator(target, draft, config=cfg)
    prompt = torch.randint(3, 200, (1, 24), generator=torch.Generator().manual_seed(seed))
    gen.generate(prompt, max_new_tokens=16, do_sample=False)  # warm-up: sessions, plans, workspaces

    _wrap(counter, gen.draft_engine, "generate", where="draft")
    _wrap(counter, gen.target_engine, "verify", where="target")
    _wrap(counter, graphs_mod.StaticForward, "_forward", model=True)  # static-path forwards
    _wrap(counter, ModelRunner, "forward", model=True)  # eager forwards of both engines
    with counter:
        out = gen.generate(prompt, max_new_tokens=new_tokens, do_sample=False, return_dict_in_generate=True)
    rounds = out.spec_stats.rounds
    n_rounds = len(rounds) if isinstance(rounds, list) else int(rounds)
    per_round = {k: sum(c.values()) / n_rounds for k, c in counter.counts.items()}
    top = collections.Counter()
    for c in counter.counts.values():
        top.update(c)
    gen.close()
    return {
        "shape": shape,
        "rounds": n_rounds,
        "tau": new_tokens / n_rounds,
        "per_round": per_round,
        "total_per_round": sum(per_round.values()),
        "by_component": {k: dict(c.most_common()) for k, c in counter.counts.items()},
        "top": top.most_common(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="chain,static,dynamic")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--noise", type=float, default=0.003, help="draft = target + this Gaussian weight noise")
    ap.add_argument(
        "--no-target-rounds",
        action="store_true",
        help="TargetConfig.graph_rounds off: the target's acceptance and KV commit run eagerly",
    )
    ap.add_argument("--json", default=None, help="write the counts here")
    ap.add_argument("--md", default=None, help="write the table here (markdown)")
    args = ap.parse_args()
    rounds = not args.no_target_rounds
    results = [count(s, args.new_tokens, args.seed, args.noise, rounds) for s in args.shapes.split(",")]
    lines = [
        "| tree | rounds | tokens/round | draft ops/round | target ops/round | other ops/round | total |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        pr = r["per_round"]
        lines.append(
            f"| {r['shape']} | {r['rounds']} | {r['tau']:.2f} | {pr.get('draft', 0):.0f} | {pr.get('target', 0):.0f} | "
            f"{pr.get('other', 0):.0f} | {r['total_per_round']:.0f} |"
        )
    lines.append("")
    for r in results:
        n = r["rounds"]
        top = ", ".join(f"{k} {v / n:.1f}" for k, v in r["top"][: args.top])
        lines.append(f"- {r['shape']}: most frequent ops per round: {top}")
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    if args.md:
        cmd = "python scripts/round_ops.py " + " ".join(sys.argv[1:])
        head = [
            "# Host-side ops per decoding round (static path, outside model forwards and whole-round graphs)",
            "",
            f"- command: `{cmd}`",
            f"- torch {torch.__version__}; tiny random Llama pair (draft = target + noise), greedy, "
            f"{args.new_tokens} new tokens, draft noise {args.noise}; ops counted with a TorchDispatchMode, views included",
            "- on a GPU most of these are kernel launches outside the CUDA graphs (~5-10 us of host time "
            "each); on CPU the target also validates host-side trees, which a GPU run skips",
            "- target: "
            + (
                "acceptance and KV commit inside the verify round (`TargetConfig.graph_rounds`)"
                if rounds
                else "acceptance and KV commit eager (`graph_rounds` off)"
            ),
            "",
        ]
        Path(args.md).write_text("\n".join(head + lines) + "\n")


if __name__ == "__main__":
    main()
