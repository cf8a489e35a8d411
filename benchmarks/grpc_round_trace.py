#!/usr/bin/env python
"""Where a gRPC round's time goes, across both worker processes (a GPU diagnostic).

``specsplit bench`` shows that a round over gRPC (``grpc_loop="target"``) takes longer than the same
round in one process, and its ``transport_s`` column says how much of that is the call. This script
says which part of the call and of each worker's handling it is. It starts the draft and target
workers as ``specsplit serve`` processes with timing hooks, runs the prompts with the target worker
running the rounds, and joins the two processes' timestamps (``time.perf_counter_ns`` is
``CLOCK_MONOTONIC`` on Linux: one clock for every process on the machine) into one timeline per
round:

- on the target worker: building and encoding the draft request, the call, decoding the tree,
  validating it, the host work before the verification graph is launched, the launch, waiting for
  the GPU, and the loop's glue up to the next draft call (encoding the round's update for the
  client and handing it to gRPC);
- on the draft worker: the hop from the call's start to its handler, decoding, the engine's host
  time, waiting for the GPU and encoding the tree (``tree_to_proto`` reads it from the device), and
  the hop back to the caller;
- the GPU time of each side (CUDA events around the engine call and its last device read).

The same prompts also run in this process (``LocalTransport``) for the round time to compare.
Shapes, not weights, decide these times, so random-weight copies of the real pair
(``benchmarks/random_like.py``) serve where the real weights are not staged; their acceptance
differs, which changes tokens a round, not the time of one.

    python benchmarks/grpc_round_trace.py --draft D --target T --device cuda:0 --tag h100
    python benchmarks/grpc_round_trace.py --rerender benchmarks/results/grpc_round_trace-h100.json

Experiments (environment of the worker processes): ``SPECSPLIT_TRACE_SWITCH_INTERVAL=S`` sets the
workers' GIL switch interval; ``SPECSPLIT_TRACE_SPIN_S=S`` keeps the threads that wait between rounds
spinning instead of sleeping (the target's draft call, and one draft request thread for ``S`` seconds
after each call); ``SPECSPLIT_TRACE_NO_DEFER=1`` makes the target worker hand each round to its
client before the next draft call, as before deferred updates (``decode_rounds(defer_updates=...)``).
With deferred updates (the default) that hand-off lies in "loop between draft and verify".
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

_now = time.perf_counter_ns  # CLOCK_MONOTONIC: comparable across processes on one machine


# ------------------------------------------------------------------------------------ worker hooks
class _Recorder:
    """Spans kept in memory (no I/O on the round's path) and written when the worker exits."""

    def __init__(self, path: str):
        self.path = path
        self.spans: list[tuple[str, int, int]] = []
        self.events: list[tuple[str, Any, Any]] = []  # (name, start event, end event): GPU spans

    def wrap(self, owner: Any, attr: str, name: str) -> None:
        fn = getattr(owner, attr)
        spans = self.spans

        def inner(*args: Any, **kwargs: Any) -> Any:
            t0 = _now()
            try:
                return fn(*args, **kwargs)
            finally:
                spans.append((name, t0, _now()))

        setattr(owner, attr, inner)

    def wrap_all(self, *points: tuple[Any, str, str]) -> None:
        """:meth:`wrap` each ``(owner, attribute, span name)``."""
        for owner, attr, name in points:
            self.wrap(owner, attr, name)

    def dump(self) -> None:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
        gpu = [(n, a.elapsed_time(b)) for n, a, b in self.events]
        Path(self.path).write_text(json.dumps({"spans": self.spans, "gpu_ms": gpu}))


def _gpu_span(rec: _Recorder, owner: Any, start_attr: str, end_owner: Any, end_attr: str, name: str) -> None:
    """CUDA events from the entry of ``owner.start_attr`` to the return of ``end_owner.end_attr``."""
    import torch

    if not torch.cuda.is_available():
        return
    begin, finish = getattr(owner, start_attr), getattr(end_owner, end_attr)
    open_: list[Any] = []
    if owner is end_owner and start_attr == end_attr:

        def both(*args: Any, **kwargs: Any) -> Any:
            first = torch.cuda.Event(enable_timing=True)
            first.record()
            out = begin(*args, **kwargs)
            last = torch.cuda.Event(enable_timing=True)
            last.record()
            rec.events.append((name, first, last))
            return out

        setattr(owner, start_attr, both)
        return

    def start(*args: Any, **kwargs: Any) -> Any:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        open_.append(ev)
        return begin(*args, **kwargs)

    def end(*args: Any, **kwargs: Any) -> Any:
        out = finish(*args, **kwargs)
        if open_:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            rec.events.append((name, open_.pop(), ev))
        return out

    setattr(owner, start_attr, start)
    setattr(end_owner, end_attr, end)


def _install_draft(rec: _Recorder) -> None:
    from specsplit.engines.draft import DraftEngine
    from specsplit.remote import convert, server

    _gpu_span(rec, DraftEngine, "generate", convert, "draft_result_to_proto", "d.gpu")
    rec.wrap_all(
        (server.DraftServicer, "GenerateDrafts", "d.handler"),
        (convert, "draft_request_from_proto", "d.req_decode"),
        (DraftEngine, "generate", "d.engine"),
        (DraftEngine, "_feed", "d.feed"),
        (DraftEngine, "_grow", "d.grow"),
        (convert, "draft_result_to_proto", "d.encode"),
    )


def _install_target(rec: _Recorder) -> None:
    from specsplit.core.tree import TokenTree
    from specsplit.core.verification import VerifyOutcome
    from specsplit.engines.target import TargetEngine
    from specsplit.remote import client, convert, server, target_loop

    _gpu_span(rec, TargetEngine, "_verify_one_graph", TargetEngine, "_verify_one_graph", "t.gpu")
    loop = target_loop.TargetLoopTransport
    rec.wrap_all(
        (loop, "draft", "t.draft"),
        (loop, "verify", "t.verify"),
        (loop, "end_session", "t.end"),
        (convert, "draft_request_to_proto", "t.req_encode"),
        (client.GrpcTransport, "_call_or_stream", "t.call"),
        (convert, "draft_result_from_proto", "t.tree_decode"),
        (TokenTree, "validate", "t.validate"),
        (TargetEngine, "_verify_one_graph", "t.round"),
        (VerifyOutcome, "to_host", "t.sync"),
        (convert, "generate_update_to_proto", "t.update_encode"),
    )
    original = server.TargetServicer.Generate
    spans = rec.spans

    def generate(self: Any, request: Any, context: Any) -> Any:
        it = original(self, request, context)
        while True:
            t0 = _now()
            try:
                msg = next(it)
            except StopIteration:
                return
            t1 = _now()
            spans.append(("t.gen_next", t0, t1))
            yield msg
            spans.append(("t.send", t1, _now()))  # gRPC sent it and asked for the next message

    server.TargetServicer.Generate = generate


def _spin_until(done: Any) -> None:
    """Wait for ``done()`` without sleeping: the core stays awake and its caches warm. ``sleep(0)``
    hands the GIL over on every turn, so the threads that complete the wait are not held up."""
    while not done():
        time.sleep(0)


def _install_spin(role: str, spin_s: float) -> None:
    """Experimental: keep the threads that wait between rounds awake (``SPECSPLIT_TRACE_SPIN_S``).

    Target worker: the draft call is made as a future and waited for by spinning. Draft worker: one
    extra request thread that spins for ``spin_s`` after each call before it blocks; calls arriving
    meanwhile run on it without a thread wake-up (when it is busy they go to the normal pool).
    """
    import collections
    import concurrent.futures
    import threading

    import grpc

    from specsplit.remote import client, server

    if role == "target":
        original = client.GrpcTransport._call

        def call(
            self: Any, peer: Any, method: str, msg: Any, *, timeout: float, retry: bool, wait: bool = False
        ) -> Any:
            if method != "GenerateDrafts":
                return original(self, peer, method, msg, timeout=timeout, retry=retry, wait=wait)
            fut = getattr(peer.stub, method).future(msg, timeout=timeout, metadata=self._metadata,
                                                    wait_for_ready=wait)  # fmt: skip
            _spin_until(fut.done)
            try:
                return fut.result()
            except grpc.RpcError as e:
                raise client._to_error(peer, method, e) from None

        client.GrpcTransport._call = call
        return

    class SpinningPool(concurrent.futures.ThreadPoolExecutor):
        def __init__(self, *args: Any, **kwargs: Any):
            super().__init__(*args, **kwargs)
            self._items: collections.deque[Any] = collections.deque()
            self._busy = False
            self._wake = threading.Event()
            threading.Thread(target=self._spin, name="specsplit-spinner", daemon=True).start()

        def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
            if self._busy or self._items:
                return super().submit(fn, *args, **kwargs)
            fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
            self._items.append((fut, fn, args, kwargs))
            self._wake.set()
            return fut

        def _spin(self) -> None:
            while True:
                deadline = time.monotonic() + spin_s
                while not self._items:
                    if time.monotonic() > deadline:
                        self._wake.wait()
                        deadline = time.monotonic() + spin_s
                    else:
                        time.sleep(0)
                self._wake.clear()
                fut, fn, args, kwargs = self._items.popleft()
                self._busy = True
                try:
                    if fut.set_running_or_notify_cancel():
                        try:
                            fut.set_result(fn(*args, **kwargs))
                        except BaseException as e:  # noqa: BLE001 (handed to the future)
                            fut.set_exception(e)
                finally:
                    self._busy = False

    server.ThreadPoolExecutor = SpinningPool


def _hooked_worker(role: str, out: str, argv: list[str]) -> int:
    switch = os.environ.get("SPECSPLIT_TRACE_SWITCH_INTERVAL")
    if switch:  # the GIL hand-over interval of the workers (default 5 ms), for an A/B
        sys.setswitchinterval(float(switch))
    spin = os.environ.get("SPECSPLIT_TRACE_SPIN_S")
    if spin:
        _install_spin(role, float(spin))
    if role == "target" and os.environ.get("SPECSPLIT_TRACE_NO_DEFER"):
        from specsplit.remote import server

        rounds = server.decode_rounds  # each round to the client before the next draft call: the A/B

        def no_defer(*args: Any, **kwargs: Any) -> Any:
            return rounds(*args, **{**kwargs, "defer_updates": False})

        server.decode_rounds = no_defer
    rec = _Recorder(out)
    (_install_draft if role == "draft" else _install_target)(rec)
    from specsplit.cli import main

    try:
        return main(argv)
    finally:
        rec.dump()


# ------------------------------------------------------------------------------------------ driver
def _worker_class() -> Any:
    from specsplit.remote.launch import WorkerProcess

    class HookedWorker(WorkerProcess):
        """``specsplit serve`` run through this script's hooks; the trace lands in ``trace_out``."""

        def __init__(self, trace_out: str, *args: Any, **kwargs: Any):
            super().__init__(*args, **kwargs)
            self.trace_out = trace_out

        def command(self) -> list[str]:
            cmd = super().command()
            i = cmd.index("serve")
            return [sys.executable, str(Path(__file__).resolve()), "--hooked", self.role, self.trace_out,
                    "--", *cmd[i:]]  # fmt: skip

    return HookedWorker


def _run_prompts(gen: Any, prompts: list[Any], max_new: int) -> tuple[list[dict[str, Any]], int, int]:
    """Generate every prompt (greedy); per prompt: rounds, tokens, wall seconds. Returns the rows and
    the clock's value before and after."""
    import torch

    rows: list[dict[str, Any]] = []
    t_begin = _now()
    for p in prompts:
        ids = torch.tensor([p.input_ids])
        t0 = time.perf_counter()
        out = gen.generate(ids, max_new_tokens=max_new, do_sample=False, return_dict_in_generate=True)
        wall = time.perf_counter() - t0
        st = out.spec_stats
        rows.append({"id": p.id, "rounds": len(st.rounds), "tokens": int(out.sequences.shape[1] - ids.shape[1]),
                     "wall_s": wall, "tau": st.tau, "start_ns": t_begin if not rows else rows[-1]["end_ns"],
                     "end_ns": _now()})  # fmt: skip
    return rows, t_begin, _now()


def _local_result(result: dict[str, Any], rec: _Recorder, rows: list[dict[str, Any]]) -> None:
    """The in-process run's rows and per-prompt split into ``result``."""
    spans = _spans_by_name({"spans": rec.spans}, rows[0]["start_ns"], rows[-1]["end_ns"])
    inner = {"draft ingest": spans["l.feed"], "draft tree growth": spans["l.grow"]}
    result["local_prompts"] = per_prompt(rows, spans["l.draft"], spans["l.verify"], inner)
    result["local"] = rows
    result["local_ms_per_round"] = 1e3 * sum(r["wall_s"] for r in rows) / sum(r["rounds"] for r in rows)


def _spans_by_name(trace: dict[str, Any], lo: int, hi: int) -> dict[str, list[tuple[int, int]]]:
    out: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for name, s, e in trace["spans"]:
        if lo <= s and e <= hi:
            out[name].append((s, e))
    for v in out.values():
        v.sort()
    return out


def _inside(spans: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    return [x for x in spans if lo <= x[0] and x[1] <= hi]


def analyze(target: dict[str, Any], draft: dict[str, Any], lo: int, hi: int) -> dict[str, Any]:
    """Join the two workers' spans into per-round segments (ms); see the module docstring."""
    t = _spans_by_name(target, lo, hi)
    d = _spans_by_name(draft, lo, hi)
    handlers = d["d.handler"]
    seg: dict[str, list[float]] = defaultdict(list)
    ms = 1e-6
    drafts, verifies = t["t.draft"], t["t.verify"]
    skipped = 0
    for k, (ds, de) in enumerate(drafts):
        nxt = next((v for v in verifies if v[0] >= de), None)
        after = drafts[k + 1] if k + 1 < len(drafts) else None
        calls = _inside(t["t.call"], ds, de)
        if nxt is None or after is None or len(calls) != 1:
            skipped += 1
            continue
        vs, ve = nxt
        if after[0] - ve > 50e6:  # a generation's end (the next draft is another prompt's prefill)
            skipped += 1
            continue
        cs, ce = calls[0]
        h = _inside(handlers, cs, ce)
        if len(h) != 1:
            skipped += 1
            continue
        hs, he = h[0]

        def one(name: str, spans: dict[str, list[tuple[int, int]]], a: int, b: int) -> tuple[int, int] | None:
            got = _inside(spans[name], a, b)
            return got[0] if len(got) == 1 else None

        rdec, eng, enc = (
            one("d.req_decode", d, hs, he),
            one("d.engine", d, hs, he),
            one("d.encode", d, hs, he),
        )
        tdec = one("t.tree_decode", t, ds, de)
        rnd, sync = one("t.round", t, vs, ve), one("t.sync", t, vs, ve)
        val = one("t.validate", t, vs, ve)
        if None in (rdec, eng, enc, tdec, sync):
            skipped += 1
            continue
        assert rdec and eng and enc and tdec and sync
        rnd = rnd or (sync[0], sync[0])  # the eager verification (no round graph): no launch span
        vdur = (val[1] - val[0]) if val else 0
        seg["round"].append((after[0] - ds) * ms)
        seg["t: build + encode the draft request"].append((cs - ds) * ms)
        seg["call -> draft handler starts"].append((hs - cs) * ms)
        seg["d: decode the request"].append((rdec[1] - hs) * ms)  # from the handler's entry
        seg["d: handler before the engine"].append((eng[0] - rdec[1]) * ms)
        seg["d: engine (host: checks, ingest, grow launches)"].append((eng[1] - eng[0]) * ms)
        seg["d: between engine and encode"].append((enc[0] - eng[1]) * ms)
        seg["d: encode the tree (waits for the GPU)"].append((enc[1] - enc[0]) * ms)
        seg["d: handler after encode"].append((he - enc[1]) * ms)
        seg["draft handler returns -> call returns"].append((ce - he) * ms)
        seg["t: decode the tree"].append((tdec[1] - tdec[0]) * ms)
        seg["t: rest of the draft call"].append((de - ce - (tdec[1] - tdec[0])) * ms)
        seg["t: loop between draft and verify (+ the last round's update, deferred)"].append((vs - de) * ms)
        seg["t: validate the tree"].append(vdur * ms)
        seg["t: verify before the round graph"].append((rnd[0] - vs - vdur) * ms)
        seg["t: round graph launch (host)"].append((sync[0] - rnd[0]) * ms)
        seg["t: wait for the GPU + read the result"].append((sync[1] - sync[0]) * ms)
        seg["t: verify after the read"].append((ve - sync[1]) * ms)
        seg["t: loop glue to the next draft call (+ the update, not deferred)"].append((after[0] - ve) * ms)
    gpu: dict[str, list[float]] = defaultdict(list)
    for trace in (target, draft):
        for name, v in trace["gpu_ms"]:
            gpu[name].append(v)
    sends = [(e - s) * ms for s, e in t.get("t.send", [])]
    return {
        "rounds": len(seg["round"]),
        "skipped": skipped,
        "mean_ms": {k: statistics.fmean(v) for k, v in seg.items()},
        "median_ms": {k: statistics.median(v) for k, v in seg.items()},
        "gpu_span_ms": {k: statistics.median(v[len(v) // 4 :]) for k, v in gpu.items() if v},
        "send_ms_median": statistics.median(sends) if sends else None,
    }


def per_prompt(
    rows: list[dict[str, Any]],
    drafts: list[tuple[int, int]],
    verifies: list[tuple[int, int]],
    inner: dict[str, list[tuple[int, int]]] | None = None,
) -> dict[str, Any]:
    """Split each prompt's client wall time into its steady rounds and what lies around them.

    ``drafts`` / ``verifies``: the loop's draft and verify spans (any process: one clock). A round
    runs from one draft call's start to the next; the first round holds the prefill, the last
    one ends at its verification. ``inner``: named spans inside the draft engine (its ingest and
    tree growth); the first of each inside the first draft call is reported as ``first round: <name>``.
    """
    ms = 1e-6
    out: dict[str, list[float]] = defaultdict(list)
    for r in rows:
        lo, hi = r["start_ns"], r["end_ns"]
        mine = [d for d in drafts if lo <= d[0] <= hi]
        starts = [s for s, _ in mine]
        checks = [v for v in verifies if lo <= v[1] <= hi]
        ends = [e for _, e in checks]
        if len(starts) < 3 or not ends:
            continue
        diffs = [(b - a) * ms for a, b in zip(starts, starts[1:], strict=False)]
        out["steady round"] += diffs[1:]
        out["setup: client call to first draft call"].append((starts[0] - lo) * ms)
        out["first round (prefill)"].append(diffs[0])
        # The first round's two calls: the draft's prefill and tree, the target's prefill and check.
        out["first round: draft call"].append((mine[0][1] - mine[0][0]) * ms)
        out["first round: verify call"].append((checks[0][1] - checks[0][0]) * ms)
        for name, spans in (inner or {}).items():
            inside = [sp for sp in spans if mine[0][0] <= sp[0] and sp[1] <= mine[0][1]]
            if inside:
                out[f"first round: {name}"].append((inside[0][1] - inside[0][0]) * ms)
        out["last round"].append((ends[-1] - starts[-1]) * ms)
        out["teardown: last verify to client return"].append((hi - ends[-1]) * ms)
        out["outside the steady rounds"].append((hi - lo) * ms - sum(diffs[1:]))
    return {
        k: {"mean": statistics.fmean(v), "median": statistics.median(v), "n": len(v)} for k, v in out.items()
    }


def _table(res: dict[str, Any]) -> str:
    a = res["trace"]
    lines = [
        f"# gRPC round trace ({res['device']}, {res['tag'] or 'untagged'})",
        "",
        f"Command: `{res['command']}`",
        "",
        *([f"> {res['note']}", ""] if res.get("note") else []),
        f"Worker environment of the experiment: {res.get('experiment_env', '(none)')}",
        "",
        f"The target worker's draft calls: {res.get('draft_calls', 'unary')} (runs before the draft stream "
        "existed made unary calls); trees "
        + (
            "from tree slots (CUDA IPC; the draft call returns before the tree's GPU work ends, so the draft "
            "segments below hold no GPU wait)"
            if res.get("tree_slots")
            else "in the draft worker's replies"
        )
        + ".",
        "",
        f"Local (one process): {res.get('local_ms_per_round', float('nan')):.2f} ms a round; gRPC target loop: "
        f"{res['grpc_ms_per_round']:.2f} ms a round (wall / rounds over all prompts; "
        + (
            "every prompt ran once before timing)."
            if res.get("warmup_all")
            else "the trace warms up on one prompt, so first rounds include graph captures for new lengths: "
            "compare the steady rounds below)."
        ),
        "",
        "Timing order: "
        + (
            "interleaved (each prompt locally, then over gRPC; both stay loaded, as the bench alternates "
            "its decoders)."
            if res.get("interleave")
            else "all prompts locally, then all over gRPC."
        ),
        "",
        f"Traced steady-state rounds: {a['rounds']} (skipped {a['skipped']}: first and last of each prompt).",
        "",
        "| segment | mean ms | median ms |",
        "|---|---|---|",
    ]
    for k, v in a["mean_ms"].items():
        lines.append(f"| {k} | {v:.3f} | {a['median_ms'][k]:.3f} |")
    lines += ["", "Per prompt (ms): the steady rounds and what lies around them.", "",
              "| | local mean | local median | gRPC mean | gRPC median |", "|---|---|---|---|---|"]  # fmt: skip
    loc, rem = res.get("local_prompts", {}), res.get("grpc_prompts", {})
    for k in rem:
        lv = loc.get(k)
        lcells = f"{lv['mean']:.2f} | {lv['median']:.2f}" if lv else "– | –"
        lines.append(f"| {k} | {lcells} | {rem[k]['mean']:.2f} | {rem[k]['median']:.2f} |")
    lines += ["", "| GPU span (CUDA events, median) | ms |", "|---|---|"]
    for k, v in a["gpu_span_ms"].items():
        what = {"d.gpu": "draft: engine entry to the tree's last device read",
                "t.gpu": "target: the verification round (graph) to its read"}.get(k, k)  # fmt: skip
        lines.append(f"| {what} | {v:.3f} |")
    if a.get("send_ms_median") is not None:
        lines += [
            "",
            f"gRPC's hand-off of a round's update to the client (median): {a['send_ms_median']:.3f} ms",
        ]
    return "\n".join(lines) + "\n"


def write_plot(res: dict[str, Any], path: Path) -> bool:
    """The median gRPC round as one stacked bar per side, beside the local steady round."""
    from specsplit.bench.report import pyplot, save_figure

    plt = pyplot()
    if plt is None:
        return False
    med = res["trace"]["median_ms"]
    segs = [(k, v) for k, v in med.items() if k != "round" and v > 0]
    fig, ax = plt.subplots(figsize=(12, 4.8))
    left = 0.0
    cmap = plt.get_cmap("tab20")
    for i, (k, v) in enumerate(segs):
        ax.barh(1, v, left=left, color=cmap(i % 20), label=f"{k} ({v:.2f})")
        left += v
    lp = res.get("local_prompts", {}).get("steady round")
    gp = res.get("grpc_prompts", {}).get("steady round")
    bars = [("gRPC round (segments)", left)]
    if lp:
        ax.barh(0, lp["median"], color="grey")
        bars.insert(0, ("local steady round", lp["median"]))
    ax.set_yticks(range(len(bars)) if lp else [1], [b[0] for b in bars])
    if gp:
        ax.axvline(gp["median"], color="black", linestyle="--", linewidth=0.8)
    ax.set_xlabel("milliseconds (medians over steady-state rounds)")
    ax.set_title(f"Where a gRPC round goes: {res['device']} ({res['tag']})")
    ax.legend(fontsize=7, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.15))
    return save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    from specsplit.bench.report import add_pair_arguments, rerender, write_result

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--hooked"]:
        return _hooked_worker(argv[1], argv[2], argv[4:])
    if argv[:1] == ["--rerender"]:  # the .md and .png again from a result's .json
        rerender(Path(argv[1]), _table, write_plot)
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_pair_arguments(ap, prompts_per_category=1)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--no-local", action="store_true", help="skip the in-process run")
    ap.add_argument(
        "--warmup-all",
        action="store_true",
        help="run every prompt once before timing (as specsplit bench does): first rounds then hold no "
        "graph captures",
    )
    ap.add_argument(
        "--no-draft-stream",
        action="store_true",
        help="the target worker calls the draft worker with unary calls (the A/B of the draft stream)",
    )
    ap.add_argument(
        "--no-tree-ipc",
        action="store_true",
        help="the target worker takes every tree from the draft worker's reply (the A/B of tree slots; "
        "with slots the draft call returns before the tree's GPU work ends)",
    )
    ap.add_argument(
        "--interleave",
        action="store_true",
        help="time prompt by prompt, local then gRPC (as specsplit bench alternates its decoders): each "
        "side starts every prompt after the other one ran; both stay loaded (needs both on the device)",
    )
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--tag", default="")
    args = ap.parse_args(argv)
    if args.interleave and args.no_local:
        ap.error("--interleave needs the local run (drop --no-local)")

    import tempfile

    import torch

    from specsplit.bench.run import DEFAULT_PROMPTS, load_prompts, tokenize_prompts
    from specsplit.config import DraftConfig, SpecSplitConfig, TargetConfig, TreeConfig
    from specsplit.generator import SpecSplitGenerator
    from specsplit.models import load_tokenizer

    topk, width, budget, depth = (int(x) for x in args.dynamic_tree.split(","))
    tree = TreeConfig(shape="dynamic", topk=topk, width=width, budget=budget, max_depth=depth)
    tok = load_tokenizer(args.target)
    prompts = load_prompts(DEFAULT_PROMPTS, args.prompts_per_category)
    tokenize_prompts(prompts, tok)
    warm = prompts if args.warmup_all else prompts[:1]
    result: dict[str, Any] = {
        "command": "python benchmarks/grpc_round_trace.py " + " ".join(argv),
        "tag": args.tag,
        "device": torch.cuda.get_device_name(args.device)
        if args.device.startswith("cuda")
        else platform.processor() or "cpu",
        "host": platform.node(),
        "torch": torch.__version__,
        "tree": args.dynamic_tree,
        "warmup_all": args.warmup_all,
        "draft_calls": "unary" if args.no_draft_stream else "stream",
        "tree_slots": not args.no_tree_ipc,
        "interleave": args.interleave,
        "experiment_env": " ".join(
            f"{k}={os.environ[k]}"
            for k in (
                "SPECSPLIT_TRACE_SWITCH_INTERVAL",
                "SPECSPLIT_TRACE_SPIN_S",
                "SPECSPLIT_TRACE_NO_DEFER",
            )
            if k in os.environ
        )
        or "(none)",
    }
    graphs = args.device.startswith("cuda")
    if not args.no_local:
        cfg = SpecSplitConfig(
            tree=tree,
            draft=DraftConfig(model=args.draft, device=args.device, dtype=args.dtype, cuda_graphs=graphs),
            target=TargetConfig(model=args.target, device=args.device, dtype=args.dtype, cuda_graphs=graphs),
        )
        gen = SpecSplitGenerator.from_pretrained(args.target, args.draft, tokenizer=tok, config=cfg)
        from specsplit.engines.draft import DraftEngine
        from specsplit.local import LocalTransport

        local_rec = _Recorder("")
        local_rec.wrap(LocalTransport, "draft", "l.draft")
        local_rec.wrap(LocalTransport, "verify", "l.verify")
        local_rec.wrap(DraftEngine, "_feed", "l.feed")
        local_rec.wrap(DraftEngine, "_grow", "l.grow")
        _run_prompts(gen, warm, args.max_new_tokens)
        if not args.interleave:
            local_rows, _, _ = _run_prompts(gen, prompts, args.max_new_tokens)
            _local_result(result, local_rec, local_rows)
            gen.close()
            del gen
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    worker = _worker_class()
    tmp = Path(tempfile.mkdtemp(prefix="specsplit-trace-"))
    serve = ["--cuda-graphs"] if graphs else []
    d = worker(str(tmp / "draft.json"), "draft", args.draft, device=args.device, dtype=args.dtype, args=serve)
    d.start()
    t = worker(str(tmp / "target.json"), "target", args.target, device=args.device, dtype=args.dtype,
               args=[*serve, "--draft-address", d.address, *(["--no-draft-stream"] if args.no_draft_stream else []),
                     *(["--no-tree-ipc"] if args.no_tree_ipc else [])])  # fmt: skip
    try:
        t.start()
        cfg = SpecSplitConfig(transport="grpc", grpc_loop="target", target_address=t.address,
                              draft_address=d.address, tree=tree, timeout_s=600.0)  # fmt: skip
        with SpecSplitGenerator(None, None, tokenizer=tok, config=cfg) as rgen:
            _run_prompts(rgen, warm, args.max_new_tokens)
            if args.interleave:  # one prompt on each side in turn, as the bench alternates decoders
                lo, local_rows, rows = _now(), [], []
                for p in prompts:
                    local_rows += _run_prompts(gen, [p], args.max_new_tokens)[0]
                    rows += _run_prompts(rgen, [p], args.max_new_tokens)[0]
                hi = _now()
                _local_result(result, local_rec, local_rows)
                gen.close()
            else:
                rows, lo, hi = _run_prompts(rgen, prompts, args.max_new_tokens)
    finally:
        t.stop()
        d.stop()
    result["grpc"] = rows
    result["grpc_ms_per_round"] = 1e3 * sum(r["wall_s"] for r in rows) / sum(r["rounds"] for r in rows)
    traces = {role: json.loads((tmp / f"{role}.json").read_text()) for role in ("target", "draft")}
    result["trace"] = analyze(traces["target"], traces["draft"], lo, hi)
    spans = _spans_by_name(traces["target"], lo, hi)
    d_spans = _spans_by_name(traces["draft"], lo, hi)
    inner = {"draft ingest": d_spans["d.feed"], "draft tree growth": d_spans["d.grow"]}
    result["grpc_prompts"] = per_prompt(rows, spans["t.draft"], spans["t.verify"], inner)
    name = "grpc_round_trace" + (f"-{args.tag}" if args.tag else "")
    print(write_result(result, args.out, name, _table, write_plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
