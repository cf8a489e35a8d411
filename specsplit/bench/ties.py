"""Are the bench's greedy mismatches against HF ``generate()`` numerical near-ties? Measure it.

In bf16/fp16 a decoder's greedy output may differ from ``generate()``'s only where the target's two
best tokens are numerically tied (DESIGN.md, "Invariants -> Fidelity"); this module shows it for
every mismatch instead of assuming it.

For each ``(prompt, reference = HF generate's tokens, other = a decoder's tokens)`` that differ, let
``j`` be the first differing new token. Both sequences agree before ``j``, so both decoders saw the
same context ``prompt + reference[:j]``; one forward of the target over that context (no cache, same
dtype as the bench) and one of a float32 copy of the *same weights* give, at the last position, the
logits of ``reference[j]`` and ``other[j]``.

Near-tie criterion (documented in the output as well):

1. *Noise scale.* On the same prompts, at every position of ``prompt + reference`` that predicts a
   generated token ("ordinary positions"), take the float32 top-2 tokens ``(a, b)`` and record
   ``|(l_bf16[a] - l_bf16[b]) - (l_fp32[a] - l_fp32[b])|``: how far low-precision arithmetic moves
   exactly the quantity greedy decoding decides on. Its 99th percentile is ``noise_p99``.
2. *Threshold.* ``threshold = factor * noise_p99`` (``factor`` 3 by default). Two bf16 computations
   of the same gap (HF's kernels and ours: other shapes, cache layouts, reduction orders) can disagree
   in sign only when the true gap is within the sum of their two errors, i.e. about ``2 * noise``; the
   third unit is margin.
3. A mismatch is a **near-tie** when both tokens are in the target's bf16 top-2 at position ``j``
   (rank by strict ">" so bf16 logit ties share a rank) **and** ``|gap_fp32| <= threshold`` where
   ``gap_fp32 = l_fp32[reference[j]] - l_fp32[other[j]]``. Anything else (a token ranked third or
   lower, a wide gap, or a length difference without a differing token) is reported as NOT a
   near-tie: that is a bug, not rounding.

The float32 model is the bf16 model's weights upcast (:func:`fp32_copy`), not a separate float32
checkpoint: the question is what exact arithmetic on the weights every decoder used would choose.
The raw gaps, the noise-normalised gap and the float32 probability difference are reported too, so a
reader can apply a stricter rule.
"""

from __future__ import annotations

import copy
import gc
import logging
import math
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import torch

from specsplit.bench.report import first_difference

logger = logging.getLogger(__name__)

DEFAULT_FACTOR = 3.0
DEFAULT_NOISE_POSITIONS = 256
MAX_MD_ROWS = 60


class TiePair(NamedTuple):
    """One decoder's output on one prompt next to the reference (HF ``generate()``) output.

    Attributes:
        prompt_ids: the prompt's token ids.
        reference_ids: the reference decoder's new tokens.
        other_ids: the compared decoder's new tokens.
        decoder: the compared decoder's name.
        prompt_id: the prompt's id.
    """

    prompt_ids: Sequence[int]
    reference_ids: Sequence[int]
    other_ids: Sequence[int]
    decoder: str = ""
    prompt_id: str = ""


def fp32_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A float32 copy of ``model`` on its device: the same weights, upcast exactly, in eval mode."""
    return copy.deepcopy(model).float().eval()


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _dtype(model: torch.nn.Module) -> torch.dtype:
    return next(model.parameters()).dtype


@torch.inference_mode()
def _logits(model: torch.nn.Module, ids: Sequence[int], keep: int) -> torch.Tensor:
    """Float32 logits ``[keep, vocab]`` of the last ``keep`` positions of one uncached forward (on CPU)."""
    x = torch.tensor([list(ids)], dtype=torch.long, device=_device(model))
    mask = torch.ones_like(x)
    try:
        out = model(input_ids=x, attention_mask=mask, use_cache=False, logits_to_keep=keep)
    except TypeError:  # a model without logits_to_keep
        out = model(input_ids=x, attention_mask=mask, use_cache=False)
    return out.logits[0, -keep:].float().cpu()


def _rank(logits: torch.Tensor, tok: int) -> int:
    """0-based rank of ``tok``: how many tokens have a strictly larger logit (ties share a rank)."""
    return int((logits > logits[tok]).sum())


def _top2(logits: torch.Tensor) -> list[list[float | int]]:
    v, i = logits.topk(2)
    return [[int(i[0]), float(v[0])], [int(i[1]), float(v[1])]]


def _text(tokenizer: Any, tok: int | None) -> str | None:
    if tokenizer is None or tok is None:
        return None
    try:
        return str(tokenizer.decode([tok]))
    except Exception:  # a label only
        return None


def measure_noise(
    target_model: torch.nn.Module,
    fp32_model: torch.nn.Module,
    sequences: Iterable[tuple[Sequence[int], Sequence[int]]],
    noise_positions: int | None = DEFAULT_NOISE_POSITIONS,
) -> dict[str, Any]:
    """How much the target's dtype moves the top-2 logit gap, at ordinary positions.

    Args:
        target_model: the model in the bench's dtype.
        fp32_model: its float32 copy (may be ``target_model`` itself when that is float32).
        sequences: ``(prompt_ids, reference_ids)``; the positions that predict ``reference_ids`` are used.
        noise_positions: at most this many positions per sequence, evenly spaced (``None``: all).

    Returns:
        ``{"positions", "sequences", "gap_noise": {"median", "p99", "max"}, "logit_diff_std"}``:
        ``|gap_low - gap_fp32|`` of the float32 top-2 tokens, and the std of ``l_low - l_fp32`` over
        the whole vocabulary at the same positions.
    """
    noise: list[torch.Tensor] = []
    sq_sum, count, n_seq = 0.0, 0, 0
    for prompt, ref in sequences:
        if not prompt or not ref:
            continue
        keep = len(ref)  # positions P-1 .. P+R-2 predict reference[0 .. R-1]
        ids = list(prompt) + list(ref[:-1])
        lo = _logits(target_model, ids, keep)
        hi = lo if fp32_model is target_model else _logits(fp32_model, ids, keep)
        if noise_positions is not None and keep > noise_positions:
            sel = torch.linspace(0, keep - 1, noise_positions).round().long().unique()
            lo, hi = lo[sel], hi[sel]
        top = hi.topk(2, dim=-1).indices
        g_hi = hi.gather(1, top)
        g_lo = lo.gather(1, top)
        noise.append(((g_lo[:, 0] - g_lo[:, 1]) - (g_hi[:, 0] - g_hi[:, 1])).abs())
        d = (lo - hi).double()
        sq_sum += float((d - d.mean(dim=-1, keepdim=True)).pow(2).sum())
        count += d.numel()
        n_seq += 1
    if not noise:
        return {"positions": 0, "sequences": 0, "gap_noise": None, "logit_diff_std": None}
    allv = torch.cat(noise).double()
    return {
        "positions": int(allv.numel()),
        "sequences": n_seq,
        "gap_noise": {
            "median": float(allv.median()),
            "p99": float(torch.quantile(allv, 0.99)),
            "max": float(allv.max()),
        },
        "logit_diff_std": math.sqrt(sq_sum / count) if count else None,
    }


def analyze_mismatches(
    target_model: torch.nn.Module,
    pairs: Iterable[TiePair | tuple[Any, ...]],
    *,
    fp32_model: torch.nn.Module | None = None,
    noise_positions: int | None = DEFAULT_NOISE_POSITIONS,
    factor: float = DEFAULT_FACTOR,
    tokenizer: Any = None,
    reference_name: str = "hf-target",
) -> dict[str, Any]:
    """Classify every first difference between ``reference_ids`` and ``other_ids`` as near-tie or not.

    Args:
        target_model: the target in the dtype the outputs were produced with (e.g. bf16).
        pairs: :class:`TiePair` (or plain tuples in its field order); equal outputs add no row but
            their prompts still contribute to the noise measurement.
        fp32_model: a float32 copy of the same weights (:func:`fp32_copy`); ``None``: made here and
            freed after use, or the target itself when it is float32 (noise is then 0 and only exact
            ties pass, as float32 fidelity demands).
        noise_positions: positions per prompt for the noise measurement (``None``: all).
        factor: near-tie threshold in units of the p99 gap noise.
        tokenizer: optional, to show the two tokens as text.
        reference_name: the reference decoder's name, for the report.

    Returns:
        A JSON-able dict: ``dtype``, ``reference``, ``criterion``, ``factor``, ``noise``,
        ``threshold``, ``rows`` (one per mismatch), ``summary`` (per decoder) and ``totals``.
    """
    plist = [p if isinstance(p, TiePair) else TiePair(*p) for p in pairs]
    dtype = _dtype(target_model)
    own_copy = fp32_model is None and dtype != torch.float32
    ref_model: torch.nn.Module = target_model
    if fp32_model is not None:
        ref_model = fp32_model
    elif own_copy:
        ref_model = fp32_copy(target_model)
    try:
        return _analyze(target_model, ref_model, plist, dtype, noise_positions, factor, tokenizer,
                        reference_name)  # fmt: skip
    finally:
        if own_copy:
            on_cuda = _device(ref_model).type == "cuda"
            del ref_model
            gc.collect()
            if on_cuda:
                torch.cuda.empty_cache()


def _analyze(
    target: torch.nn.Module,
    ref_model: torch.nn.Module,
    plist: list[TiePair],
    dtype: torch.dtype,
    noise_positions: int | None,
    factor: float,
    tokenizer: Any,
    reference_name: str,
) -> dict[str, Any]:
    seen: dict[tuple[int, ...], tuple[Sequence[int], Sequence[int]]] = {}
    for p in plist:
        seen.setdefault(tuple(p.prompt_ids) + (-1,) + tuple(p.reference_ids), (p.prompt_ids, p.reference_ids))
    noise = measure_noise(target, ref_model, seen.values(), noise_positions)
    p99 = noise["gap_noise"]["p99"] if noise["gap_noise"] else 0.0
    threshold = factor * p99
    dt = str(dtype).removeprefix("torch.")
    cache: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}
    rows: list[dict[str, Any]] = []
    summary: dict[str, dict[str, Any]] = {}
    for p in plist:
        s = summary.setdefault(
            p.decoder,
            {"compared": 0, "mismatches": 0, "near_ties": 0, "not_near_ties": 0,
             "max_abs_gap_fp32": None, "max_abs_prob_diff_fp32": None},
        )  # fmt: skip
        s["compared"] += 1
        j = first_difference(p.other_ids, p.reference_ids)
        if j is None:
            continue
        s["mismatches"] += 1
        ref_tok = int(p.reference_ids[j]) if j < len(p.reference_ids) else None
        oth_tok = int(p.other_ids[j]) if j < len(p.other_ids) else None
        row: dict[str, Any] = {
            "decoder": p.decoder,
            "prompt_id": p.prompt_id,
            "position": j,
            "reference_token": ref_tok,
            "other_token": oth_tok,
            "reference_text": _text(tokenizer, ref_tok),
            "other_text": _text(tokenizer, oth_tok),
        }
        if ref_tok is None or oth_tok is None:
            row.update(near_tie=False, reason="one output is a prefix of the other (length difference)")
            rows.append(row)
            s["not_near_ties"] += 1
            continue
        ctx = tuple(int(t) for t in p.prompt_ids) + tuple(int(t) for t in p.reference_ids[:j])
        if ctx not in cache:
            lo = _logits(target, ctx, 1)[0]
            hi = lo if ref_model is target else _logits(ref_model, ctx, 1)[0]
            cache[ctx] = (lo, hi)
        lo, hi = cache[ctx]
        p_lo, p_hi = lo.softmax(-1), hi.softmax(-1)
        gap_lo = float(lo[ref_tok] - lo[oth_tok])
        gap_hi = float(hi[ref_tok] - hi[oth_tok])
        rank_ref, rank_oth = _rank(lo, ref_tok), _rank(lo, oth_tok)
        prob_diff = float(p_hi[ref_tok] - p_hi[oth_tok])
        reasons = []
        if rank_oth > 1 or rank_ref > 1:
            reasons.append(
                f"not both in the {dt} top-2 (reference rank {rank_ref + 1}, other rank {rank_oth + 1})"
            )
        if abs(gap_hi) > threshold:
            reasons.append(f"|fp32 gap| {abs(gap_hi):.4g} > threshold {threshold:.4g}")
        near = not reasons
        row.update(
            logit_reference=float(lo[ref_tok]),
            logit_other=float(lo[oth_tok]),
            gap=gap_lo,
            gap_fp32=gap_hi,
            gap_over_noise=(abs(gap_hi) / p99) if p99 > 0 else None,
            prob_reference=float(p_lo[ref_tok]),
            prob_other=float(p_lo[oth_tok]),
            prob_reference_fp32=float(p_hi[ref_tok]),
            prob_other_fp32=float(p_hi[oth_tok]),
            prob_diff_fp32=prob_diff,
            rank_reference=rank_ref + 1,
            rank_other=rank_oth + 1,
            rank_other_fp32=_rank(hi, oth_tok) + 1,
            top2=_top2(lo),
            top2_fp32=_top2(hi),
            fp32_prefers="reference" if gap_hi > 0 else "other" if gap_hi < 0 else "tie",
            near_tie=near,
            reason="; ".join(reasons) if reasons else "near-tie",
        )
        rows.append(row)
        s["near_ties" if near else "not_near_ties"] += 1
        for key, val in (("max_abs_gap_fp32", abs(gap_hi)), ("max_abs_prob_diff_fp32", abs(prob_diff))):
            s[key] = val if s[key] is None else max(s[key], val)
    mismatches = len(rows)
    near_ties = sum(r["near_tie"] for r in rows)
    return {
        "dtype": dt,
        "reference": reference_name,
        "criterion": (
            f"both tokens in the target's {dt} top-2 at the first differing position and "
            f"|fp32 logit gap| <= {factor:g} x p99 of the {dt} "
            "noise of the top-2 logit gap measured at ordinary positions of the same prompts"
        ),
        "factor": factor,
        "noise": noise,
        "threshold": threshold,
        "rows": rows,
        "summary": summary,
        "totals": {
            "compared": len(plist),
            "mismatches": mismatches,
            "near_ties": near_ties,
            "not_near_ties": mismatches - near_ties,
            "all_near_ties": near_ties == mismatches,
        },
    }


# --------------------------------------------------------------------------------------------- report


def _f(x: float | None, fmt: str = ".4g") -> str:
    return "-" if x is None else format(x, fmt)


def _tok(tok: int | None, text: str | None) -> str:
    if tok is None:
        return "(end)"
    return f"{tok} `{text!r}`" if text is not None else str(tok)


def to_markdown(analysis: dict[str, Any] | None, max_rows: int = MAX_MD_ROWS) -> str:
    """A markdown section for :func:`analyze_mismatches`'s dict ("" for ``None``)."""
    if not analysis:
        return ""
    ref = analysis.get("reference", "hf-target")
    lines = ["", f"## Mismatches vs `{ref}`: near-tie analysis", ""]
    if "error" in analysis:
        return "\n".join([*lines, f"The analysis failed: {analysis['error']}", ""])
    dt = analysis["dtype"]
    noise = analysis["noise"]
    gn = noise.get("gap_noise")
    t = analysis["totals"]
    if gn:
        lines.append(
            f"{dt} noise of the top-2 logit gap (|gap_{dt} - gap_fp32|, float32 copy of the same weights) "
            f"at {noise['positions']} positions of {noise['sequences']} prompts: median {_f(gn['median'])}, "
            f"p99 {_f(gn['p99'])}, max {_f(gn['max'])}; std of logit differences {_f(noise['logit_diff_std'])}."
        )
    lines += [
        f"Near-tie: {analysis['criterion']} (threshold {_f(analysis['threshold'])}).",
        "",
        f"{t['mismatches']} of {t['compared']} outputs differ from `{ref}`; "
        + (
            "all are near-ties."
            if t["all_near_ties"]
            else f"**{t['not_near_ties']} are NOT near-ties** (a real difference, not rounding)."
        ),
        "",
        "| decoder | compared | mismatches | near-ties | not near-ties | max fp32 gap | max fp32 prob diff |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, s in analysis["summary"].items():
        lines.append(
            f"| `{name}` | {s['compared']} | {s['mismatches']} | {s['near_ties']} | {s['not_near_ties']} "
            f"| {_f(s['max_abs_gap_fp32'])} | {_f(s['max_abs_prob_diff_fp32'])} |"
        )
    rows = analysis["rows"]
    if rows:
        lines += [
            "",
            f"| decoder | prompt | pos | `{ref}` token | other token | ranks {dt} | gap {dt} | gap fp32 "
            "| gap / p99 noise | p diff fp32 | fp32 prefers | near-tie |",
            "|---|---|---:|---|---|---|---:|---:|---:|---:|---|---|",
        ]
        shown = sorted(rows, key=lambda r: (r["near_tie"], -abs(r.get("gap_fp32") or 0.0)))[:max_rows]
        for r in shown:
            ranks = f"{r['rank_reference']}/{r['rank_other']}" if "rank_other" in r else "-"
            verdict = "yes" if r["near_tie"] else f"**no**: {r['reason']}"
            lines.append(
                f"| `{r['decoder']}` | {r['prompt_id']} | {r['position']} "
                f"| {_tok(r['reference_token'], r['reference_text'])} | {_tok(r['other_token'], r['other_text'])} "
                f"| {ranks} | {_f(r.get('gap'))} | {_f(r.get('gap_fp32'))} | {_f(r.get('gap_over_noise'), '.2f')} "
                f"| {_f(r.get('prob_diff_fp32'))} | {r.get('fp32_prefers', '-')} | {verdict} |"
            )
        if len(rows) > len(shown):
            lines.append(f"\n({len(rows) - len(shown)} more near-tie rows in the JSON.)")
    return "\n".join([*lines, ""])


# --------------------------------------------------------------------------------------------- bench


def bench_tie_analysis(
    models: Any,
    prompts: Sequence[Any],
    tokens: dict[tuple[str, str], list[int]],
    baseline: str,
    enabled: bool | None = None,
) -> dict[str, Any] | None:
    """The bench's hook: analyse every decoder's first-repeat output against ``baseline``'s.

    Args:
        models: :class:`specsplit.bench.decoders.BenchModels` (``target``, ``tokenizer``, ``dtype``).
        prompts: the bench prompts (``id``, ``input_ids``).
        tokens: ``{(decoder, prompt id): new tokens}``.
        baseline: the reference decoder's name.
        enabled: ``None`` (auto): only when the dtype is not float32 and some output differs.

    Returns:
        The analysis dict, ``{"reference", "error"}`` if it failed (the timings are kept either way),
        or ``None`` when skipped.
    """
    by_id = {p.id: p for p in prompts}
    pairs = [
        TiePair(by_id[pid].input_ids, tokens[(baseline, pid)], toks, dec, pid)
        for (dec, pid), toks in tokens.items()
        if dec != baseline and (baseline, pid) in tokens and pid in by_id
    ]
    differs = any(first_difference(p.other_ids, p.reference_ids) is not None for p in pairs)
    if enabled is False or not pairs or (enabled is None and (models.dtype == "float32" or not differs)):
        return None
    logger.info("near-tie analysis of %d outputs against %s", len(pairs), baseline)
    try:
        return analyze_mismatches(models.target, pairs, tokenizer=models.tokenizer, reference_name=baseline)
    except Exception as e:  # the timings must still be written
        logger.exception("near-tie analysis failed")
        return {"reference": baseline, "error": f"{type(e).__name__}: {e}"}
