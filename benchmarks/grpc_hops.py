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

    python benchmarks/grpc_hops.py --calls 2000 --gap-ms 0,10 [--json out.json]
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

import grpc

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--serve", choices=["sync", "aio", "tcp"], help=argparse.SUPPRESS)
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--gap-ms", default="0,10", help="comma list of sleeps between calls")
    ap.add_argument("--bytes", type=int, default=700, help="payload size each way")
    ap.add_argument("--styles", default="tcp,sync-unary,sync-stream,aio-unary,aio-stream")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    if args.serve:
        serve(args.serve)
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
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"grpcio": grpc.__version__, "cpus": os.cpu_count(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
