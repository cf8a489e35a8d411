"""What HF logits processors cost per round: the same prompts with and without the model's
repetition penalty, target-only, with n-gram trees and with a draft model's dynamic trees (the
draft applying the processors to its own distribution or drafting from raw logits), in one process
on one device.

Each configuration generates every prompt once untimed (graph capture), then once timed. For the
configurations with processors a second timed pass synchronises the device around the processor
pass of every round (:class:`~specsplit.engines.processing.TreeProcessors`) to measure it alone;
its share of the round is that time over the round time of the un-instrumented pass.

    python benchmarks/processors_cost.py --target qwen2.5-coder-1.5b --device cuda:0 --out benchmarks/results
    python benchmarks/processors_cost.py --smoke      # tiny random model on the CPU (checks the script)
    python benchmarks/processors_cost.py --micro --device cuda:0   # the scoring step alone, by tree size

``--micro`` times, with CUDA events over many repetitions, what turns a verified tree's logits into
the distribution verification uses: SpecSplit's own sampling transform (temperature, top-k, top-p;
the fast one verification runs, and the full-vocabulary sort it replaces) against the HF processor pass with the repetition penalty (processors, warpers, softmax), for trees
of several sizes over a Qwen2.5-sized vocabulary (the weights do not matter: a one-layer model of
that vocabulary supplies the processor list).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's specsplit

# The model's published sampling defaults (Qwen2.5-Coder-Instruct) with and without its penalty.
SAMPLING = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20}
GREEDY = {"do_sample": False}
# name -> (drafter, options, the draft model applies the processors too)
CONFIGS: dict[str, tuple[str, dict[str, Any], bool]] = {
    "target-only, sampling": ("none", {**SAMPLING, "repetition_penalty": 1.0}, True),
    "target-only, sampling + rp 1.1": ("none", {**SAMPLING, "repetition_penalty": 1.1}, True),
    "ngram, sampling": ("ngram", {**SAMPLING, "repetition_penalty": 1.0}, True),
    "ngram, sampling + rp 1.1": ("ngram", {**SAMPLING, "repetition_penalty": 1.1}, True),
    "ngram, greedy": ("ngram", {**GREEDY, "repetition_penalty": 1.0}, True),
    "ngram, greedy + rp 1.1": ("ngram", {**GREEDY, "repetition_penalty": 1.1}, True),
    # With a draft model (dynamic trees): the draft applying the processors to its own q or not.
    "model, sampling": ("model", {**SAMPLING, "repetition_penalty": 1.0}, True),
    "model, sampling + rp 1.1": ("model", {**SAMPLING, "repetition_penalty": 1.1}, True),
    "model, sampling + rp 1.1, raw draft": ("model", {**SAMPLING, "repetition_penalty": 1.1}, False),
    "model, greedy": ("model", {**GREEDY, "repetition_penalty": 1.0}, True),
    "model, greedy + rp 1.1": ("model", {**GREEDY, "repetition_penalty": 1.1}, True),
    "model, greedy + rp 1.1, raw draft": ("model", {**GREEDY, "repetition_penalty": 1.1}, False),
}


class _ProcessorTimer:
    """Times every TreeProcessors.scores call with a device sync on either side (instrumented pass)."""

    def __init__(self, device: torch.device):
        from specsplit.engines import processing

        self.mod, self.orig, self.device = processing.TreeProcessors, processing.TreeProcessors.scores, device
        self.times: list[float] = []

    def __enter__(self) -> _ProcessorTimer:
        timer = self

        def timed(proc: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
            _sync(timer.device)
            t = time.perf_counter()
            out = timer.orig(proc, *args, **kwargs)
            _sync(timer.device)
            timer.times.append(time.perf_counter() - t)
            return out

        self.mod.scores = timed  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        self.mod.scores = self.orig  # type: ignore[method-assign]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _generator(target: Any, draft: Any, drafter: str, device: str, cuda_graphs: bool, on_draft: bool) -> Any:
    from specsplit import SpecSplitConfig, SpecSplitGenerator
    from specsplit.config import DraftConfig, PipelineTuning, TargetConfig, TreeConfig

    cfg = SpecSplitConfig(drafter="ngram" if drafter == "ngram" else "model",
                          tree=TreeConfig(shape="dynamic"),
                          draft=DraftConfig(device=device, cuda_graphs=cuda_graphs),
                          target=TargetConfig(device=device, cuda_graphs=cuda_graphs),
                          tuning=PipelineTuning(draft_processors=on_draft))  # fmt: skip
    return SpecSplitGenerator(target, draft if drafter == "model" else None, config=cfg)


def _run_all(gen: Any, prompts: list[list[int]], kw: dict[str, Any], seed: int) -> dict[str, float]:
    tokens = rounds = 0
    round_s = 0.0
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        out = gen.generate(torch.tensor([p]), generator=torch.Generator().manual_seed(seed + i),
                           return_dict_in_generate=True, **kw)  # fmt: skip
        st = out.spec_stats
        tokens += st.new_tokens
        rounds += len(st.rounds)
        round_s += sum(r.draft_s + r.verify_s + r.host_s for r in st.rounds)
    wall = time.perf_counter() - t0
    return {"tokens": tokens, "rounds": rounds, "wall_s": wall, "tok_per_s": tokens / wall,
            "round_ms": 1e3 * round_s / max(rounds, 1), "tokens_per_round": tokens / max(rounds, 1)}  # fmt: skip


def _load(args: argparse.Namespace) -> tuple[Any, Any, list[list[int]], str, int, bool]:
    """``(target, draft or None, prompts, device, max_new_tokens, cuda_graphs)``."""
    from specsplit.bench.run import load_prompts, tokenize_prompts

    if args.smoke:
        sys.path.insert(0, str(ROOT / "tests"))
        from conftest import sharpen, tiny_llama

        target, draft = sharpen(tiny_llama(0)), sharpen(tiny_llama(1))
        prompts = [[5, 17, 33, 81, 9, 100] * 3, [7, 7, 12, 40, 41, 42] * 3]
        device, max_new, graphs = "cpu", 32, False
        args.target, args.draft = "tiny random Llama", "tiny random Llama"
    else:
        from specsplit.models import load_model, load_tokenizer

        target = load_model(args.target, dtype=args.dtype, device=args.device)
        draft = load_model(args.draft, dtype=args.dtype, device=args.device) if args.draft else None
        bench = load_prompts(ROOT / "benchmarks" / "prompts", args.prompts_per_category)
        tokenize_prompts(bench, load_tokenizer(args.target))
        prompts = [p.input_ids for p in bench]
        device, max_new, graphs = args.device, args.max_new_tokens, True
    return target, draft, prompts, device, max_new, graphs


def run(args: argparse.Namespace) -> dict[str, Any]:
    target, draft, prompts, device, max_new, graphs = _load(args)
    dev = torch.device(device)
    rows: dict[str, Any] = {}
    for name, (drafter, opts, on_draft) in CONFIGS.items():
        if drafter == "model" and draft is None:
            continue
        kw = {"max_new_tokens": max_new, **opts}
        with _generator(target, draft, drafter, device, graphs, on_draft) as gen:
            _run_all(gen, prompts, kw, args.seed)  # untimed: captures, compiles, warms caches
            row = _run_all(gen, prompts, kw, args.seed)
            if opts["repetition_penalty"] != 1.0:
                with _ProcessorTimer(dev) as timer:
                    inst = _run_all(gen, prompts, kw, args.seed)
                # Per round, not per call: a one-graph greedy round applies them inside its graph
                # (not timed here), so only its eager rounds (a prompt's first) add calls.
                row["processor_calls"] = len(timer.times)
                row["processor_ms_per_call"] = 1e3 * statistics.fmean(timer.times) if timer.times else 0.0
                row["processor_ms_per_round"] = 1e3 * sum(timer.times) / max(inst["rounds"], 1)
                row["processor_share_of_round"] = row["processor_ms_per_round"] / row["round_ms"]
                row["instrumented_round_ms"] = inst["round_ms"]
        rows[name] = row
        print(f"{name:34s} {row['tok_per_s']:8.1f} tok/s  {row['round_ms']:7.2f} ms/round  "
              f"{row['tokens_per_round']:5.2f} tok/round"
              + (f"  processors {row['processor_ms_per_round']:.3f} ms ({100 * row['processor_share_of_round']:.1f}%)"
                 if "processor_ms_per_round" in row else ""), flush=True)  # fmt: skip
    return {"configs": rows, "prompts": len(prompts), "max_new_tokens": max_new, "target": args.target,
            "draft": args.draft, "cuda_graphs": graphs}  # fmt: skip


class _FullSortTransform:
    """Within the block, verification and drafting use the full-vocabulary sampling transform
    (:func:`~specsplit.core.sampling.logits_to_probs`) instead of the fast top-k + top-p one."""

    def __enter__(self) -> _FullSortTransform:
        from specsplit.core import growth
        from specsplit.core.sampling import logits_to_probs
        from specsplit.engines import verifiers

        self.mods = (growth, verifiers)
        self.orig = [m.fast_probs for m in self.mods]
        for m in self.mods:
            m.fast_probs = lambda logits, params: (logits_to_probs(logits, params), None)  # type: ignore[attr-defined]
        return self

    def __exit__(self, *exc: object) -> None:
        for m, f in zip(self.mods, self.orig, strict=True):
            m.fast_probs = f  # type: ignore[attr-defined]


def transform_ab(args: argparse.Namespace) -> dict[str, Any]:
    """The model's sampling defaults (no penalty: SpecSplit's own transform decides) with the fast
    top-k + top-p transform and with the full-vocabulary sort, side by side per configuration."""
    target, draft, prompts, device, max_new, graphs = _load(args)
    rows: dict[str, Any] = {}
    for drafter in ("none", "ngram", "model"):
        if drafter == "model" and draft is None:
            continue
        kw = {"max_new_tokens": max_new, **SAMPLING, "repetition_penalty": 1.0}
        with _generator(target, draft, drafter, device, graphs, True) as gen:
            _run_all(gen, prompts, kw, args.seed)  # untimed: captures, compiles, warms caches
            for transform in ("fast", "full sort"):
                with _FullSortTransform() if transform == "full sort" else contextlib.nullcontext():
                    row = _run_all(gen, prompts, kw, args.seed)
                name = f"{'target-only' if drafter == 'none' else drafter}, sampling, {transform}"
                rows[name] = row
                print(f"{name:34s} {row['tok_per_s']:8.1f} tok/s  {row['round_ms']:7.2f} ms/round  "
                      f"{row['tokens_per_round']:5.2f} tok/round", flush=True)  # fmt: skip
    return {"configs": rows, "prompts": len(prompts), "max_new_tokens": max_new, "target": args.target,
            "draft": args.draft, "cuda_graphs": graphs}  # fmt: skip


def _ab_table(res: dict[str, Any]) -> str:
    lines = [
        f"# The sampling transform, fast against full-vocabulary sort: {res['device']}, {res['target']}",
        "",
        f"`{res['command']}` ({res['date']}; torch {res['torch']}; {res['prompts']} prompts x "
        f"{res['max_new_tokens']} new tokens, CUDA graphs {'on' if res['cuda_graphs'] else 'off'}; "
        "sampling T 0.7, top-p 0.8, top-k 20)",
        "",
        "| configuration | tok/s | ms / round | tokens / round | tok/s vs full sort |",
        "|---|---:|---:|---:|---:|",
    ]
    cfgs = res["configs"]
    for name, r in cfgs.items():
        base = cfgs.get(name.replace(", fast", ", full sort"))
        ratio = f"{r['tok_per_s'] / base['tok_per_s']:.3f}x" if base is not None and base is not r else "-"
        lines.append(f"| {name} | {r['tok_per_s']:.1f} | {r['round_ms']:.2f} | {r['tokens_per_round']:.2f} | "
                     f"{ratio} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def micro(args: argparse.Namespace) -> dict[str, Any]:
    """The scoring step alone: SpecSplit's transform vs the HF processor pass, per tree size."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from specsplit.core.sampling import SamplingParams, fast_probs, logits_to_probs
    from specsplit.core.tree import TokenTree
    from specsplit.engines.processing import TreeProcessors
    from specsplit.messages import LogitsProcessing

    dev = torch.device(args.device)
    vocab = 151_936
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    model = Qwen2ForCausalLM(cfg).eval()
    sampling = SamplingParams(do_sample=True, temperature=0.7, top_k=20, top_p=0.8)
    options = {**SAMPLING, "repetition_penalty": 1.1, "max_length": 4096}
    g = torch.Generator().manual_seed(0)
    rows = []
    for nodes, context in [(0, 512), (8, 512), (16, 512), (32, 512), (16, 2048)]:
        depth = min(nodes, 6)
        parents = [-1 if i < max(nodes - depth + 1, 1) else i - 1 for i in range(nodes)]
        depths = [1] * nodes
        for i, p in enumerate(parents):
            depths[i] = 1 if p < 0 else depths[p] + 1
        tree = TokenTree(torch.randint(0, vocab, (nodes,), generator=g), torch.tensor(parents, dtype=torch.long),
                         torch.tensor(depths, dtype=torch.long), torch.zeros(nodes)).to(dev)  # fmt: skip
        proc = TreeProcessors(model, LogitsProcessing(options, context), dev)
        length = proc.begin(0, torch.randint(0, vocab, (context,), generator=g).tolist())
        logits = (torch.randn(nodes + 1, vocab, generator=g) * 3).to(dev, torch.bfloat16)

        ours = functools.partial(fast_probs, logits, sampling)
        exact = functools.partial(logits_to_probs, logits, sampling)
        theirs = functools.partial(_processed_probs, proc, logits, tree, depths, length)
        rows.append({"nodes": nodes, "context": context, "specsplit_ms": _time_ms(ours, dev),
                     "specsplit_full_sort_ms": _time_ms(exact, dev),
                     "hf_processors_ms": _time_ms(theirs, dev)})  # fmt: skip
        r = rows[-1]
        print(f"{nodes:3d} nodes, context {context:5d}: ours {r['specsplit_ms']:.3f} ms "
              f"(full-vocabulary sort {r['specsplit_full_sort_ms']:.3f}), "
              f"HF processors {r['hf_processors_ms']:.3f} ms", flush=True)  # fmt: skip
    return {"micro": rows, "vocab": vocab, "options": options}


def _processed_probs(
    proc: Any, logits: torch.Tensor, tree: Any, depths: list[int], length: int
) -> torch.Tensor:
    return torch.softmax(proc.scores(logits, tree, depths, length), -1)


def _time_ms(fn: Any, dev: torch.device, reps: int = 200) -> float:
    for _ in range(10):
        fn()
    if dev.type != "cuda":
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        return 1e3 * (time.perf_counter() - t) / reps
    torch.cuda.synchronize(dev)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize(dev)
    return start.elapsed_time(end) / reps


def _micro_table(res: dict[str, Any]) -> str:
    lines = [
        f"# The scoring step alone: {res['device']}",
        "",
        f"`{res['command']}` ({res['date']}; torch {res['torch']}; vocab {res['vocab']}; "
        f"options {res['options']})",
        "",
        "| tree nodes | context | SpecSplit's transform ms | its full-vocabulary sort ms | HF processor pass ms "
        "| extra ms |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res["micro"]:
        full = f"{r['specsplit_full_sort_ms']:.3f}" if "specsplit_full_sort_ms" in r else "-"
        lines.append(f"| {r['nodes']} | {r['context']} | {r['specsplit_ms']:.3f} | {full} | "
                     f"{r['hf_processors_ms']:.3f} | {r['hf_processors_ms'] - r['specsplit_ms']:+.3f} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def _no_plot(res: dict[str, Any], path: Path) -> bool:
    return False


def _table(res: dict[str, Any]) -> str:
    lines = [
        f"# Logits-processor cost per round: {res['device']}, {res['target']}"
        + (f" (draft {res['draft']})" if res.get("draft") else ""),
        "",
        f"`{res['command']}` ({res['date']}; torch {res['torch']}; {res['prompts']} prompts x "
        f"{res['max_new_tokens']} new tokens, CUDA graphs {'on' if res['cuda_graphs'] else 'off'})",
        "",
        "| configuration | tok/s | ms / round | tokens / round | round time vs no penalty | processors ms / round "
        "(synced) | share of round |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in res["configs"].items():
        pm = f"{r['processor_ms_per_round']:.3f}" if "processor_ms_per_round" in r else "-"
        share = f"{100 * r['processor_share_of_round']:.1f}%" if "processor_share_of_round" in r else "-"
        base = res["configs"].get(name.replace(" + rp 1.1", ""))
        delta = (
            f"{100 * (r['round_ms'] / base['round_ms'] - 1):+.1f}%"
            if base is not None and base is not r
            else "-"
        )
        lines.append(f"| {name} | {r['tok_per_s']:.1f} | {r['round_ms']:.2f} | {r['tokens_per_round']:.2f} | "
                     f"{delta} | {pm} | {share} |")  # fmt: skip
    lines += ["", "Processors ms / round: the processor pass alone, timed with a device sync on either side in a "
              "second pass, summed and divided by that pass's rounds (a greedy round that replays as one graph "
              "applies them inside the graph, untimed here); the round-time column compares the "
              "un-instrumented passes."]  # fmt: skip
    return "\n".join(lines) + "\n"


def write_plot(res: dict[str, Any], path: Path) -> bool:
    from specsplit.bench.report import pyplot, save_figure

    plt = pyplot()
    if plt is None:
        return False
    names = list(res["configs"])
    fig, ax = plt.subplots(figsize=(9, 4.2))
    round_ms = [res["configs"][n]["round_ms"] for n in names]
    proc_ms = [res["configs"][n].get("processor_ms_per_round", 0.0) for n in names]
    ys = range(len(names))
    ax.barh(ys, [r - p for r, p in zip(round_ms, proc_ms, strict=True)], label="rest of the round")
    ax.barh(ys, proc_ms, left=[r - p for r, p in zip(round_ms, proc_ms, strict=True)],
            label="logits processors (measured with syncs)")  # fmt: skip
    ax.set_yticks(list(ys), names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms per round (mean)")
    ax.set_title(f"Logits processors per round: {res['device']}")
    ax.legend(fontsize=7)
    return save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    from datetime import date

    from specsplit.bench.report import rerender, write_result

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--rerender"]:
        print(rerender(Path(argv[1]), _table, write_plot))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument(
        "--draft", default="qwen2.5-coder-0.5b", help="draft model of the 'model' rows ('': none)"
    )
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--prompts-per-category", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="a tiny random model on the CPU")
    ap.add_argument("--micro", action="store_true", help="time the scoring step alone, by tree size")
    ap.add_argument("--transform-ab", action="store_true",
                    help="sampling defaults without a penalty: the fast transform against the full sort")  # fmt: skip
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--tag", default="")
    args = ap.parse_args(argv)
    if args.micro:
        res = micro(args)
        res.update(command="python benchmarks/processors_cost.py " + " ".join(argv), date=str(date.today()),
                   device=torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu",
                   torch=torch.__version__)  # fmt: skip
        print(write_result(res, args.out, "processors_micro" + (f"-{args.tag}" if args.tag else ""),
                           _micro_table, _no_plot))  # fmt: skip
        return 0
    result = transform_ab(args) if args.transform_ab else run(args)
    cuda = not args.smoke and args.device.startswith("cuda")
    result.update(command="python benchmarks/processors_cost.py " + " ".join(argv), date=str(date.today()),
                  device=torch.cuda.get_device_name(args.device) if cuda else platform.processor() or "cpu",
                  torch=torch.__version__)  # fmt: skip
    if args.transform_ab:
        name = "sampling_transform" + (f"-{args.tag}" if args.tag else "")
        print(write_result(result, args.out, name, _ab_table, _no_plot))
        return 0
    name = "processors_cost" + (f"-{args.tag}" if args.tag else "")
    print(write_result(result, args.out, name, _table, write_plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
