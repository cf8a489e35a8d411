#!/usr/bin/env python
"""Hostile clients against a draft and a target worker on this machine (loopback only).

Starts both workers as ``specsplit serve`` subprocesses on tiny random models with four named
clients (``alice``, ``bob``, ``mallory`` and the target worker itself) and runs, bounded in count
and time:

1. **malformed**: thousands of malformed or hostile requests of many classes to both workers
   (random bytes, out-of-vocabulary ids, cyclic parents, NaN probabilities, huge trees, 1-17 MB
   session ids, wrong lengths, unknown sessions, ...): status codes counted, a valid generation
   checked against the local reference after each class;
2. **streams**: ``alice`` opens 8 long ``Generate`` streams; ``Ping`` latency and ``bob``'s
   generation speed (against his solo speed) meanwhile;
3. **sessions**: ``mallory`` asks for 2,000 sessions of 10**9 tokens each; the worker's memory,
   the refusals and a running session of ``bob``'s;
4. **ownership**: ``bob`` and a second ``alice`` process try to read, advance and end a session
   of ``alice``'s;
5. **faults**: the target worker killed and restarted mid-generation (both loops, greedy and
   sampled), the draft worker killed and brought back (how soon drafting resumes);
6. **soak**: 200 generations on 4 threads; session counts and worker memory afterwards.

    python benchmarks/hostile_soak.py --tag cpu-2core
        # writes benchmarks/results/hostile_soak-<tag>.{json,md}
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import platform
import random
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specsplit import (
    DraftEngine,
    LocalTransport,
    SpecSplitConfig,
    SpecSplitGenerator,
    TargetEngine,
    TreeConfig,
)
from specsplit.core.tree import TokenTree
from specsplit.errors import ResourceExhausted, SpecSplitError
from specsplit.messages import GenerateRequest, VerifyRequest
from specsplit.remote import GrpcTransport, convert
from specsplit.remote._generated import spec_decoding_pb2 as pb
from specsplit.remote._generated import spec_decoding_pb2_grpc as pb_grpc
from specsplit.remote.launch import WorkerProcess

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 256
TREE = TreeConfig(shape="chain", num_draft_tokens=4)
TOKENS = {name: f"{name}-{os.urandom(8).hex()}" for name in ("alice", "bob", "mallory", "target")}
KV_BUDGET_MB = 16
CALL_TIMEOUT_S = 20.0


# ---------------------------------------------------------------------- setup
def save_models(root: Path) -> tuple[Path, Path]:
    """A seeded tiny target and a draft close to it (partial acceptance), as float32 safetensors."""
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=40000)  # fmt: skip
    torch.manual_seed(0)
    target, draft = LlamaForCausalLM(cfg).eval(), LlamaForCausalLM(cfg).eval()
    draft.load_state_dict(target.state_dict())
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for p in draft.parameters():
            p.add_(0.005 * torch.randn(p.shape, generator=g))
        for m in (target, draft):
            m.get_output_embeddings().weight.mul_(8.0)
    paths = root / "target", root / "draft"
    for m, p in zip((target, draft), paths, strict=True):
        m.save_pretrained(p)
    return paths


class Workers:
    """The two workers (restartable on their ports) and the token files they share."""

    def __init__(self, root: Path, target_dir: Path, draft_dir: Path):
        tokens = root / "clients"
        tokens.write_text("".join(f"{n}:{t}\n" for n, t in TOKENS.items()))
        own = root / "target-token"
        own.write_text(TOKENS["target"] + "\n")
        common = ["--device", "cpu", "--auth-token-file", str(tokens), "--max-sessions", "256",
                  "--kv-budget-mb", str(KV_BUDGET_MB), "--stream-idle-timeout", "30"]  # fmt: skip
        self.draft = WorkerProcess("draft", str(draft_dir), dtype="float32", args=common, ready_timeout_s=180)
        self.draft.start()
        self.target = WorkerProcess(
            "target", str(target_dir), dtype="float32", ready_timeout_s=180,
            args=[*common, "--draft-address", self.draft.address, "--draft-auth-token-file", str(own)],
        )  # fmt: skip
        self.target.start()

    def alive(self) -> bool:
        return all(w.proc is not None and w.proc.poll() is None for w in (self.draft, self.target))

    def stop(self) -> None:
        for w in (self.target, self.draft):
            w.stop()


def rss_mib(w: WorkerProcess) -> float:
    assert w.proc is not None
    for line in Path(f"/proc/{w.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return math.nan


def meta(name: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {TOKENS[name]}"), ("specsplit-client-secret", f"{name}-raw"))


def generator(ws: Workers, name: str, loop: str = "client", **kw: Any) -> SpecSplitGenerator:
    cfg = SpecSplitConfig(transport="grpc", grpc_loop=loop, tree=TREE, target_address=ws.target.address,  # type: ignore[arg-type]
                          draft_address=ws.draft.address, auth_token=TOKENS[name], timeout_s=60.0)  # fmt: skip
    return SpecSplitGenerator(config=cfg, **kw)


def prompt(seed: int, n: int = 12) -> torch.Tensor:
    return torch.randint(3, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------- 1. malformed requests
def malformed(ws: Workers, reference: Callable[[], bool], per_class: int) -> dict[str, Any]:
    """Hostile request classes to both workers; codes counted; a valid generation after each class."""
    tch, dch = (grpc.insecure_channel(w.address, options=[("grpc.max_send_message_length", 64 << 20)])
                for w in (ws.target, ws.draft))  # fmt: skip
    tstub, dstub = pb_grpc.TargetServiceStub(tch), pb_grpc.DraftServiceStub(dch)
    raw_t = tch.unary_unary("/specsplit.v1.TargetService/VerifyDrafts")
    raw_d = dch.unary_unary("/specsplit.v1.DraftService/GenerateDrafts")
    md = meta("mallory")
    rng = random.Random(0)
    sampling = pb.SamplingParams(do_sample=False, temperature=1.0, top_p=1.0)
    live = pb.VerifyRequest(session_id="live", pending_token_ids=[5, 6, 7], sampling=sampling)
    tstub.VerifyDrafts(live, metadata=md, timeout=CALL_TIMEOUT_S)

    def tree(n: int, parents: list[int] | None = None, q: bool = False, nan: bool = False) -> pb.TokenTree:
        m = pb.TokenTree(token_ids=[rng.randrange(VOCAB) for _ in range(n)],
                         parents=parents if parents is not None else [-1] + list(range(n - 1)),
                         depths=list(range(1, n + 1)), log_probs=[-0.1] * n)  # fmt: skip
        if q:
            m.has_q, m.q_width = True, 2
            m.q_ids.extend([1, 2] * n)
            m.q_probs.extend([math.nan if nan else -0.5, 0.5] * n)
        return m

    def verify(**kw: Any) -> Callable[[], Any]:
        kw.setdefault("sampling", sampling)
        return lambda: tstub.VerifyDrafts(pb.VerifyRequest(**kw), metadata=md, timeout=CALL_TIMEOUT_S)

    def draft(**kw: Any) -> Callable[[], Any]:
        kw.setdefault("sampling", sampling)
        kw.setdefault("tree", convert.tree_config_to_proto(TREE))
        return lambda: dstub.GenerateDrafts(pb.DraftRequest(**kw), metadata=md, timeout=CALL_TIMEOUT_S)

    def generate(**kw: Any) -> Callable[[], Any]:
        kw.setdefault("sampling", sampling)
        kw.setdefault("tree", convert.tree_config_to_proto(TREE))
        return lambda: list(tstub.Generate(pb.GenerateRequest(**kw), metadata=md, timeout=CALL_TIMEOUT_S))

    OK = grpc.StatusCode.OK
    IA, NF, FP, RE = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                      grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED)  # fmt: skip
    sid = lambda n: "x" * n  # noqa: E731
    classes: list[tuple[str, Callable[[int], Callable[[], Any]], set[grpc.StatusCode]]] = [
        (
            "random bytes (target)",
            lambda i: lambda: raw_t(os.urandom(rng.randrange(1, 4096)), metadata=md, timeout=CALL_TIMEOUT_S),
            {IA},
        ),
        (
            "random bytes (draft)",
            lambda i: lambda: raw_d(os.urandom(rng.randrange(1, 4096)), metadata=md, timeout=CALL_TIMEOUT_S),
            {IA},
        ),
        (
            "out-of-vocab ids",
            lambda i: (
                verify(session_id=f"m{i}", pending_token_ids=[VOCAB + i])
                if i % 2
                else draft(session_id=f"m{i}", new_token_ids=[-1 - i])
            ),
            {IA},
        ),
        (
            "cyclic / out-of-range parents",
            lambda i: verify(
                session_id=f"m{i}",
                pending_token_ids=[5],
                tree=tree(4, parents=[-1, 2, 1, 9][:4] if i % 2 else [0, 0, 1, 2]),
            ),
            {IA},
        ),
        (
            "NaN / negative probabilities",
            lambda i: verify(
                session_id=f"m{i}",
                pending_token_ids=[5],
                tree=tree(3, q=True, nan=bool(i % 2)),
                sampling=pb.SamplingParams(do_sample=True, temperature=1.0, top_p=1.0),
            ),
            {IA},
        ),
        (
            "huge trees",
            lambda i: (
                verify(session_id=f"m{i}", pending_token_ids=[5], tree=tree(300))
                if i % 3 == 0
                else draft(
                    session_id=f"m{i}",
                    new_token_ids=[5],
                    tree=pb.TreeSpec(
                        shape=pb.TREE_SHAPE_DYNAMIC, topk=256, width=256, budget=256, max_depth=64
                    ),
                )
                if i % 3 == 1
                else generate(
                    prompt_token_ids=[5],
                    max_new_tokens=4,
                    tree=pb.TreeSpec(shape=pb.TREE_SHAPE_CHAIN, num_draft_tokens=10_000),
                )
            ),
            {IA, RE},
        ),
        (
            "bad tree specs / sampling",
            lambda i: (
                draft(session_id=f"m{i}", new_token_ids=[5], tree=pb.TreeSpec(shape=7))
                if i % 3 == 0
                else draft(
                    session_id=f"m{i}",
                    new_token_ids=[5],
                    sampling=pb.SamplingParams(do_sample=True, temperature=0.0, top_p=0.0),
                )
                if i % 3 == 1
                else generate(prompt_token_ids=[], max_new_tokens=4)
            ),
            {IA},
        ),
        (
            "long session ids (1-64 KB)",
            lambda i: (
                verify(session_id=sid(1024 * (1 + i % 64)), pending_token_ids=[5])
                if i % 2
                else draft(session_id=sid(1024 * (1 + i % 64)), new_token_ids=[5])
            ),
            {IA},
        ),
        (
            "unknown sessions",
            lambda i: (
                verify(session_id=f"nobody{i}", pending_token_ids=[5], expected_prefix_length=3)
                if i % 2
                else draft(session_id=f"nobody{i}", new_token_ids=[5], prefix_length=3)
            ),
            {NF},
        ),
        (
            "wrong prefix lengths",
            lambda i: verify(session_id="live", pending_token_ids=[5], expected_prefix_length=100 + i),
            {FP},
        ),
        (
            "negative values",
            lambda i: (
                verify(session_id=f"m{i}", pending_token_ids=[5], expected_prefix_length=-1 - i)
                if i % 2
                else generate(prompt_token_ids=[5], max_new_tokens=-1 - i)
            ),
            {IA},
        ),
        (
            "bad rng state / drafter",
            lambda i: (
                generate(
                    prompt_token_ids=[5],
                    max_new_tokens=2,
                    rng_state=b"x" * i,
                    sampling=pb.SamplingParams(do_sample=True, temperature=1.0, top_p=1.0),
                )
                if i % 2
                else generate(prompt_token_ids=[5], max_new_tokens=2, drafter="evil")
            ),
            {IA},
        ),
    ]
    huge = [(1 << 20) * k for k in (1, 4, 8, 17)]  # 1-17 MB session ids, to both workers
    classes.append(
        (
            "1-17 MB session ids",
            lambda i: (
                verify(session_id=sid(huge[i % 4]), pending_token_ids=[5])
                if i % 2
                else draft(session_id=sid(huge[i % 4]), new_token_ids=[5])
            ),
            {IA, RE},
        )
    )
    out: dict[str, Any] = {
        "classes": [],
        "requests": 0,
        "internal": 0,
        "wrong": 0,
        "hangs": 0,
        "checks_failed": 0,
    }
    for name, make, expect in classes:
        n = 8 if name.startswith("1-17") else per_class
        codes: Counter[str] = Counter()
        t0 = time.perf_counter()
        for i in range(n):
            try:
                make(i)()
                code = OK
            except grpc.RpcError as e:
                code = e.code()
            codes[code.name] += 1
            out["requests"] += 1
            out["internal"] += code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)
            out["hangs"] += code == grpc.StatusCode.DEADLINE_EXCEEDED
            out["wrong"] += code not in expect and code != grpc.StatusCode.DEADLINE_EXCEEDED
        ok = reference()
        out["checks_failed"] += not ok
        out["classes"].append({"class": name, "requests": n, "codes": dict(codes), "valid_after": ok,
                               "seconds": round(time.perf_counter() - t0, 2)})  # fmt: skip
        print(f"  {name}: {dict(codes)} valid-after={ok}", flush=True)
    out["alive"] = ws.alive()
    tch.close()
    dch.close()
    return out


# ---------------------------------------------------------------------- 2. long streams
def streams(ws: Workers, ids: torch.Tensor) -> dict[str, Any]:
    bob = generator(ws, "bob")
    bob.generate(ids, max_new_tokens=16)  # warm
    solo = speed(bob, ids)
    # alice runs in a process of her own, as a remote client would: her streams' threads do not
    # share this process (bob's client) with him.
    ctx = mp.get_context("spawn")
    report: Any = ctx.Queue()
    stop = ctx.Event()
    alice = ctx.Process(
        target=alice_streams, args=(ws.target.address, TOKENS["alice"], stop, report), daemon=True
    )
    t_open = time.monotonic()
    alice.start()
    ran_early = report.get(timeout=120)  # streams that produced a round within 3 s of opening
    ch = grpc.insecure_channel(ws.target.address)
    ping = pb_grpc.TargetServiceStub(ch).Ping
    lat = []
    for _ in range(20):
        t1 = time.perf_counter()
        ping(pb.PingRequest(), metadata=meta("bob"), timeout=5)
        lat.append((time.perf_counter() - t1) * 1000)
        time.sleep(0.05)
    busy = speed(bob, ids)
    time.sleep(max(0.0, 16.0 - (time.monotonic() - t_open)))  # past the queue timeout: queued ones refused
    stop.set()
    ran, refused = report.get(timeout=60)
    alice.join(30)
    bob.close()
    ch.close()
    return {"streams_opened": 8, "streams_running": ran_early, "streams_ran": ran, "streams_refused": refused,
            "ping_ms_p50": round(statistics.median(lat), 1), "ping_ms_max": round(max(lat), 1),
            "bob_solo_tok_s": round(solo, 1), "bob_busy_tok_s": round(busy, 1),
            "bob_ratio": round(busy / solo, 2)}  # fmt: skip


def speed(gen: SpecSplitGenerator, ids: torch.Tensor, runs: int = 5, tokens: int = 64) -> float:
    """Median tokens/s of ``runs`` greedy generations of ``tokens`` tokens."""
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        gen.generate(ids, max_new_tokens=tokens)
        out.append(tokens / (time.perf_counter() - t0))
    return statistics.median(out)


def alice_streams(address: str, token: str, stop: Any, report: Any) -> None:
    """Open 8 long generations on the target worker; report how many ran and were refused."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    client = GrpcTransport(address, auth_token=token, timeout_s=120.0)
    ran: set[int] = set()
    refused = [0]

    def run(i: int) -> None:
        req = GenerateRequest(session_id=f"long{i}", prompt_token_ids=prompt(100 + i)[0].tolist(),
                              max_new_tokens=30_000, tree=TREE)  # fmt: skip
        try:
            s = client.generate_on_target(req)
            for _ in s:
                ran.add(i)
                if stop.is_set():
                    s.cancel()
                    return
        except ResourceExhausted:
            refused[0] += 1
        except SpecSplitError:
            pass

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(8)]
    for t in threads:
        t.start()
    time.sleep(3.0)
    report.put(len(ran))
    stop.wait(120)
    for t in threads:
        t.join(30)
    report.put((len(ran), refused[0]))
    client.close()


# ---------------------------------------------------------------------- 3. sessions
def sessions(ws: Workers, n: int) -> dict[str, Any]:
    base = rss_mib(ws.target), rss_mib(ws.draft)
    bob = GrpcTransport(ws.target.address, auth_token=TOKENS["bob"], timeout_s=30)
    first = bob.verify(VerifyRequest("bob-running", TokenTree.empty(), [5, 6, 7], 0))
    prefix, nxt = first.prefix_length, first.next_token_id
    tch, dch = grpc.insecure_channel(ws.target.address), grpc.insecure_channel(ws.draft.address)
    tstub, dstub = pb_grpc.TargetServiceStub(tch), pb_grpc.DraftServiceStub(dch)
    md = meta("mallory")
    sampling = pb.SamplingParams(temperature=1.0, top_p=1.0)
    codes: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    running_ok = True
    for i in range(n):
        try:
            if i % 2:
                tstub.VerifyDrafts(pb.VerifyRequest(session_id=f"big{i}", pending_token_ids=[5, 6, 7], sampling=sampling,
                                                    capacity_hint=10**9), metadata=md, timeout=CALL_TIMEOUT_S)  # fmt: skip
            else:
                dstub.GenerateDrafts(pb.DraftRequest(session_id=f"big{i}", new_token_ids=[5, 6, 7], sampling=sampling,
                                                     tree=convert.tree_config_to_proto(TREE), capacity_hint=10**9),
                                     metadata=md, timeout=CALL_TIMEOUT_S)  # fmt: skip
            codes["OK"] += 1
        except grpc.RpcError as e:
            codes[e.code().name] += 1
            reasons[
                "budget" if "budget" in e.details() else "sessions" if "session" in e.details() else "other"
            ] += 1
        if i % 100 == 99:  # bob's running session goes on between the flood's requests
            try:
                r = bob.verify(VerifyRequest("bob-running", TokenTree.empty(), [nxt], prefix))
                prefix, nxt = r.prefix_length, r.next_token_id
                running_ok &= r.cache_hit
            except SpecSplitError:
                running_ok = False
    peak = rss_mib(ws.target), rss_mib(ws.draft)
    for i in range(n):
        (tstub if i % 2 else dstub).EndSession(
            pb.EndSessionRequest(session_id=f"big{i}"), metadata=md, timeout=10
        )
    bob.end_session("bob-running")
    bob.close()
    tch.close()
    dch.close()
    return {"requests": n, "codes": dict(codes), "refusal_reasons": dict(reasons), "kv_budget_mib": KV_BUDGET_MB,
            "target_rss_mib": [round(base[0], 1), round(peak[0], 1)],
            "draft_rss_mib": [round(base[1], 1), round(peak[1], 1)],
            "rss_growth_mib": round(max(peak[0] - base[0], peak[1] - base[1]), 1),
            "running_session_kept": running_ok}  # fmt: skip


# ---------------------------------------------------------------------- 4. ownership
def ownership(ws: Workers) -> dict[str, Any]:
    alice = GrpcTransport(ws.target.address, ws.draft.address, auth_token=TOKENS["alice"], timeout_s=20)
    first = alice.verify(VerifyRequest("shared-id", TokenTree.empty(), [5, 6, 7], 0))
    attempts = succeeded = 0
    for name in ("bob", "alice"):  # another client; the same token from another process
        other = GrpcTransport(ws.target.address, auth_token=TOKENS[name], timeout_s=20)
        for req in (VerifyRequest("shared-id", TokenTree.empty(), [first.next_token_id], first.prefix_length),
                    VerifyRequest("shared-id", TokenTree.empty(), [9], 1)):  # fmt: skip
            attempts += 1
            try:
                other.verify(req)
                succeeded += 1
            except SpecSplitError as e:
                succeeded += "3" in str(e).replace("shared-id", "")  # learnt the length?
        ch = grpc.insecure_channel(ws.target.address)
        attempts += 1
        md = (("authorization", f"Bearer {TOKENS[name]}"),)
        succeeded += pb_grpc.TargetServiceStub(ch).EndSession(pb.EndSessionRequest(session_id="shared-id"),
                                                              metadata=md, timeout=10).existed  # fmt: skip
        ch.close()
        other.close()
    again = alice.verify(
        VerifyRequest("shared-id", TokenTree.empty(), [first.next_token_id], first.prefix_length)
    )
    alice.end_session("shared-id")
    alice.close()
    return {"attempts": attempts, "succeeded": succeeded, "owner_unaffected": again.cache_hit}


# ---------------------------------------------------------------------- 5. faults
class _Restart:
    """A streamer that restarts a worker after ``rounds`` rounds (in a thread: the call goes on)."""

    def __init__(self, ws: Workers, w: WorkerProcess, rounds: int):
        self.ws, self.w, self.rounds, self.seen = ws, w, rounds, -1
        self.thread: threading.Thread | None = None

    def put(self, tokens: torch.Tensor) -> None:
        self.seen += 1
        if self.seen == self.rounds:
            assert self.w.proc is not None
            self.w.proc.kill()
            self.w.proc.wait()
            self.thread = threading.Thread(target=self.w.start, daemon=True)
            self.thread.start()

    def end(self) -> None:
        pass


def faults(ws: Workers, ids: torch.Tensor, want: dict[str, torch.Tensor]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for loop in ("client", "target"):
        for mode in ("greedy", "sampled"):
            gen = generator(ws, "alice", loop)
            kw: dict[str, Any] = {"do_sample": mode == "sampled", "temperature": 0.8}
            r = _Restart(ws, ws.target, rounds=3)
            res = gen.generate(ids, max_new_tokens=40, streamer=r, return_dict_in_generate=True,
                               generator=torch.Generator().manual_seed(7), **kw)  # fmt: skip
            if r.thread is not None:
                r.thread.join(180)
            gen.close()
            out[f"target_restart_{loop}_{mode}"] = {"identical": bool(torch.equal(res.sequences, want[mode])),
                                                    "recoveries": res.spec_stats.recoveries}  # fmt: skip
    # draft killed mid-generation, then back: how soon is it used again?
    gen = generator(ws, "alice", "client")
    transport = gen.transport
    assert isinstance(transport, GrpcTransport)
    transport.draft_retry_interval_s = 3600  # only the background probe may find it again
    r = _Restart(ws, ws.draft, rounds=3)
    res = gen.generate(ids, max_new_tokens=40, streamer=r, return_dict_in_generate=True)
    identical = bool(torch.equal(res.sequences, want["greedy"]))
    if r.thread is not None:
        r.thread.join(180)
    ready = time.monotonic()
    while not transport._draft_up() and time.monotonic() - ready < 30:
        time.sleep(0.05)
    client_back = time.monotonic() - ready
    res2 = gen.generate(ids, max_new_tokens=40, return_dict_in_generate=True)
    gen.close()
    out["draft_kill_client_loop"] = {"identical": identical, "fallback": res.spec_stats.draft_fallback,
                                     "used_again_after_s": round(client_back, 2),
                                     "drafting_after": any(x.drafted_depth > 0 for x in res2.spec_stats.rounds)}  # fmt: skip
    # target loop: the target worker's own draft client finds the returning draft worker
    gen = generator(ws, "alice", "target")
    r = _Restart(ws, ws.draft, rounds=3)
    res = gen.generate(ids, max_new_tokens=40, streamer=r, return_dict_in_generate=True)
    identical = bool(torch.equal(res.sequences, want["greedy"]))
    if r.thread is not None:
        r.thread.join(180)
    ready = time.monotonic()
    back = math.nan
    while time.monotonic() - ready < 30:
        rr = gen.generate(ids, max_new_tokens=8, return_dict_in_generate=True)
        if any(x.drafted_depth > 0 for x in rr.spec_stats.rounds):
            back = time.monotonic() - ready
            break
        time.sleep(0.1)
    gen.close()
    out["draft_kill_target_loop"] = {"identical": identical, "used_again_after_s": round(back, 2)}
    return out


# ---------------------------------------------------------------------- 6. soak
def soak(ws: Workers, n: int) -> dict[str, Any]:
    gens = {loop: generator(ws, "bob", loop) for loop in ("client", "target")}
    for g in gens.values():
        for i in range(5):
            g.generate(prompt(i), max_new_tokens=16)
    ch = grpc.insecure_channel(ws.target.address), grpc.insecure_channel(ws.draft.address)
    pings = pb_grpc.TargetServiceStub(ch[0]).Ping, pb_grpc.DraftServiceStub(ch[1]).Ping

    def counts() -> list[int]:
        return [p(pb.PingRequest(), metadata=meta("bob"), timeout=10).active_sessions for p in pings]

    base = counts(), [rss_mib(ws.target), rss_mib(ws.draft)]
    errors = 0

    def one(i: int) -> None:
        nonlocal errors
        try:
            gens["client" if i % 2 else "target"].generate(prompt(1000 + i), max_new_tokens=24,
                                                           do_sample=bool(i % 3 == 0))  # fmt: skip
        except SpecSplitError:
            errors += 1

    t0 = time.perf_counter()
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(one, range(n)))
    seconds = time.perf_counter() - t0
    time.sleep(1.0)
    after = counts(), [rss_mib(ws.target), rss_mib(ws.draft)]
    for g in gens.values():
        g.close()
    for c in ch:
        c.close()
    return {"generations": n, "errors": errors, "seconds": round(seconds, 1),
            "sessions_before": base[0], "sessions_after": after[0],
            "rss_mib_before": [round(x, 1) for x in base[1]], "rss_mib_after": [round(x, 1) for x in after[1]]}  # fmt: skip


# ---------------------------------------------------------------------- report
def table(r: dict[str, Any]) -> str:
    m, s, se, o, f, k = (r[x] for x in ("malformed", "streams", "sessions", "ownership", "faults", "soak"))
    fr = [v for key, v in f.items() if key.startswith("target_restart")]
    rows = [
        ("≥ 3,000 malformed/hostile requests to both workers",
         "0 crashes, 0 hangs, 0 wrong answers, 0 INTERNAL; a valid request answered correctly after each class",
         f"{m['requests']} requests in {len(m['classes'])} classes: workers alive {m['alive']}, {m['hangs']} hangs, "
         f"{m['wrong']} wrong answers, {m['internal']} INTERNAL/UNKNOWN; valid generation correct after "
         f"{len(m['classes']) - m['checks_failed']}/{len(m['classes'])} classes"),
        ("8 long streams from one client", "Ping < 100 ms; a second client ≥ 0.5× its solo speed",
         f"{s['streams_running']} ran at once, {s['streams_refused']} queued then refused: Ping p50 "
         f"{s['ping_ms_p50']} ms, max {s['ping_ms_max']} ms; bob {s['bob_busy_tok_s']} tok/s vs "
         f"{s['bob_solo_tok_s']} solo = {s['bob_ratio']}×"),
        ("2,000 sessions asking for 10⁹ tokens", "memory under budget; excess RESOURCE_EXHAUSTED; none evicted",
         f"{se['codes']} (refusals: {se['refusal_reasons']}); RSS +{se['rss_growth_mib']} MiB "
         f"(KV budget {se['kv_budget_mib']} MiB a worker); running session kept: {se['running_session_kept']}"),
        ("another client with the same token", "cannot read, advance or end a session it did not create",
         f"{o['succeeded']}/{o['attempts']} attempts succeeded; owner unaffected: {o['owner_unaffected']}"),
        ("target restart mid-generation (both loops); draft kill and come-back",
         "identical output; a returning draft used again within 5 s",
         f"target restarts identical {sum(v['identical'] for v in fr)}/{len(fr)} (client/target loop, greedy/"
         f"sampled); draft kill identical {f['draft_kill_client_loop']['identical']}/"
         f"{f['draft_kill_target_loop']['identical']}; used again after "
         f"{f['draft_kill_client_loop']['used_again_after_s']} s (client loop), "
         f"{f['draft_kill_target_loop']['used_again_after_s']} s (target loop)"),
        ("soak: 200 generations one after another", "memory and session count back to baseline",
         f"{k['generations']} generations, {k['errors']} errors; sessions {k['sessions_before']} → "
         f"{k['sessions_after']}; RSS MiB target/draft {k['rss_mib_before']} → {k['rss_mib_after']}"),
    ]  # fmt: skip
    lines = ["| what | goal | measured |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    lines += ["", "Malformed request classes:", "", "| class | requests | status codes | valid after |",
              "|---|---:|---|---|"]  # fmt: skip
    lines += [f"| {c['class']} | {c['requests']} | {c['codes']} | {c['valid_after']} |" for c in m["classes"]]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tag", default="cpu-2core")
    ap.add_argument("--per-class", type=int, default=250, help="malformed requests per class")
    ap.add_argument("--sessions", type=int, default=2000)
    ap.add_argument("--soak", type=int, default=200)
    ap.add_argument("--only", default=None, help="run one part (malformed, streams, sessions, ...); no files")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        target_dir, draft_dir = save_models(Path(tmp))
        local = SpecSplitGenerator(transport=LocalTransport(DraftEngine(LlamaForCausalLM.from_pretrained(draft_dir)),
                                                            TargetEngine(LlamaForCausalLM.from_pretrained(target_dir))),
                                   config=SpecSplitConfig(tree=TREE))  # fmt: skip
        ids = prompt(5)
        want = {"greedy": local.generate(ids, max_new_tokens=40),
                "sampled": local.generate(ids, max_new_tokens=40, do_sample=True, temperature=0.8,
                                          generator=torch.Generator().manual_seed(7))}  # fmt: skip
        ws = Workers(Path(tmp), target_dir, draft_dir)
        try:
            check = generator(ws, "bob")

            def reference() -> bool:
                try:
                    return bool(torch.equal(check.generate(ids, max_new_tokens=40), want["greedy"]))
                except SpecSplitError:
                    return False

            report: dict[str, Any] = {}
            for name, fn in (("malformed", lambda: malformed(ws, reference, args.per_class)),
                             ("streams", lambda: streams(ws, ids)), ("sessions", lambda: sessions(ws, args.sessions)),
                             ("ownership", lambda: ownership(ws)), ("faults", lambda: faults(ws, ids, want)),
                             ("soak", lambda: soak(ws, args.soak))):  # fmt: skip
                if args.only and name != args.only:
                    continue
                t0 = time.perf_counter()
                print(f"{name} ...", flush=True)
                report[name] = fn()
                print(
                    f"{name}: {json.dumps(report[name])[:400]} ({time.perf_counter() - t0:.0f}s)", flush=True
                )
            check.close()
        finally:
            ws.stop()
    if args.only:
        return 0
    report["machine"] = {"platform": platform.platform(), "cpus": os.cpu_count(), "python": sys.version.split()[0],
                         "torch": torch.__version__, "grpc": grpc.__version__,
                         "date": time.strftime("%Y-%m-%d"), "seconds": round(time.perf_counter() - t_start)}  # fmt: skip
    out = ROOT / "benchmarks" / "results" / f"hostile_soak-{args.tag}"
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    md = (f"# Hostile clients, {args.tag} ({report['machine']['date']})\n\n`python benchmarks/hostile_soak.py "
          f"--tag {args.tag}` ({report['machine']['seconds']} s, {report['machine']['cpus']} CPUs, tiny models)\n\n")  # fmt: skip
    out.with_suffix(".md").write_text(md + table(report))
    print(table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
