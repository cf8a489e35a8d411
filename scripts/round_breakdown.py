"""Where a round's time goes on a GPU: host time per phase (plain timers, no profiler) and the
profiled per-round GPU timeline (:mod:`specsplit.bench.profiling`), for target-only decoding, a dynamic
tree with the one-graph verify round, and the same with eager acceptance. Keeps each Chrome trace
(gzipped) for a closer look (kernel names, launch gaps).

    python scripts/round_breakdown.py cuda:0 /tmp/out [--fuse] [--no-compile]

Environment: T / D (target / draft, default: the offline pair), NEW (new tokens, default 128).
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specsplit import SpecSplitConfig, SpecSplitGenerator, TreeConfig
from specsplit.bench.decoders import load_models
from specsplit.bench.profiling import format_summary, host_times, round_timeline
from specsplit.bench.run import DEFAULT_PROMPTS, load_prompts, tokenize_prompts
from specsplit.config import DraftConfig, EngineTuning, TargetConfig


def main() -> None:
    dev, out = sys.argv[1], sys.argv[2]
    fuse, compile_ = "--fuse" in sys.argv, "--no-compile" not in sys.argv
    os.makedirs(out, exist_ok=True)
    m = load_models(False, dev, None, os.environ.get("T"), os.environ.get("D"), "auto")
    prompts = load_prompts(DEFAULT_PROMPTS, 1)
    tokenize_prompts(prompts, m.tokenizer)
    new = int(os.environ.get("NEW", "128"))
    tag = "fused" if fuse else "plain"
    res = {}
    for name, draft, rounds_on in (
        ("target", None, True),
        ("dynamic", m.draft, True),
        ("dynamic-eager-accept", m.draft, False),
    ):
        cfg = SpecSplitConfig(
            tree=TreeConfig(shape="dynamic", topk=4, width=4, budget=24, max_depth=5),
            draft=DraftConfig(cuda_graphs=True, compile=compile_, fuse_projections=fuse),
            target=TargetConfig(
                cuda_graphs=True,
                compile=compile_,
                fuse_projections=fuse,
                tuning=EngineTuning(graph_rounds=rounds_on),
            ),
        )
        gen = SpecSplitGenerator(m.target, draft, tokenizer=m.tokenizer, config=cfg)
        kw = dict(max_new_tokens=new, eos_token_id=[], return_dict_in_generate=True)
        t0 = time.perf_counter()
        for p in prompts:  # warm-up: captures and compiles stay out of the timed calls
            gen.generate(torch.tensor([p.input_ids]), **kw)
        warm = time.perf_counter() - t0
        _sync()
        rounds = tokens = 0
        t0 = time.perf_counter()
        with host_times(gen) as acc:
            for p in prompts:
                o = gen.generate(torch.tensor([p.input_ids]), **kw)
                rounds += len(o.spec_stats.rounds)
                tokens += o.sequences.shape[1] - len(p.input_ids)
            _sync()
        dt = time.perf_counter() - t0
        r = {
            "warmup_s": warm,
            "tokens_per_s": tokens / dt,
            "ms_per_round": 1e3 * dt / rounds,
            "tau": tokens / rounds,
            "host_ms_per_round": {k: 1e3 * s / rounds for k, (s, n) in acc.items()},
            "calls_per_round": {k: n / rounds for k, (s, n) in acc.items()},
        }
        print(f"== {tag} {name}: {r['tokens_per_s']:.1f} tok/s, {r['ms_per_round']:.2f} ms/round, "
              f"tau {r['tau']:.2f} (warm-up {warm:.0f} s)", flush=True)  # fmt: skip
        for k, v in sorted(r["host_ms_per_round"].items(), key=lambda kv: -kv[1]):
            print(f"   host {k:20s} {v:7.3f} ms/round  {r['calls_per_round'][k]:5.2f} calls", flush=True)
        trace = os.path.join(out, f"trace-{tag}-{name}.json")
        ids = torch.tensor([prompts[1].input_ids])
        s = round_timeline(gen, ids, trace_path=trace, max_new_tokens=new, eos_token_id=[])
        print(format_summary(s), flush=True)
        with open(trace, "rb") as f, gzip.open(trace + ".gz", "wb") as g:
            shutil.copyfileobj(f, g)
        os.remove(trace)
        r["timeline"] = s["mean"]
        res[name] = r
        gen.close()
        with open(os.path.join(out, f"round_breakdown-{tag}.json"), "w") as f:
            json.dump(res, f, indent=1)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
