#!/usr/bin/env python
"""SpecPV diagnosis: teacher-forced partial vs full verification on a real long-context prompt.

The greedy full-verification continuation of a long prompt (the ``long_context.py`` recall task) is
computed once. Then the SAME chain trees (the next ``depth`` reference tokens) are verified round
after round by

- a full-cache engine (exact logits for exactly the same forwards), and
- a :class:`~specsplit.engines.specpv.PartialVerifier` (seed / partial / refresh, the real policy),

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

from specsplit.core.tree import TokenTree  # noqa: E402
from specsplit.core.tree_attention import build_verify_attention, chain_parents  # noqa: E402
from specsplit.engines.partial_kv import (  # noqa: E402
    PartialSession,
    QueryRecorder,
    SpecPVConfig,
    block_token_index,
    gather_tokens,
    score_blocks,
    select_blocks,
)
from specsplit.engines.specpv import PartialVerifier  # noqa: E402
from specsplit.models import load_model, load_tokenizer  # noqa: E402
from specsplit.runtime.attention import ATTENTION_NAME, RECORDER_KWARG, specsplit_attention  # noqa: E402
from specsplit.runtime.kv_cache import StaticKVCache  # noqa: E402
from specsplit.runtime.runner import ModelRunner  # noqa: E402


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
    kv_path = path.with_suffix(".kv.pt")
    last = None
    if kv_path.exists():  # the prefilled prompt cache (minutes on CPU at 8K): reuse it
        saved_kv = torch.load(kv_path)
        if saved_kv["prompt"] == prompt:
            for i, (k, v) in enumerate(saved_kv["kv"]):
                cache.append(i, k, v)
            last = saved_kv["last"]
    if last is None:
        last = prefill(runner, prompt, cache)
        torch.save(
            {
                "prompt": prompt,
                "last": last,
                "kv": [cache.get_kv_for_layer(i) for i in range(len(cache.layers))],
            },
            kv_path,
        )
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


# ---------------------------------------------------------------------- first-divergence diagnosis
def _capture_attention(runner: ModelRunner, fn: Any) -> dict[int, tuple[torch.Tensor, ...]]:
    """Run ``fn()`` with every layer's (query, key, value) as the attention function saw them."""
    from transformers import AttentionInterface

    got: dict[int, tuple[torch.Tensor, ...]] = {}

    def capture(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, **kw: Any) -> Any:
        got[int(module.layer_idx)] = (query.detach().clone(), key.detach().clone(), value.detach().clone())
        return specsplit_attention(module, query, key, value, attention_mask, **kw)

    AttentionInterface.register(ATTENTION_NAME, capture)
    try:
        fn()
    finally:
        AttentionInterface.register(ATTENTION_NAME, specsplit_attention)
    return got


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_prefix: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention of `[1, H, nq, D]` chain queries over ``n_prefix`` visible keys + themselves
    (causal); returns (output `[1, H, nq, D]`, probabilities `[1, H, nq, kv]`)."""
    g = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(g, 1), v.float().repeat_interleave(g, 1)
    nq = q.shape[2]
    s = (q.float() @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    own = torch.ones(nq, nq, dtype=torch.bool).tril()
    allowed = torch.cat([torch.ones(nq, n_prefix, dtype=torch.bool), own], 1)
    s = s.masked_fill(~allowed, float("-inf"))
    p = s.softmax(-1)
    return p @ v, p


def _quest_scores(q: torch.Tensor, kmax: torch.Tensor, kmin: torch.Tensor, reduce: str) -> torch.Tensor:
    """Quest's per-channel upper bound ``sum_d max(q_d Kmax_d, q_d Kmin_d)`` (vs the policy's
    ``max(q . Kmax, q . Kmin)``), reduced like :func:`score_blocks`: `[B, kvH, C]`."""
    b, h, nq, d = q.shape
    kvh, c = kmax.shape[1], kmax.shape[2]
    g = h // kvh
    qq = q.float().reshape(b, kvh, g * nq, 1, d)
    s = torch.maximum(qq * kmax.float()[:, :, None], qq * kmin.float()[:, :, None]).sum(-1)  # [B,kvH,G*nq,C]
    s = s.view(b, kvh, g, nq, c)
    return s.amax(dim=(2, 3)) if reduce == "max" else s.mean(dim=(2, 3))


def _block_mass(
    q: torch.Tensor, keys: torch.Tensor, full_len: int, bs: int, first: int, last: int
) -> torch.Tensor:
    """Exact attention mass of the queries (over the full prefix, softmax over ``full_len`` keys
    only) on candidate blocks ``first..last``, summed over queries and GQA group heads: `[1, kvH, C]`."""
    g = q.shape[1] // keys.shape[1]
    k = keys[:, :, :full_len].float().repeat_interleave(g, 1)
    p = ((q.float() @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5).softmax(-1)  # [1, H, nq, L]
    m = p[..., first * bs : last * bs].unflatten(-1, (last - first, bs)).sum(-1)  # [1, H, nq, C]
    return m.sum(2).unflatten(1, (keys.shape[1], g)).sum(2)


def diagnose(
    runner: ModelRunner,
    pvs: PartialSession,
    full: StaticKVCache,
    exact: StaticKVCache,
    ids: list[int],
    tree: TokenTree,
    plen: int,
    row: int,
    target: int,
    exact_q: dict[int, torch.Tensor],
    seed_sel: list[torch.Tensor] | None,
    prev_q: dict[int, torch.Tensor] | None,
) -> dict[str, Any]:
    """At the first divergent partial round: (a) per-layer attention error of the view vs the full
    cache for the SAME (partial-forward) queries, (b) oracle retrieval (top blocks by exact attention
    mass of the current queries) and other selections, re-run end to end at the same budget, (c)
    the view's rows against the full cache (key/value equality at the claimed positions)."""
    cfg, lay, view = pvs.cfg, pvs.layout, pvs.view
    assert lay is not None and view is not None
    bs, k = cfg.block_size, lay.retrieved_blocks
    first, last = cfg.n_sink_blocks, lay.window_start // bs
    lo, hi = lay.sink, lay.sink + k * bs
    n_back = plen - lay.view_len
    logical = lay.full_len + n_back
    n_layers = len(full.layers)
    p = 1
    mask, pos = build_verify_attention(tree.parents, plen, p, runner.dtype)
    pos = pos + (logical - plen)
    x = torch.tensor([ids])
    n = tree.num_nodes

    def fwd(blocks: list[torch.Tensor] | None, exact_buffer: bool = False) -> tuple[torch.Tensor, dict]:
        v = copy.deepcopy(view)
        v.rollback(plen)
        for i in range(n_layers):
            fl, vl = full.layers[i], v.layers[i]
            if blocks is not None:
                idx = block_token_index(blocks[i], bs)
                vl.keys[:, :, lo:hi] = gather_tokens(fl.keys, idx)
                vl.values[:, :, lo:hi] = gather_tokens(fl.values, idx)
            if exact_buffer and n_back:
                el = exact.layers[i]
                vl.keys[:, :, lay.view_len : plen] = el.keys[:, :, lay.full_len : logical]
                vl.values[:, :, lay.view_len : plen] = el.values[:, :, lay.full_len : logical]
        out: dict[str, torch.Tensor] = {}

        def go() -> None:
            out["logits"] = runner.forward(x, pos, mask, v, logits_to_keep=n + 1)

        cap = _capture_attention(runner, go)
        return out["logits"], cap

    def verdict(lg: torch.Tensor) -> dict[str, Any]:
        r = lg[row].float()
        return {
            "top1_ok": int(r.argmax()) == target,
            "rank_ref": int((r > r[target]).sum()) + 1,
            "gap_top_minus_ref": round(float(r.max() - r[target]), 3),
        }

    res: dict[str, Any] = {"row": row, "plen": plen, "backlog": n_back, "full_len": lay.full_len, "k": k}
    # (c) contents: every retrieved/sink/window key and value equals the full cache row it claims
    worst = 0.0
    for i in range(n_layers):
        fl, vl = full.layers[i], view.layers[i]
        idx = torch.cat(
            [
                torch.arange(lay.sink).expand(1, fl.keys.shape[1], -1),
                block_token_index(pvs.selected[i], bs),
                torch.arange(lay.window_start, lay.full_len).expand(1, fl.keys.shape[1], -1),
            ],
            -1,
        )
        for a, b in ((vl.keys, fl.keys), (vl.values, fl.values)):
            worst = max(worst, (a[:, :, : lay.view_len] - gather_tokens(b, idx)).abs().max().item())
        assert (idx[..., 1:] > idx[..., :-1]).all(), "view rows not strictly increasing positions"
    res["c_view_rows_max_abs_diff"] = worst
    # queries at their true positions: layer 0's query rows of the partial forward equal the exact ones
    logits_now, cap = fwd(None)
    res["c_layer0_query_max_abs_diff"] = (cap[0][0].float() - exact_q[0].float()).abs().max().item()
    res["c_layer0_buffer_key_max_abs_diff"] = (
        (
            cap[0][1][:, :, lay.view_len :].float()
            - exact.layers[0].keys[:, :, lay.full_len : logical + len(ids)].float()
        )
        .abs()
        .max()
        .item()
    )
    res["current"] = verdict(logits_now)
    # selections to compare
    sels: dict[str, list[torch.Tensor]] = {"current": list(pvs.selected)}
    if seed_sel is not None:
        sels["seed_view(no_reselect)"] = seed_sel
    orc, orc_partial_q, pol_exact_q, quest_exact_q, quest_prev_q, max_prev_q = [], [], [], [], [], []
    for i in range(n_layers):
        km = pvs.summaries.kmax[i][:, :, first:last]
        kn = pvs.summaries.kmin[i][:, :, first:last]
        mass = _block_mass(exact_q[i], exact.layers[i].keys, lay.full_len, bs, first, last)
        orc.append(select_blocks(mass, k, first))
        mass_p = _block_mass(cap[i][0], full.layers[i].keys, lay.full_len, bs, first, last)
        orc_partial_q.append(select_blocks(mass_p, k, first))
        pol_exact_q.append(select_blocks(score_blocks(exact_q[i], km, kn, cfg.retrieval_reduce), k, first))
        quest_exact_q.append(select_blocks(_quest_scores(exact_q[i], km, kn, cfg.retrieval_reduce), k, first))
        if prev_q is not None:
            quest_prev_q.append(
                select_blocks(_quest_scores(prev_q[i], km, kn, cfg.retrieval_reduce), k, first)
            )
            max_prev_q.append(select_blocks(score_blocks(prev_q[i], km, kn, "max"), k, first))
    sels["oracle(exact_q)"] = orc
    sels["oracle(partial_q)"] = orc_partial_q
    sels["policy(exact_current_q)"] = pol_exact_q
    sels["quest(exact_current_q)"] = quest_exact_q
    if prev_q is not None:
        sels["quest(prev_committed_q)"] = quest_prev_q
        sels["policy_max(prev_committed_q)"] = max_prev_q
    # (a) per layer, for the SAME partial-forward queries: attention output error of each selection
    # vs the full cache (+ the same buffer), and the share of oracle mass each selection captures
    per: dict[str, dict[str, Any]] = {}
    for name, blocks in sels.items():
        rel, miss, recall = [], [], []
        for i in range(n_layers):
            q, kv_k, kv_v = cap[i]
            buf_k, buf_v = kv_k[:, :, lay.view_len :], kv_v[:, :, lay.view_len :]  # backlog + this round
            fk, fv = full.layers[i].keys[:, :, : lay.full_len], full.layers[i].values[:, :, : lay.full_len]
            o_full, p_full = _attend(q, torch.cat([fk, buf_k], 2), torch.cat([fv, buf_v], 2), logical)
            idx = torch.cat(
                [
                    torch.arange(lay.sink).expand(1, fk.shape[1], -1),
                    block_token_index(blocks[i], bs),
                    torch.arange(lay.window_start, lay.full_len).expand(1, fk.shape[1], -1),
                ],
                -1,
            )
            vk = torch.cat([gather_tokens(fk, idx), buf_k], 2)
            vv = torch.cat([gather_tokens(fv, idx), buf_v], 2)
            o_view, _ = _attend(q, vk, vv, lay.view_len + n_back)
            a, b = o_view[:, :, row], o_full[:, :, row]
            rel.append(((a - b).norm() / b.norm()).item())
            g = q.shape[1] // fk.shape[1]
            ins = torch.zeros(1, fk.shape[1], logical + q.shape[2], dtype=torch.bool)
            ins.scatter_(2, idx, True)
            ins[:, :, lay.full_len :] = True
            ins_h = ins.repeat_interleave(g, 1)
            miss.append((p_full[:, :, row] * (~ins_h)).sum(-1).mean().item())
            mass = _block_mass(q, fk, lay.full_len, bs, first, last)  # [1, kvH, C]
            top = mass.topk(k, -1).values.sum(-1)
            got = mass.gather(-1, blocks[i] - first).sum(-1)
            recall.append((got / top).mean().item())
        per[name] = {
            "attn_rel_err_mean": round(sum(rel) / n_layers, 4),
            "attn_rel_err_max": round(max(rel), 4),
            "worst_layers": sorted(range(n_layers), key=lambda i: -rel[i])[:4],
            "missed_mass_mean": round(sum(miss) / n_layers, 4),
            "oracle_mass_recall": round(sum(recall) / n_layers, 4),
            "overlap_with_current": round(
                sum(
                    (blocks[i][..., :, None] == pvs.selected[i][..., None, :]).any(-1).float().mean().item()
                    for i in range(n_layers)
                )
                / n_layers,
                3,
            ),
        }
    res["a_per_selection"] = per
    # (b) end to end: the same round re-run at the same budget with each selection
    res["b_logits"] = {name: verdict(fwd(blocks)[0]) for name, blocks in sels.items()}
    res["b_logits"]["current+exact_buffer"] = verdict(fwd(None, exact_buffer=True)[0])
    res["b_logits"]["oracle(exact_q)+exact_buffer"] = verdict(fwd(orc, exact_buffer=True)[0])
    return res


_orig_reselect = PartialSession.reselect


def _reselect_remembering(
    self: PartialSession, cache: StaticKVCache, queries: dict[int, torch.Tensor]
) -> bool:
    self._diag_prev_q = queries  # type: ignore[attr-defined]
    return _orig_reselect(self, cache, queries)


PartialSession.reselect = _reselect_remembering  # type: ignore[method-assign]


def run(
    args: argparse.Namespace,
    runner: ModelRunner,
    prompt: list[int],
    ref: list[int],
    base: StaticKVCache,
    replay: list[dict[str, Any]] | None = None,
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
    diag: dict[str, Any] | None = None
    seed_sel: list[torch.Tensor] | None = None
    plan = iter(replay or [])
    while True:
        if replay is None:
            if j + 1 + d >= len(ref):
                break
            pending, chain, m = [ref[j]], ref[j + 1 : j + 1 + d], d
        else:  # a logged free run: its trees and acceptance, up to its split from the reference
            rd = next(plan, None)
            if rd is None or rd["pending"] != [ref[j]] or j + 1 + len(rd["nodes"]) >= len(ref):
                break
            pending, chain, m = rd["pending"], rd["tree"], len(rd["nodes"])
            assert rd["parents"] == list(range(-1, len(chain) - 1)), "replay supports chain trees"
            assert rd["nodes"] == list(range(m))
        tree = chain_tree(chain)
        n_rows = m + 1  # rows whose prefix is the reference: pending + the accepted chain prefix
        # exact logits of the same forward, with the tree's queries for the missed-mass metric
        rec = QueryRecorder(rows=len(chain) + 1)
        ex_len = exact.seq_len
        mask, pos = build_verify_attention(tree.parents, ex_len, 1)
        ex_logits = runner.forward(
            torch.tensor([pending + chain]),
            pos,
            mask,
            exact,
            logits_to_keep=len(chain) + 1,
            **{RECORDER_KWARG: rec},
        )
        exact.rollback(ex_len + 1 + m)
        pvs_before = state.pv
        layout_before = pvs_before.layout if pvs_before is not None else None
        t = time.perf_counter()
        step = pv.forward(state, pending, tree)
        dt = time.perf_counter() - t
        targets = ref[j + 1 : j + 1 + n_rows]
        if (
            args.diagnose
            and diag is None
            and step.partial
            and any(int(step.logits[r].argmax()) != targets[r] for r in range(n_rows))
        ):
            r_bad = next(r for r in range(n_rows) if int(step.logits[r].argmax()) != targets[r])
            diag = diagnose(
                runner,
                state.pv,
                state.cache,
                exact,
                pending + chain,
                tree,
                step.base - 1,
                r_bad,
                targets[r_bad],
                rec.queries,
                seed_sel,
                getattr(state.pv, "_diag_prev_q", None),
            )
            diag["pos"] = j + 1 + r_bad
            diag["step_logits"] = {
                "rank_ref": int((step.logits[r_bad] > step.logits[r_bad][targets[r_bad]]).sum()) + 1,
                "gap_top_minus_ref": round(
                    float(step.logits[r_bad].max() - step.logits[r_bad][targets[r_bad]]), 3
                ),
            }
            print("DIAGNOSIS", json.dumps(diag, indent=1), flush=True)
        mm = None
        if step.partial and layout_before is not None and args.missed_mass:
            mm = missed_mass(rec.queries, exact, state.pv, group, exact.seq_len)
        if step.partial:
            t_part += dt
        pv.commit(state, step, list(range(m)), chain[:m])
        if not step.partial and state.pv.ready:
            seed_sel = [b.clone() for b in state.pv.selected] if state.pv.selected else None
        for r in range(n_rows):
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
                "accepted": m,
                "bad_rows": sum(not r["ok"] for r in rows[-n_rows:]),
                "kl_max": max(r["kl"] for r in rows[-n_rows:]),
                **{f"inv_{k}": v for k, v in inv.items()},
            }
        )
        j += 1 + m
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
        "diagnosis": diag,
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
        retrieval_query_window=args.query_window,
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
    ap.add_argument("--query-window", type=int, default=0, help="SpecPV retrieval_query_window")
    ap.add_argument("--retrieval-refresh", type=int, default=None)
    ap.add_argument("--missed-mass", action="store_true")
    ap.add_argument(
        "--diagnose",
        action="store_true",
        help="at the first divergent partial round: attention error per layer, oracle and other "
        "retrievals re-run at the same budget, view rows vs the full cache",
    )
    ap.add_argument(
        "--sweep",
        default=None,
        help='JSON list of option overrides run after ONE prefill, e.g. \'[{"refresh": 8}, {"reduce": "max"}]\'',
    )
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--replay",
        default=None,
        help="a specpv_free_run.py log: replay its rounds (trees, acceptance) instead of teacher-forced "
        "chains; the run whose retrieval_refresh equals --retrieval-refresh (or the first)",
    )
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
        replay = None
        if a.replay:
            runs = json.loads(Path(a.replay).read_text())["runs"]
            pick = [r for r in runs if r["retrieval_refresh"] == (a.retrieval_refresh or 0)] or runs
            replay = pick[0]["rounds"]
        res = run(a, runner, prompt, ref, base, replay)
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
