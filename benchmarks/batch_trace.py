#!/usr/bin/env python
"""Where a client's time goes when N clients share one batching target worker (a diagnostic).

The concurrency bench (``specsplit bench --concurrent-clients``) says how fast each client is; this
script says where each client's time goes. It starts one target worker (``specsplit serve target
--max-batch M``, a process, with timing hooks on its batch scheduler) and N client processes that
call ``Generate`` (``grpc_loop="target"``) at once, released by one barrier. Both sides stamp
``time.perf_counter_ns`` (``CLOCK_MONOTONIC`` on Linux: one clock for every process on the machine),
so each client's timeline joins up:

    client start -> worker handler entered -> row queued -> prompt forward (start, end)
      -> first round holding the row ends -> client sees its first tokens -> row done -> client end

and the worker's steps (prompt forwards and rounds, with their rows) are listed in time order.

Answer lengths: with real weights each client stops at EOS; with random weights
(``benchmarks/random_like.py``) nothing stops early, so ``--lengths-from`` takes each prompt's
answer length from a ``specsplit bench`` result (its ``hf-target`` runs) to reproduce the real mix
of short and long answers.

    python benchmarks/batch_trace.py --target DIR --device cuda:0 --clients 1,16 \
        --lengths-from benchmarks/results/h200-2026-11-28-drafters.json --tag h200-random
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

_now = time.perf_counter_ns


# ------------------------------------------------------------------------------------ worker hooks
def _key(prompt: Any) -> int:
    return hash(tuple(int(t) for t in prompt))


def _install(events: list[tuple[Any, ...]]) -> None:
    """Stamp the batch scheduler's steps and each row's life (no I/O on the rounds' path)."""
    from specsplit.pipeline import batch
    from specsplit.remote import server

    keys: dict[int, int] = {}  # id(ticket) -> prompt key
    sched = batch.BatchScheduler

    submit, prefill, round_, finish = sched.submit, sched._prefill, sched._round, sched._finish_ticket

    def on_submit(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        t = _now()
        ticket = submit(self, request, *args, **kwargs)
        keys[id(ticket)] = _key(request.prompt)
        events.append(("queued", t, keys[id(ticket)]))
        return ticket

    def on_prefill(self: Any, joining: list[Any]) -> Any:
        t = _now()
        try:
            return prefill(self, joining)
        finally:
            events.append(("prefill", t, _now(), [keys.get(id(x), 0) for x in joining]))

    def on_round(self: Any) -> Any:
        rows = [keys.get(id(r.ticket), 0) for r in self._live]
        t = _now()
        try:
            return round_(self)
        finally:
            events.append(("round", t, _now(), rows))

    def on_finish(self: Any, ticket: Any) -> Any:
        events.append(("done", _now(), keys.get(id(ticket), 0)))
        return finish(self, ticket)

    sched.submit, sched._prefill, sched._round, sched._finish_ticket = (
        on_submit,
        on_prefill,
        on_round,
        on_finish,
    )

    generate = server.TargetServicer.Generate

    def on_generate(self: Any, request: Any, context: Any) -> Any:
        events.append(("handler", _now(), _key(request.prompt_token_ids)))
        yield from generate(self, request, context)

    server.TargetServicer.Generate = on_generate  # type: ignore[method-assign]


def _hooked_worker(out: str, argv: list[str]) -> int:
    events: list[tuple[Any, ...]] = []
    _install(events)
    from specsplit.cli import main

    try:
        return main(argv)
    finally:
        Path(out).write_text(json.dumps(events))


def _worker(trace_out: str, model: str, device: str, dtype: str, args: list[str]) -> Any:
    from specsplit.remote.launch import WorkerProcess

    class HookedWorker(WorkerProcess):
        def command(self) -> list[str]:
            cmd = super().command()
            i = cmd.index("serve")
            return [sys.executable, str(Path(__file__).resolve()), "--hooked", trace_out, "--", *cmd[i:]]

    return HookedWorker("target", model, device=device, dtype=dtype, args=args)


# ------------------------------------------------------------------------------------------ clients
def _client(pipe: Any, address: str, barrier: Any) -> None:
    """A client process: one generator; each ``run`` waits at the barrier, then generates."""
    import torch
    from transformers import GenerationConfig

    from specsplit import SpecSplitConfig, SpecSplitGenerator

    torch.set_num_threads(1)
    cfg = SpecSplitConfig(transport="grpc", grpc_loop="target", target_address=address, timeout_s=600.0)
    gen = SpecSplitGenerator(config=cfg)
    pipe.send("ready")
    try:
        while (msg := pipe.recv()) != "close":
            ids, max_new, eos = msg
            gc = GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=eos, pad_token_id=0)
            streamer = _Stamps()
            barrier.wait(timeout=600)
            t0 = _now()
            out = gen.generate(torch.tensor([ids]), generation_config=gc, streamer=streamer)
            t1 = _now()
            first = streamer.stamps[1] if len(streamer.stamps) > 1 else None  # the first put is the prompt
            pipe.send({"start": t0, "first": first, "end": t1, "tokens": int(out.shape[1] - len(ids))})
    finally:
        gen.close()


class _Stamps:
    """An HF-style streamer stamping each ``put``."""

    def __init__(self) -> None:
        self.stamps: list[int] = []

    def put(self, value: Any) -> None:
        self.stamps.append(_now())

    def end(self) -> None:
        pass


class _Clients:
    def __init__(self, n: int, address: str):
        import multiprocessing as mp

        from specsplit.bench.batch import spawn_with_pipes

        self.barrier = mp.get_context("spawn").Barrier(n)
        self.pipes: list[Any] = []
        self.procs: list[Any] = []
        spawn_with_pipes(n, _client, (address, self.barrier), self.pipes, self.procs)
        for pipe in self.pipes:
            assert pipe.recv() == "ready"

    def run(self, jobs: list[tuple[list[int], int, Any]]) -> list[dict[str, Any]]:
        for pipe, job in zip(self.pipes, jobs, strict=True):
            pipe.send(job)
        return [pipe.recv() for pipe in self.pipes]

    def close(self) -> None:
        for pipe in self.pipes:
            pipe.send("close")
        for p in self.procs:
            p.join(30)


# ------------------------------------------------------------------------------------------ analysis
def timeline(clients: list[dict[str, Any]], events: list[list[Any]]) -> dict[str, Any]:
    """Each client's milestones (ms from its own start) and the worker's steps in the clients' window."""
    t_lo = min(c["start"] for c in clients) - 50_000_000
    t_hi = max(c["end"] for c in clients) + 50_000_000
    ev = [e for e in events if t_lo <= e[1] <= t_hi]
    per: list[dict[str, Any]] = []
    for c in clients:
        k, t0 = c["key"], c["start"]

        def first(kind: str, at: int = 1, k: int = k, t0: int = t0) -> float | None:
            """ms from the client's start to the first ``kind`` event of its row (field ``at``)."""
            hits = [e for e in ev if e[0] == kind and e[1] >= t0 - 1_000_000
                    and (e[-1] == k if kind in ("handler", "queued", "done") else k in e[-1])]  # fmt: skip
            return (hits[0][at] - t0) / 1e6 if hits else None

        rounds = [e for e in ev if e[0] == "round" and k in e[-1]]
        per.append({
            "prompt_id": c["prompt_id"], "prompt_tokens": c["prompt_tokens"], "tokens": c["tokens"],
            "handler_ms": first("handler"), "queued_ms": first("queued"),
            "prefill_start_ms": first("prefill"), "prefill_end_ms": first("prefill", 2),
            "first_round_end_ms": first("round", 2), "client_first_ms": (c["first"] - t0) / 1e6 if c["first"] else None,
            "done_ms": first("done"), "client_end_ms": (c["end"] - t0) / 1e6, "rounds": len(rounds),
            "round_ms_mean": statistics.fmean((e[2] - e[1]) / 1e6 for e in rounds) if rounds else None,
        })  # fmt: skip
    origin = min(c["start"] for c in clients)
    steps = [{"kind": e[0], "start_ms": (e[1] - origin) / 1e6, "ms": (e[2] - e[1]) / 1e6, "rows": len(e[3])}
             for e in ev if e[0] in ("prefill", "round")]  # fmt: skip
    return {"clients": per, "steps": steps}


def _table(res: dict[str, Any]) -> str:
    lines = [f"# Batched Generate timeline: {res['device']} ({res['tag']})", "", f"`{res['command']}`", ""]
    cols = ["handler_ms", "queued_ms", "prefill_start_ms", "prefill_end_ms", "first_round_end_ms",
            "client_first_ms", "done_ms", "client_end_ms"]  # fmt: skip
    for run in res["runs"]:
        tl = run["timeline"]
        lines += [f"## {run['clients']} clients (repeat {run['repeat']})", "",
                  "ms from each client's own start.", "",
                  "| prompt | prompt tok | new tok | " + " | ".join(c.replace("_ms", "") for c in cols)
                  + " | rounds | round ms |", "|---|" + "---:|" * (len(cols) + 4)]  # fmt: skip
        for c in tl["clients"]:
            cells = [f"{c[k]:.1f}" if c[k] is not None else "–" for k in cols]
            rm = f"{c['round_ms_mean']:.2f}" if c["round_ms_mean"] is not None else "–"
            lines.append(f"| {c['prompt_id']} | {c['prompt_tokens']} | {c['tokens']} | " + " | ".join(cells)
                         + f" | {c['rounds']} | {rm} |")  # fmt: skip
        steps = tl["steps"]
        lines += ["", "Worker steps (ms from the first client's start; the first 40 and a summary):", "",
                  "| step | start | ms | rows |", "|---|---:|---:|---:|"]  # fmt: skip
        for s in steps[:40]:
            lines.append(f"| {s['kind']} | {s['start_ms']:.1f} | {s['ms']:.2f} | {s['rows']} |")
        rounds = [s["ms"] for s in steps if s["kind"] == "round"]
        gaps = [b["start_ms"] - a["start_ms"] - a["ms"] for a, b in zip(steps, steps[1:], strict=False)]
        if rounds:
            lines += ["", f"{len(rounds)} rounds, median {statistics.median(rounds):.2f} ms; "
                      f"{sum(s['kind'] == 'prefill' for s in steps)} prompt forwards; "
                      f"median gap between steps {statistics.median(gaps) if gaps else 0:.2f} ms", ""]  # fmt: skip
    return "\n".join(lines) + "\n"


def _no_plot(res: dict[str, Any], path: Path) -> bool:
    return False


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--hooked"]:
        return _hooked_worker(argv[1], argv[3:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True, help="model directory (config, tokenizer, weights)")
    ap.add_argument(
        "--draft",
        help="a draft model: the target worker drafts on a draft worker of it (--draft-address); a call "
        "alone then runs its own speculative rounds (no queued / prompt-forward / round entries), calls "
        "that arrive while others run join the batched rounds",
    )
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--clients", default="1,16")
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--lengths-from", type=Path, help="a bench result: each prompt's hf-target answer length")
    ap.add_argument("--repeats", type=int, default=2, help="timed passes per client count (after a warm-up)")
    ap.add_argument("--worker-args", default="--cuda-graphs", help="extra `specsplit serve target` options")
    ap.add_argument("--tag", default="run")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = ap.parse_args(argv)

    import tempfile

    import torch
    from transformers import AutoTokenizer

    from specsplit.bench.batch import interleaved
    from specsplit.bench.report import write_result
    from specsplit.bench.run import load_prompts, tokenize_prompts

    prompts = load_prompts(Path(__file__).resolve().parent / "prompts")
    tokenize_prompts(prompts, AutoTokenizer.from_pretrained(args.target))
    lengths: dict[str, int] = {}
    eos: Any = None  # random weights: every answer runs to its length
    if args.lengths_from:
        runs = json.loads(args.lengths_from.read_text())["runs"]
        lengths = {r["prompt_id"]: r["new_tokens"] for r in runs if r["decoder"] == "hf-target"}
    counts = [int(x) for x in args.clients.split(",")]
    need = max(len(p.input_ids) for p in prompts) + args.max_new_tokens + 64
    wargs = [*args.worker_args.split(), "--max-batch", str(args.max_batch),
             "--batch-capacity", str(-(-need // 256) * 256), "--max-workers", str(2 * args.max_batch + 8)]  # fmt: skip
    res: dict[str, Any] = {
        "command": "python benchmarks/batch_trace.py " + " ".join(argv), "tag": args.tag,
        "device": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else platform.processor() or "cpu",
        "worker_args": wargs, "runs": [],
    }  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        trace = str(Path(tmp) / "worker.json")
        drafter = None
        if args.draft:
            from specsplit.remote.launch import WorkerProcess

            drafter = WorkerProcess(
                "draft", args.draft, device=args.device, dtype=args.dtype, args=wargs
            ).start()
            wargs = [*wargs, "--draft-address", drafter.address]
            res["worker_args"] = wargs
        raw: list[tuple[int, int, list[dict[str, Any]]]] = []
        try:
            worker = _worker(trace, args.target, args.device, args.dtype, wargs).start()
        except BaseException:
            if drafter is not None:
                drafter.stop()
            raise
        try:
            for n in counts:
                rows = interleaved(prompts, n)
                jobs = [(p.input_ids, lengths.get(p.id, args.max_new_tokens), eos) for p in rows]
                clients = _Clients(n, worker.address)
                try:
                    clients.run(jobs)  # warm-up
                    for rep in range(args.repeats):
                        got = clients.run(jobs)
                        for c, p in zip(got, rows, strict=True):
                            c.update(prompt_id=p.id, prompt_tokens=len(p.input_ids), key=_key(p.input_ids))
                        raw.append((n, rep, got))
                        time.sleep(0.2)
                finally:
                    clients.close()
        finally:
            worker.stop(grace=10.0)
            if drafter is not None:
                drafter.stop()
            print("".join(worker._log[-15:]))  # the worker's start-up lines (graph captures)
        events = json.loads(Path(trace).read_text())
    for n, rep, got in raw:
        res["runs"].append({"clients": n, "repeat": rep, "timeline": timeline(got, events)})
    print(write_result(res, args.out, f"batch_trace-{args.tag}", _table, _no_plot))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
