"""What ``specsplit bench`` measured, summarised: per-run records, aggregation, markdown table, PNG plot.

Vocabulary (the same for every decoder, Hugging Face or SpecSplit):

- *round*: one target forward that commits tokens. Target-only decoding has one round per token.
- *drafted depth*: the longest drafted path checked in a round (0 when nothing was drafted).
- *accepted*: drafted tokens the target agreed with in that round; each round also commits one target
  token, so ``tau = (accepted + rounds) / rounds`` is the mean number of tokens per round.
- *per-position acceptance*: entry ``i`` is the fraction of rounds that drafted ``>= i+1`` tokens and
  accepted ``>= i+1`` of them (acceptance by depth).

Throughput of a decoder over a set of prompts is ``sum(generated tokens) / sum(wall time)`` of one
repeat; the reported value is the median over repeats with its min and max. Speedups are paired per
repeat (this decoder's repeat ``r`` over the baseline's repeat ``r``, measured interleaved), then the
median and spread of those ratios.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import re
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

SPLIT_KEYS = ("draft", "verify", "transport", "host")


@dataclass
class RunRecord:
    """One timed ``generate`` of one decoder on one prompt.

    Attributes:
        decoder: decoder name (e.g. ``"specsplit-chain"``).
        prompt_id: id of the prompt.
        category: prompt category.
        repeat: 0-based repeat index.
        prompt_tokens: prompt length in tokens.
        new_tokens: tokens generated (EOS included when it was generated).
        time_s: wall time of the call, device-synchronised on both ends.
        rounds: target forwards that committed tokens.
        drafted: sum over rounds of the drafted depth.
        accepted: sum over rounds of the accepted drafted tokens.
        pos_eligible: entry ``i``: rounds that drafted ``>= i+1`` tokens.
        pos_accepted: entry ``i``: rounds that accepted ``>= i+1`` tokens.
        split_s: summed seconds per round phase (``draft``, ``verify``, ``transport``, ``host``);
            ``None`` for decoders that do not report it (Hugging Face).
        matches_baseline: the new tokens equal the baseline decoder's on this prompt (``None`` when
            there is no baseline in the run).
        first_diff: index of the first differing new token (``None`` when equal or unknown).
    """

    decoder: str
    prompt_id: str
    category: str
    repeat: int
    prompt_tokens: int
    new_tokens: int
    time_s: float
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    pos_eligible: list[int] = field(default_factory=list)
    pos_accepted: list[int] = field(default_factory=list)
    split_s: dict[str, float] | None = None
    matches_baseline: bool | None = None
    first_diff: int | None = None


def rounds_to_counts(rounds: Sequence[tuple[int, int]]) -> tuple[int, int, list[int], list[int]]:
    """``[(drafted depth, accepted), ...]`` -> ``(drafted, accepted, pos_eligible, pos_accepted)``."""
    depth = max((d for d, _ in rounds), default=0)
    eligible = [sum(d >= i for d, _ in rounds) for i in range(1, depth + 1)]
    accepted = [sum(a >= i for d, a in rounds if d >= i) for i in range(1, depth + 1)]
    return sum(d for d, _ in rounds), sum(a for _, a in rounds), eligible, accepted


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first position where ``a`` and ``b`` differ (a length difference counts)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _spread(values: Sequence[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _tps_by_repeat(recs: Sequence[RunRecord]) -> dict[int, float]:
    out: dict[int, float] = {}
    for r in sorted({x.repeat for x in recs}):
        sel = [x for x in recs if x.repeat == r]
        t = sum(x.time_s for x in sel)
        out[r] = sum(x.new_tokens for x in sel) / t if t > 0 else 0.0
    return out


def _speedup(mine: dict[int, float], base: dict[int, float]) -> dict[str, float] | None:
    """Paired per repeat; a repeat the baseline skipped (``--baseline-repeats``) uses its median."""
    if not base:
        return None
    fallback = statistics.median(base.values())
    ratios = [mine[r] / base.get(r, fallback) for r in mine if base.get(r, fallback) > 0]
    return _spread(ratios)


def _sum_lists(lists: Sequence[list[int]]) -> list[int]:
    n = max((len(x) for x in lists), default=0)
    return [sum(x[i] for x in lists if i < len(x)) for i in range(n)]


def scope_metrics(
    recs: Sequence[RunRecord], base: Sequence[RunRecord], assisted: Sequence[RunRecord]
) -> dict[str, Any]:
    """Metrics of one decoder over one set of prompts (all repeats).

    Args:
        recs: this decoder's records.
        base: the target-only HF ``generate()`` records on the same prompts (may be empty).
        assisted: the HF assisted-generation records on the same prompts (may be empty).
    """
    tps = _tps_by_repeat(recs)
    rounds = sum(x.rounds for x in recs)
    drafted = sum(x.drafted for x in recs)
    accepted = sum(x.accepted for x in recs)
    elig = _sum_lists([x.pos_eligible for x in recs])
    acc = _sum_lists([x.pos_accepted for x in recs])
    split = None
    if recs and all(x.split_s is not None for x in recs) and rounds:
        keys = (*SPLIT_KEYS, "overlap_draft")
        split = {k: 1000.0 * sum((x.split_s or {}).get(k, 0.0) for x in recs) / rounds for k in keys}
    first = min((x.repeat for x in recs), default=0)
    matches = [x.matches_baseline for x in recs if x.repeat == first and x.matches_baseline is not None]
    n_prompts = len({x.prompt_id for x in recs})
    return {
        "prompts": n_prompts,
        "new_tokens_per_prompt": sum(x.new_tokens for x in recs) / len(recs) if recs else 0.0,
        "tokens_per_s": _spread(list(tps.values())),
        "speedup_vs_hf_target": _speedup(tps, _tps_by_repeat(base)) if base else None,
        "speedup_vs_hf_assisted": _speedup(tps, _tps_by_repeat(assisted)) if assisted else None,
        "rounds": rounds,
        "tau": (accepted + rounds) / rounds if rounds else None,
        "acceptance_rate": accepted / drafted if drafted else None,
        "per_position_acceptance": [a / e if e else 0.0 for a, e in zip(acc, elig, strict=True)],
        "exact_match_rate": sum(matches) / len(matches) if matches else None,
        "mismatched_prompts": sorted(
            {x.prompt_id for x in recs if x.repeat == first and x.matches_baseline is False}
        ),
        "time_split_ms_per_round": split,
        "overlap_hit_rate": _hit_rate(recs),
        "overlap_spec_rounds": sum((x.split_s or {}).get("spec_rounds", 0.0) for x in recs),
        "drafters": _drafters(recs),
    }


def _drafters(recs: Sequence[RunRecord]) -> dict[str, dict[str, float]] | None:
    """Per drafter (``model``, ``ngram``, ``hybrid``, ``none``): its rounds and its own draft time per
    round in milliseconds (from the ``rounds_<kind>`` / ``draft_<kind>_s`` split keys)."""
    out: dict[str, dict[str, float]] = {}
    for x in recs:
        for key, value in (x.split_s or {}).items():
            if key.startswith("rounds_"):
                kind = key.removeprefix("rounds_")
                row = out.setdefault(kind, {"rounds": 0.0, "draft_s": 0.0})
                row["rounds"] += value
                row["draft_s"] += (x.split_s or {}).get(f"draft_{kind}_s", 0.0)
    for row in out.values():
        row["draft_ms_per_round"] = 1000.0 * row["draft_s"] / row["rounds"] if row["rounds"] else 0.0
    return out or None


def _hit_rate(recs: Sequence[RunRecord]) -> float | None:
    """Overlapped pipeline: share of speculative next-round drafts that held (None: not overlapped)."""
    tried = sum((x.split_s or {}).get("spec_rounds", 0.0) for x in recs)
    return sum((x.split_s or {}).get("spec_hits", 0.0) for x in recs) / tried if tried else None


def summarize(
    records: Sequence[RunRecord],
    decoders: Sequence[str],
    categories: Sequence[str],
    baseline: str,
    assisted: str,
) -> dict[str, Any]:
    """``{decoder: {"overall": metrics, "by_category": {category: metrics}}}`` (see :func:`scope_metrics`)."""
    out: dict[str, Any] = {}

    def pick(name: str, cat: str | None) -> list[RunRecord]:
        return [x for x in records if x.decoder == name and (cat is None or x.category == cat)]

    for name in decoders:
        out[name] = {
            "overall": scope_metrics(pick(name, None), pick(baseline, None), pick(assisted, None)),
            "by_category": {
                c: scope_metrics(pick(name, c), pick(baseline, c), pick(assisted, c))
                for c in categories
                if pick(name, c)
            },
        }
    return out


# --------------------------------------------------------------------------------------------- machine


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def machine_info(devices: Sequence[str]) -> dict[str, Any]:
    """Host, accelerator and library versions for the results file."""
    import torch
    import transformers

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": _cpu_model(),
        "cpu_cores": _cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "devices": list(devices),
        "gpus": [],
    }
    if any(d.startswith("cuda") for d in devices) and torch.cuda.is_available():
        info["cuda"] = torch.version.cuda
        for d in sorted(set(devices)):
            if d.startswith("cuda"):
                p = torch.cuda.get_device_properties(torch.device(d))
                info["gpus"].append(
                    {"device": d, "name": p.name, "memory_gib": round(p.total_memory / 2**30, 1)}
                )
    return info


def machine_slug(info: dict[str, Any]) -> str:
    """``cpu-2core``, ``h100``, ``h200``, ``h100x2`` (two GPUs used), or a slug of the GPU name."""
    gpus = info.get("gpus") or []
    if not gpus:
        return f"cpu-{info.get('cpu_cores', 1)}core"
    name = gpus[0]["name"].lower()
    m = re.search(r"\b([ahlbv]\d{2,3}|rtx\s?\d{4}|mi\d{3})\b", name)
    slug = re.sub(r"[^a-z0-9]+", "", m.group(1)) if m else re.sub(r"[^a-z0-9]+", "-", name).strip("-")
    return f"{slug}x{len(gpus)}" if len(gpus) > 1 else slug


# --------------------------------------------------------------------------------------------- markdown


def _fmt(x: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "–" if x is None else f"{x:{spec}}{suffix}"


def _fmt_spread(s: dict[str, float] | None, spec: str = ".2f", suffix: str = "") -> str:
    if s is None:
        return "–"
    if abs(s["max"] - s["min"]) < 1e-12:
        return f"{s['median']:{spec}}{suffix}"
    return f"{s['median']:{spec}}{suffix} [{s['min']:{spec}}–{s['max']:{spec}}]"


def to_markdown(result: dict[str, Any]) -> str:
    """The human-readable table of a results dict (as written to ``<machine>-<date>.json``)."""
    cfg, summary = result["config"], result["summary"]
    decs = [d for d in cfg["decoders"] if d in summary]
    labels = result.get("decoder_labels", {})
    lines = [
        f"# SpecSplit benchmark: `{cfg['suite']}` suite on `{result['machine']['slug']}`",
        "",
        f"- date (UTC): {result['created_utc']}",
        f"- command: `{result['command']}`",
        f"- target: `{cfg['target']}`, draft: `{cfg['draft']}`, dtype {cfg['dtype']}, "
        f"device {cfg['device']}, draft device {cfg['draft_device']}",
        f"- {cfg['num_prompts']} prompts ({', '.join(cfg['categories'])}), max_new_tokens "
        f"{cfg['max_new_tokens']}, {cfg['repeats']} repeat(s) after one warm-up, greedy, "
        f"K = {cfg['num_draft_tokens']} draft tokens",
        f"- machine: {result['machine']['cpu']} ({result['machine']['cpu_cores']} cores), "
        + (", ".join(g["name"] for g in result["machine"]["gpus"]) or "no GPU")
        + f"; {result['machine']['torch_threads']} torch thread(s); torch {result['machine']['torch']}, "
        f"transformers {result['machine']['transformers']}",
    ]
    for note in result.get("notes", []):
        lines.append(f"- note: {note}")
    if cfg.get("skipped"):
        for name, why in cfg["skipped"].items():
            lines.append(f"- skipped `{name}`: {why}")
    lines += [
        "",
        "Tokens/s is the median over repeats [min–max]; speedups are paired per repeat. Exact match: share "
        "of prompts whose new tokens equal `hf-target`'s. Time split: mean milliseconds per round "
        "(draft / verify / transport / host)"
        + (
            ", host wall time without device syncs: a phase's GPU work may be counted in the next one."
            if cfg.get("sync_timing") is False
            else "."
        ),
        "",
        "## Overall",
        "",
        "| decoder | tokens/s | × HF generate | × HF assisted | tau | acceptance | exact match | "
        "draft / verify / transport / host ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for d in decs:
        m = summary[d]["overall"]
        split = m["time_split_ms_per_round"]
        split_s = " / ".join(f"{split[k]:.1f}" for k in SPLIT_KEYS) if split else "–"
        lines.append(
            f"| `{d}` | {_fmt_spread(m['tokens_per_s'])} | {_fmt_spread(m['speedup_vs_hf_target'], suffix='×')} "
            f"| {_fmt_spread(m['speedup_vs_hf_assisted'], suffix='×')} | {_fmt(m['tau'])} "
            f"| {_fmt(m['acceptance_rate'])} | {_fmt(m['exact_match_rate'], '.0%')} | {split_s} |"
        )
    for d in decs:
        m = summary[d]["overall"]
        if m.get("overlap_hit_rate") is not None:
            spec = (m["time_split_ms_per_round"] or {}).get("overlap_draft")
            tried = m.get("overlap_spec_rounds")  # absent from results written before it was recorded
            where = (
                f"ran in {tried:.0f} of {m['rounds']} rounds and "
                if tried is not None and m.get("rounds")
                else ""
            )
            lines.append(
                f"\n`{d}`: a speculative next-round draft {where}held in {m['overlap_hit_rate']:.0%} of "
                + ("those" if where else "rounds")
                + (f"; it ran {spec:.1f} ms per round beside verification" if spec is not None else "")
                + " (the draft column is the blocking draft of the rounds where it did not hold)."
            )
    bound = cfg.get("weight_read_bound")
    if bound:
        of_bound = [
            f"`{d}` runs at {summary[d]['overall']['tokens_per_s']['median'] / bound['bound_tokens_per_s']:.0%} of it"
            for d in decs
            if d.startswith("specsplit-target-only") and summary[d]["overall"]["tokens_per_s"]
        ]
        lines.append(
            f"\nWeight-read bound of the target: {bound['weight_bytes'] / 1e9:.2f} GB at the "
            f"{bound['copy_bandwidth_GBps']:.0f} GB/s of a device-to-device copy measured at the start of "
            f"the run = {bound['bound_ms']:.3f} ms a token, {bound['bound_tokens_per_s']:.0f} tokens/s"
            + ("; " + "; ".join(of_bound) if of_bound else "")
            + "."
        )
    lines += ["", "Decoders:", ""]
    lines += [f"- `{d}`: {labels.get(d, '')}" for d in decs]
    cats = [c for c in cfg["categories"] if any(c in summary[d]["by_category"] for d in decs)]
    for title, key, suffix in (
        ("Speedup over HF `generate()` by category", "speedup_vs_hf_target", "×"),
        ("Tokens/s by category", "tokens_per_s", ""),
    ):
        lines += [
            "",
            f"## {title}",
            "",
            "| decoder | " + " | ".join(cats) + " |",
            "|---" * (len(cats) + 1) + "|",
        ]
        for d in decs:
            cells = []
            for c in cats:
                s = summary[d]["by_category"].get(c, {}).get(key)
                cells.append(_fmt(s["median"] if s else None, ".2f", suffix if s else ""))
            lines.append(f"| `{d}` | " + " | ".join(cells) + " |")
    depth = min(max((len(summary[d]["overall"]["per_position_acceptance"]) for d in decs), default=0), 10)
    if depth:
        lines += ["", "## Acceptance by depth (per-position, first 10 depths)", ""]
        lines += ["| decoder | tau | " + " | ".join(str(i) for i in range(1, depth + 1)) + " |"]
        lines += ["|---" * (depth + 2) + "|"]
        for d in decs:
            pp = summary[d]["overall"]["per_position_acceptance"][:depth]
            if pp:
                cells = [f"{p:.2f}" for p in pp] + ["–"] * (depth - len(pp))
                lines.append(f"| `{d}` | {_fmt(summary[d]['overall']['tau'])} | " + " | ".join(cells) + " |")
    lines += _drafter_lines(summary, decs, cats)
    mism = {
        d: summary[d]["overall"]["mismatched_prompts"]
        for d in decs
        if summary[d]["overall"]["mismatched_prompts"]
    }
    if mism:
        lines += ["", "## Outputs that differ from `hf-target`", ""]
        for d, ids in mism.items():
            lines.append(f"- `{d}`: {', '.join(ids)}")
    return "\n".join(lines) + "\n"


def _drafter_lines(summary: dict[str, Any], decs: Sequence[str], cats: Sequence[str]) -> list[str]:
    """Rounds by drafter and each drafter's own time per round, per decoder and category."""
    rows = [(d, c) for d in decs for c in ("overall", *cats) if _scope(summary, d, c).get("drafters")]
    if not rows:
        return []
    kinds = sorted({k for d, c in rows for k in _scope(summary, d, c)["drafters"]})
    lines = ["", "## Drafting: rounds by drafter (share) and its draft time per round", ""]
    lines += ["| decoder | scope | " + " | ".join(kinds) + " |", "|---" * (len(kinds) + 2) + "|"]
    for d, c in rows:
        dr = _scope(summary, d, c)["drafters"]
        total = sum(v["rounds"] for v in dr.values()) or 1.0
        cells = [
            f"{dr[k]['rounds'] / total:.0%}, {dr[k]['draft_ms_per_round']:.3f} ms" if k in dr else "–"
            for k in kinds
        ]
        lines.append(f"| `{d}` | {c} | " + " | ".join(cells) + " |")
    return lines


def _scope(summary: dict[str, Any], decoder: str, scope: str) -> dict[str, Any]:
    entry = summary[decoder]
    return dict(entry["overall"] if scope == "overall" else entry["by_category"].get(scope) or {})


# --------------------------------------------------------------------------------------------- plot


def write_result(
    result: dict[str, Any],
    out: Path,
    name: str,
    table: Callable[[dict[str, Any]], str],
    plot: Callable[[dict[str, Any], Path], bool],
) -> str:
    """A benchmark script's ``<out>/<name>.json``, ``.md`` (``table(result)``) and ``.png``
    (``plot(result, path)``, skipped without matplotlib); returns the Markdown."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    md = table(result)
    (out / f"{name}.md").write_text(md)
    plot(result, out / f"{name}.png")
    return md


def add_pair_arguments(ap: Any, prompts_per_category: int) -> None:
    """The model-pair options the GPU benchmark scripts share: ``--draft``, ``--target``, ``--device``,
    ``--dtype``, ``--prompts-per-category`` and ``--dynamic-tree``."""
    ap.add_argument("--draft", required=True, help="draft model directory or alias")
    ap.add_argument("--target", required=True, help="target model directory or alias")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--prompts-per-category", type=int, default=prompts_per_category)
    ap.add_argument("--dynamic-tree", default="4,4,24,5", help="TOPK,WIDTH,BUDGET,DEPTH")


def rerender(
    path: Path, table: Callable[[dict[str, Any]], str], plot: Callable[[dict[str, Any], Path], bool]
) -> str:
    """:func:`write_result` again from a committed ``.json`` (e.g. after adding a note to it)."""
    return write_result(json.loads(path.read_text()), path.parent, path.stem, table, plot)


def save_figure(fig: Any, path: Path) -> bool:
    """Lay out, write and close a benchmark figure; True (the caller had matplotlib)."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend, or ``None`` (with a warning) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: no PNG (pip install 'specsplit[bench]')")
        return None
    return plt


_TARGET_ONLY = "specsplit-target-only"


def speedup_bars(
    summary: dict[str, Any], decs: Sequence[str], cats: Sequence[str]
) -> tuple[str, dict[str, list[float]]]:
    """The plot's bars: each decoder's median speedup over HF ``generate()`` per category (``"all"``:
    overall), or, in a run without HF ``generate()``, its tokens/s over our target-only decoder's;
    0 where there is nothing to divide. Returns ``(axis label, {decoder: values})``."""
    base = None if "hf-target" in summary else next((d for d in decs if d.startswith(_TARGET_ONLY)), None)

    def scope(d: str, c: str) -> dict[str, Any]:
        out: dict[str, Any] = summary[d]["overall"] if c == "all" else summary[d]["by_category"].get(c, {})
        return out

    bars: dict[str, list[float]] = {}
    for d in decs:
        vals = []
        for c in cats:
            m = scope(d, c)
            if base is None:
                s = m.get("speedup_vs_hf_target") if m else None
                vals.append(s["median"] if s else 0.0)
            else:
                b = scope(base, c).get("tokens_per_s")
                vals.append(m["tokens_per_s"]["median"] / b["median"] if m and b and b["median"] else 0.0)
        bars[d] = vals
    label = "speedup over HF generate() (tokens/s ratio)" if base is None else f"tokens/s ratio to {base}"
    return label, bars


def write_plot(result: dict[str, Any], path: Path) -> bool:
    """Speedup by category per decoder (over HF ``generate()``, or over our target-only decode in a run
    without it), and acceptance by depth; ``False`` (with a warning) without matplotlib."""
    plt = pyplot()
    if plt is None:
        return False
    cfg, summary = result["config"], result["summary"]
    decs = [d for d in cfg["decoders"] if d in summary and d != "hf-target"]
    cats = [c for c in cfg["categories"] if any(c in summary[d]["by_category"] for d in decs)] + ["all"]
    label, bars = speedup_bars(summary, decs, cats)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(15, 6.5), gridspec_kw={"width_ratios": [2.2, 1]})
    width = 0.8 / max(len(decs), 1)
    cmap = plt.get_cmap("tab10")
    for i, d in enumerate(decs):
        xs = [j + (i - (len(decs) - 1) / 2) * width for j in range(len(cats))]
        ax1.bar(xs, bars[d], width, label=d, color=cmap(i % 10))
    ax1.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax1.set_xticks(range(len(cats)), cats)
    ax1.set_ylabel(label)
    ax1.set_title(f"Speedup by category — {result['machine']['slug']}, {cfg['target']} / {cfg['draft']}")
    ax1.legend(fontsize=8, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.07))
    for i, d in enumerate(decs):
        pp = summary[d]["overall"]["per_position_acceptance"][:10]
        if pp:
            ax2.plot(range(1, len(pp) + 1), pp, marker="o", label=d, color=cmap(i % 10))
    ax2.set_ylim(0, 1.05)
    ax2.set_xlabel("draft depth d")
    ax2.set_ylabel("share of rounds drafting >= d that accept >= d")
    ax2.set_title("Acceptance by depth")
    ax2.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
