#!/usr/bin/env python
"""Per-round transport overhead of GrpcTransport over LocalTransport, on loopback.

Both transports drive the SAME engine objects with the SAME requests; the engines are no-op
stand-ins that return a canned tree / verification result of the requested shape at once, so the
difference between the two is exactly what remote mode adds per round: dataclass <-> protobuf
conversion, serialisation, HTTP/2 on loopback and the server's thread hand-off. The no-op workers
run in a subprocess (as real workers do), so client and server do not share a GIL.

For each tree shape (chain K=4, a 16-node static tree, a 64-node tree) and for greedy (no q) and
sampling (sparse q with ``Kq`` = 32 ids/probabilities per node) it reports, separately for the
draft call and the verify call: median and p90 microseconds of (gRPC - local) and the protobuf
payload bytes of request + response (HTTP/2 framing adds ~50-100 bytes per call).

A second table times whole rounds of the real decoding loop (:func:`specsplit.pipeline.decode`,
greedy, the 64-node tree) over the same no-op engines: local, gRPC with the client running the
rounds (two calls a round), and gRPC with the target worker running them
(``SpecSplitConfig.grpc_loop="target"``: one call a round, tokens streamed back). With
``--client-delays-ms 0,1,5`` it repeats the two gRPC rows with a one-way delay added to every message
between this process and the workers (a client far from its workers: 5 ms one-way = 10 ms round
trip), while the target worker reaches the draft worker over plain loopback (both workers in one
data centre). ``--engine-ms 8,4`` makes the no-op draft and target sleep that long per call (GIL
released, standing in for GPU work), so the loop table shows what a real round pays on top of its
engines' time, including work a loop can overlap with the draft worker's (``--loops-only`` skips the
per-call table).

    python benchmarks/transport_overhead.py            # writes benchmarks/results/transport_overhead-<tag>.{json,md}
    python benchmarks/transport_overhead.py --rounds 2000 --tag cpu
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specsplit.config import SamplingParams, TreeConfig  # noqa: E402
from specsplit.core.tree import TokenTree  # noqa: E402
from specsplit.local import LocalTransport  # noqa: E402
from specsplit.messages import (  # noqa: E402
    DraftRequest,
    DraftResult,
    VerifyRequest,
    VerifyResult,
    WorkerInfo,
    WorkerStats,
)
from specsplit.remote.protocol import PROTOCOL_VERSION  # noqa: E402

VOCAB = 151_936  # Qwen2.5 vocabulary: realistic id magnitudes (3-byte varints)
KQ = 32
SHAPES = {
    "chain K=4": TreeConfig(shape="chain", num_draft_tokens=4),
    "static 16 nodes": TreeConfig(shape="static"),
    "tree 64 nodes": TreeConfig(shape="dynamic", topk=4, width=4, budget=64, max_depth=6),
}


def canned_tree(cfg: TreeConfig, do_sample: bool) -> TokenTree:
    """A deterministic tree of ``cfg.max_nodes`` nodes (the shape's plan, or 4-ary BFS for dynamic)."""
    if cfg.shape == "dynamic":
        n = cfg.budget
        parents = [-1 if i < 4 else (i - 4) // 4 for i in range(n)]
    else:
        parents = list(cfg.static_plan().parents)
        n = len(parents)
    depths: list[int] = []
    for p in parents:
        depths.append(1 if p < 0 else depths[p] + 1)
    g = torch.Generator().manual_seed(n)
    tree = TokenTree(
        token_ids=torch.randint(0, VOCAB, (n,), generator=g),
        parents=torch.tensor(parents),
        depths=torch.tensor(depths),
        log_probs=-torch.rand(n, generator=g),
    )
    if do_sample:
        tree.q_ids = torch.randint(0, VOCAB, (n, KQ), generator=g)
        q = torch.rand(n, KQ, generator=g)
        tree.q_probs = q / q.sum(-1, keepdim=True)
    return tree


class NoopDraft:
    """Returns a canned tree of the requested shape after ``delay_s`` (0: immediately)."""

    device = torch.device("cpu")

    def __init__(self, delay_s: float = 0.0) -> None:
        self._cache: dict[tuple[str, bool], TokenTree] = {}
        self.delay_s = delay_s

    def generate(self, req: DraftRequest) -> DraftResult:
        if self.delay_s:
            time.sleep(self.delay_s)
        key = (repr(req.tree), req.sampling.do_sample)
        tree = self._cache.get(key)
        if tree is None:
            tree = self._cache[key] = canned_tree(req.tree, req.sampling.do_sample)
        return DraftResult(tree, req.prefix_length + len(req.new_token_ids), WorkerStats(device="cpu"), True)

    def end_session(self, session_id: str) -> bool:
        return False

    def info(self) -> WorkerInfo:
        return WorkerInfo("draft", "noop", VOCAB, "float32", "cpu", PROTOCOL_VERSION, 0)

    def shutdown(self) -> None:
        pass


class NoopTarget(NoopDraft):
    """Accepts the first root-to-leaf path of up to 3 nodes, immediately."""

    def verify(self, req: VerifyRequest) -> VerifyResult:
        if self.delay_s:
            time.sleep(self.delay_s)
        n = req.tree.num_nodes
        nodes = [0, 4, 20][: min(3, n)] if n > 4 else list(range(min(3, n)))
        base = req.expected_prefix_length + len(req.pending_token_ids)
        return VerifyResult([1000 + i for i in nodes], 77, nodes, base + len(nodes), 3, n,
                            WorkerStats(device="cpu"), True)  # fmt: skip

    def info(self) -> WorkerInfo:
        return WorkerInfo("target", "noop", VOCAB, "float32", "cpu", PROTOCOL_VERSION, 0)

    model_vocab_size = VOCAB


def serve_noop(engine_ms: tuple[float, float]) -> int:
    """Subprocess entry: serve the no-op engines on free ports, print ``READY <draft> <target>``."""
    from specsplit.remote import serve_draft, serve_target
    from specsplit.remote.server import ServerLimits

    limits = ServerLimits(max_tree_nodes=256)
    d = serve_draft(NoopDraft(engine_ms[0] / 1e3), limits=limits)
    t = serve_target(NoopTarget(engine_ms[1] / 1e3), limits=limits, draft_address=d.address)
    # the same, calling the draft worker with unary calls (the A/B of the draft stream)
    t_unary = serve_target(NoopTarget(engine_ms[1] / 1e3), limits=limits, draft_address=d.address,
                           draft_streams=False)  # fmt: skip
    print(f"READY {d.port} {t.port} {t_unary.port}", flush=True)
    sys.stdin.read()  # until the parent closes our stdin
    for w in (d, t, t_unary):
        w.stop(0)
    return 0


LOOP_TREE = "tree 64 nodes"
LOOP_TOKENS = 400  # 100 rounds of 4 committed tokens per generation


class _Delayed:
    """Iterator over a server stream whose messages reach the consumer ``delay`` seconds after they
    arrived (a one-way link delay: messages in flight overlap, delays do not add up)."""

    def __init__(self, call, delay: float):
        import queue
        import threading

        self._call, self._delay, self._q = call, delay, queue.SimpleQueue()

        def pump() -> None:
            try:
                for msg in call:
                    self._q.put((time.perf_counter(), msg, None))
            except Exception as e:  # noqa: BLE001 - handed to the consumer
                self._q.put((time.perf_counter(), None, e))
            else:
                self._q.put((time.perf_counter(), None, StopIteration()))

        threading.Thread(target=pump, daemon=True).start()

    def __iter__(self):
        return self

    def __next__(self):
        arrived, msg, err = self._q.get()
        wait = arrived + self._delay - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        if err is not None:
            raise err
        return msg

    def cancel(self) -> None:
        self._call.cancel()


def delayed_transport(transport, delay_ms: float):
    """``transport`` with ``delay_ms`` one-way on every message to and from the workers."""
    import grpc

    from specsplit.remote._generated import spec_decoding_pb2_grpc as pb_grpc

    delay = delay_ms / 1000.0

    class Delay(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
        def intercept_unary_unary(self, continuation, details, request):
            time.sleep(delay)  # the request on its way
            out = continuation(details, request)
            out.result()  # the reply has arrived ...
            time.sleep(delay)  # ... and travels back
            return out

        def intercept_unary_stream(self, continuation, details, request):
            time.sleep(delay)
            return _Delayed(continuation(details, request), delay)

    for peer, stub in (
        (transport._target, pb_grpc.TargetServiceStub),
        (transport._draft, pb_grpc.DraftServiceStub),
    ):
        peer.stub = stub(grpc.intercept_channel(peer.channel, Delay()))
    return transport


def measure_loop(transport, loop: str, generations: int) -> list[float]:
    """Seconds per round of whole greedy generations through ``decode`` (no-op engines)."""
    from specsplit.pipeline import DecodeParams, decode

    params = DecodeParams(max_new_tokens=LOOP_TOKENS, tree=SHAPES[LOOP_TREE], loop=loop)
    out = []
    for _ in range(generations):
        t0 = time.perf_counter()
        _, stats = decode(transport, list(range(100, 612)), params)
        out.append((time.perf_counter() - t0) / len(stats.rounds))
    return out


def measure(transport, tree_cfg: TreeConfig, do_sample: bool, rounds: int) -> dict[str, list[float]]:
    sampling = SamplingParams(do_sample=do_sample, temperature=1.0, top_k=0, top_p=1.0)
    draft_s, verify_s = [], []
    prefix = 0
    new = list(range(100, 612))  # a 512-token prompt on the first round, then 4 new tokens per round
    for i in range(rounds):
        dreq = DraftRequest("bench", new, prefix, tree_cfg, sampling, i if do_sample else None, None, 4096)
        t0 = time.perf_counter()
        dres = transport.draft(dreq)
        t1 = time.perf_counter()
        vreq = VerifyRequest("bench", dres.tree, [new[-1]], prefix, sampling, i if do_sample else None, 4096)
        transport.verify(vreq)
        t2 = time.perf_counter()
        draft_s.append(t1 - t0)
        verify_s.append(t2 - t1)
        prefix, new = dres.prefix_length, [1, 2, 3, 4]
    return {"draft": draft_s, "verify": verify_s}


def payload_bytes(tree_cfg: TreeConfig, do_sample: bool) -> dict[str, int]:
    from specsplit.remote import convert

    sampling = SamplingParams(do_sample=do_sample)
    seed = 2**61 if do_sample else None
    dreq = DraftRequest(
        "0123456789abcdef0123456789abcdef", [1, 2, 3, 4], 600, tree_cfg, sampling, seed, None, 4096
    )
    dres = NoopDraft().generate(dreq)
    vreq = VerifyRequest(dreq.session_id, dres.tree, [150_000], 600, sampling, seed, 4096)
    vres = NoopTarget().verify(vreq)
    dres.stats.server_time_s = vres.stats.server_time_s = 1e-4  # set by every real handler
    return {
        "draft_request": convert.draft_request_to_proto(dreq).ByteSize(),
        "draft_response": convert.draft_result_to_proto(dres).ByteSize(),
        "verify_request": convert.verify_request_to_proto(vreq).ByteSize(),
        "verify_response": convert.verify_result_to_proto(vres).ByteSize(),
    }


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=1000, help="measured rounds per configuration")
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--tag", default="cpu", help="results file suffix")
    ap.add_argument(
        "--client-delays-ms",
        type=lambda v: [float(x) for x in v.split(",") if x],
        default=[0.0],
        help="one-way delays between this process and the workers for the whole-round table, e.g. 0,1,5",
    )
    ap.add_argument(
        "--engine-ms",
        type=lambda v: tuple(float(x) for x in v.split(",")),
        default=(0.0, 0.0),
        help="DRAFT,VERIFY: milliseconds each no-op engine sleeps per call (stand-ins for GPU work)",
    )
    ap.add_argument("--loops-only", action="store_true", help="only the whole-round table")
    ap.add_argument("--serve-noop", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if len(args.engine_ms) != 2:
        ap.error("--engine-ms takes DRAFT,VERIFY")
    if args.serve_noop:
        return serve_noop(args.engine_ms)
    torch.set_num_threads(1)
    from specsplit.remote import GrpcTransport

    engine_arg = f"--engine-ms={args.engine_ms[0]:g},{args.engine_ms[1]:g}"
    proc = subprocess.Popen([sys.executable, __file__, "--serve-noop", engine_arg], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout is not None and proc.stdin is not None
    line = proc.stdout.readline().split()
    if not line or line[0] != "READY":
        raise SystemExit(f"no-op workers did not start: {line}")
    grpc_t = GrpcTransport(f"127.0.0.1:{line[2]}", f"127.0.0.1:{line[1]}", timeout_s=30)
    unary_t = GrpcTransport(f"127.0.0.1:{line[3]}", f"127.0.0.1:{line[1]}", timeout_s=30, streams=False)
    local_t = LocalTransport(
        NoopDraft(args.engine_ms[0] / 1e3),
        NoopTarget(args.engine_ms[1] / 1e3),  # type: ignore[arg-type]
    )
    rows = []
    try:
        for name, cfg in ({} if args.loops_only else SHAPES).items():
            for do_sample in (False, True):
                for t in (local_t, grpc_t, unary_t):
                    measure(t, cfg, do_sample, args.warmup)
                # Interleave blocks so drift on a shared machine hits all transports alike.
                loc: dict[str, list[float]] = {"draft": [], "verify": []}
                rem: dict[str, list[float]] = {"draft": [], "verify": []}
                una: dict[str, list[float]] = {"draft": [], "verify": []}
                block = max(1, args.rounds // 10)
                for _ in range(10):
                    for acc, t in ((loc, local_t), (rem, grpc_t), (una, unary_t)):
                        m = measure(t, cfg, do_sample, block)
                        acc["draft"] += m["draft"]
                        acc["verify"] += m["verify"]
                sizes = payload_bytes(cfg, do_sample)
                row = {"shape": name, "nodes": canned_tree(cfg, do_sample).num_nodes,
                       "mode": "sampling (q, Kq=32)" if do_sample else "greedy"}  # fmt: skip
                for call in ("draft", "verify"):
                    row[f"{call}_overhead_us_median"] = 1e6 * (
                        statistics.median(rem[call]) - statistics.median(loc[call])
                    )
                    row[f"{call}_overhead_us_p90"] = 1e6 * (pct(rem[call], 0.9) - pct(loc[call], 0.9))
                    row[f"{call}_unary_overhead_us_median"] = 1e6 * (
                        statistics.median(una[call]) - statistics.median(loc[call])
                    )
                    row[f"{call}_unary_overhead_us_p90"] = 1e6 * (pct(una[call], 0.9) - pct(loc[call], 0.9))
                    row[f"{call}_local_us_median"] = 1e6 * statistics.median(loc[call])
                    row[f"{call}_bytes"] = sizes[f"{call}_request"] + sizes[f"{call}_response"]
                row.update(sizes)
                rows.append(row)
                print(f"{name:16s} {row['mode']:20s} draft +{row['draft_overhead_us_median']:7.0f} us "
                      f"(unary +{row['draft_unary_overhead_us_median']:5.0f}) {row['draft_bytes']:6d} B | verify "
                      f"+{row['verify_overhead_us_median']:7.0f} us (unary +{row['verify_unary_overhead_us_median']:5.0f}) "
                      f"{row['verify_bytes']:6d} B", flush=True)  # fmt: skip
        runs = [("local", local_t, "client"), ("grpc, client loop", grpc_t, "client"),
                ("grpc, target loop", grpc_t, "target"), ("grpc, client loop, unary calls", unary_t, "client"),
                ("grpc, target loop, unary calls", unary_t, "target")]  # fmt: skip
        loops: dict[str, list[float]] = {name: [] for name, _, _ in runs}
        for _, t, loop in runs:
            measure_loop(t, loop, 2)
        gens = max(5, args.rounds // 100)
        for _ in range(5):  # interleaved blocks, as above
            for name, t, loop in runs:
                loops[name] += measure_loop(t, loop, max(1, gens // 5))
        base = statistics.median(loops["local"])
        loop_rows = []
        for name, xs in loops.items():
            med = statistics.median(xs)
            loop_rows.append({"mode": name, "delay_ms": 0.0, "round_us_median": 1e6 * med,
                              "overhead_us_median": 1e6 * (med - base), "generations": len(xs)})  # fmt: skip
            print(f"{name:18s} {1e6 * med:7.0f} us a round (+{1e6 * (med - base):5.0f})", flush=True)
        for delay in (d for d in args.client_delays_ms if d > 0):
            far = delayed_transport(
                GrpcTransport(grpc_t._target.address, grpc_t._draft.address, timeout_s=30), delay
            )
            try:
                for name, loop in (("grpc, client loop", "client"), ("grpc, target loop", "target")):
                    measure_loop(far, loop, 1)
                    med = statistics.median(measure_loop(far, loop, 3))
                    loop_rows.append({"mode": name, "delay_ms": delay, "round_us_median": 1e6 * med,
                                      "overhead_us_median": 1e6 * (med - base), "generations": 3})  # fmt: skip
                    print(f"{name:18s} +{delay:g} ms one-way {1e6 * med:8.0f} us a round", flush=True)
            finally:
                far.close()
    finally:
        grpc_t.close()
        unary_t.close()
        proc.stdin.close()
        proc.wait(timeout=30)
    write(rows, args, loop_rows)
    return 0


def write(rows: list[dict], args: argparse.Namespace, loop_rows: list[dict]) -> None:
    import grpc
    from google.protobuf import __version__ as pb_version

    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "benchmark": "transport_overhead",
        "command": f"python benchmarks/transport_overhead.py --rounds {args.rounds} --tag {args.tag}"
        + (
            f" --client-delays-ms {','.join(f'{d:g}' for d in args.client_delays_ms)}"
            if any(args.client_delays_ms)
            else ""
        )
        + (f" --engine-ms {args.engine_ms[0]:g},{args.engine_ms[1]:g}" if any(args.engine_ms) else "")
        + (" --loops-only" if args.loops_only else ""),
        "engine_ms": list(args.engine_ms),
        "rounds_per_config": args.rounds,
        "python": platform.python_version(),
        "grpcio": grpc.__version__,
        "protobuf": pb_version,
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "load_average_1m_at_end": round(os.getloadavg()[0], 2),  # other work on a shared machine
        "note": "overhead = gRPC minus LocalTransport on the same no-op engines; loopback TCP, "
        "workers in a subprocess; bytes = protobuf payload of request + response",
    }
    (out / f"transport_overhead-{args.tag}.json").write_text(
        json.dumps({"meta": meta, "rows": rows, "loop_rows": loop_rows}, indent=2) + "\n"
    )
    lines = [
        f"# Transport overhead per round ({args.tag})",
        "",
        f"`{meta['command']}` — Python {meta['python']}, grpcio {meta['grpcio']}, protobuf "
        f"{meta['protobuf']}, {meta['cpus']} CPUs, load average {meta['load_average_1m_at_end']}, {meta['date']}.",
    ]
    if rows:
        lines += [
            "",
            "Overhead = gRPC minus LocalTransport on the same no-op engines and requests (median, p90 in "
            "brackets), loopback, workers in a subprocess, calls over the long-lived streams (the default) "
            "and as unary calls (`streams=False`). Bytes = protobuf payload, request + response.",
            "",
            "| tree | nodes | mode | draft µs | draft µs, unary | draft bytes | verify µs | verify µs, unary "
            "| verify bytes |",
            "|---|---:|---|---:|---:|---:|---:|---:|---:|",
        ]
    for r in rows:
        cells = [r["shape"], r["nodes"], r["mode"]]
        for call in ("draft", "verify"):
            cells += [f"{r[f'{call}_overhead_us_median']:.0f} ({r[f'{call}_overhead_us_p90']:.0f})",
                      f"{r[f'{call}_unary_overhead_us_median']:.0f} ({r[f'{call}_unary_overhead_us_p90']:.0f})",
                      r[f"{call}_bytes"]]  # fmt: skip
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    lines += [
        "",
        f"Whole rounds of `specsplit.pipeline.decode` (greedy, {LOOP_TREE}, {LOOP_TOKENS} tokens = 100 "
        "rounds a generation, median over generations) on the same no-op engines"
        + (
            f", which sleep {args.engine_ms[0]:g} ms a draft and {args.engine_ms[1]:g} ms a verification"
            if any(args.engine_ms)
            else ""
        )
        + ". Overhead = minus local.",
        "",
        "| rounds run by | client ↔ workers one-way delay | µs a round | overhead µs | generations |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in loop_rows:
        lines.append(
            f"| {r['mode']} | {r['delay_ms']:g} ms | {r['round_us_median']:.0f} | {r['overhead_us_median']:.0f} "
            f"| {r['generations']} |"
        )
    (out / f"transport_overhead-{args.tag}.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out / f'transport_overhead-{args.tag}.json'} and .md")


if __name__ == "__main__":
    sys.exit(main())
