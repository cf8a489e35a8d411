#!/usr/bin/env python
"""Round-trip time of one small message between two processes, by gRPC call style.

The draft call of a gRPC round is a small request and a small reply (a few hundred bytes). This
times that exchange alone, with an echo server in a subprocess, for each way Python gRPC can carry
it, and raw TCP as the floor:

* ``sync-unary``: ``grpc.server`` with a thread pool, blocking unary call (what SpecSplit uses);
* ``sync-stream``: the same server, one bidirectional stream kept open, one message each way;
* ``aio-unary`` / ``aio-stream``: a ``grpc.aio`` server (the handler runs on the event loop);
* ``tcp``: a plain socket, length-prefixed.

``--gap-ms`` sleeps between calls, as a real round waits ~10-20 ms for its GPU work between two
draft calls (threads go cold; on VMs waking them is what costs).

    python benchmarks/grpc_hops.py --calls 2000 --gap-ms 0,10 --tag gpu-host
        # writes benchmarks/results/grpc_hops-<tag>.{json,md,png}
    python benchmarks/grpc_hops.py --rerender benchmarks/results/grpc_hops-<tag>.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import queue
import socket
import statistics
import struct
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc

ROOT = Path(__file__).resolve().parents[1]

_METHOD_U = "/hops.Echo/Unary"
_METHOD_S = "/hops.Echo/Stream"


def _ident(b: bytes) -> bytes:
    return b


def _handlers() -> grpc.GenericRpcHandler:
    def unary(req: bytes, ctx: object) -> bytes:
        return req

    def stream(it: object, ctx: object) -> object:
        yield from it  # type: ignore[misc]

    return grpc.method_handlers_generic_handler(
        "hops.Echo",
        {
            "Unary": grpc.unary_unary_rpc_method_handler(unary, _ident, _ident),
            "Stream": grpc.stream_stream_rpc_method_handler(stream, _ident, _ident),
        },
    )


def _aio_handlers() -> grpc.GenericRpcHandler:
    async def unary(req: bytes, ctx: object) -> bytes:
        return req

    async def stream(it: object, ctx: object) -> object:
        async for req in it:  # type: ignore[attr-defined]
            yield req

    return grpc.method_handlers_generic_handler(
        "hops.Echo",
        {
            "Unary": grpc.unary_unary_rpc_method_handler(unary, _ident, _ident),
            "Stream": grpc.stream_stream_rpc_method_handler(stream, _ident, _ident),
        },
    )


def serve(kind: str) -> None:
    """Run an echo server of ``kind`` (sync, aio, tcp); print its port, serve until stdin closes."""
    if kind == "sync":
        server = grpc.server(ThreadPoolExecutor(max_workers=4))
        server.add_generic_rpc_handlers((_handlers(),))
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        print(port, flush=True)
        sys.stdin.read()
        server.stop(0)
    elif kind == "aio":

        async def main() -> None:
            server = grpc.aio.server()
            server.add_generic_rpc_handlers((_aio_handlers(),))
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            print(port, flush=True)
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
            await server.stop(0)

        asyncio.run(main())
    else:
        ls = socket.socket()
        ls.bind(("127.0.0.1", 0))
        ls.listen(1)
        print(ls.getsockname()[1], flush=True)
        conn, _ = ls.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while True:
            head = conn.recv(4, socket.MSG_WAITALL)
            if len(head) < 4:
                return
            (n,) = struct.unpack("<I", head)
            conn.sendall(head + conn.recv(n, socket.MSG_WAITALL))


def _time_calls(call: object, calls: int, gap_s: float) -> list[float]:
    out = []
    for i in range(calls + 50):
        if gap_s:
            time.sleep(gap_s)
        t0 = time.perf_counter()
        call()  # type: ignore[operator]
        if i >= 50:
            out.append((time.perf_counter() - t0) * 1e6)
    return out


def measure(style: str, calls: int, gap_s: float, payload: bytes) -> list[float]:
    kind = "tcp" if style == "tcp" else style.split("-")[0]
    proc = subprocess.Popen(
        [sys.executable, __file__, "--serve", kind], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        port = int(proc.stdout.readline())  # type: ignore[union-attr]
        if style == "tcp":
            s = socket.create_connection(("127.0.0.1", port))
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            msg = struct.pack("<I", len(payload)) + payload

            def call() -> None:
                s.sendall(msg)
                s.recv(len(msg), socket.MSG_WAITALL)

            try:
                return _time_calls(call, calls, gap_s)
            finally:
                s.close()
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        grpc.channel_ready_future(channel).result(timeout=30)
        try:
            if style.endswith("unary"):
                stub = channel.unary_unary(_METHOD_U, request_serializer=_ident, response_deserializer=_ident)
                return _time_calls(lambda: stub(payload, timeout=30), calls, gap_s)
            requests: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
            stream = channel.stream_stream(_METHOD_S, request_serializer=_ident, response_deserializer=_ident)
            responses = stream(iter(requests.get, None))

            def call_stream() -> None:
                requests.put(payload)
                next(responses)

            try:
                return _time_calls(call_stream, calls, gap_s)
            finally:
                requests.put(None)
                responses.cancel()
        finally:
            channel.close()
    finally:
        proc.stdin.close()  # type: ignore[union-attr]
        proc.wait(timeout=30)


def write(result: dict[str, Any], out: Path, stem: str) -> None:
    """``<stem>.json``, a markdown table and a bar plot (when matplotlib is installed) under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [
        f"# gRPC round trip by call style ({result.get('tag') or 'untagged'})",
        "",
        f"`{result['command']}` — grpcio {result['grpcio']}, {result['cpus']} CPUs, {result.get('cpu', '')}.",
        "",
        f"One {result['bytes']}-byte message each way between two processes on loopback, median and p90 of "
        f"{result['calls']} calls after 50 warm-up calls; `gap` = sleep between calls (a round's GPU wait).",
        "",
        "| style | gap ms | median µs | p90 µs |",
        "|---|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(f"| {r['style']} | {r['gap_ms']:g} | {r['median_us']:.0f} | {r['p90_us']:.0f} |")
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    sys.path.insert(0, str(ROOT))
    from specsplit.bench.report import pyplot

    plt = pyplot()
    if plt is None:
        return
    gaps = sorted({r["gap_ms"] for r in result["rows"]})
    styles = list(dict.fromkeys(r["style"] for r in result["rows"]))
    fig, ax = plt.subplots(figsize=(9, 4))
    w = 0.8 / len(gaps)
    for j, gap in enumerate(gaps):
        med = {r["style"]: r["median_us"] for r in result["rows"] if r["gap_ms"] == gap}
        ax.bar([i + j * w for i in range(len(styles))], [med.get(st, 0) for st in styles], w,
               label=f"gap {gap:g} ms")  # fmt: skip
    ax.set_xticks([i + w * (len(gaps) - 1) / 2 for i in range(len(styles))], styles)
    ax.set_ylabel("median round trip (µs)")
    ax.set_title(f"gRPC round trip by call style ({result.get('tag') or ''})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / f"{stem}.png", dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--serve", choices=["sync", "aio", "tcp"], help=argparse.SUPPRESS)
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--gap-ms", default="0,10", help="comma list of sleeps between calls")
    ap.add_argument("--bytes", type=int, default=700, help="payload size each way")
    ap.add_argument("--styles", default="tcp,sync-unary,sync-stream,aio-unary,aio-stream")
    ap.add_argument("--tag", default="", help="results file suffix")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--rerender", type=Path, help="write the .md and .png again from this result .json")
    args = ap.parse_args()
    if args.serve:
        serve(args.serve)
        return
    if args.rerender:
        write(json.loads(args.rerender.read_text()), args.rerender.parent, args.rerender.stem)
        return
    payload = os.urandom(args.bytes)
    rows = []
    print(f"grpcio {grpc.__version__}, {os.cpu_count()} CPUs, {platform.processor() or platform.machine()}")
    print("| style | gap ms | median µs | p90 µs |\n|---|---:|---:|---:|")
    for gap in [float(g) for g in args.gap_ms.split(",")]:
        for style in args.styles.split(","):
            ts = sorted(measure(style, args.calls, gap / 1e3, payload))
            row = {
                "style": style,
                "gap_ms": gap,
                "median_us": statistics.median(ts),
                "p90_us": ts[int(0.9 * len(ts))],
            }
            rows.append(row)
            print(f"| {style} | {gap:g} | {row['median_us']:.0f} | {row['p90_us']:.0f} |", flush=True)
    result = {
        "command": "python benchmarks/grpc_hops.py " + " ".join(sys.argv[1:]),
        "tag": args.tag,
        "grpcio": grpc.__version__,
        "cpus": os.cpu_count(),
        "cpu": platform.processor() or platform.machine(),
        "calls": args.calls,
        "bytes": args.bytes,
        "rows": rows,
    }
    write(result, args.out, "grpc_hops" + (f"-{args.tag}" if args.tag else ""))


if __name__ == "__main__":
    main()
