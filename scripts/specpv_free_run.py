#!/usr/bin/env python
"""SpecPV diagnosis: a free-running greedy decode (real draft, real TargetEngine) whose rounds are logged.

Reproduces a ``long_context.py`` partial run over the first ``--new-tokens`` tokens with the prompt's
prefilled target cache reused from ``specpv_teacher_forced.py`` (``/tmp/specpv_tf_ref_*.kv.pt``) and
logs every round (pending tokens, tree tokens and parents, accepted nodes, full/partial mode). The log
can be replayed deterministically, with the diagnosis at the first divergence, by
``specpv_teacher_forced.py --replay LOG``.

    python scripts/specpv_free_run.py --context 8192 --budget 2048 --retrieval-refresh 1 --log /tmp/rr1.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from long_context import PREFILL_CHUNK, TREES, build_prompt, decode_from  # noqa: E402

from specsplit.config import (  # noqa: E402
    DraftConfig,
    SpecPVConfig,  # noqa: E402
    TargetConfig,
)
from specsplit.engines.draft import DraftEngine  # noqa: E402
from specsplit.engines.specpv import PartialVerifier  # noqa: E402
from specsplit.engines.target import TargetEngine  # noqa: E402
from specsplit.messages import DraftRequest  # noqa: E402
from specsplit.models import load_model, load_tokenizer  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--threshold", type=int, default=2048)
    ap.add_argument("--refresh", type=int, default=32)
    ap.add_argument("--window-blocks", type=int, default=8)
    ap.add_argument("--reduce", default="mean", choices=["mean", "max"])
    ap.add_argument(
        "--query-window", default="0", help="comma-separated SpecPV retrieval_query_window values"
    )
    ap.add_argument("--retrieval-refresh", default="1", help="comma-separated: one run per value")
    ap.add_argument("--tree", default="chain4")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--log", default="/tmp/specpv_free_run.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tok = load_tokenizer(args.target)
    target_model = load_model(args.target, dtype=torch.float32, device="cpu")
    draft_model = load_model(args.draft, dtype=torch.float32, device="cpu")
    prompt, _ = build_prompt(tok, "code", args.context)
    kv = torch.load(f"/tmp/specpv_tf_ref_{args.target}_{args.context}.kv.pt")
    assert kv["prompt"] == prompt, "prefilled cache is for another prompt; run specpv_teacher_forced.py first"
    ref = torch.load(f"/tmp/specpv_tf_ref_{args.target}_{args.context}.pt")["ref"]
    first = int(kv["last"].argmax())
    assert first == ref[0]
    tree = TREES[args.tree]
    cap = args.context + args.new_tokens + tree.max_nodes + 64
    max_ctx = args.context + args.new_tokens + 512
    draft = DraftEngine(draft_model, DraftConfig(max_context=max_ctx, session_ttl_s=86400.0))
    t = time.perf_counter()
    dprefix = 0
    for s in range(0, len(prompt), PREFILL_CHUNK):
        d = draft.generate(
            DraftRequest(
                "draft", prompt[s : s + PREFILL_CHUNK], dprefix, tree, max_depth=1, capacity_hint=cap
            )
        )
        dprefix = d.prefix_length
    print(f"draft prefilled in {time.perf_counter() - t:.0f}s", flush=True)

    rounds: list[dict[str, Any]] = []
    orig_forward, orig_commit = PartialVerifier.forward, PartialVerifier.commit

    def forward(self: PartialVerifier, state: Any, pending: list[int], tr: Any) -> Any:
        step = orig_forward(self, state, pending, tr)
        rounds.append(
            {
                "pending": list(pending),
                "tree": tr.token_ids.tolist(),
                "parents": tr.parents.tolist(),
                "partial": step.partial,
                "reason": step.reason,
            }
        )
        return step

    def commit(self: PartialVerifier, state: Any, step: Any, nodes: list[int], tokens: list[int]) -> int:
        rounds[-1]["nodes"] = list(nodes)
        return orig_commit(self, state, step, nodes, tokens)

    PartialVerifier.forward, PartialVerifier.commit = forward, commit  # type: ignore[method-assign]
    out: dict[str, Any] = {"prompt_len": len(prompt), "runs": []}
    runs = [(int(r), int(w)) for r in args.retrieval_refresh.split(",") for w in args.query_window.split(",")]
    for rr, qw in runs:
        base = SpecPVConfig(n_window_blocks=args.window_blocks)
        n_ret = max(
            0, (args.budget - (base.budget - base.n_retrieval_blocks * base.block_size)) // base.block_size
        )
        cfg = SpecPVConfig(
            enabled=True,
            n_retrieval_blocks=n_ret,
            n_window_blocks=args.window_blocks,
            partial_threshold=args.threshold,
            full_refresh_interval=args.refresh,
            retrieval_reduce=args.reduce,
            retrieval_query_window=qw,
            retrieval_refresh_interval=rr,
        )
        engine = TargetEngine(
            target_model,
            TargetConfig(
                device="cpu", dtype="float32", max_context=max_ctx, session_ttl_s=86400.0, specpv=cfg
            ),
        )
        state, _ = engine.get_or_create_session("pv", cap)
        for i, (k, v) in enumerate(kv["kv"]):
            state.cache.append(i, k, v)
        rounds.clear()
        t = time.perf_counter()
        toks, _, modes, acc, _ = decode_from(engine, draft, "pv", prompt, first, args.new_tokens, tree, cap)
        n = min(len(toks), len(ref))
        split = next((i for i in range(n) if toks[i] != ref[i]), n)
        res = {
            "retrieval_refresh": rr,
            "query_window": qw,
            "config": {k: getattr(cfg, k) for k in cfg.__dataclass_fields__},
            "common_prefix": split,
            "tokens": toks,
            "accepted": acc,
            "modes": modes,
            "rounds": list(rounds),
            "wall_s": round(time.perf_counter() - t, 1),
        }
        if split < n:
            res["split"] = {"full": tok.decode([ref[split]]), "partial": tok.decode([toks[split]])}
        print(
            json.dumps({k: v for k, v in res.items() if k not in ("tokens", "rounds", "config", "modes")}),
            flush=True,
        )
        out["runs"].append(res)
        engine.shutdown()
    Path(args.log).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
