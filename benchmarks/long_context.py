#!/usr/bin/env python
"""SpecPV long-context benchmark: partial vs full verification with the Qwen2.5-Coder pair.

Real text that installs offline: Python standard-library sources (the interpreter's own ``lib``
directory), license texts under /usr/share/common-licenses and docs under /usr/share/doc. The task
needs the long context: the prompt is a long document followed by a request to reproduce a piece
of it that sits early in the document (a function for ``code``, a paragraph for ``license``), so a
partial view that misses the right blocks shows up as disagreement.

For every context length the prompt is prefilled ONCE (in chunks) and the prefilled target session
is cloned for each mode, so modes differ only in how the generated tokens are verified:

- ``full``: the normal engine (every round verifies against the whole cache);
- ``partial``: SpecPV with a ``--budget``-token view (sink + retrieval + window + buffer);
- at the longest context, a sweep of budgets (``--sweep``).

Reported per run: mean verify-step time (partial steps and full steps separately), tokens/s of
the decode loop (draft + verify, prefill excluded), tau (tokens per round), and agreement with
full verification (fraction of generated positions whose token equals the full-mode token, and
the length of the common prefix). Writes ``benchmarks/results/long_context-<tag>.{json,md,png}``.

    python benchmarks/long_context.py --contexts 4096 --new-tokens 256           # CPU, fp32
    python benchmarks/long_context.py --device cuda:0 --dtype bfloat16 \\
        --contexts 4096,8192,16384,32768 --tree static --tag h100              # GPU

``--random-weights`` builds randomly initialised models with the Qwen2.5-Coder-1.5B shapes (target)
and a 2-layer draft instead of loading weights, and random prompts: only the verify-step times mean
anything then (tau, agreement and tokens/s do not). It runs where the weights are not available.
"""

from __future__ import annotations

import argparse
import copy
import glob
import json
import os
import platform
import statistics
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specsplit.bench.report import pyplot  # noqa: E402
from specsplit.config import (  # noqa: E402
    DraftConfig,
    EngineTuning,
    SpecPVConfig,  # noqa: E402
    TargetConfig,
    TreeConfig,
)
from specsplit.core.tree import TokenTree  # noqa: E402
from specsplit.engines.draft import DraftEngine  # noqa: E402
from specsplit.engines.target import TargetEngine  # noqa: E402
from specsplit.messages import DraftRequest, VerifyRequest  # noqa: E402
from specsplit.models import load_model, load_tokenizer  # noqa: E402

TREES = {
    "chain4": TreeConfig(shape="chain", num_draft_tokens=4),
    "static": TreeConfig(shape="static"),
    "dynamic": TreeConfig(shape="dynamic", topk=4, width=4, budget=24, max_depth=6),
}
PREFILL_CHUNK = 2048
# Qwen2.5-Coder-1.5B-Instruct shapes (from its config.json), for --random-weights.
QWEN_1_5B = dict(
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    vocab_size=151936,
    max_position_embeddings=32768,
    rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"},
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)


def random_models(dtype: torch.dtype, device: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Randomly initialised target (1.5B shapes) and a 2-layer draft of the same width."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    models = []
    for layers in (QWEN_1_5B["num_hidden_layers"], 2):
        cfg = Qwen2Config(**{**QWEN_1_5B, "num_hidden_layers": layers})
        with torch.device(device):
            models.append(Qwen2ForCausalLM(cfg).to(dtype).eval())
    return models[0], models[1]


# ---------------------------------------------------------------------- prompts from offline text
def _stdlib_files() -> list[Path]:
    lib = Path(sysconfig.get_paths()["stdlib"])
    names = ["argparse.py", "textwrap.py", "difflib.py", "shutil.py", "tarfile.py", "inspect.py", "typing.py"]
    names += ["pathlib.py", "dataclasses.py", "functools.py", "subprocess.py", "zipfile.py", "pydoc.py"]
    return [lib / n for n in names if (lib / n).is_file()]


def _license_files() -> list[Path]:
    found = [Path(p) for p in sorted(glob.glob("/usr/share/common-licenses/*")) if Path(p).is_file()]
    docs = sorted(glob.glob("/usr/share/doc/*/copyright"))[:200]
    return found + [Path(p) for p in docs]


def _first_function(text: str) -> tuple[str, str]:
    """Name and source of the first top-level ``def`` of at least 6 lines in ``text``."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("def "):
            j = i + 1
            while j < len(lines) and (not lines[j] or lines[j][:1].isspace()):
                j += 1
            if j - i >= 6:
                return line[4:].split("(")[0], "\n".join(lines[i:j]).rstrip()
    raise ValueError("no function found")


def build_prompt(tok: Any, kind: str, n_tokens: int) -> tuple[list[int], str]:
    """A chat prompt of exactly ``n_tokens`` tokens: a long document, then a recall request.

    Returns:
        ``(token ids, a one-line description of the task)``.
    """
    files = _stdlib_files() if kind == "code" else _license_files()
    if not files:
        raise SystemExit(f"no offline text found for kind {kind!r}")
    if kind == "code":
        first = files[0].read_text(errors="replace")
        name, _ = _first_function(first)
        question = (
            f"Above is the source of several Python standard-library modules. Reproduce the function "
            f"`{name}` from the first module exactly as written, including its docstring. Output only the code."
        )
        task = f"recall function {name} of {files[0].name}"
    else:
        question = (
            "Above are several license texts. Quote the first two paragraphs of the first license "
            "verbatim. Output only the quotation."
        )
        task = f"recall the start of {files[0].name}"

    def render(doc: str) -> list[int]:
        msgs = [{"role": "user", "content": doc + "\n\n" + question}]
        return tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)

    overhead = len(render(""))
    body: list[int] = []
    for f in files:  # documents in order, each with a header line
        body += tok.encode(f"\n# ===== file: {f.name} =====\n" + f.read_text(errors="replace"))
        if len(body) >= n_tokens:
            break
    want = n_tokens - overhead
    if len(body) < want:
        raise SystemExit(f"only {len(body)} tokens of {kind} text available; {want} needed")
    doc = tok.decode(body[:want])
    ids = render(doc)
    # decode/encode may shift the count by a few tokens: trim or pad the document tail until exact
    for _ in range(8):
        diff = len(ids) - n_tokens
        if diff == 0:
            break
        body_ids = tok.encode(doc)
        doc = tok.decode(body_ids[: len(body_ids) - diff]) if diff > 0 else doc + " ." * (-diff)
        ids = render(doc)
    return ids, task


# ---------------------------------------------------------------------- decode loop over the engines
@dataclass
class RunResult:
    mode: str
    budget: int | None
    tokens: list[int]
    rounds: int
    wall_s: float
    verify_s: list[float] = field(default_factory=list)
    modes: list[str] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    specpv: dict[str, Any] | None = None

    def summary(self, reference: list[int] | None) -> dict[str, Any]:
        part = [t for t, m in zip(self.verify_s, self.modes, strict=True) if m == "partial"]
        full = [t for t, m in zip(self.verify_s, self.modes, strict=True) if m != "partial"]
        out: dict[str, Any] = {
            "mode": self.mode,
            "budget": self.budget,
            "new_tokens": len(self.tokens),
            "rounds": self.rounds,
            "tau": len(self.tokens) / self.rounds if self.rounds else 0.0,
            "tokens_per_s": len(self.tokens) / self.wall_s if self.wall_s else 0.0,
            "wall_s": self.wall_s,
            "verify_partial_ms": 1e3 * statistics.mean(part) if part else None,
            "verify_full_ms": 1e3 * statistics.mean(full) if full else None,
            "verify_all_ms": 1e3 * statistics.mean(self.verify_s) if self.verify_s else None,
            "partial_steps": len(part),
            "full_steps": len(full),
        }
        if reference is not None:
            n = min(len(reference), len(self.tokens))
            same = sum(a == b for a, b in zip(reference[:n], self.tokens[:n], strict=True))
            prefix = next((i for i in range(n) if reference[i] != self.tokens[i]), n)
            out["agreement"] = same / len(reference) if reference else 1.0
            out["common_prefix"] = prefix
        if self.specpv is not None:
            out["specpv"] = self.specpv
        return out


@torch.inference_mode()
def divergence_gap(
    model: torch.nn.Module, prompt: list[int], ref: list[int], other: list[int]
) -> dict[str, Any] | None:
    """At the first position where ``other`` leaves ``ref`` (full verification's tokens): the
    target's own logits there (one plain forward over prompt + the common prefix), the gap between
    the two tokens and the rank of ``other``'s token. A gap within bf16 noise (the bench measures its
    p99 at ~0.18 logits for this model) means the two runs split at a numerical near-tie."""
    j = next((i for i in range(min(len(ref), len(other))) if ref[i] != other[i]), None)
    if j is None:
        return None
    dev = next(model.parameters()).device
    ids = torch.tensor([prompt + ref[:j]], device=dev)
    logits = model(input_ids=ids, logits_to_keep=1).logits[0, -1].float()
    a, b = ref[j], other[j]
    probs = logits.softmax(-1)
    return {
        "position": j,
        "full_token": a,
        "partial_token": b,
        "gap": float(logits[a] - logits[b]),
        "rank_full": int((logits > logits[a]).sum()) + 1,
        "rank_partial": int((logits > logits[b]).sum()) + 1,
        "p_full": float(probs[a]),
        "p_partial": float(probs[b]),
    }


def clone_target_session(src: TargetEngine, src_id: str, dst: TargetEngine, dst_id: str) -> None:
    """Copy a prefilled target session (its KV cache) into another engine sharing the model."""
    state, existed = src.get_or_create_session(src_id)
    if not existed or state.seq_len == 0:
        raise RuntimeError(f"session {src_id!r} is gone (expired?); nothing to clone")
    new, _ = dst.get_or_create_session(dst_id, state.cache.capacity)
    new.cache = copy.deepcopy(state.cache)


def decode_from(
    target: TargetEngine,
    draft: DraftEngine,
    sid: str,
    prompt: list[int],
    first: int,
    n_new: int,
    tree: TreeConfig,
    capacity: int,
) -> tuple[list[int], list[float], list[str], list[int], float]:
    """Greedy speculative decoding after a prefilled target session ``sid`` (first token known).

    The draft session ``"draft"`` is resent the full context each run (prefix_length 0): the draft
    engine reuses its cached prompt and recomputes only the tail. Returns ``(tokens, per-round verify
    seconds, per-round verify modes, per-round accepted counts, wall seconds)``.
    """
    out, pending, prefix = [first], [first], len(prompt)
    draft_new, draft_prefix = prompt + [first], 0
    verify_s: list[float] = []
    modes: list[str] = []
    accepted: list[int] = []
    t0 = time.perf_counter()
    while len(out) < n_new:
        remaining = n_new - len(out)
        tr = TokenTree.empty(target.device)
        if remaining > 1:
            dres = draft.generate(
                DraftRequest(
                    "draft", draft_new, draft_prefix, tree, max_depth=remaining - 1, capacity_hint=capacity
                )
            )
            tr, draft_prefix, draft_new = dres.tree, dres.prefix_length, []
        target.synchronize()  # the draft's queued device work must not count as verify time
        t = time.perf_counter()
        vres = target.verify(
            VerifyRequest(sid, tr.to(target.device), pending, prefix, capacity_hint=capacity)
        )
        verify_s.append(time.perf_counter() - t)
        modes.append(vres.stats.verify_mode or "full")
        accepted.append(len(vres.accepted_token_ids))
        new = (vres.accepted_token_ids + [vres.next_token_id])[:remaining]
        out += new
        prefix, pending = vres.prefix_length, [vres.next_token_id]
        draft_new = draft_new + new
    wall = time.perf_counter() - t0
    target.end_session(sid)
    return out, verify_s, modes, accepted, wall


def prefill(
    target: TargetEngine, draft: DraftEngine, prompt: list[int], tree: TreeConfig, capacity: int
) -> int:
    """Prefill the target session ``"base"`` and the draft session ``"draft"`` in chunks; first token."""
    nxt, prefix = -1, 0
    for s in range(0, len(prompt), PREFILL_CHUNK):
        chunk = prompt[s : s + PREFILL_CHUNK]
        r = target.verify(
            VerifyRequest("base", TokenTree.empty(target.device), chunk, prefix, capacity_hint=capacity)
        )
        nxt, prefix = r.next_token_id, r.prefix_length
    dprefix = 0
    draft.end_session("draft")
    for s in range(0, len(prompt), PREFILL_CHUNK):
        d = draft.generate(
            DraftRequest(
                "draft", prompt[s : s + PREFILL_CHUNK], dprefix, tree, max_depth=1, capacity_hint=capacity
            )
        )
        dprefix = d.prefix_length
    return nxt


def step_timing(
    full_engine: TargetEngine,
    pv_engine: TargetEngine,
    draft: DraftEngine,
    prompt: list[int],
    first: int,
    tree: TreeConfig,
    cap: int,
    reps: int,
) -> dict[str, Any]:
    """Paired verify-step timing: the SAME tree verified alternately in full and partially.

    Both engines start from the prefilled ``"base"`` session; one full step (which seeds the SpecPV
    view) commits a round, then each repetition verifies the next round's tree on both engines
    (alternating which goes first) and rolls the session back (O(1); the SpecPV view survives a
    rollback into its speculative buffer). Interleaving makes the pair see the same machine load.

    Returns:
        ``{"full_ms": median, "partial_ms": median, "speedup": ratio, "reps": reps, ...}``.
    """
    sids = {"full": "ab_full", "partial": "ab_pv"}
    engines = {"full": full_engine, "partial": pv_engine}
    for name, eng in engines.items():
        clone_target_session(full_engine, "base", eng, sids[name])
    d = draft.generate(DraftRequest("draft", prompt + [first], 0, tree, capacity_hint=cap))
    res = {}
    for name, eng in engines.items():
        req = VerifyRequest(sids[name], d.tree.to(eng.device), [first], len(prompt), capacity_hint=cap)
        res[name] = eng.verify(req)
    r = res["full"]
    ctx = prompt + [first] + r.accepted_token_ids + [r.next_token_id]
    prefix, pend = r.prefix_length, [r.next_token_id]
    d = draft.generate(DraftRequest("draft", ctx, 0, tree, capacity_hint=cap))
    times: dict[str, list[float]] = {"full": [], "partial": []}
    modes: set[str] = set()
    for i in range(reps):
        order = ("full", "partial") if i % 2 == 0 else ("partial", "full")
        for name in order:
            eng = engines[name]
            t = time.perf_counter()
            out = eng.verify(
                VerifyRequest(sids[name], d.tree.to(eng.device), pend, prefix, capacity_hint=cap)
            )
            times[name].append(time.perf_counter() - t)
            if name == "partial":
                modes.add(out.stats.verify_mode)
            eng.rollback_cache(sids[name], prefix)
    for name, eng in engines.items():
        eng.end_session(sids[name])
    full_ms = 1e3 * statistics.median(times["full"])
    part_ms = 1e3 * statistics.median(times["partial"])
    return {
        "full_ms": full_ms,
        "partial_ms": part_ms,
        "speedup": full_ms / part_ms,
        "reps": reps,
        "tree_nodes": d.tree.num_nodes,
        "partial_modes": sorted(modes),
    }


def pv_config(budget: int, args: argparse.Namespace, refresh: int | None = None) -> SpecPVConfig:
    """SpecPV settings whose view (sink + retrieval + window + buffer) totals about ``budget`` tokens."""
    base = SpecPVConfig(n_window_blocks=args.window_blocks)
    fixed = base.budget - base.n_retrieval_blocks * base.block_size
    n_ret = max(0, (budget - fixed) // base.block_size)
    return SpecPVConfig(
        enabled=True,
        n_retrieval_blocks=n_ret,
        n_window_blocks=args.window_blocks,
        partial_threshold=args.threshold,
        full_refresh_interval=refresh or args.refresh,
        retrieval_reduce=args.reduce,
        retrieval_refresh_interval=args.retrieval_refresh,
        retrieval_query_window=args.query_window,
        rectify_margin=args.rectify_margin,
    )


# ---------------------------------------------------------------------- report
def write_markdown(
    path: Path, meta: dict[str, Any], rows: list[dict[str, Any]], sweep: list[dict[str, Any]]
) -> None:
    def f(x: Any, fmt: str = ".1f") -> str:
        return "-" if x is None else format(x, fmt)

    head = (
        "| context | mode | budget | verify ms, decode loop (partial / full steps) | paired step ms "
        "(full / partial) | paired step speedup | tokens/s | e2e speedup | tau | agreement | common prefix "
        "| partial/full steps |"
    )

    def line(r: dict[str, Any]) -> str:
        st = r.get("step") or {}
        n_rect = (r.get("specpv") or {}).get("rectifications") or 0
        rect = f" ({n_rect} rectified)" if n_rect else ""
        paired = f"{f(st.get('full_ms'))} / {f(st.get('partial_ms'))}" if st else "-"
        return (
            f"| {r['context']} | {r['mode']} | {r['budget'] or '-'} | {f(r['verify_partial_ms'])} / "
            f"{f(r['verify_full_ms'])} | {paired} | {f(st.get('speedup'), '.2f')} | "
            f"{f(r['tokens_per_s'], '.2f')} | {f(r.get('e2e_speedup'), '.2f')} | {r['tau']:.2f} | "
            f"{f(r.get('agreement'), '.3f')} | {r.get('common_prefix', '-')} | "
            f"{r['partial_steps']}/{r['full_steps']}{rect} |"
        )

    lines = [
        f"# SpecPV long-context benchmark ({meta['tag']})",
        "",
        f"Target `{meta['target']}`, draft `{meta['draft']}`, {meta['dtype']} on {meta['device_name']}, "
        f"tree `{meta['tree']}`, greedy, {meta['new_tokens']} generated tokens per run, prompt kind "
        f"`{meta['prompt_kind']}` ({meta['task']}). SpecPV: threshold {meta['threshold']}, refresh every "
        f"{meta['refresh']} partial steps, retrieval re-selected every {meta.get('retrieval_refresh') or '-'} "
        f"partial steps (query window {meta.get('query_window') or '-'}), rectify margin "
        f"{meta.get('rectify_margin') or '-'}, reduce `{meta.get('reduce', 'mean')}`, window {meta.get('window_blocks', 8)} blocks, "
        f"main budget {meta['budget']} tokens. Torch threads: "
        f"{meta['threads']}. Attention: "
        + (
            "transformers' SDPA (repeat_kv)."
            if meta.get("fold_gqa") is False
            else "GQA folded into the query rows (`specsplit.runtime.attention`)."
            if meta.get("fold_gqa")
            else "transformers' SDPA (runs before `fold_gqa` existed)."
        ),
        "",
        f"Command: `{meta['command']}`",
        "",
        "- *verify ms, decode loop*: mean wall time of one `TargetEngine.verify` call during generation "
        "(forward + verification + host read), partial steps and full steps (seed/refresh, including the "
        "recomputed backlog) separately; the full-mode row has full steps only.",
        "- *paired step*: median over repetitions of the SAME tree verified alternately by the full engine "
        "and the SpecPV engine (interleaved, so both see the same machine load); the verify-step speedup.",
        "- *e2e speedup*: tokens/s of the decode loop (draft + verify, prefill excluded) over full mode.",
        "- *agreement*: fraction of generated positions whose token equals full mode's; *common prefix*: "
        "tokens before the first difference.",
        "",
        "## Per context (main budget)",
        "",
        head,
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
        *[line(r) for r in rows],
        "",
    ]
    if sweep:
        lines += [f"## Budget sweep at {sweep[0]['context']} tokens", "", head, "|" + "---|" * 12]
        lines += [line(r) for r in sweep] + [""]
    div = [r for r in rows + sweep if r.get("divergence")]
    if div:
        lines += [
            "## Where partial and full verification split",
            "",
            "The target's own logits at the first differing position (plain forward over prompt + common "
            "prefix): gap = logit(full's token) - logit(partial's token). A small gap (bf16 noise alone is ~0.2 "
            "logits for this model, see the bench's near-tie analysis) means the two tokens were nearly tied "
            "for the target itself, so any small perturbation of attention flips the choice; a large gap "
            "means the partial view missed what the full context says.",
            "",
            "| context | budget | position | gap | rank of full's / partial's token | p full / p partial |",
            "|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['context']} | {r['budget']} | {d['position']} | {d['gap']:.3f} | {d['rank_full']} / "
            f"{d['rank_partial']} | {d['p_full']:.3f} / {d['p_partial']:.3f} |"
            for r in div
            for d in [r["divergence"]]
        ] + [""]
    lines += [f"Prefill seconds per context: {meta['prefill_s']}", ""]
    if meta.get("notes"):
        lines += ["Notes:", ""] + [f"- {n}" for n in meta["notes"]] + [""]
    path.write_text("\n".join(lines))


def plot(path: Path, rows: list[dict[str, Any]], sweep: list[dict[str, Any]]) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    part = sorted((r for r in rows if r["mode"] == "partial"), key=lambda r: r["context"])
    full = {r["context"]: r for r in rows if r["mode"] == "full"}
    ctx = [r["context"] for r in part]

    def step(r: dict[str, Any], key: str, fallback: Any) -> Any:
        return (r.get("step") or {}).get(key, fallback)

    axes[0].plot(
        ctx, [step(r, "full_ms", full[r["context"]]["verify_full_ms"]) for r in part], "o-", label="full"
    )
    axes[0].plot(ctx, [step(r, "partial_ms", r["verify_partial_ms"]) for r in part], "s-", label="partial")
    axes[0].set_xlabel("context tokens")
    axes[0].set_ylabel("ms per verify step")
    axes[0].set_xscale("log", base=2)
    axes[0].legend()
    axes[0].set_title(f"verify step (budget {part[0]['budget'] if part else '-'} tokens)")
    if sweep:
        b = [r["budget"] for r in sweep]
        axes[1].plot(b, [r["agreement"] for r in sweep], marker="o", color="C2", label="agreement")
        axes[1].set_ylim(0, 1.05)
        axes[1].set_xscale("log", base=2)
        axes[1].set_xlabel(f"partial budget (tokens), context {sweep[0]['context']}")
        axes[1].set_ylabel("agreement with full verification", color="C2")
        ax2 = axes[1].twinx()
        ax2.plot(b, [step(r, "speedup", r.get("verify_speedup")) for r in sweep], "s-", color="C3")
        ax2.set_ylabel("verify-step speedup (x)", color="C3")
        axes[1].set_title("budget sweep")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def save(
    stem: Path,
    meta: dict[str, Any],
    rows: list[dict[str, Any]],
    sweep: list[dict[str, Any]],
    final: bool = False,
) -> Path:
    """Write JSON + markdown (after every run, so a crash keeps what was measured) and, at the end, the PNG."""
    Path(f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows, "sweep": sweep}, indent=2))
    write_markdown(Path(f"{stem}.md"), meta, rows, sweep)
    if final:
        plot(Path(f"{stem}.png"), rows, sweep)
    return stem


# ---------------------------------------------------------------------- main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--contexts", default="4096", help="comma-separated prompt lengths in tokens")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--tree", default="chain4", choices=sorted(TREES))
    ap.add_argument("--prompt-kind", default="code", choices=["code", "license"])
    ap.add_argument("--budget", type=int, default=2048, help="partial view tokens for the per-context runs")
    ap.add_argument(
        "--sweep", default="512,2048,4096,8192", help="budgets swept at the longest context ('' = none)"
    )
    ap.add_argument("--threshold", type=int, default=2048, help="SpecPV partial_threshold")
    ap.add_argument("--refresh", type=int, default=32, help="SpecPV full_refresh_interval")
    ap.add_argument(
        "--retrieval-refresh",
        type=int,
        default=0,
        help="SpecPV retrieval_refresh_interval: re-select the retrieved blocks every N partial steps (0: off)",
    )
    ap.add_argument(
        "--query-window",
        type=int,
        default=0,
        help="SpecPV retrieval_query_window: score re-selections with the last N committed tokens' queries",
    )
    ap.add_argument(
        "--rectify-margin",
        type=float,
        default=0.0,
        help="SpecPV rectify_margin: verify in full when a partial step decides a token by a smaller logit gap",
    )
    ap.add_argument("--reduce", default="mean", choices=["mean", "max"], help="SpecPV retrieval_reduce")
    ap.add_argument("--window-blocks", type=int, default=8, help="SpecPV n_window_blocks")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: leave as is)")
    ap.add_argument("--no-cudnn-sdp", action="store_true", help="disable the cuDNN SDPA backend (CUDA)")
    ap.add_argument(
        "--no-fold-gqa",
        action="store_true",
        help="attend through transformers' SDPA (repeat_kv) instead of SpecSplit's folded GQA kernel",
    )
    ap.add_argument("--step-reps", type=int, default=5, help="paired verify-step repetitions (0: skip)")
    ap.add_argument(
        "--random-weights", action="store_true", help="timing only: random models, random prompts"
    )
    ap.add_argument("--tag", default=None, help="results file tag (default: the device type)")
    ap.add_argument("--note", action="append", default=[], help="free-text note for the report")
    ap.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.no_cudnn_sdp:  # cuDNN builds a plan per new shape: costly when the KV length moves every round
        torch.backends.cuda.enable_cudnn_sdp(False)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    contexts = [int(c) for c in args.contexts.split(",") if c]
    sweep_budgets = [int(b) for b in args.sweep.split(",") if b]
    tree = TREES[args.tree]
    tag = args.tag or torch.device(args.device).type
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    t = time.perf_counter()
    if args.random_weights:
        tok = None
        target_model, draft_model = random_models(dtype, args.device)
        args.target, args.draft = "random (Qwen2.5-1.5B shapes)", "random (2 layers)"
        args.note.append(
            "random weights: only verify-step times are meaningful (not tau, agreement, tokens/s)"
        )
    else:
        tok = load_tokenizer(args.target)
        target_model = load_model(args.target, dtype=dtype, device=args.device)
        draft_model = load_model(args.draft, dtype=dtype, device=args.device)
    print(f"models loaded in {time.perf_counter() - t:.0f}s", flush=True)
    # Sessions must not expire while the other modes run (a long CPU run takes far over 10 minutes).
    tcfg = dict(
        device=args.device,
        dtype=args.dtype,
        max_context=max(contexts) + args.new_tokens + 512,
        session_ttl_s=7 * 86400.0,
        fold_gqa=not args.no_fold_gqa,
    )
    full_engine = TargetEngine(target_model, TargetConfig(**tcfg))
    draft = DraftEngine(
        draft_model,
        DraftConfig(
            max_context=tcfg["max_context"],
            session_ttl_s=7 * 86400.0,
            tuning=EngineTuning(fold_gqa=not args.no_fold_gqa),
        ),
    )
    rows: list[dict[str, Any]] = []
    sweep: list[dict[str, Any]] = []
    prefill_s: dict[int, float] = {}
    task = ""
    meta = {
        "tag": tag,
        "target": args.target,
        "draft": args.draft,
        "dtype": args.dtype,
        "device": args.device,
        "device_name": torch.cuda.get_device_name(0)
        if torch.device(args.device).type == "cuda"
        else platform.processor() or "cpu",
        "threads": torch.get_num_threads(),
        "tree": args.tree,
        "new_tokens": args.new_tokens,
        "prompt_kind": args.prompt_kind,
        "task": task,
        "threshold": args.threshold,
        "refresh": args.refresh,
        "retrieval_refresh": args.retrieval_refresh,
        "query_window": args.query_window,
        "rectify_margin": args.rectify_margin,
        "reduce": args.reduce,
        "window_blocks": args.window_blocks,
        "budget": args.budget,
        "prefill_s": prefill_s,
        "torch": torch.__version__,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "cpu_count": os.cpu_count(),
        "cudnn_sdp": torch.backends.cuda.cudnn_sdp_enabled(),
        "fold_gqa": not args.no_fold_gqa,
        "notes": args.note,
    }
    for i, ctx in enumerate(contexts):
        if tok is None:
            g = torch.Generator().manual_seed(ctx)
            prompt, task = (
                torch.randint(0, QWEN_1_5B["vocab_size"], (ctx,), generator=g).tolist(),
                "random ids",
            )
        else:
            prompt, task = build_prompt(tok, args.prompt_kind, ctx)
        meta["task"] = task
        cap = ctx + args.new_tokens + tree.max_nodes + 64
        t = time.perf_counter()
        first = prefill(full_engine, draft, prompt, tree, cap)
        full_engine.synchronize()
        prefill_s[ctx] = round(time.perf_counter() - t, 1)
        print(f"[{ctx}] prefilled in {prefill_s[ctx]}s", flush=True)

        def run(
            engine: TargetEngine, mode: str, budget: int | None, ctx_run: tuple = (prompt, first, cap)
        ) -> RunResult:
            clone_target_session(full_engine, "base", engine, mode)
            p, f0, c = ctx_run
            toks, vs, modes, acc, wall = decode_from(engine, draft, mode, p, f0, args.new_tokens, tree, c)
            stats = engine.specpv_stats
            return RunResult(
                mode, budget, toks, len(vs), wall, vs, modes, acc, stats.summary() if stats else None
            )

        full = run(full_engine, "full", None)
        ref = full.summary(None)
        base_row = {"context": ctx, **full.summary(full.tokens)}
        rows.append(base_row)
        print(json.dumps(base_row), flush=True)
        save(out_dir / f"long_context-{tag}", meta, rows, sweep)
        budgets = [args.budget] + (sweep_budgets if i == len(contexts) - 1 else [])
        done: dict[int, dict[str, Any]] = {}
        for j, b in enumerate(budgets):
            if b in done:
                row = dict(done[b])
            else:
                engine = TargetEngine(target_model, TargetConfig(**tcfg, specpv=pv_config(b, args)))
                res = run(engine, "partial", b)
                engine.shutdown()
                row = {"context": ctx, **res.summary(full.tokens)}
                if tok is not None:  # real weights: is the split a near-tie of the full model?
                    row["divergence"] = divergence_gap(target_model, prompt, full.tokens, res.tokens)
                if args.step_reps:
                    ab = TargetEngine(target_model, TargetConfig(**tcfg, specpv=pv_config(b, args, 10**6)))
                    row["step"] = step_timing(
                        full_engine, ab, draft, prompt, first, tree, cap, args.step_reps
                    )
                    ab.shutdown()
                row["verify_speedup"] = (
                    (ref["verify_all_ms"] / row["verify_partial_ms"]) if row["verify_partial_ms"] else None
                )
                row["e2e_speedup"] = (
                    row["tokens_per_s"] / ref["tokens_per_s"] if ref["tokens_per_s"] else None
                )
                row["tau_change"] = row["tau"] / ref["tau"] - 1.0 if ref["tau"] else None
                done[b] = row
                print(json.dumps(row), flush=True)
            (rows if j == 0 else sweep).append(row)
            save(out_dir / f"long_context-{tag}", meta, rows, sweep)
        full_engine.end_session("base")

    path = save(out_dir / f"long_context-{tag}", meta, rows, sweep, final=True)
    print(
        f"wrote {path}.json, .md" + (", .png" if Path(f"{path}.png").exists() else " (no matplotlib: no PNG)")
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
