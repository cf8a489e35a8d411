#!/usr/bin/env python
"""How the client loop's shared rounds scale with concurrent clients, on a tiny model (any machine).

Starts a batching target worker and a batching draft worker (``specsplit serve ... --max-batch N``,
both on the same tiny random Qwen2 model, so every chain draft is accepted) and runs N clients of
the client loop at once (``grpc_loop="client"``: each round one ``GenerateDrafts`` call to the draft
worker and one ``VerifyDrafts`` call to the target worker). Reports the aggregate tokens/s, each
client's tokens/s and the latency of the two calls as each client sees it (p50 / p90). Shared
rounds work when N clients cost far less than N times one client; a gathering that cannot collect
concurrent requests shows up as call latencies that grow with N at an unchanged aggregate.

On a CPU the workers' forwards grow with the rows they batch, so the aggregate cannot reach N times
one client; compare runs of one machine (e.g. before and after a change), not machines.

    python benchmarks/client_loop_gather.py --clients 1,16 --new-tokens 128 --tag cpu
        # writes benchmarks/results/client_loop_gather-<tag>.{json,md}
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

OUT = Path(__file__).resolve().parent / "results"


def tiny_model(path: Path) -> None:
    """A seeded tiny Qwen2 (2 layers, 2048-token vocabulary) saved to ``path``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=2048, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)  # fmt: skip
    Qwen2ForCausalLM(cfg).eval().save_pretrained(path)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def run_clients(target: str, draft: str, n: int, new_tokens: int) -> dict[str, Any]:
    """N client-loop generators at once (after one warm-up pass): tok/s and call latencies."""
    from transformers import GenerationConfig

    from specsplit import SpecSplitConfig, SpecSplitGenerator
    from specsplit.bench.batch import together
    from specsplit.remote import client as grpc_client

    latency: dict[str, list[float]] = {"draft": [], "verify": []}
    lock = threading.Lock()
    originals = {name: getattr(grpc_client.GrpcTransport, name) for name in latency}

    def timed(name: str) -> Any:
        def call(self: Any, req: Any) -> Any:
            t0 = time.perf_counter()
            out = originals[name](self, req)
            with lock:
                latency[name].append(time.perf_counter() - t0)
            return out

        return call

    cfg = SpecSplitConfig(transport="grpc", draft_address=draft, target_address=target, timeout_s=600.0)
    gc = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 2000, (1, 40 + 7 * i), generator=g) for i in range(n)]
    gens = [SpecSplitGenerator(config=cfg) for _ in range(n)]

    def one(i: int) -> tuple[int, float]:
        t0 = time.perf_counter()
        out = gens[i].generate(prompts[i], generation_config=gc)
        return out.shape[1] - prompts[i].shape[1], time.perf_counter() - t0

    def once() -> tuple[float, list[tuple[int, float]]]:
        return together([functools.partial(one, i) for i in range(n)])

    try:
        once()  # sessions placed, shapes seen
        for name in latency:
            setattr(grpc_client.GrpcTransport, name, timed(name))
        wall, per = once()
    finally:
        for name, fn in originals.items():
            setattr(grpc_client.GrpcTransport, name, fn)
        for gen in gens:
            gen.close()
    tokens = sum(t for t, _ in per)
    speeds = [t / s for t, s in per]
    return {
        "clients": n,
        "tok_s": tokens / wall,
        "client_tok_s_min": min(speeds),
        "client_tok_s_p50": statistics.median(speeds),
        "draft_ms_p50": 1e3 * _pct(latency["draft"], 0.5),
        "draft_ms_p90": 1e3 * _pct(latency["draft"], 0.9),
        "verify_ms_p50": 1e3 * _pct(latency["verify"], 0.5),
        "verify_ms_p90": 1e3 * _pct(latency["verify"], 0.9),
        "calls": len(latency["verify"]),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", default="1,16", help="client counts, comma-separated")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--tag", default="cpu")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    counts = [int(x) for x in args.clients.split(",")]
    from specsplit.remote.launch import WorkerProcess

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "tiny-qwen2"
        tiny_model(model)
        batch = [
            "--max-batch",
            str(max(counts)),
            "--batch-capacity",
            "1024",
            "--max-workers",
            str(max(counts) + 8),
        ]
        workers = [WorkerProcess(role, str(model), device="cpu", dtype="float32", args=batch).start()
                   for role in ("target", "draft")]  # fmt: skip
        try:
            for n in counts:
                rows.append(run_clients(workers[0].address, workers[1].address, n, args.new_tokens))
                print(json.dumps(rows[-1]), flush=True)
        finally:
            for w in workers:
                w.stop()
    one = next((r["tok_s"] for r in rows if r["clients"] == 1), None)
    command = "python benchmarks/client_loop_gather.py " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    result = {
        "command": command.strip(),
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "torch": torch.__version__,
        },  # fmt: skip
        "new_tokens": args.new_tokens,
        "rows": rows,
    }
    lines = [
        "# Client-loop shared rounds on a tiny model",
        "",
        f"`{result['command']}` — {result['created_utc']}, {platform.platform()}, torch {torch.__version__}",
        "",
        "| clients | tok/s (all) | x 1 client | client tok/s min / p50 | draft call ms p50 / p90 | verify call ms p50 / p90 |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        x = f"{r['tok_s'] / one:.2f}" if one else "-"
        lines.append(
            f"| {r['clients']} | {r['tok_s']:.1f} | {x} | {r['client_tok_s_min']:.1f} / {r['client_tok_s_p50']:.1f} "
            f"| {r['draft_ms_p50']:.1f} / {r['draft_ms_p90']:.1f} | {r['verify_ms_p50']:.1f} / {r['verify_ms_p90']:.1f} |"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"client_loop_gather-{args.tag}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1), encoding="utf-8")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
