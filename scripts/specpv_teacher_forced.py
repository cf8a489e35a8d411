#!/usr/bin/env python
"""SpecPV diagnosis: teacher-forced partial vs full verification on a real long-context prompt.

The greedy full-verification continuation of a long prompt (the ``long_context.py`` recall task) is
computed once. Then the SAME chain trees (the next ``depth`` reference tokens) are verified round
after round by

- a full-cache engine (exact logits for exactly the same forwards), and
- a :class:`~specsplit.specpv.PartialVerifier` (seed / partial / refresh, the real policy),

both committing the whole reference chain every round (teacher forcing), so per-row top-1 agreement
and KL(full || partial) are measured position by position without the sequences diverging. The first
row whose partial top-1 differs from the reference is the common prefix a free-running greedy run
would have (same trees). After every round the view's invariants are checked against the caches:
sink / retrieved blocks / window slices equal the full cache, retrieved blocks are unique, sorted and
outside sink and window, layer-0 buffer keys equal the exact keys (positions and RoPE), the full
cache after a refresh equals the exact cache (backlog recomputed), and the share of exact attention
mass (full-cache softmax of the tree queries) that falls outside the view.

    python scripts/specpv_teacher_forced.py --context 4096 --budget 2048
    python scripts/specpv_teacher_forced.py --context 4096 --budget 2048 --retrieval-refresh 1
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from long_context import _first_function, _stdlib_files, build_prompt  # noqa: E402

from specsplit.engine_common import ModelRunner  # noqa: E402
from specsplit.kv_cache import StaticKVCache  # noqa: E402
from specsplit.models import load_model, load_tokenizer  # noqa: E402
from specsplit.partial_kv import RECORDER_KWARG, QueryRecorder, SpecPVConfig  # noqa: E402
from specsplit.specpv import PartialVerifier  # noqa: E402
from specsplit.tree import TokenTree  # noqa: E402
from specsplit.tree_attention import build_verify_attention, chain_parents  # noqa: E402


def chain_tree(tokens: list[int]) -> TokenTree:
    n = len(tokens)
    return TokenTree(
        torch.tensor(tokens, dtype=torch.long),
        chain_parents(n),
        torch.arange(1, n + 1),
        torch.zeros(n),
        max_branch=1 if n else 0,
        depth_bound=n,
    )


def prefill(runner: ModelRunner, ids: list[int], cache: StaticKVCache, chunk: int = 1024) -> torch.Tensor:
    logits = None
    for s in range(0, len(ids), chunk):
        part = ids[s : s + chunk]
        mask, pos = build_verify_attention(torch.zeros(0, dtype=torch.long), cache.seq_len, len(part))
        logits = runner.forward(torch.tensor([part]), pos, mask, cache, logits_to_keep=1)
    assert logits is not None
    return logits[-1]


def reference(
    runner: ModelRunner, prompt: list[int], n_new: int, path: Path
) -> tuple[list[int], StaticKVCache]:
    """Greedy continuation (one token per forward) and the prompt's prefilled cache; cached on disk."""
    cache = StaticKVCache(runner.num_layers, len(prompt) + n_new + 64)
    last = prefill(runner, prompt, cache)
    if path.exists():
        saved = torch.load(path)
        if saved["prompt"] == prompt and len(saved["ref"]) >= n_new:
            return saved["ref"][:n_new], cache
    base = copy.deepcopy(cache)
    ref = [int(last.argmax())]
    while len(ref) < n_new:
        mask, pos = build_verify_attention(torch.zeros(0, dtype=torch.long), cache.seq_len, 1)
        lg = runner.forward(torch.tensor([[ref[-1]]]), pos, mask, cache, logits_to_keep=1)
        ref.append(int(lg[-1].argmax()))
    torch.save({"prompt": prompt, "ref": ref}, path)
    return ref, base


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    lp, lq = p_logits.float().log_softmax(-1), q_logits.float().log_softmax(-1)
    return (lp.exp() * (lp - lq)).sum(-1)


def missed_mass(
    queries: dict[int, torch.Tensor], full: StaticKVCache, pvs: Any, group: int, length: int
) -> float:
    """Mean over layers/heads/queries of the exact attention mass on tokens outside the view."""
    lay, bs = pvs.layout, pvs.cfg.block_size
    inside = torch.zeros(length, dtype=torch.bool)
    inside[: lay.sink] = True
    inside[lay.window_start :] = True  # window + backlog (buffer) + the round's tokens
    out = []
    for i, q in queries.items():
        k = full.layers[i].keys[:, :, :length].float()  # [1, kvH, L, D]
        kvh = k.shape[1]
        att = (q.float() @ k.repeat_interleave(group, 1).transpose(-1, -2)) / q.shape[-1] ** 0.5
        # the round's own rows: causal among themselves; approximate with all-visible (tiny effect)
        p = att.softmax(-1)  # [1, H, nq, L]
        ins = inside.expand(1, kvh, length).clone()
        if pvs.selected:
            blocks = pvs.selected[i]  # [1, kvH, k]
            for h in range(kvh):
                for b in blocks[0, h].tolist():
                    ins[0, h, b * bs : (b + 1) * bs] = True
        elif lay.retrieved_blocks:
            ins[:, :, lay.sink : lay.sink + lay.retrieved_blocks * bs] = True
        ins_h = ins.repeat_interleave(group, 1)[:, :, None, :]  # [1, H, 1, L]
        out.append((p * (~ins_h)).sum(-1).mean().item())
    return sum(out) / len(out)


def check_view(pvs: Any, state: Any, exact: StaticKVCache, tol: float = 1e-4) -> dict[str, float]:
    """Max abs differences of the view's parts against the caches (0 when exact)."""
    lay, bs = pvs.layout, pvs.cfg.block_size
    view, full = pvs.view, state.cache
    res = {"sink": 0.0, "retr": 0.0, "win": 0.0, "buf_l0": 0.0, "buf_deep": 0.0, "fullcache": 0.0}
    k = lay.retrieved_blocks
    n_back = len(pvs.backlog)
    assert full.seq_len == lay.full_len, (full.seq_len, lay.full_len)
    assert view.seq_len == lay.view_len + n_back, (view.seq_len, lay.view_len, n_back)
    for i, (fl, vl, el) in enumerate(zip(full.layers, view.layers, exact.layers, strict=True)):
        for name, fa, va, ea in (("k", fl.keys, vl.keys, el.keys), ("v", fl.values, vl.values, el.values)):
            res["sink"] = max(res["sink"], (va[:, :, : lay.sink] - fa[:, :, : lay.sink]).abs().max().item())
            lo, hi = lay.sink, lay.sink + k * bs
            if pvs.selected:
                blocks = pvs.selected[i]
                srt = blocks.sort(-1).values
                assert torch.equal(srt, blocks), "retrieved blocks not in position order"
                assert (blocks[..., 1:] > blocks[..., :-1]).all(), "duplicate retrieved blocks"
                assert blocks.min() >= pvs.cfg.n_sink_blocks, "retrieved block inside the sink"
                assert blocks.max() < lay.window_start // bs, "retrieved block inside the window"
                idx = (blocks[..., None] * bs + torch.arange(bs)).flatten(-2)
                want = fa.gather(2, idx[..., None].expand(-1, -1, -1, fa.shape[-1]))
            else:
                want = fa[:, :, lo:hi]
            res["retr"] = max(res["retr"], (va[:, :, lo:hi] - want).abs().max().item() if k else 0.0)
            win = lay.full_len - lay.window_start
            res["win"] = max(
                res["win"],
                (va[:, :, hi : hi + win] - fa[:, :, lay.window_start : lay.full_len]).abs().max().item(),
            )
            assert hi + win == lay.view_len
            if n_back:
                d = (
                    va[:, :, lay.view_len : lay.view_len + n_back]
                    - ea[:, :, lay.full_len : lay.full_len + n_back]
                )
                d = d.abs().max().item()
                if i == 0 and name == "k":
                    res["buf_l0"] = max(res["buf_l0"], d)
                else:
                    res["buf_deep"] = max(res["buf_deep"], d)
            res["fullcache"] = max(
                res["fullcache"], (fa[:, :, : lay.full_len] - ea[:, :, : lay.full_len]).abs().max().item()
            )
    bad = {n: v for n, v in res.items() if n not in ("buf_deep",) and v > tol}
    if bad:
        print("INVARIANT VIOLATION", bad, flush=True)
    return res


def run(
    args: argparse.Namespace, runner: ModelRunner, prompt: list[int], ref: list[int], base: StaticKVCache
) -> dict[str, Any]:
    cfg = pv_config(args)
    pv = PartialVerifier(cfg, runner)
    assert pv._ready_model()
    group = runner.require().config.num_attention_heads // runner.require().config.num_key_value_heads
    state = SimpleNamespace(cache=copy.deepcopy(base), pv=None)
    exact = copy.deepcopy(base)
    d = args.depth
    j = 0
    rows: list[dict[str, Any]] = []
    steps: list[dict[str, Any]] = []
    first_bad = None
    t_part = 0.0
    while j + 1 + d < len(ref):
        pending, chain = [ref[j]], ref[j + 1 : j + 1 + d]
        tree = chain_tree(chain)
        # exact logits of the same forward, with the tree's queries for the missed-mass metric
        rec = QueryRecorder(rows=d + 1)
        mask, pos = build_verify_attention(tree.parents, exact.seq_len, 1)
        ex_logits = runner.forward(
            torch.tensor([pending + chain]), pos, mask, exact, logits_to_keep=d + 1, **{RECORDER_KWARG: rec}
        )
        pvs_before = state.pv
        layout_before = pvs_before.layout if pvs_before is not None else None
        t = time.perf_counter()
        step = pv.forward(state, pending, tree)
        dt = time.perf_counter() - t
        mm = None
        if step.partial and layout_before is not None and args.missed_mass:
            mm = missed_mass(rec.queries, exact, state.pv, group, exact.seq_len)
        if step.partial:
            t_part += dt
        pv.commit(state, step, list(range(d)), chain)
        targets = ref[j + 1 : j + 2 + d]
        for r in range(d + 1):
            pt, et = int(step.logits[r].argmax()), int(ex_logits[r].argmax())
            row = {
                "pos": j + 1 + r,
                "partial": step.partial,
                "reason": step.reason,
                "ok": pt == targets[r],
                "exact_ok": et == targets[r],
                "kl": kl(ex_logits[r], step.logits[r]).item(),
                "margin": (ex_logits[r].topk(2).values[0] - ex_logits[r].topk(2).values[1]).item(),
            }
            rows.append(row)
            if first_bad is None and not row["ok"]:
                first_bad = row["pos"]
        inv = check_view(state.pv, state, exact) if state.pv.ready else {}
        steps.append(
            {
                "j": j,
                "reason": step.reason,
                "since_refresh": state.pv.steps_since_refresh,
                "backlog": len(state.pv.backlog),
                "missed_mass": mm,
                "bad_rows": sum(not r["ok"] for r in rows[-(d + 1) :]),
                "kl_max": max(r["kl"] for r in rows[-(d + 1) :]),
                **{f"inv_{k}": v for k, v in inv.items()},
            }
        )
        j += d + 1
    part = [r for r in rows if r["partial"]]
    mms = [s["missed_mass"] for s in steps if s["missed_mass"] is not None]
    return {
        "config": {k: getattr(cfg, k) for k in cfg.__dataclass_fields__},
        "first_mismatch": first_bad,
        "rows": len(rows),
        "partial_rows": len(part),
        "partial_top1": sum(r["ok"] for r in part) / max(1, len(part)),
        "exact_top1": sum(r["exact_ok"] for r in rows) / len(rows),
        "mean_kl_partial": sum(r["kl"] for r in part) / max(1, len(part)),
        "mean_missed_mass": sum(mms) / max(1, len(mms)),
        "stats": pv.stats.summary(),
        "partial_s": t_part,
        "steps": steps,
        "row_detail": rows,
    }


def pv_config(args: argparse.Namespace) -> SpecPVConfig:
    base = SpecPVConfig(
        block_size=args.block_size, n_window_blocks=args.window_blocks, n_spec_tokens_buf=args.buf
    )
    fixed = base.budget - base.n_retrieval_blocks * base.block_size
    n_ret = max(0, (args.budget - fixed) // base.block_size)
    extra = {}
    if args.retrieval_refresh is not None:
        extra["retrieval_refresh_interval"] = args.retrieval_refresh
    return SpecPVConfig(
        enabled=True,
        block_size=args.block_size,
        n_window_blocks=args.window_blocks,
        n_spec_tokens_buf=args.buf,
        n_retrieval_blocks=n_ret,
        partial_threshold=args.threshold,
        full_refresh_interval=args.refresh,
        retrieval_reduce=args.reduce,
        **extra,
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--depth", type=int, default=4, help="chain tree depth per round")
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--window-blocks", type=int, default=8)
    ap.add_argument("--buf", type=int, default=128)
    ap.add_argument("--threshold", type=int, default=2048)
    ap.add_argument("--refresh", type=int, default=32)
    ap.add_argument("--reduce", default="mean", choices=["mean", "max"])
    ap.add_argument("--retrieval-refresh", type=int, default=None)
    ap.add_argument("--missed-mass", action="store_true")
    ap.add_argument(
        "--sweep",
        default=None,
        help='JSON list of option overrides run after ONE prefill, e.g. \'[{"refresh": 8}, {"reduce": "max"}]\'',
    )
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prime", action="store_true", help="append the function's first line to the prompt")
    ap.add_argument("--json", default=None, help="write the full result here")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tok = load_tokenizer(args.model)
    model = load_model(args.model, dtype=torch.float32, device="cpu")
    runner = ModelRunner(model, None, "cpu", None, "float32")
    prompt, task = build_prompt(tok, "code", args.context)
    if args.prime:  # start the answer with the function's first line: a copy task even for base models
        _, src = _first_function(_stdlib_files()[0].read_text(errors="replace"))
        head = tok.encode("```python\n" + src.splitlines()[0] + "\n", add_special_tokens=False)
        prompt = prompt + head
        task += " (primed)"
    t = time.perf_counter()
    ref, base = reference(
        runner,
        prompt,
        args.new_tokens,
        Path(f"/tmp/specpv_tf_ref_{args.model}_{args.context}{'_p' if args.prime else ''}.pt"),
    )
    print(f"reference ready in {time.perf_counter() - t:.0f}s: {tok.decode(ref[:60])!r}", flush=True)
    if args.verbose:
        print(repr(tok.decode(ref)))
    results = []
    for over in json.loads(args.sweep) if args.sweep else [{}]:
        a = argparse.Namespace(**{**vars(args), **over})
        t = time.perf_counter()
        res = run(a, runner, prompt, ref, base)
        res["task"], res["overrides"], res["wall_s"] = task, over, time.perf_counter() - t
        if args.verbose:
            for s in res["steps"]:
                print(json.dumps(s))
        inv = {k: max(s.get(k, 0.0) for s in res["steps"]) for k in res["steps"][-1] if k.startswith("inv_")}
        st = res["stats"]
        line = {
            "overrides": over,
            "first_mismatch": res["first_mismatch"],
            "partial_top1": round(res["partial_top1"], 4),
            "mean_kl": round(res["mean_kl_partial"], 5),
            "missed_mass": round(res["mean_missed_mass"], 4),
            "steps_full/partial": f"{st['full_steps']}/{st['partial_steps']}",
            "reselections": st.get("reselections"),
            "partial_ms": round(1e3 * res["partial_s"] / max(1, st["partial_steps"]), 1),
            "invariants_max_abs": {k: float(f"{v:.2g}") for k, v in inv.items()},
        }
        print(json.dumps(line), flush=True)
        results.append(res)
    if args.json:
        Path(args.json).write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
