"""Where does a round's time go? A profiled generation split per round and per phase.

:func:`round_timeline` runs one ``generate()`` under the torch profiler with the pipeline's phases
annotated (the draft call and, inside it, the ingest of the accepted tokens and the tree's growth;
the verify call) and reduces the trace with :func:`analyze_trace` to, per round:

- ``wall_ms``: host wall time of the round (from one draft call to the next);
- ``gpu_busy_ms``: the union of the GPU's kernel/copy intervals inside that window, and
  ``gpu_idle_ms`` = wall - busy: time the device waited for the host;
- ``gpu_ms[phase]``: GPU time of the work *launched* in each phase (a graph replay's kernels count
  for the phase that replayed it, wherever they ran);
- ``idle_ms[phase]``: the device's idle time by what the host was doing meanwhile (``glue``: the
  decoding loop between the engine calls);
- ``sync_ms[phase]``: host time blocked in device synchronisations / device-to-host copies;

and, over the whole generation, ``kernels_ms``: GPU time a round by kernel name (largest first;
a kernel replayed from a CUDA graph counts under its own name). :func:`merge_profiles` pools the
summaries of several generations and :func:`profiles_markdown` writes them as a bench report's
section (``specsplit bench --profile-prompts N``).

The profiler slows the host down, so idle times are upper bounds; GPU times are not affected.

    from specsplit.bench.profiling import round_timeline
    summary = round_timeline(generator, input_ids, max_new_tokens=128)
    print(format_summary(summary))
"""

from __future__ import annotations

import bisect
import contextlib
import json
import os
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import torch

PREFIX = "specsplit."
# Annotated calls, outermost first: (object attribute path, method, label).
_PHASES = (
    ("transport", "draft", "draft"),
    ("transport", "verify", "verify"),
    ("transport.draft_engine", "_feed", "draft.ingest"),
    ("transport.draft_engine", "_grow", "draft.grow"),
)
GLUE = "glue"
KERNEL_NAME_CHARS = 90  # kernel names (often long C++ templates) are kept this long
_GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
_RUNTIME_CATS = ("cuda_runtime", "cuda_driver")
_SYNC_NAMES = ("Synchronize", "cudaMemcpy", "cuMemcpy")


def _resolve(root: Any, path: str) -> Any:
    obj = root
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


@contextlib.contextmanager
def _wrapped(generator: Any, points: tuple[tuple[str, str, str], ...], wrap: Any) -> Iterator[None]:
    """Replace each ``(attribute path, method, label)`` of ``generator`` that exists by
    ``wrap(method, label)`` (an instance attribute), removed again on exit."""
    patched: list[tuple[Any, str]] = []
    try:
        for path, method, label in points:
            obj = _resolve(generator, path)
            if obj is None or not hasattr(obj, method):
                continue
            setattr(obj, method, wrap(getattr(obj, method), label))
            patched.append((obj, method))
        yield
    finally:
        for obj, method in patched:
            delattr(obj, method)  # the instance attribute shadowed the class's method


@contextlib.contextmanager
def annotate_phases(generator: Any) -> Iterator[None]:
    """Wrap the pipeline's phases of ``generator`` (a SpecSplitGenerator over a LocalTransport)
    in profiler ranges named ``specsplit.<phase>``; restored on exit."""

    def wrap(fn: Any, label: str) -> Any:
        def inner(*args: Any, **kwargs: Any) -> Any:
            with torch.profiler.record_function(PREFIX + label):
                return fn(*args, **kwargs)

        return inner

    with _wrapped(generator, _PHASES, wrap):
        yield


# Host-side timing points (no profiler): the phases above plus what runs inside them.
_HOST_POINTS = (
    *_PHASES,
    # ``_static``, not the ``static`` property: looking must not build a workspace
    ("transport.draft_engine._workspace._static", "run", "draft.static_run"),
    ("transport.target_engine._verifier", "verify", "verify.locked"),
    ("transport.target_engine._workspace._static", "run", "verify.static_run"),
)


@contextlib.contextmanager
def host_times(generator: Any) -> Iterator[dict[str, list[float]]]:
    """Accumulate host wall seconds and calls per phase (``{label: [seconds, calls]}``) of
    ``generator`` while the block runs, with plain timers: no profiler overhead, no device sync.
    Besides the phases of :func:`annotate_phases`: each engine's static forward (``*.static_run``),
    the target's locked verification, and every CUDA graph replay (``graph.replay``)."""
    acc: dict[str, list[float]] = {}

    def wrap(fn: Any, label: str) -> Any:
        cell = acc.setdefault(label, [0.0, 0])

        def inner(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                cell[0] += time.perf_counter() - t
                cell[1] += 1

        return inner

    replay = torch.cuda.CUDAGraph.replay
    with _wrapped(generator, _HOST_POINTS, wrap):
        torch.cuda.CUDAGraph.replay = wrap(replay, "graph.replay")  # type: ignore[method-assign]
        try:
            yield acc
        finally:
            torch.cuda.CUDAGraph.replay = replay  # type: ignore[method-assign]


def round_timeline(
    generator: Any, input_ids: torch.Tensor, trace_path: str | None = None, **generate_kwargs: Any
) -> dict[str, Any]:
    """Profile one ``generator.generate(input_ids, **generate_kwargs)``; see the module docstring.

    Args:
        trace_path: also keep the Chrome trace there (open it in Perfetto / chrome://tracing).

    Returns:
        :func:`analyze_trace`'s summary.
    """
    acts = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize()
    with annotate_phases(generator), torch.profiler.profile(activities=acts) as prof:
        generator.generate(input_ids, **generate_kwargs)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
        if trace_path:
            os.replace(path, trace_path)
    finally:
        if os.path.exists(path):
            os.remove(path)
    return analyze_trace(events)


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


class _Phases:
    """Innermost annotated phase at a host timestamp."""

    def __init__(self, ranges: list[tuple[float, float, str]]):
        self.ranges = sorted(ranges)
        self.starts = [r[0] for r in self.ranges]

    def split(self, lo: float, hi: float) -> list[tuple[float, float]]:
        """``[lo, hi)`` cut at every phase boundary inside it."""
        cuts = sorted({x for s, e, _ in self.ranges for x in (s, e) if lo < x < hi})
        points = [lo, *cuts, hi]
        return list(zip(points, points[1:], strict=False))

    def at(self, ts: float) -> str:
        best, best_len = GLUE, float("inf")
        i = bisect.bisect_right(self.starts, ts)
        for s, e, name in reversed(self.ranges[max(0, i - 8) : i]):  # phases nest a few deep at most
            if s <= ts < e and e - s < best_len:
                best, best_len = name, e - s
        return best


def analyze_trace(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Reduce a Chrome trace (``traceEvents`` of a profiled, annotated generation) to per-round
    figures and their means; see the module docstring. Times in milliseconds."""
    ranges: list[tuple[float, float, str]] = []
    runtime: dict[Any, float] = {}
    gpu: list[tuple[float, float, Any, str]] = []  # start, end, correlation id, kernel name
    syncs: list[tuple[float, float]] = []
    for ev in events:
        if ev.get("ph") != "X":
            continue
        cat, name = ev.get("cat", ""), ev.get("name", "")
        ts, dur = float(ev.get("ts", 0.0)), float(ev.get("dur", 0.0))
        corr = (ev.get("args") or {}).get("correlation")
        if cat == "user_annotation" and name.startswith(PREFIX):
            ranges.append((ts, ts + dur, name[len(PREFIX) :]))
        elif cat in _RUNTIME_CATS:
            if corr is not None:
                runtime[corr] = ts
            if any(k in name for k in _SYNC_NAMES):
                syncs.append((ts, dur))
        elif cat in _GPU_CATS:
            gpu.append((ts, ts + dur, corr, name[:KERNEL_NAME_CHARS]))
    phases = _Phases(ranges)
    calls = sorted(r for r in ranges if r[2] in ("draft", "verify"))
    if not calls:
        raise ValueError("the trace holds no annotated draft/verify call (profile with annotate_phases)")
    # A round starts at a draft call, or at a verify call not preceded by its round's draft call.
    starts = [s for i, (s, _, n) in enumerate(calls) if n == "draft" or i == 0 or calls[i - 1][2] != "draft"]
    end = max(max(e for _, e, _ in calls), max((e for _, e, *_ in gpu), default=0.0))
    bounds = list(zip(starts, starts[1:] + [end], strict=True))
    busy_spans = _union([(s, e) for s, e, *_ in gpu])
    rounds: list[dict[str, Any]] = []
    for lo, hi in bounds:
        rounds.append(
            {"wall_ms": (hi - lo) / 1e3, "gpu_busy_ms": 0.0, "gpu_ms": {}, "idle_ms": {}, "sync_ms": {}}
        )

    def round_of(ts: float) -> int:
        return max(0, bisect.bisect_right(starts, ts) - 1)

    kernels: dict[str, float] = {}
    for s, e, corr, name in gpu:
        launched = runtime.get(corr, s)
        r = rounds[round_of(launched)]
        ph = phases.at(launched)
        r["gpu_ms"][ph] = r["gpu_ms"].get(ph, 0.0) + (e - s) / 1e3
        if launched >= starts[0]:
            kernels[name] = kernels.get(name, 0.0) + (e - s) / 1e3
    for lo_i, (lo, hi) in enumerate(bounds):  # busy and idle inside each round's window
        r, t = rounds[lo_i], lo
        j = bisect.bisect_left(busy_spans, (lo, lo))
        j = max(0, j - 1)
        idle: list[tuple[float, float]] = []
        for s, e in busy_spans[j:]:
            if s >= hi:
                break
            s, e = max(s, lo), min(e, hi)
            if e <= s:
                continue
            r["gpu_busy_ms"] += (e - s) / 1e3
            if s > t:
                idle.append((t, s))
            t = max(t, e)
        if t < hi:
            idle.append((t, hi))
        for s, e in idle:
            for a, b in phases.split(s, e):
                ph = phases.at((a + b) / 2)
                r["idle_ms"][ph] = r["idle_ms"].get(ph, 0.0) + (b - a) / 1e3
        r["gpu_idle_ms"] = r["wall_ms"] - r["gpu_busy_ms"]
    for ts, dur in syncs:
        r = rounds[round_of(ts)]
        ph = phases.at(ts)
        r["sync_ms"][ph] = r["sync_ms"].get(ph, 0.0) + dur / 1e3
    mean = _mean(rounds)
    mean["kernels_ms"] = {k: v / len(rounds) for k, v in sorted(kernels.items(), key=lambda kv: -kv[1])}
    return {"rounds": rounds, "mean": mean}


def _mean(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    n = max(len(rounds), 1)
    out: dict[str, Any] = {"rounds": len(rounds)}
    for k in ("wall_ms", "gpu_busy_ms", "gpu_idle_ms"):
        out[k] = sum(r[k] for r in rounds) / n
    for k in ("gpu_ms", "idle_ms", "sync_ms"):
        keys = sorted({p for r in rounds for p in r[k]})
        out[k] = {p: sum(r[k].get(p, 0.0) for r in rounds) / n for p in keys}
    return out


def format_summary(summary: dict[str, Any]) -> str:
    """One readable line per figure of ``summary["mean"]``."""
    m = summary["mean"]

    def parts(d: dict[str, float]) -> str:
        return ", ".join(f"{k} {v:.2f}" for k, v in sorted(d.items(), key=lambda kv: -kv[1])) or "-"

    return "\n".join(
        [
            f"{m['rounds']} rounds: wall {m['wall_ms']:.2f} ms/round, GPU busy {m['gpu_busy_ms']:.2f}, "
            f"idle {m['gpu_idle_ms']:.2f}",
            f"  GPU ms by launching phase: {parts(m['gpu_ms'])}",
            f"  GPU idle ms by host phase: {parts(m['idle_ms'])}",
            f"  host blocked in syncs ms: {parts(m['sync_ms'])}",
        ]
    )


def merge_profiles(summaries: list[dict[str, Any]], prompt_ids: list[str]) -> dict[str, Any]:
    """One decoder's profiled generations pooled: every figure of their ``mean`` weighted by the
    generation's rounds, so the result is per round over all of them."""
    total = sum(s["mean"]["rounds"] for s in summaries)
    out: dict[str, Any] = {"prompts": list(prompt_ids), "rounds": total}
    weights = [s["mean"]["rounds"] / max(total, 1) for s in summaries]
    for k in ("wall_ms", "gpu_busy_ms", "gpu_idle_ms"):
        out[k] = sum(w * s["mean"][k] for w, s in zip(weights, summaries, strict=True))
    for k in ("gpu_ms", "idle_ms", "sync_ms", "kernels_ms"):
        pooled: dict[str, float] = {}
        for w, s in zip(weights, summaries, strict=True):
            for name, v in s["mean"].get(k, {}).items():
                pooled[name] = pooled.get(name, 0.0) + w * v
        out[k] = dict(sorted(pooled.items(), key=lambda kv: -kv[1]))
    return out


def profiles_markdown(profiles: dict[str, Any] | None, top_kernels: int = 12) -> str:
    """A bench report's section of profiled rounds (``result["profiles"]``: decoder -> pooled
    profile or the reason it has none); empty without profiles."""
    if not profiles:
        return ""

    def parts(d: dict[str, float], n: int = 3) -> str:
        return ", ".join(f"{k} {v:.2f}" for k, v in list(d.items())[:n]) or "–"

    lines = [
        "",
        "## Profiled rounds",
        "",
        "After the timed runs, each decoder generated the listed prompts once more under the torch "
        "profiler (which slows the host, so idle times are upper bounds; GPU times are not affected). "
        "Milliseconds a round: host wall time, the union of the GPU's work inside it and the rest, and "
        "the GPU time by the phase that launched it.",
        "",
        "| decoder | prompts | rounds | wall ms | GPU busy ms | GPU idle ms | GPU ms by launching phase | idle ms by host phase |",
        "|---|---|---:|---:|---:|---:|---|---|",
    ]
    kept = {d: p for d, p in profiles.items() if isinstance(p, dict)}
    for dec, p in profiles.items():
        if not isinstance(p, dict):
            lines.append(f"| `{dec}` | – | – | – | – | – | {p} | – |")
            continue
        lines.append(
            f"| `{dec}` | {', '.join(p['prompts'])} | {p['rounds']} | {p['wall_ms']:.2f} | "
            f"{p['gpu_busy_ms']:.2f} | {p['gpu_idle_ms']:.2f} | {parts(p['gpu_ms'])} | {parts(p['idle_ms'])} |"
        )
    if not any(p.get("kernels_ms") for p in kept.values()):
        return "\n".join([*lines, "", "No GPU kernels were recorded (a run without a GPU).", ""])
    lines += ["", f"Largest kernels, µs a round (each decoder's {top_kernels} largest):", ""]
    lines += ["| decoder | kernel | µs a round |", "|---|---|---:|"]
    for dec, p in kept.items():
        for name, ms in list(p["kernels_ms"].items())[:top_kernels]:
            lines.append(f"| `{dec}` | `{name.replace('|', '/')}` | {1e3 * ms:.1f} |")
    return "\n".join([*lines, ""])
