"""``specsplit bench --batch-size B[,B...]``: aggregate throughput of batched generation, in one process.

For each batch size ``B`` every decoder gets the same ``B`` prompts (the prompt set's categories
interleaved, cycled when ``B`` is larger than the set) as one left-padded ``generate()`` call:

- ``hf-batch``: Hugging Face ``generate()`` on the batch (one forward per token for all rows);
- ``specsplit-plain``: SpecSplit without a draft (``B = 1``: our single-row target-only decode, CUDA
  graphs and compile as set; ``B > 1``: batched one-token rounds);
- ``specsplit-ngram``: SpecSplit with n-gram trees (``B > 1``: batched rounds sized by the batch
  planner, which turns trees off where plain steps are faster).

Each decoder is warmed up on the batch once (graph captures), then timed ``repeats`` times; the
median is reported. Per row: time per token (its wall time, from joining the batch to its last
token, over its tokens) as p50/p95 over the rows. Every SpecSplit row is compared with the same row
of ``specsplit-plain`` at ``B = 1``'s path (the target's own greedy output).
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import torch

from specsplit.bench.models import BenchModels, load_models
from specsplit.bench.report import machine_info, machine_slug, pyplot
from specsplit.bench.run import BenchPrompt, load_prompts, pack_copies, smoke_prompts, tokenize_prompts

logger = logging.getLogger(__name__)

T = TypeVar("T")
SCHEMA = "specsplit-bench-batch/1"
BATCH_DECODERS = ("hf-batch", "specsplit-plain", "specsplit-ngram")
CLIENT_DECODERS = ("grpc-plain", "grpc-ngram")  # concurrent clients of one batched target worker
# ... and clients that run the rounds themselves against a draft worker and the batching target worker
# (client loop, the draft model's chain; optional: it loads the draft model)
CLIENT_LOOP_DECODER = "grpc-model-clientloop"
# ... and clients of a target worker that drafts on the draft worker (``--draft-address``) and runs
# the loop: alone, a client's generation speculates with the draft model; concurrent ones share
# batched rounds (optional: it loads the draft model)
TARGET_LOOP_MODEL_DECODER = "grpc-model-targetloop"
DRAFT_WORKER_DECODERS = (CLIENT_LOOP_DECODER, TARGET_LOOP_MODEL_DECODER)


@dataclass
class BatchBenchOptions:
    """One batched bench run (the CLI fills it)."""

    batch_sizes: tuple[int, ...] = (1, 4, 16)
    device: str = "cpu"
    target: str | None = None
    draft: str | None = None  # the draft model of the decoders that load one (default: the target's pair)
    dtype: str = "auto"
    tiny: bool = False
    max_new_tokens: int = 128
    repeats: int = 1
    decoders: tuple[str, ...] = BATCH_DECODERS
    cuda_graphs: bool = False
    compile: bool = False
    pack_weights: bool | None = None  # SpecSplit decoders run packed-weight copies (None: float32 on a CPU)
    threads: int | None = None
    clients: tuple[int, ...] = ()  # --concurrent-clients: client counts (instead of batch sizes)
    workers: str = "thread"  # --concurrent-clients: workers as "process"es (`specsplit serve`) or "thread"s
    # --concurrent-clients: each client a process of its own (None: when the workers are processes)
    client_processes: bool | None = None
    prompts_dir: Path | None = None
    out: Path = Path("benchmarks/results")
    tag: str = ""
    command: str = ""
    notes: list[str] = field(default_factory=list)


def interleaved(prompts: list[BenchPrompt], n: int) -> list[BenchPrompt]:
    """``n`` prompts taking the categories in turn (cycled when the set is smaller than ``n``)."""
    by_cat: dict[str, list[BenchPrompt]] = {}
    for p in prompts:
        by_cat.setdefault(p.category, []).append(p)
    order: list[BenchPrompt] = []
    depth = max((len(v) for v in by_cat.values()), default=0)
    for i in range(depth):
        order += [v[i] for v in by_cat.values() if i < len(v)]
    if not order:
        raise ValueError("no prompts")
    return [order[i % len(order)] for i in range(n)]


def left_padded(rows: list[list[int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` of ``rows`` left-padded with ``pad``, as ``generate()`` takes them."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r)
        mask[i, width - len(r) :] = 1
    return ids, mask


def _until_eos(row: list[int], eos: list[int]) -> list[int]:
    for i, t in enumerate(row):
        if t in eos:
            return row[: i + 1]
    return row


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


class _Decoder:
    """One decoder of the batched bench: ``run(ids, mask) -> (rows of new tokens, per-row seconds)``."""

    def __init__(self, name: str, m: BenchModels, opts: BatchBenchOptions):
        self.name, self.m, self.opts = name, m, opts
        self.gen: Any = None
        if name != "hf-batch":
            from specsplit import SpecSplitConfig, SpecSplitGenerator

            cfg = SpecSplitConfig(drafter="ngram" if name == "specsplit-ngram" else "model", max_batch=128)
            cfg.target.cuda_graphs = opts.cuda_graphs
            cfg.target.compile = opts.compile
            self.gen = SpecSplitGenerator(m.specsplit_target, None, tokenizer=m.tokenizer, config=cfg)

    def run(self, ids: torch.Tensor, mask: torch.Tensor, max_new: int) -> tuple[list[list[int]], list[float]]:
        m = self.m
        gc = m.generation_config(max_new)
        dev = self.opts.device
        _sync(dev)
        t0 = time.perf_counter()
        if self.gen is None:
            out = m.target.generate(ids.to(dev), attention_mask=mask.to(dev), generation_config=gc)
            _sync(dev)
            wall = time.perf_counter() - t0
            rows = [_until_eos(r, m.eos_token_ids) for r in out[:, ids.shape[1] :].tolist()]
            return rows, [wall] * len(rows)
        res = self.gen.generate(ids, attention_mask=mask, generation_config=gc, return_dict_in_generate=True)
        _sync(dev)
        rows = [_until_eos(r, m.eos_token_ids) for r in res.sequences[:, ids.shape[1] :].tolist()]
        return rows, [s.wall_time_s for s in res.per_sequence_stats]

    def close(self) -> None:
        if self.gen is not None:
            self.gen.close()


def run_batch_bench(opts: BatchBenchOptions) -> dict[str, Any]:
    """Run every decoder at every batch size; write ``<out>/batch-<machine>-<date>[-tag].{json,md,png}``."""
    known = (*CLIENT_DECODERS, *DRAFT_WORKER_DECODERS) if opts.clients else BATCH_DECODERS
    unknown = set(opts.decoders) - set(known)
    if unknown:
        raise ValueError(f"unknown decoders {sorted(unknown)} for this run; choose from {', '.join(known)}")
    if any(b < 1 for b in opts.batch_sizes):
        raise ValueError("batch sizes must be >= 1")
    if opts.threads:
        torch.set_num_threads(opts.threads)
    draft = any(d in opts.decoders for d in DRAFT_WORKER_DECODERS)
    m = load_models(opts.tiny, opts.device, None, opts.target, opts.draft, opts.dtype, with_draft=draft)
    # the draft stays float32 here: these rows measure batching, not the draft's weights
    if m.use_cpu_weights(pack_copies(opts.pack_weights, opts.compile, ()), int8_draft=False):
        logger.info("packed the weights of the SpecSplit decoders' copies for the CPU")
    if opts.tiny:
        prompts = smoke_prompts()
    else:
        prompts = load_prompts(
            opts.prompts_dir or Path(__file__).resolve().parents[2] / "benchmarks" / "prompts"
        )
        tokenize_prompts(prompts, m.tokenizer)
    # specsplit-plain first: its batch-1 rows are the reference the others are compared with.
    names = sorted(opts.decoders, key=lambda d: d not in ("specsplit-plain", "grpc-plain"))
    if opts.clients:
        cells = _client_cells(m, prompts, opts)
    else:
        cells = _batch_cells(m, prompts, names, opts)
    info = machine_info([opts.device])
    info["slug"] = machine_slug(info)
    now = time.gmtime()
    result: dict[str, Any] = {
        "schema": SCHEMA,
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", now),
        "command": opts.command,
        "notes": opts.notes,
        "machine": info,
        "config": {
            "target": m.target_name,
            "dtype": m.dtype,
            "max_new_tokens": opts.max_new_tokens,
            "repeats": opts.repeats,
            "cuda_graphs": opts.cuda_graphs,
            "compile": opts.compile,
            "pack_weights": m.packed,
            "batch_sizes": sorted(set(opts.clients or opts.batch_sizes)),
            "mode": "concurrent-clients" if opts.clients else "batch",
            "decoders": list(opts.decoders),
        },
        "cells": cells,
    }
    _ratios(result)
    kind = "clients" if opts.clients else "batch"
    stem = f"{kind}-{info['slug']}-{time.strftime('%Y-%m-%d', now)}" + (f"-{opts.tag}" if opts.tag else "")
    opts.out.mkdir(parents=True, exist_ok=True)
    files = {"json": opts.out / f"{stem}.json", "md": opts.out / f"{stem}.md"}
    files["json"].write_text(json.dumps(result, indent=1), encoding="utf-8")
    files["md"].write_text(batch_markdown(result), encoding="utf-8")
    png = opts.out / f"{stem}.png"
    if write_batch_plot(result, png):
        files["png"] = png
    result["files"] = {k: str(v) for k, v in files.items()}
    return result


def _batch_cells(
    m: BenchModels, prompts: list[BenchPrompt], names: list[str], opts: BatchBenchOptions
) -> list[dict[str, Any]]:
    decoders = [_Decoder(d, m, opts) for d in names]
    cells: list[dict[str, Any]] = []
    reference: dict[str, list[int]] = {}  # prompt id -> the target's own tokens (single-row plain path)
    try:
        for b in sorted(set(opts.batch_sizes)):
            batch = interleaved(prompts, b)
            ids, mask = left_padded([p.input_ids for p in batch], m.pad_token_id)
            for dec in decoders:
                cells.append(_cell(dec, b, batch, ids, mask, opts, reference))
    finally:
        for dec in decoders:
            dec.close()
    return cells


def _client_cells(
    m: BenchModels, prompts: list[BenchPrompt], opts: BatchBenchOptions
) -> list[dict[str, Any]]:
    """``N`` clients at once, each with its own generator over gRPC (one thread each) against ONE
    target worker that batches concurrent calls (``max_batch`` = the largest N; a ``specsplit
    serve`` process, or a server in this process with ``workers="thread"``): ``grpc-plain`` /
    ``grpc-ngram`` make one ``Generate`` call (``grpc_loop="target"``); ``grpc-model-clientloop``
    runs the rounds itself, drafting on a draft worker (greedy sessions' chain drafts batched on
    the draft worker, their verifications on the target worker)."""
    from specsplit import SpecSplitConfig, SpecSplitGenerator
    from specsplit.config import Drafter

    most = max(opts.clients)
    need = max(len(p.input_ids) for p in prompts) + opts.max_new_tokens + 64
    capacity = -(-need // 256) * 256
    workers = _ClientWorkers(m, opts, most, capacity)
    target_address, draft_address, loop_address = workers.addresses
    # with worker processes the clients are processes too, as separate programs would be
    own_processes = bool(workers.processes) if opts.client_processes is None else opts.client_processes
    cells: list[dict[str, Any]] = []
    try:
        for name in [d for d in opts.decoders if d in (*CLIENT_DECODERS, *DRAFT_WORKER_DECODERS)]:
            drafter: Drafter = "ngram" if name == "grpc-ngram" else "model"
            if name == TARGET_LOOP_MODEL_DECODER:
                assert loop_address is not None
                cfg = SpecSplitConfig(transport="grpc", grpc_loop="target", target_address=loop_address,
                                      drafter="model", timeout_s=600.0)  # fmt: skip
            elif name == CLIENT_LOOP_DECODER:
                assert draft_address is not None
                cfg = SpecSplitConfig(transport="grpc", draft_address=draft_address, target_address=target_address,
                                      timeout_s=600.0)  # fmt: skip
            else:
                cfg = SpecSplitConfig(transport="grpc", grpc_loop="target", target_address=target_address,
                                      drafter=drafter, timeout_s=600.0)  # fmt: skip
            alone = _alone_speeds(SpecSplitGenerator(tokenizer=m.tokenizer, config=copy.deepcopy(cfg)),
                                  interleaved(prompts, most), m, opts.max_new_tokens)  # fmt: skip
            for n in sorted(set(opts.clients)):
                rows = interleaved(prompts, n)
                clients: _Clients = (
                    _ClientProcesses(n, cfg) if own_processes else _ClientThreads(n, cfg, m.tokenizer)
                )
                try:
                    logger.info("%d clients: %s (warm-up)", n, name)
                    clients.once(rows, m, opts.max_new_tokens)
                    wall, per = clients.once(rows, m, opts.max_new_tokens)
                finally:
                    clients.close()
                tokens = sum(c.tokens for c in per)
                speeds = sorted(c.tokens / c.seconds for c in per if c.seconds > 0)
                # each client against its own prompt decoded alone (answers differ in length)
                vs_alone = sorted((c.tokens / c.seconds) / alone[r.id] for c, r in zip(per, rows, strict=True)
                                  if c.seconds > 0 and alone.get(r.id))  # fmt: skip
                tpt = sorted(1e3 * c.seconds / max(c.tokens, 1) for c in per)
                # the same prompts one at a time: their tokens over the time they took alone
                alone_s = [c.tokens / alone[r.id] for c, r in zip(per, rows, strict=True) if alone.get(r.id)]
                firsts = sorted(c.first_s for c in per if c.first_s is not None)
                cells.append({
                    "decoder": name, "batch": n, "wall_s": wall, "walls_s": [wall], "tokens": tokens,
                    "tok_s": tokens / wall if wall > 0 else 0.0,
                    "x_alone": sum(alone_s) / wall if wall > 0 and len(alone_s) == len(per) else None,
                    "row_ms_per_token_p50": tpt[len(tpt) // 2],
                    "row_ms_per_token_p95": tpt[min(len(tpt) - 1, int(round(0.95 * (len(tpt) - 1))))],
                    "client_tok_s_min": speeds[0] if speeds else 0.0,
                    "client_tok_s_max": speeds[-1] if speeds else 0.0,
                    "client_vs_alone_min": vs_alone[0] if vs_alone else None,
                    "client_vs_alone_p50": vs_alone[len(vs_alone) // 2] if vs_alone else None,
                    "client_vs_alone_max": vs_alone[-1] if vs_alone else None,
                    "first_token_ms_p50": 1e3 * firsts[len(firsts) // 2] if firsts else None,
                    "first_token_ms_max": 1e3 * firsts[-1] if firsts else None,
                    # per client: which prompt, its tokens, speed, first token, and speed against the prompt alone
                    "clients": [
                        {"prompt_id": r.id, "category": r.category, "tokens": c.tokens,
                         "tok_s": c.tokens / c.seconds if c.seconds > 0 else 0.0,
                         "first_token_ms": 1e3 * c.first_s if c.first_s is not None else None,
                         "vs_alone": (c.tokens / c.seconds) / alone[r.id] if c.seconds > 0 and alone.get(r.id) else None}
                        for c, r in zip(per, rows, strict=True)
                    ],
                    "rows_checked": 0, "rows_identical": 0,
                    "peak_gpu_bytes": workers.peak_gpu_bytes(),
                })  # fmt: skip
                logger.info("%d clients: %s %.1f tok/s (client min %.1f, max %.1f)", n, name,
                            cells[-1]["tok_s"], cells[-1]["client_tok_s_min"], cells[-1]["client_tok_s_max"])  # fmt: skip
    finally:
        workers.close()
    return cells


def _alone_speeds(gen: Any, rows: list[BenchPrompt], m: BenchModels, max_new: int) -> dict[str, float]:
    """Each distinct prompt of ``rows`` decoded by ``gen`` alone (after one warm-up call): its tok/s."""
    try:
        _clients_once([gen], rows[:1], m, max_new)
        speeds: dict[str, float] = {}
        for r in rows:
            if r.id not in speeds:
                _, [c] = _clients_once([gen], [r], m, max_new)
                speeds[r.id] = c.tokens / c.seconds if c.seconds > 0 else 0.0
        return speeds
    finally:
        gen.close()


class _ClientWorkers:
    """The workers the concurrent clients call: the batching target worker; with the draft model
    loaded, a draft worker (the client loop's) and a second batching target worker drafting on it
    (``grpc-model-targetloop``). ``specsplit serve`` processes, or servers inside this process (which
    then share its GIL with every client thread). ``addresses``: (target, draft, target with a draft
    worker), the last two None without the draft model, the last None unless its decoder runs."""

    def __init__(self, m: BenchModels, opts: BatchBenchOptions, most: int, capacity: int):
        from specsplit import DraftEngine, TargetEngine
        from specsplit.config import DraftConfig, TargetConfig
        from specsplit.remote import serve_draft, serve_target
        from specsplit.remote.admission import AdmissionLimits
        from specsplit.remote.launch import WorkerProcess

        self.processes: list[Any] = []
        self.servers: list[Any] = []
        want_loop = TARGET_LOOP_MODEL_DECODER in opts.decoders  # the second target worker only if run
        if opts.workers == "process" and not opts.tiny:
            flags = ["--cuda-graphs"] if opts.cuda_graphs else []
            flags += ["--compile"] if opts.compile else []
            flags += ["--max-workers", str(most + 4), "--pack-weights" if m.packed else "--no-pack-weights"]
            batch = ["--max-batch", str(most), "--batch-capacity", str(capacity)]

            def start(role: str, name: str, extra: list[str]) -> str:
                worker = WorkerProcess(role, name, device=m.device, dtype=m.dtype, args=flags + batch + extra)
                self.processes.append(worker.start())
                return worker.address

            try:
                target = start("target", m.target_name, [])
                draft = (
                    start("draft", m.draft_name, ["--draft-quantize", "none"])
                    if m.draft is not None
                    else None
                )
                loop = (
                    start("target", m.target_name, ["--draft-address", draft])
                    if draft and want_loop
                    else None
                )
            except BaseException:
                self.close()
                raise
            self.addresses = (target, draft, loop)
            return
        limits = AdmissionLimits(max_calls=most + 4, max_queued=most + 4)

        def target_server(draft_address: str | None = None) -> Any:
            engine = TargetEngine(
                m.specsplit_target, TargetConfig(cuda_graphs=opts.cuda_graphs, compile=opts.compile)
            )
            return serve_target(engine, max_workers=most + 4, admission=limits, max_batch=most,
                                batch_capacity=capacity, draft_address=draft_address)  # fmt: skip

        self.servers.append(target_server())
        if m.draft is None:
            self.addresses = (self.servers[0].address, None, None)
            return
        d_engine = DraftEngine(m.specsplit_draft, DraftConfig(cuda_graphs=opts.cuda_graphs))
        self.servers.append(serve_draft(d_engine, max_workers=most + 4, admission=limits, max_batch=most,
                                        batch_capacity=capacity))  # fmt: skip
        loop_server = target_server(self.servers[1].address) if want_loop else None
        if loop_server is not None:
            self.servers.append(loop_server)
        self.addresses = (self.servers[0].address, self.servers[1].address,
                          loop_server.address if loop_server is not None else None)  # fmt: skip

    def peak_gpu_bytes(self) -> int | None:
        """This process's peak GPU memory (None with worker processes: theirs is their own)."""
        if self.processes or not torch.cuda.is_available():
            return None
        return int(torch.cuda.max_memory_allocated())

    def close(self) -> None:
        for srv in self.servers:
            srv.stop(grace=1.0)
        for w in self.processes:
            w.stop()


def _clients_once(
    gens: list[Any], rows: list[BenchPrompt], m: BenchModels, max_new: int
) -> tuple[float, list[ClientRun]]:
    """Every client (a thread each) generates its prompt at once; ``(wall, [ClientRun] per client)``."""
    gc = m.generation_config(max_new)
    pairs = list(zip(gens, rows, strict=True))

    def client(i: int) -> ClientRun:
        return _timed_generate(pairs[i][0], pairs[i][1].input_ids, gc, m.eos_token_ids)

    return together([functools.partial(client, i) for i in range(len(pairs))])


def together(calls: list[Callable[[], T]]) -> tuple[float, list[T]]:
    """Run every call in a thread of its own, all released by one barrier; ``(wall, results)``.
    The first error is raised once every call has finished."""
    import threading

    start = threading.Barrier(len(calls) + 1)
    out: list[Any] = [None] * len(calls)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        start.wait()
        try:
            out[i] = calls[i]()
        except BaseException as e:  # reported after the others finish
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return wall, out


class ClientRun(NamedTuple):
    """One client's generation: new tokens up to EOS, its seconds, and the seconds to its first
    new tokens (None when nothing came)."""

    tokens: int
    seconds: float
    first_s: float | None


class _FirstTokens:
    """An HF-style streamer noting when the first new tokens arrive (its first ``put`` is the prompt)."""

    def __init__(self) -> None:
        self.puts = 0
        self.at: float | None = None

    def put(self, value: Any) -> None:
        self.puts += 1
        if self.puts == 2:
            self.at = time.perf_counter()

    def end(self) -> None:
        pass


def _timed_generate(gen: Any, input_ids: list[int], gc: Any, eos: list[int]) -> ClientRun:
    """One client's generation, timed."""
    first = _FirstTokens()
    t0 = time.perf_counter()
    out = gen.generate(torch.tensor([input_ids]), generation_config=gc, streamer=first)
    took = time.perf_counter() - t0
    tokens = len(_until_eos(out[0, len(input_ids) :].tolist(), eos))
    return ClientRun(tokens, took, first.at - t0 if first.at is not None else None)


class _Clients:
    """N concurrent clients, each with its own generator over gRPC."""

    def once(self, rows: list[BenchPrompt], m: BenchModels, max_new: int) -> tuple[float, list[ClientRun]]:
        """Every client generates its row's prompt at once; ``(wall, [ClientRun] per client)``."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class _ClientThreads(_Clients):
    """Clients as threads of this process: they share its GIL (and with in-process workers, the
    workers' too), so a client loop's per-round Python of N clients runs one at a time."""

    def __init__(self, n: int, cfg: Any, tokenizer: Any):
        from specsplit import SpecSplitGenerator

        self.gens = [SpecSplitGenerator(tokenizer=tokenizer, config=copy.deepcopy(cfg)) for _ in range(n)]

    def once(self, rows: list[BenchPrompt], m: BenchModels, max_new: int) -> tuple[float, list[ClientRun]]:
        return _clients_once(self.gens, rows, m, max_new)

    def close(self) -> None:
        for g in self.gens:
            g.close()


class _ClientProcesses(_Clients):
    """Clients as processes of their own (as separate programs would be), one generator each, started
    with ``spawn`` and driven over pipes; a shared barrier starts their generations together."""

    def __init__(self, n: int, cfg: Any):
        import multiprocessing as mp

        self.barrier = mp.get_context("spawn").Barrier(n + 1)
        self.pipes: list[Any] = []
        self.procs: list[Any] = []
        try:
            spawn_with_pipes(n, _client_process, (cfg, self.barrier), self.pipes, self.procs)
            for pipe in self.pipes:  # each says it is ready (imports done, generator built)
                _reply(pipe)
        except BaseException:
            self.close()
            raise

    def once(self, rows: list[BenchPrompt], m: BenchModels, max_new: int) -> tuple[float, list[ClientRun]]:
        gc = m.generation_config(max_new)
        for pipe, row in zip(self.pipes, rows, strict=True):
            pipe.send(("run", row.input_ids, gc, m.eos_token_ids))
        self.barrier.wait(timeout=600)
        t0 = time.perf_counter()
        per = [_reply(pipe) for pipe in self.pipes]
        # a client may leave the barrier before this process is scheduled again
        return max(time.perf_counter() - t0, *(c.seconds for c in per)), per

    def close(self) -> None:
        for pipe in self.pipes:
            try:
                pipe.send(("close",))
            except OSError:
                pass
        for proc in self.procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()


def spawn_with_pipes(n: int, target: Callable[..., None], args: tuple[Any, ...], pipes: list[Any],
                     procs: list[Any]) -> None:  # fmt: skip
    """Start ``n`` daemon processes (``spawn``) running ``target(pipe, *args)``; our end of each
    pipe goes to ``pipes`` and each process to ``procs`` as it starts (so a caller can stop those
    already started if a later one fails)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    for _ in range(n):
        mine, theirs = ctx.Pipe()
        proc = ctx.Process(target=target, args=(theirs, *args), daemon=True)
        proc.start()
        pipes.append(mine)
        procs.append(proc)


def _reply(pipe: Any) -> Any:
    """A client process's answer; its error raised here."""
    if not pipe.poll(900):
        raise TimeoutError("a client process did not answer within 900 s")
    kind, value = pipe.recv()
    if kind == "error":
        raise RuntimeError(f"a client process failed: {value}")
    return value


def _client_process(pipe: Any, cfg: Any, barrier: Any) -> None:
    """A client process: one generator; ``run`` waits at the barrier, generates and answers."""
    import traceback

    from specsplit import SpecSplitGenerator

    torch.set_num_threads(1)  # its host work is small; N clients must not each spawn a thread per core
    gen = None
    try:
        gen = SpecSplitGenerator(config=cfg)
        pipe.send(("ok", None))
        while True:
            msg = pipe.recv()
            if msg[0] != "run":
                break
            _, input_ids, gc, eos = msg
            barrier.wait(timeout=600)
            try:
                pipe.send(("ok", _timed_generate(gen, input_ids, gc, eos)))
            except Exception:
                pipe.send(("error", traceback.format_exc(limit=8)))
    except (EOFError, KeyboardInterrupt):
        pass
    finally:
        if gen is not None:
            gen.close()


def _cell(
    dec: _Decoder,
    b: int,
    batch: list[BenchPrompt],
    ids: torch.Tensor,
    mask: torch.Tensor,
    opts: BatchBenchOptions,
    reference: dict[str, list[int]],
) -> dict[str, Any]:
    logger.info("batch %d: %s (warm-up)", b, dec.name)
    dec.run(ids, mask, opts.max_new_tokens)  # graph captures, compiles, allocator warm-up
    walls: list[float] = []
    rows: list[list[int]] = []
    per_row: list[float] = []
    for _ in range(opts.repeats):
        t0 = time.perf_counter()
        rows, per_row = dec.run(ids, mask, opts.max_new_tokens)
        walls.append(time.perf_counter() - t0)
    wall = statistics.median(walls)
    tokens = sum(len(r) for r in rows)
    tpt = sorted(s / max(len(r), 1) for s, r in zip(per_row, rows, strict=True))
    if dec.name == "specsplit-plain" and b == 1:
        reference[batch[0].id] = rows[0]
    same = [reference[p.id] == r for p, r in zip(batch, rows, strict=True) if p.id in reference]
    cell = {
        "decoder": dec.name,
        "batch": b,
        "wall_s": wall,
        "walls_s": walls,
        "tokens": tokens,
        "tok_s": tokens / wall if wall > 0 else 0.0,
        "row_ms_per_token_p50": 1e3 * tpt[len(tpt) // 2],
        "row_ms_per_token_p95": 1e3 * tpt[min(len(tpt) - 1, int(round(0.95 * (len(tpt) - 1))))],
        "rows_checked": len(same),
        "rows_identical": sum(same),
    }
    logger.info("batch %d: %s %.1f tok/s", b, dec.name, cell["tok_s"])
    return cell


def _ratios(result: dict[str, Any]) -> None:
    """Each cell's throughput over the same decoder at batch 1 and over hf-batch at its batch size."""
    by = {(c["decoder"], c["batch"]): c for c in result["cells"]}
    for c in result["cells"]:
        one = by.get((c["decoder"], 1))
        hf = by.get(("hf-batch", c["batch"]))
        plain = by.get(("specsplit-plain", 1))
        c["x_batch1"] = c["tok_s"] / one["tok_s"] if one and one["tok_s"] else None
        c["x_hf_batch"] = c["tok_s"] / hf["tok_s"] if hf and hf["tok_s"] else None
        c["x_plain1"] = c["tok_s"] / plain["tok_s"] if plain and plain["tok_s"] else None


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def batch_markdown(result: dict[str, Any]) -> str:
    cfg, mach = result["config"], result["machine"]
    gpus = ", ".join(g["name"] for g in mach.get("gpus") or []) or f"CPU ({mach.get('cpu_cores')} cores)"
    lines = [
        f"# Batched generation: {cfg['target']} ({cfg['dtype']}) on {gpus}",
        "",
        f"`{result['command']}` — {result['created_utc']}, {cfg['max_new_tokens']} new tokens a row, "
        f"median of {cfg['repeats']}; CUDA graphs {'on' if cfg['cuda_graphs'] else 'off'}, "
        f"compile {'on' if cfg['compile'] else 'off'}.",
        "",
        "| batch | decoder | tok/s (all rows) | x same decoder at batch 1 | x hf-batch | x our target-only at batch 1 "
        "| row ms/token p50 / p95 | rows = target-only batch 1 |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    if cfg.get("mode") == "concurrent-clients":
        return _clients_markdown(result, lines[:4])
    for c in result["cells"]:
        lines.append(
            f"| {c['batch']} | {c['decoder']} | {c['tok_s']:.1f} | {_fmt(c['x_batch1'], '.2f')} | "
            f"{_fmt(c['x_hf_batch'], '.2f')} | {_fmt(c['x_plain1'], '.2f')} | "
            f"{c['row_ms_per_token_p50']:.2f} / {c['row_ms_per_token_p95']:.2f} | "
            f"{c['rows_identical']}/{c['rows_checked']} |"
        )
    return _with_notes(lines, result)


def _clients_markdown(result: dict[str, Any], head: list[str]) -> str:
    lines = head + [
        "| clients | decoder | tok/s (all clients) | x 1 client | x its prompts alone | "
        "slowest client / its prompt alone (p50) | fastest / slowest client: tok/s (each / its prompt alone) | "
        "client ms/token p50 / p95 | first tokens ms p50 / max | peak GPU memory |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in result["cells"]:
        lo, mid, hi = c.get("client_vs_alone_min"), c.get("client_vs_alone_p50"), c.get("client_vs_alone_max")
        mem = c.get("peak_gpu_bytes")
        fast, slow_ = c.get("client_tok_s_max"), c.get("client_tok_s_min")
        lines.append(
            f"| {c['batch']} | {c['decoder']} | {c['tok_s']:.1f} | {_fmt(c['x_batch1'], '.2f')} | "
            f"{_fmt(c.get('x_alone'), '.2f')} | {_fmt(lo, '.2f')} ({_fmt(mid, '.2f')}) | "
            f"{_fmt(fast / slow_ if fast and slow_ else None, '.2f')} "
            f"({_fmt(hi / lo if lo and hi else None, '.2f')}) | "
            f"{c['row_ms_per_token_p50']:.2f} / {c['row_ms_per_token_p95']:.2f} | "
            f"{_fmt(c.get('first_token_ms_p50'), '.1f')} / {_fmt(c.get('first_token_ms_max'), '.1f')} | "
            f"{'-' if mem is None else format(mem / 2**30, '.1f') + ' GiB'} |"
        )
    slow = [c for c in result["cells"] if c["batch"] > 1 and c.get("clients")]
    if slow:  # which prompts fall furthest behind their own speed alone
        lines += ["", "Slowest clients against their prompt alone (the `.json` has every client):", ""]
        for c in slow:
            worst = sorted(
                (r for r in c["clients"] if r["vs_alone"] is not None), key=lambda r: r["vs_alone"]
            )[:3]
            named = ", ".join(f"{r['prompt_id']} {r['vs_alone']:.2f}" for r in worst)
            lines.append(f"- {c['batch']} clients, {c['decoder']}: {named}")
    return _with_notes(lines, result)


def _with_notes(lines: list[str], result: dict[str, Any]) -> str:
    return "\n".join([*lines, "", *(f"- {n}" for n in result.get("notes", []))]) + "\n"


def write_batch_plot(result: dict[str, Any], path: Path) -> bool:
    """Aggregate tok/s against the batch size, one line per decoder (log-log)."""
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for d in result["config"]["decoders"]:
        pts = sorted((c["batch"], c["tok_s"]) for c in result["cells"] if c["decoder"] == d)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=d)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    clients = result["config"].get("mode") == "concurrent-clients"
    ax.set_xlabel(
        "concurrent clients (one target worker)" if clients else "batch size (rows per generate() call)"
    )
    ax.set_ylabel("tokens/s, all rows")
    ax.set_title(f"{result['config']['target']} ({result['config']['dtype']})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
