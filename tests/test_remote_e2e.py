"""Remote mode end to end: a draft and a target worker on loopback, started through the CLI.

Pins the DESIGN.md invariants "Same code both ways" (identical tokens AND acceptance statistics,
local vs gRPC), "Bad input gets a typed error and changes nothing" (status codes) and "Sessions
end" (session counts and worker memory after a soak).
"""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("grpc")

import grpc  # noqa: E402
from remote_support import VOCAB, Worker, load_saved, start_all  # noqa: E402

from specsplit import (  # noqa: E402
    DraftEngine,
    LocalTransport,
    SpecSplitConfig,
    SpecSplitGenerator,
    TargetEngine,
    TreeConfig,
)
from specsplit.config import PipelineTuning  # noqa: E402
from specsplit.remote._generated import spec_decoding_pb2 as pb  # noqa: E402
from specsplit.remote._generated import spec_decoding_pb2_grpc as pb_grpc  # noqa: E402
from specsplit.remote.protocol import PROTOCOL_VERSION  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # one torch thread, as the workers run

TREES = {
    "chain4": TreeConfig(shape="chain", num_draft_tokens=4),
    "chain8-stop": TreeConfig(shape="chain", num_draft_tokens=8, min_confidence=0.5),
    "static16": TreeConfig(shape="static"),
    "dynamic16": TreeConfig(shape="dynamic", budget=16, max_depth=4, topk=4, width=4),
}
SAMPLING = {"greedy": {"do_sample": False}, "seeded": {"do_sample": True, "temperature": 0.8, "top_p": 0.95}}


@pytest.fixture(scope="module")
def workers(model_dirs: tuple[Path, Path]):
    target_dir, draft_dir = model_dirs
    target, draft = start_all([Worker("target", target_dir), Worker("draft", draft_dir)])
    yield target, draft
    for w in (target, draft):
        assert w.terminate() == 0, "".join(w.log[-20:])  # graceful SIGTERM shutdown


def local_gen(engines: tuple[DraftEngine, TargetEngine], tree: TreeConfig) -> SpecSplitGenerator:
    return SpecSplitGenerator(transport=LocalTransport(*engines), config=SpecSplitConfig(tree=tree))


def grpc_gen(workers: tuple[Worker, Worker], tree: TreeConfig, draft: bool = True) -> SpecSplitGenerator:
    target, drafter = workers
    cfg = SpecSplitConfig(
        transport="grpc",
        tree=tree,
        target_address=target.address,
        draft_address=drafter.address if draft else None,
        timeout_s=60.0,
    )
    return SpecSplitGenerator(config=cfg)


def prompts(batch: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, 10), generator=g)
    mask = torch.ones_like(ids)
    if batch > 1:
        mask[1, :3] = 0  # left padding: rows of different lengths
        ids[1, :3] = 0
    return ids, mask


def run(
    gen: SpecSplitGenerator, ids: torch.Tensor, mask: torch.Tensor, sampling: dict, seed: int, n: int = 24
):
    return gen.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=n,
        generator=torch.Generator().manual_seed(seed),
        return_dict_in_generate=True,
        **sampling,
    )


def round_stats(out) -> list[list[tuple[int, int, int]]]:
    return [[(r.accepted, r.drafted_depth, r.tree_nodes) for r in s.rounds] for s in out.per_sequence_stats]


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("sampling", list(SAMPLING))
@pytest.mark.parametrize("tree", list(TREES))
def test_local_and_grpc_identical(workers, engines, tree: str, sampling: str, batch: int) -> None:
    ids, mask = prompts(batch)
    ref = run(local_gen(engines, TREES[tree]), ids, mask, SAMPLING[sampling], seed=7)
    with grpc_gen(workers, TREES[tree]) as gen:
        out = run(gen, ids, mask, SAMPLING[sampling], seed=7)
    assert torch.equal(out.sequences, ref.sequences)
    assert round_stats(out) == round_stats(ref)
    assert sum(sum(r.accepted for r in s.rounds) for s in ref.per_sequence_stats) > 0, "no token accepted"
    assert out.spec_stats.recoveries == 0 and not out.spec_stats.draft_fallback


@pytest.mark.parametrize("sampling", list(SAMPLING))
def test_unary_calls_equal_local(workers, engines, sampling: str) -> None:
    """``grpc_streams=False`` (one unary call per draft and verify) is the streams' A/B."""
    ids, mask = prompts(1, seed=4)
    ref = run(local_gen(engines, TREES["static16"]), ids, mask, SAMPLING[sampling], seed=5)
    target, drafter = workers
    cfg = SpecSplitConfig(transport="grpc", tree=TREES["static16"], target_address=target.address, draft_address=drafter.address, timeout_s=60.0, tuning=PipelineTuning(grpc_streams=False))  # fmt: skip
    with SpecSplitGenerator(config=cfg) as gen:
        out = run(gen, ids, mask, SAMPLING[sampling], seed=5)
        assert gen.transport._verify_stream is None and gen.transport._draft_stream is None
    assert torch.equal(out.sequences, ref.sequences)
    assert round_stats(out) == round_stats(ref)


@pytest.mark.parametrize("sampling", list(SAMPLING))
@pytest.mark.parametrize("tree", ["chain4", "static16"])
def test_overlapped_grpc_equals_sequential_local(workers, engines, tree: str, sampling: str) -> None:
    """The overlapped pipeline over gRPC (speculative draft beside the remote verification)."""
    ids, mask = prompts(1, seed=5)
    ref = run(local_gen(engines, TREES[tree]), ids, mask, SAMPLING[sampling], seed=9, n=40)
    target, drafter = workers
    cfg = SpecSplitConfig(transport="grpc", tree=TREES[tree], target_address=target.address, draft_address=drafter.address, timeout_s=60.0, overlap=True, tuning=PipelineTuning(overlap_policy="always"))  # fmt: skip
    with SpecSplitGenerator(config=cfg) as gen:
        out = run(gen, ids, mask, SAMPLING[sampling], seed=9, n=40)
    assert torch.equal(out.sequences, ref.sequences)
    assert [(r.accepted, r.drafted_depth) for r in out.spec_stats.rounds] == [
        (r.accepted, r.drafted_depth) for r in ref.spec_stats.rounds
    ]
    assert out.spec_stats.spec_rounds > 0 and out.spec_stats.recoveries == 0


def test_greedy_grpc_equals_target_generate(workers, model_dirs) -> None:
    target = load_saved(model_dirs[0])
    ids, mask = prompts(1, seed=3)
    want = target.generate(ids, attention_mask=mask, max_new_tokens=32, do_sample=False)
    with grpc_gen(workers, TREES["static16"]) as gen:
        got = gen.generate(ids, attention_mask=mask, max_new_tokens=32, do_sample=False)
    assert torch.equal(got, want)


def test_target_only_without_draft_address(workers, engines) -> None:
    ids, mask = prompts(1, seed=4)
    ref = run(local_gen(engines, TREES["chain4"]), ids, mask, SAMPLING["greedy"], seed=1)
    with grpc_gen(workers, TREES["chain4"], draft=False) as gen:
        assert not gen.transport.has_draft
        out = run(gen, ids, mask, SAMPLING["greedy"], seed=1)
    assert torch.equal(out.sequences, ref.sequences)
    assert all(r.drafted_depth == 0 for r in out.spec_stats.rounds)


def test_ping_reports_workers(workers) -> None:
    with grpc_gen(workers, TREES["chain4"]) as gen:
        info = gen.transport.info()
    assert info["target"].worker_type == "target" and info["draft"].worker_type == "draft"
    for i in info.values():
        assert i.vocab_size == VOCAB and i.dtype == "float32" and i.device == "cpu"
        assert i.protocol_version == PROTOCOL_VERSION and i.model_name


def test_concurrent_generations(workers) -> None:
    shapes = ("chain4", "static16")
    gens = {name: grpc_gen(workers, TREES[name]) for name in shapes}  # one transport each, shared
    cases = [(shapes[i % 2], ("greedy", "seeded")[i // 4], i) for i in range(8)]

    def one(i: int) -> torch.Tensor:
        tree, sampling, seed = cases[i]
        ids, mask = prompts(1, seed=100 + i)
        return run(gens[tree], ids, mask, SAMPLING[sampling], seed=seed, n=20).sequences

    single = [one(i) for i in range(8)]
    results: list[torch.Tensor | BaseException | None] = [None] * 8
    start = threading.Barrier(8)

    def worker(i: int) -> None:
        try:
            start.wait()
            results[i] = one(i)
        except BaseException as e:  # surfaced below
            results[i] = e

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    info = gens["chain4"].transport.info()
    for g in gens.values():
        g.close()
    for i in range(8):
        assert isinstance(results[i], torch.Tensor), results[i]
        assert torch.equal(results[i], single[i]), f"thread {i} differs from its single-call output"
    assert info["target"].active_sessions == 0
    assert info["draft"].active_sessions == 0


# ---------------------------------------------------------------------- malformed requests
def _tree(rng: random.Random, n: int) -> pb.TokenTree:
    parents = [-1] + [rng.randrange(-1, i) for i in range(1, n)]
    depths: list[int] = []
    for p in parents:
        depths.append(1 if p < 0 else depths[p] + 1)
    return pb.TokenTree(
        token_ids=[rng.randrange(VOCAB) for _ in range(n)],
        parents=parents,
        depths=depths,
        log_probs=[-rng.random() for _ in range(n)],
    )


def _with_q(t: pb.TokenTree, rng: random.Random, k: int = 4) -> pb.TokenTree:
    t.has_q, t.q_width = True, k
    for _ in range(len(t.token_ids)):
        w = [rng.random() + 0.01 for _ in range(k)]
        t.q_ids.extend(rng.sample(range(VOCAB), k))
        t.q_probs.extend(x / sum(w) for x in w)
    return t


GREEDY = pb.SamplingParams(do_sample=False, temperature=1.0, top_k=0, top_p=1.0)
SAMPLE = pb.SamplingParams(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
CHAIN = pb.TreeSpec(shape=pb.TREE_SHAPE_CHAIN, num_draft_tokens=4, topk=4, width=4, budget=16, max_depth=4)
INVALID, NOT_FOUND, DESYNC, EXHAUSTED = (
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
)

HUGE = 17 * 1024 * 1024  # above the workers' 16 MiB message limit


def _verify_case(rng: random.Random, kind: str, live: str, live_len: int) -> tuple[pb.VerifyRequest, object]:
    n = rng.randrange(1, 12)
    req = pb.VerifyRequest(
        session_id=f"bad-{rng.randrange(10**9)}",
        tree=_tree(rng, n),
        pending_token_ids=[rng.randrange(VOCAB) for _ in range(rng.randrange(1, 6))],
        expected_prefix_length=0,
        sampling=GREEDY,
    )
    t = req.tree
    if kind == "oov_tree":
        t.token_ids[rng.randrange(n)] = rng.choice(
            [VOCAB, VOCAB + rng.randrange(10**6), -rng.randrange(1, 10**6)]
        )
    elif kind == "oov_pending":
        req.pending_token_ids.append(rng.choice([VOCAB, -1, 2**40]))
    elif kind == "parents_cycle":
        i = rng.randrange(n)
        t.parents[i] = rng.randrange(i, i + 5)  # self, forward reference or past the end
    elif kind == "parents_range":
        t.parents[rng.randrange(n)] = -rng.randrange(2, 10**6)
    elif kind == "depths":
        t.depths[rng.randrange(n)] += rng.choice([-1, 1, 7])
    elif kind == "lengths":
        del t.parents[-1]
    elif kind == "oversized":
        req.tree.CopyFrom(_tree(rng, rng.randrange(257, 400)))
    elif kind == "nan":
        t.log_probs[rng.randrange(n)] = float("nan")
    elif kind == "q_negative":
        req.sampling.CopyFrom(SAMPLE)
        _with_q(t, rng)
        t.q_probs[rng.randrange(len(t.q_probs))] = rng.choice([-0.5, float("nan"), float("inf")])
    elif kind == "q_sum":
        req.sampling.CopyFrom(SAMPLE)
        _with_q(t, rng)
        t.q_probs[0] += 0.5
    elif kind == "q_shape":
        _with_q(t, rng)
        del t.q_ids[-1]
    elif kind == "sampling":
        req.sampling.CopyFrom(rng.choice([
            pb.SamplingParams(do_sample=True, temperature=0.0, top_p=1.0),
            pb.SamplingParams(do_sample=True, temperature=1.0, top_p=0.0),
            pb.SamplingParams(do_sample=False, temperature=1.0, top_k=-3, top_p=1.0),
        ]))  # fmt: skip
    elif kind == "empty_pending":
        del req.pending_token_ids[:]
    elif kind == "negative_prefix":
        req.expected_prefix_length = -rng.randrange(1, 100)
    elif kind == "too_long":
        req.pending_token_ids.extend([5] * 33000)
    elif kind == "unknown_session":
        req.expected_prefix_length = rng.randrange(1, 1000)
    elif kind == "wrong_prefix":
        req.session_id = live
        req.expected_prefix_length = rng.choice(
            [live_len - 1, live_len + 1, live_len + rng.randrange(2, 500)]
        )
    elif kind == "huge":
        req.session_id = "x" * HUGE
    else:
        raise AssertionError(kind)
    code = {"unknown_session": NOT_FOUND, "wrong_prefix": DESYNC, "too_long": EXHAUSTED, "huge": EXHAUSTED}
    return req, code.get(kind, INVALID)


def _draft_case(rng: random.Random, kind: str, live: str, live_len: int) -> tuple[pb.DraftRequest, object]:
    req = pb.DraftRequest(
        session_id=f"bad-{rng.randrange(10**9)}",
        new_token_ids=[rng.randrange(VOCAB) for _ in range(rng.randrange(1, 8))],
        prefix_length=0,
        tree=CHAIN,
        sampling=GREEDY,
    )
    if kind == "oov":
        req.new_token_ids.append(rng.choice([VOCAB, -7, 2**33]))
    elif kind == "shape":
        req.tree.shape = pb.TREE_SHAPE_UNSPECIFIED if rng.random() < 0.5 else 42
    elif kind == "negative_k":
        req.tree.num_draft_tokens = -rng.randrange(1, 100)
    elif kind == "oversized":
        if rng.random() < 0.5:
            req.tree.num_draft_tokens = rng.randrange(257, 10**7)
        else:
            req.tree.CopyFrom(pb.TreeSpec(shape=pb.TREE_SHAPE_DYNAMIC, topk=4, width=4, max_depth=4,
                                          budget=rng.randrange(257, 10**9)))  # fmt: skip
    elif kind == "bad_paths":
        req.tree.CopyFrom(pb.TreeSpec(shape=pb.TREE_SHAPE_STATIC, topk=4, width=4, budget=16, max_depth=4))
        req.tree.static_paths.paths.add(ranks=[rng.randrange(1, 5)])  # rank 0 missing
    elif kind == "sampling":
        req.sampling.CopyFrom(pb.SamplingParams(do_sample=True, temperature=-1.0, top_p=1.0))
    elif kind == "negative_prefix":
        req.prefix_length = -rng.randrange(1, 100)
    elif kind == "too_long":
        req.new_token_ids.extend([5] * 33000)
    elif kind == "unknown_session":
        req.prefix_length = rng.randrange(1, 1000)
    elif kind == "wrong_prefix":
        req.session_id = live
        req.prefix_length = rng.choice([live_len - 1, live_len + 1, live_len + rng.randrange(2, 500)])
    elif kind == "huge":
        req.session_id = "x" * HUGE
    else:
        raise AssertionError(kind)
    code = {
        "unknown_session": NOT_FOUND,
        "wrong_prefix": DESYNC,
        "too_long": EXHAUSTED,
        "huge": EXHAUSTED,
        "oversized": EXHAUSTED,
    }
    return req, code.get(kind, INVALID)


VERIFY_KINDS = ["oov_tree", "oov_pending", "parents_cycle", "parents_range", "depths", "lengths", "oversized",
                "nan", "q_negative", "q_sum", "q_shape", "sampling", "empty_pending", "negative_prefix",
                "too_long", "unknown_session", "wrong_prefix"]  # fmt: skip
DRAFT_KINDS = ["oov", "shape", "negative_k", "oversized", "bad_paths", "sampling", "negative_prefix",
               "too_long", "unknown_session", "wrong_prefix"]  # fmt: skip


def test_malformed_requests_get_status_codes_and_change_nothing(workers, engines) -> None:
    target, drafter = workers
    opts = [("grpc.max_send_message_length", 64 * 1024 * 1024)]
    t_ch = grpc.insecure_channel(target.address, options=opts)
    d_ch = grpc.insecure_channel(drafter.address, options=opts)
    t_stub, d_stub = pb_grpc.TargetServiceStub(t_ch), pb_grpc.DraftServiceStub(d_ch)
    prompt = list(range(10, 22))
    # One live session on each worker, for wrong-prefix-length requests.
    v = t_stub.VerifyDrafts(
        pb.VerifyRequest(session_id="live", tree=pb.TokenTree(), pending_token_ids=prompt, sampling=GREEDY),
        timeout=30,
    )
    d = d_stub.GenerateDrafts(
        pb.DraftRequest(session_id="live", new_token_ids=prompt, tree=CHAIN, sampling=GREEDY), timeout=30
    )
    before = (t_stub.Ping(pb.PingRequest(), timeout=10).active_sessions,
              d_stub.Ping(pb.PingRequest(), timeout=10).active_sessions)  # fmt: skip
    rng = random.Random(1234)
    counts: dict[str, int] = {}
    cases = [("verify", k) for k in VERIFY_KINDS] + [("draft", k) for k in DRAFT_KINDS]
    plan = cases * 2 + [rng.choice(cases) for _ in range(1000 - 2 * len(cases))]
    plan += [("verify", "huge"), ("draft", "huge")]
    for i, (service, kind) in enumerate(plan):
        if service == "verify":
            req, want = _verify_case(rng, kind, "live", v.prefix_length)
            call, stream = t_stub.VerifyDrafts, t_stub.VerifyDraftsStream
        else:
            req, want = _draft_case(rng, kind, "live", d.prefix_length)
            call, stream = d_stub.GenerateDrafts, d_stub.GenerateDraftsStream
        with pytest.raises(grpc.RpcError) as ei:
            if i % 4 == 0:  # every 4th over the stream: the same check, the same status code
                next(stream(iter([req]), timeout=30))
            else:
                call(req, timeout=30)
        assert ei.value.code() == want, f"{service}/{kind}: {ei.value.code()} {ei.value.details()}"
        counts[f"{service}/{kind}"] = counts.get(f"{service}/{kind}", 0) + 1
    assert sum(counts.values()) >= 1000
    after = (t_stub.Ping(pb.PingRequest(), timeout=10).active_sessions,
             d_stub.Ping(pb.PingRequest(), timeout=10).active_sessions)  # fmt: skip
    assert after == before, "a rejected request created or dropped a session"
    # The live sessions are untouched: the right prefix length still works.
    v2 = t_stub.VerifyDrafts(
        pb.VerifyRequest(session_id="live", tree=pb.TokenTree(), pending_token_ids=[v.next_token_id],
                         expected_prefix_length=v.prefix_length, sampling=GREEDY),
        timeout=30,
    )  # fmt: skip
    assert v2.prefix_length == v.prefix_length + 1
    d_stub.GenerateDrafts(
        pb.DraftRequest(session_id="live", new_token_ids=[1], prefix_length=d.prefix_length, tree=CHAIN,
                        sampling=GREEDY),
        timeout=30,
    )  # fmt: skip
    for stub in (t_stub, d_stub):
        assert stub.EndSession(pb.EndSessionRequest(session_id="live"), timeout=10).existed
        assert not stub.EndSession(pb.EndSessionRequest(session_id="never-existed"), timeout=10).existed
    t_ch.close()
    d_ch.close()
    # ... and a normal generation still succeeds, identical to local.
    ids, mask = prompts(1, seed=9)
    ref = run(local_gen(engines, TREES["chain4"]), ids, mask, SAMPLING["greedy"], seed=0)
    with grpc_gen(workers, TREES["chain4"]) as gen:
        out = run(gen, ids, mask, SAMPLING["greedy"], seed=0)
        info = gen.transport.info()
    assert torch.equal(out.sequences, ref.sequences)
    assert info["target"].active_sessions == 0 and info["draft"].active_sessions == 0


def test_rejected_empty_draft_context_creates_no_session(workers) -> None:
    ch = grpc.insecure_channel(workers[1].address)
    stub = pb_grpc.DraftServiceStub(ch)
    before = stub.Ping(pb.PingRequest(), timeout=10).active_sessions
    with pytest.raises(grpc.RpcError) as ei:
        stub.GenerateDrafts(pb.DraftRequest(session_id="empty", tree=CHAIN, sampling=GREEDY), timeout=30)
    assert ei.value.code() == INVALID
    after = stub.Ping(pb.PingRequest(), timeout=10).active_sessions
    stub.EndSession(pb.EndSessionRequest(session_id="empty"), timeout=10)
    ch.close()
    assert after == before


def test_soak_sessions_end_and_memory_stays_flat(workers) -> None:
    target, drafter = workers
    ids = torch.randint(3, VOCAB, (1, 64), generator=torch.Generator().manual_seed(11))
    mask = torch.ones_like(ids)
    with grpc_gen(workers, TREES["static16"]) as gen:

        def batch(n: int, offset: int) -> None:
            for i in range(n):
                sampling = SAMPLING["seeded" if i % 2 else "greedy"]
                run(gen, ids, mask, sampling, seed=offset + i, n=8)

        batch(40, 0)  # warm-up: allocator pools, plan caches, gRPC buffers
        rss0 = (target.rss_kib(), drafter.rss_kib())
        batch(200, 1000)
        rss1 = (target.rss_kib(), drafter.rss_kib())
        info = gen.transport.info()
    assert info["target"].active_sessions == 0
    assert info["draft"].active_sessions == 0
    for before, after in zip(rss0, rss1, strict=True):
        # A leaked KV cache would be ~50 KiB per session (10 MiB here); allocator noise is ~0.1 MiB.
        assert after - before < 4 * 1024, f"worker RSS grew from {before} to {after} KiB over 200 sessions"


def test_worker_process_launcher(model_dirs) -> None:
    """specsplit.remote.launch.WorkerProcess: spawn, READY, serve, stop; a bad model fails clearly."""
    from specsplit.errors import TransportError
    from specsplit.remote.launch import WorkerProcess

    target = load_saved(model_dirs[0])
    ids, mask = prompts(1, seed=6)
    want = target.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    with WorkerProcess("target", str(model_dirs[0]), device="cpu", dtype="float32", ready_timeout_s=120) as w:
        cfg = SpecSplitConfig(transport="grpc", target_address=w.address, timeout_s=60.0)
        with SpecSplitGenerator(config=cfg) as gen:
            got = gen.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
        proc = w.proc
    assert torch.equal(got, want)
    assert proc is not None and proc.poll() is not None  # stopped on exit
    with pytest.raises(TransportError, match="did not start"):
        WorkerProcess("target", str(model_dirs[0] / "missing"), device="cpu", ready_timeout_s=120).start()


def test_worker_process_passes_on_the_workers_warnings(caplog: pytest.LogCaptureFixture) -> None:
    """A worker's WARNING/ERROR log lines reach the launching process's log (the bench's), its other
    stderr (progress bars, Python's UserWarnings) does not."""
    import logging
    import sys

    from specsplit.remote.launch import WorkerProcess

    script = (
        "import sys, time\n"
        "print('Loading weights: 100%', file=sys.stderr, flush=True)\n"
        "print('x.py:1: UserWarning: not a log level', file=sys.stderr, flush=True)\n"
        "print('2026-11-27 10:00:00 WARNING specsplit.runtime.graphs: workspace held', file=sys.stderr, flush=True)\n"
        "print('2026-11-27 10:00:01 ERROR specsplit.remote.server: internal error', file=sys.stderr)\n"
        "print('Traceback (most recent call last):', file=sys.stderr)\n"
        "print('  File \"w.py\", line 1, in f', file=sys.stderr)\n"
        "print('RuntimeError: boom', file=sys.stderr)\n"
        "print('2026-11-27 10:00:02 INFO specsplit.remote.server: serving', file=sys.stderr, flush=True)\n"
        "print('READY 1', flush=True)\n"
        "time.sleep(30)\n"
    )

    class Fake(WorkerProcess):
        def command(self) -> list[str]:
            return [sys.executable, "-c", script]

    with caplog.at_level(logging.WARNING, logger="specsplit.remote.launch"):
        w = Fake("draft", "m", ready_timeout_s=60).start()
        try:
            deadline = time.monotonic() + 10
            while not any("boom" in r.message for r in caplog.records) and time.monotonic() < deadline:
                time.sleep(0.02)
        finally:
            w.stop(grace=1.0)
    forwarded = [r.message for r in caplog.records if r.name == "specsplit.remote.launch"]
    # Warnings and errors are forwarded with their traceback lines; other records and output are not.
    assert forwarded == [
        "draft worker: 2026-11-27 10:00:00 WARNING specsplit.runtime.graphs: workspace held",
        "draft worker: 2026-11-27 10:00:01 ERROR specsplit.remote.server: internal error",
        "draft worker: Traceback (most recent call last):",
        'draft worker:   File "w.py", line 1, in f',
        "draft worker: RuntimeError: boom",
    ]


def test_serve_engine_options_reach_both_roles() -> None:
    """`specsplit serve`: graph, compile and attention flags become engine-config fields."""
    import argparse

    from specsplit.cli.serve import add_cli, engine_options
    from specsplit.config import DraftConfig, TargetConfig

    parser = argparse.ArgumentParser()
    add_cli(parser.add_subparsers(dest="command", required=True))
    default = engine_options(parser.parse_args(["serve", "draft", "--model", "m"]))
    assert default == {}  # every engine field keeps its config default
    opts = engine_options(parser.parse_args([
        "serve", "target", "--model", "m", "--cuda-graphs", "--no-fold-gqa", "--graph-capacity", "4096",
        "--fuse-projections", "--attention-kernel", "math",
    ]))  # fmt: skip
    assert opts == {"cuda_graphs": True, "fuse_projections": True,
                    "tuning": {"fold_gqa": False, "graph_capacity": 4096, "attention_kernel": "math"}}  # fmt: skip
    assert not TargetConfig(**opts).tuning.fold_gqa and not DraftConfig(**opts).tuning.fold_gqa
    assert TargetConfig(**opts).fuse_projections and DraftConfig(**opts).fuse_projections
    assert (
        TargetConfig(**opts).tuning.attention_kernel == DraftConfig(**opts).tuning.attention_kernel == "math"
    )
    assert "graph_rounds" not in opts["tuning"]  # each role keeps its own default
    assert (
        DraftConfig(**opts).tuning.prefill_graphs and TargetConfig(**opts).tuning.prefill_graphs
    )  # the default
    opts = engine_options(
        parser.parse_args(["serve", "draft", "--model", "m", "--cuda-graphs", "--no-prefill-graphs"])
    )
    assert not DraftConfig(**opts).tuning.prefill_graphs and not TargetConfig(**opts).tuning.prefill_graphs
    for flag, value in (("--graph-rounds", True), ("--no-graph-rounds", False)):
        opts = engine_options(parser.parse_args(["serve", "target", "--model", "m", flag]))
        assert (
            TargetConfig(**opts).tuning.graph_rounds is value
            and DraftConfig(**opts).tuning.graph_rounds is value
        )


def test_serve_specpv_options_reach_the_config() -> None:
    """`specsplit serve target --specpv ...`: each SpecPV option lands in the served SpecPVConfig."""
    import argparse

    from specsplit.cli.serve import add_cli, specpv_config
    from specsplit.errors import ConfigError

    parser = argparse.ArgumentParser()
    add_cli(parser.add_subparsers(dest="command", required=True))
    base = ["serve", "target", "--model", "m"]
    default = specpv_config(parser.parse_args(base))
    assert not default.enabled and default.rectify_margin == 0.0
    args = parser.parse_args([
        *base, "--specpv", "--specpv-threshold", "8192", "--specpv-retrieval-blocks", "64",
        "--specpv-retrieval-refresh", "1", "--specpv-query-window", "16", "--specpv-rectify-margin", "1.5",
    ])  # fmt: skip
    pv = specpv_config(args)
    assert (pv.enabled, pv.partial_threshold, pv.n_retrieval_blocks) == (True, 8192, 64)
    assert (pv.retrieval_refresh_interval, pv.retrieval_query_window, pv.rectify_margin) == (1, 16, 1.5)
    with pytest.raises(ConfigError, match="rectify_margin"):
        specpv_config(parser.parse_args([*base, "--specpv", "--specpv-rectify-margin", "-1"]))


def test_draft_worker_with_a_restricted_vocabulary_keeps_the_output(workers, model_dirs) -> None:
    """``specsplit serve draft --draft-vocab N``: a draft worker whose output layer scores a subset;
    the generation over gRPC still equals the target's ``generate()``."""
    target_dir, draft_dir = model_dirs
    (restricted,) = start_all([Worker("draft", draft_dir, ["--draft-vocab", str(VOCAB // 2)])])
    try:
        target = load_saved(target_dir)
        ids, mask = prompts(1, seed=5)
        want = target.generate(ids, attention_mask=mask, max_new_tokens=32, do_sample=False)
        with grpc_gen((workers[0], restricted), TREES["dynamic16"]) as gen:
            got = gen.generate(ids, attention_mask=mask, max_new_tokens=32, do_sample=False)
        assert torch.equal(got, want)
    finally:
        assert restricted.terminate() == 0, "".join(restricted.log[-20:])
    assert any(f"drafts from the {VOCAB // 2} best-ranked tokens" in line for line in restricted.log)


@pytest.mark.parametrize("sampling", list(SAMPLING))
def test_an_int8_draft_worker_equals_the_int8_draft_in_process(workers, model_dirs, sampling: str) -> None:
    """``specsplit serve draft --draft-quantize int8``: the same int8 draft over gRPC as in one process
    (identical tokens and rounds, greedy and seeded), and greedy still the target's ``generate()``."""
    from specsplit.config import DraftConfig
    from specsplit.runtime import int8

    target_dir, draft_dir = model_dirs
    (quantized,) = start_all([Worker("draft", draft_dir, ["--draft-quantize", "int8"])])
    try:
        ids, mask = prompts(1, seed=6)
        tree = TREES["chain8-stop"]
        local = (
            DraftEngine(load_saved(draft_dir), DraftConfig(quantize="int8")),
            TargetEngine(load_saved(target_dir)),
        )
        with local_gen(local, tree) as gen:
            want = run(gen, ids, mask, SAMPLING[sampling], seed=11, n=32)
        with grpc_gen((workers[0], quantized), tree) as gen:
            got = run(gen, ids, mask, SAMPLING[sampling], seed=11, n=32)
        assert torch.equal(got.sequences, want.sequences)
        assert round_stats(got) == round_stats(want)
        if sampling == "greedy":
            target = load_saved(target_dir)
            ref = target.generate(ids, attention_mask=mask, max_new_tokens=32, do_sample=False)
            assert torch.equal(got.sequences, ref)
    finally:
        assert quantized.terminate() == 0, "".join(quantized.log[-20:])
    assert any(f"int8 weights ({int8.default_kernel()})" in line for line in quantized.log)
