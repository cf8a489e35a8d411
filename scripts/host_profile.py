"""Where a round's host time goes: the round loop's phases per round and a Python profile of them.

For target-only decoding and n-gram rounds with a lookahead window (the GPU default, and other
splits of a round's nodes), on the bench's prompts, greedy: tokens a second, time a round, tau, the mean
of each phase of a round as the loop times it (its drafting, the verify call, the engine's part of
that call, the commit and record after it), and a ``cProfile`` of the same generations (functions
by their own time), to find the Python work between two verifications.

    python scripts/host_profile.py cuda:0 /tmp/out [--compile] [--cases target,lookahead,8x2x16]

A case ``WxLxN`` is a window of L rows of W guesses beside N n-gram nodes; ``lookahead`` is the
default window. Environment: T (target, default: the offline pair's), NEW (new tokens, default 128),
PER (prompts a category, default 2).
"""

from __future__ import annotations

import cProfile
import io
import json
import os
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specsplit import SpecSplitConfig, SpecSplitGenerator
from specsplit.bench.decoders import load_models
from specsplit.bench.run import DEFAULT_PROMPTS, load_prompts, tokenize_prompts
from specsplit.config import EngineTuning, NgramConfig, PipelineTuning, TargetConfig


def _config(case: str, compile_: bool) -> SpecSplitConfig:
    target = TargetConfig(cuda_graphs=True, compile=compile_, fuse_projections=True,
                          tuning=EngineTuning(graph_capacity=2048))  # fmt: skip
    if case == "target":
        return SpecSplitConfig(drafter="model", target=target)  # no draft model: plain steps
    ngram = NgramConfig()  # lookahead="auto": the default window on a graph-replaying target
    if case != "lookahead":
        width, levels, nodes = (int(x) for x in case.split("x"))
        ngram = NgramConfig(lookahead=width, lookahead_levels=levels, lookahead_nodes=nodes)
    return SpecSplitConfig(drafter="ngram", target=target, tuning=PipelineTuning(ngram=ngram))


def _phases(rounds: list) -> dict[str, dict[str, float]]:
    """Mean milliseconds of each phase of a round, per drafter."""
    out: dict[str, dict[str, float]] = {}
    for name in sorted({r.drafter for r in rounds}):
        rs = [r for r in rounds if r.drafter == name]
        n = len(rs)
        out[name] = {
            "rounds": n,
            "tau": sum(r.accepted + 1 for r in rs) / n,
            "draft_ms": 1e3 * sum(r.draft_s for r in rs) / n,
            "verify_ms": 1e3 * sum(r.verify_s for r in rs) / n,
            "engine_ms": 1e3 * sum(r.verify_model_s for r in rs) / n,
            "after_ms": 1e3 * sum(r.host_s for r in rs) / n,
            "nodes": sum(r.tree_nodes for r in rs) / n,
        }
    return out


def main() -> None:
    dev, out = sys.argv[1], Path(sys.argv[2])
    compile_ = "--compile" in sys.argv
    cases = ["target", "lookahead"]
    if "--cases" in sys.argv:
        cases = sys.argv[sys.argv.index("--cases") + 1].split(",")
    out.mkdir(parents=True, exist_ok=True)
    m = load_models(False, dev, None, os.environ.get("T"), None, "auto", with_draft=False)
    prompts = load_prompts(DEFAULT_PROMPTS, int(os.environ.get("PER", "2")))
    tokenize_prompts(prompts, m.tokenizer)
    # greedy, as the bench decodes (the Qwen models' own defaults sample with a repetition penalty)
    kw = dict(max_new_tokens=int(os.environ.get("NEW", "128")), eos_token_id=[], do_sample=False,
              repetition_penalty=1.0, return_dict_in_generate=True)  # fmt: skip
    res = {}
    for case in cases:
        gen = SpecSplitGenerator(m.target, None, tokenizer=m.tokenizer, config=_config(case, compile_))
        t0 = time.perf_counter()
        for p in prompts:  # warm-up: captures (and compiles) stay out of the timed calls
            gen.generate(torch.tensor([p.input_ids]), **kw)
        warm = time.perf_counter() - t0
        rounds, tokens = [], 0
        if torch.cuda.is_available():
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        for p in prompts:
            o = gen.generate(torch.tensor([p.input_ids]), **kw)
            rounds += o.spec_stats.rounds
            tokens += o.sequences.shape[1] - len(p.input_ids)
        dt = time.perf_counter() - t0
        prof = cProfile.Profile()
        prof.enable()
        for p in prompts:
            gen.generate(torch.tensor([p.input_ids]), **kw)
        prof.disable()
        text = io.StringIO()
        stats = pstats.Stats(prof, stream=text)
        text.write(f"== {case}: {len(rounds)} rounds a pass; ms per round = cumtime / rounds * 1000\n")
        stats.sort_stats("tottime").print_stats(45)
        stats.sort_stats("cumtime").print_stats(45)
        (out / f"host_profile-{case}.txt").write_text(text.getvalue())
        r = {
            "warmup_s": warm,
            "tokens_per_s": tokens / dt,
            "ms_per_round": 1e3 * dt / len(rounds),
            "tau": tokens / len(rounds),
            "phases": _phases(rounds),
        }
        res[case] = r
        print(f"== {case}: {r['tokens_per_s']:.1f} tok/s, {r['ms_per_round']:.3f} ms/round, "
              f"tau {r['tau']:.2f} (warm-up {warm:.0f} s)", flush=True)  # fmt: skip
        for name, ph in r["phases"].items():
            print(f"   {name:10s} " + ", ".join(f"{k} {v:.3f}" for k, v in ph.items()), flush=True)
        gen.close()
        (out / "host_profile.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
