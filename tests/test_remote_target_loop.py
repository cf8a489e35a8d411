"""Rounds run by the target worker (``SpecSplitConfig(grpc_loop="target")``, ``TargetService.Generate``).

Real workers on loopback, started through the CLI: the target worker gets ``--draft-address`` and
calls the draft worker itself. Pins: the same tokens, round statistics and sampling-generator state
as local mode; stop strings cut on the client, with the cancelled generation's sessions freed on
both workers; bad requests get status codes and the worker keeps serving; a missing or dead draft
worker means target-only steps with the same output; a silent worker trips the client's watchdog.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

pytest.importorskip("grpc")

import grpc  # noqa: E402
from remote_support import VOCAB, Worker, load_saved, wait_until  # noqa: E402

from specsplit import (  # noqa: E402
    ConfigError,
    DraftEngine,
    LocalTransport,
    SpecSplitConfig,
    SpecSplitGenerator,
    TargetEngine,
    TransportError,
    TreeConfig,
)
from specsplit.config import PipelineTuning  # noqa: E402
from specsplit.pipeline import DecodeParams, decode  # noqa: E402
from specsplit.remote import GrpcTransport, convert, serve_draft, serve_target  # noqa: E402
from specsplit.remote._generated import spec_decoding_pb2 as pb  # noqa: E402
from specsplit.remote._generated import spec_decoding_pb2_grpc as pb_grpc  # noqa: E402
from specsplit.remote.server import TargetServicer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # one torch thread, as the workers run

TREES = {
    "chain4": TreeConfig(shape="chain", num_draft_tokens=4),
    "dynamic16": TreeConfig(shape="dynamic", budget=16, max_depth=4, topk=4, width=4),
}
SAMPLING = {"greedy": {"do_sample": False}, "seeded": {"do_sample": True, "temperature": 0.8, "top_p": 0.95}}


@pytest.fixture(scope="module")
def workers(model_dirs: tuple[Path, Path]):
    """A draft worker, and a target worker started with ``--draft-address`` pointing at it."""
    target_dir, draft_dir = model_dirs
    drafter = Worker("draft", draft_dir).start().wait_ready()
    try:
        target = Worker("target", target_dir, ["--draft-address", drafter.address]).start().wait_ready()
    except Exception:
        drafter.kill()
        raise
    yield target, drafter
    for w in (target, drafter):
        assert w.terminate() == 0, "".join(w.log[-20:])


def loop_gen(target_address: str, tree: TreeConfig, tokenizer=None, **kwargs) -> SpecSplitGenerator:
    tuning = {k: kwargs.pop(k) for k in ("overlap_policy", "grpc_streams") if k in kwargs}
    cfg = SpecSplitConfig(transport="grpc", grpc_loop="target", tree=tree, target_address=target_address,
                          timeout_s=60.0, tuning=PipelineTuning(**tuning), **kwargs)  # fmt: skip
    return SpecSplitGenerator(config=cfg, tokenizer=tokenizer)


def prompts(batch: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, 10), generator=g)
    mask = torch.ones_like(ids)
    if batch > 1:
        mask[1, :3] = 0
        ids[1, :3] = 0
    return ids, mask


def run(gen: SpecSplitGenerator, ids, mask, sampling: dict, g: torch.Generator, n: int = 24, **kw):
    return gen.generate(ids, attention_mask=mask, max_new_tokens=n, generator=g, return_dict_in_generate=True,
                        **sampling, **kw)  # fmt: skip


def round_stats(out) -> list[list[tuple[int, int, int, int]]]:
    return [
        [(r.accepted, r.committed, r.drafted_depth, r.tree_nodes) for r in s.rounds]
        for s in out.per_sequence_stats
    ]


def sessions(target_address: str, draft_address: str) -> tuple[int, int]:
    """Live sessions on the target and the draft worker."""
    out = []
    for addr, stub in (
        (target_address, pb_grpc.TargetServiceStub),
        (draft_address, pb_grpc.DraftServiceStub),
    ):
        with grpc.insecure_channel(addr) as ch:
            out.append(stub(ch).Ping(pb.PingRequest(), timeout=10).active_sessions)
    return out[0], out[1]


class CharTokenizer:
    """Just enough tokenizer for stop strings: token ``i`` reads ``<i>``."""

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(f"<{int(i)}>" for i in ids)


@pytest.mark.parametrize("sampling", list(SAMPLING))
@pytest.mark.parametrize("tree", list(TREES))
def test_target_loop_equals_local(workers, engines, tree: str, sampling: str) -> None:
    """Tokens, per-round statistics and the sampling generator's state afterwards: all as local mode's."""
    target, _ = workers
    ids, mask = prompts(3)
    g_ref, g_out = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    local = SpecSplitGenerator(transport=LocalTransport(*engines), config=SpecSplitConfig(tree=TREES[tree]))
    ref = run(local, ids, mask, SAMPLING[sampling], g_ref)
    with loop_gen(target.address, TREES[tree]) as gen:
        out = run(gen, ids, mask, SAMPLING[sampling], g_out)
    assert torch.equal(out.sequences, ref.sequences)
    assert round_stats(out) == round_stats(ref)
    assert torch.equal(g_out.get_state(), g_ref.get_state())  # the next call draws the same seeds
    assert sum(r.accepted for r in out.spec_stats.rounds) > 0, "no token accepted"
    assert all(r.transport_s >= 0 and r.draft_s > 0 for r in out.spec_stats.rounds if r.drafted_depth)


def test_target_loop_overlapped_equals_sequential(workers, engines) -> None:
    target, _ = workers
    ids, mask = prompts(1, seed=3)
    tree = TREES["dynamic16"]
    local = SpecSplitGenerator(transport=LocalTransport(*engines), config=SpecSplitConfig(tree=tree))
    ref = run(local, ids, mask, SAMPLING["seeded"], torch.Generator().manual_seed(2), n=40)
    with loop_gen(target.address, tree, overlap=True, overlap_policy="always") as gen:
        out = run(gen, ids, mask, SAMPLING["seeded"], torch.Generator().manual_seed(2), n=40)
    assert torch.equal(out.sequences, ref.sequences)
    assert out.spec_stats.spec_rounds > 0  # speculation ran on the target worker
    assert out.spec_stats.spec_rounds == sum(r.spec_hit is not None for r in out.spec_stats.rounds)


def test_stop_string_cuts_on_the_client_and_frees_both_sessions(workers, engines) -> None:
    target, drafter = workers
    ids, mask = prompts(1, seed=5)
    tree, tok = TREES["chain4"], CharTokenizer()
    local = SpecSplitGenerator(
        transport=LocalTransport(*engines), config=SpecSplitConfig(tree=tree), tokenizer=tok
    )
    full = run(local, ids, mask, SAMPLING["greedy"], None, n=60).sequences[0, 10:].tolist()
    stop = f"<{full[5]}>"
    ref = run(local, ids, mask, SAMPLING["greedy"], None, n=60, stop_strings=[stop])
    with loop_gen(target.address, tree, tokenizer=tok) as gen:
        out = run(gen, ids, mask, SAMPLING["greedy"], None, n=60, stop_strings=[stop])
    new = out.sequences[0, 10:].tolist()
    assert new == ref.sequences[0, 10:].tolist() == full[: full.index(full[5]) + 1]
    assert round_stats(out) == round_stats(ref)
    # the cancelled generation ended its session on both workers
    assert wait_until(lambda: sessions(target.address, drafter.address) == (0, 0), timeout=10)


def test_target_loop_matches_target_generate_greedy(workers, model_dirs) -> None:
    target, _ = workers
    model = load_saved(model_dirs[0])
    ids, _ = prompts(1, seed=11)
    ref = model.generate(ids, max_new_tokens=30, do_sample=False, pad_token_id=0)
    with loop_gen(target.address, TREES["dynamic16"]) as gen:
        out = gen.generate(ids, max_new_tokens=30, do_sample=False)
    assert torch.equal(out, ref)
    # a finished generation's watchdog thread goes away (it must not live on for timeout_s)
    watchdogs = lambda: sum(t.name == "specsplit-generate-watchdog" for t in threading.enumerate())  # noqa: E731
    assert wait_until(lambda: watchdogs() == 0, timeout=3.0)


def test_concurrent_generations_on_one_target_worker(workers, engines) -> None:
    target, drafter = workers
    tree = TREES["dynamic16"]
    local = SpecSplitGenerator(transport=LocalTransport(*engines), config=SpecSplitConfig(tree=tree))
    batches = [prompts(1, seed=s)[0] for s in range(4)]
    refs = [local.generate(b, max_new_tokens=20) for b in batches]
    with loop_gen(target.address, tree) as gen, ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda b: gen.generate(b, max_new_tokens=20), batches))
    for o, r in zip(outs, refs, strict=True):
        assert torch.equal(o, r)
    assert wait_until(lambda: sessions(target.address, drafter.address) == (0, 0), timeout=10)


def _generate_call(address: str, **fields) -> list[pb.GenerateResponse]:
    base = {"prompt_token_ids": [5, 6, 7], "max_new_tokens": 4,
            "tree": convert.tree_config_to_proto(TREES["chain4"]),
            "sampling": pb.SamplingParams(top_p=1.0, temperature=1.0)}  # fmt: skip
    base.update(fields)
    with grpc.insecure_channel(address) as ch:
        return list(pb_grpc.TargetServiceStub(ch).Generate(pb.GenerateRequest(**base), timeout=30))


@pytest.mark.parametrize(
    ("fields", "code"),
    [
        ({"prompt_token_ids": []}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"prompt_token_ids": [1, VOCAB]}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"prompt_token_ids": [-1]}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"max_new_tokens": -1}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"max_new_tokens": 10**9}, grpc.StatusCode.RESOURCE_EXHAUSTED),
        (
            {"tree": convert.tree_config_to_proto(TreeConfig(shape="chain", num_draft_tokens=500))},
            grpc.StatusCode.RESOURCE_EXHAUSTED,
        ),
        ({"tree": pb.TreeSpec()}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"overlap_policy": "sometimes"}, grpc.StatusCode.INVALID_ARGUMENT),
        (
            {"sampling": pb.SamplingParams(do_sample=True, temperature=0.0, top_p=1.0)},
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (
            {
                "sampling": pb.SamplingParams(do_sample=True, temperature=1.0, top_p=1.0),
                "rng_state": b"\x01" * 7,
            },
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
    ],
)
def test_bad_generate_requests_get_status_codes_and_the_worker_keeps_serving(workers, fields, code) -> None:
    target, drafter = workers
    with pytest.raises(grpc.RpcError) as err:
        _generate_call(target.address, **fields)
    assert err.value.code() == code, err.value.details()
    assert sessions(target.address, drafter.address) == (0, 0)  # nothing was created
    good = _generate_call(target.address)
    assert good[-1].done and sum(len(r.token_ids) for m in good for r in m.rounds) == 4


def test_out_of_vocab_prompt_raises_invalid_request_on_the_client(workers) -> None:
    from specsplit import InvalidRequest

    target, _ = workers
    with loop_gen(target.address, TREES["chain4"]) as gen, pytest.raises(InvalidRequest, match="vocabulary"):
        gen.generate(torch.tensor([[1, VOCAB + 3]]), max_new_tokens=4)


def test_without_a_draft_worker_the_target_loop_decodes_target_only(model_dirs, engines) -> None:
    """No ``--draft-address``, or one nobody answers on: target-only steps, the same greedy output."""
    target_engine = TargetEngine(load_saved(model_dirs[0]))
    ids, _ = prompts(1, seed=4)
    ref = SpecSplitGenerator(transport=LocalTransport(None, engines[1])).generate(ids, max_new_tokens=12)
    for draft_address in (None, "127.0.0.1:1"):
        srv = serve_target(target_engine, draft_address=draft_address, draft_timeout_s=2.0)
        try:
            with loop_gen(srv.address, TREES["chain4"]) as gen:
                out = gen.generate(ids, max_new_tokens=12, return_dict_in_generate=True)
        finally:
            srv.stop(grace=1.0)
        assert torch.equal(out.sequences, ref)
        assert all(r.drafted_depth == 0 for r in out.spec_stats.rounds)
        assert out.spec_stats.draft_fallback == (draft_address is not None)


def test_in_process_servers_and_draft_worker_killed_mid_generation(model_dirs, engines) -> None:
    """A draft worker that stops mid-generation: the rest is target-only and the output unchanged."""
    d_engine, t_engine = DraftEngine(load_saved(model_dirs[1])), TargetEngine(load_saved(model_dirs[0]))
    d_srv = serve_draft(d_engine)
    t_srv = serve_target(t_engine, draft_address=d_srv.address, draft_timeout_s=5.0)
    ids, _ = prompts(1, seed=9)
    ref = SpecSplitGenerator(transport=LocalTransport(*engines), config=SpecSplitConfig(tree=TREES["chain4"]))
    expected = ref.generate(ids, max_new_tokens=40)
    seen: list[int] = []

    class Streamer:
        def put(self, t: torch.Tensor) -> None:
            seen.append(t.numel())
            if len(seen) == 3:  # prompt, then two rounds: stop the draft worker now
                d_srv.stop(grace=0.0)

        def end(self) -> None:
            pass

    try:
        with loop_gen(t_srv.address, TREES["chain4"]) as gen:
            out = gen.generate(ids, max_new_tokens=40, streamer=Streamer(), return_dict_in_generate=True)
    finally:
        t_srv.stop(grace=1.0)
        d_srv.stop(grace=0.0)
    assert torch.equal(out.sequences, expected)
    assert out.spec_stats.draft_fallback
    assert out.spec_stats.rounds[0].drafted_depth > 0 and out.spec_stats.rounds[-1].drafted_depth == 0


def test_a_draft_call_past_its_deadline_still_ends_its_session(model_dirs, engines) -> None:
    """A draft call slower than the target worker's deadline (a first-time compile, say): that
    generation finishes target-only with the same output, and its draft session still ends, once the
    slow call has returned. Before, the session stayed until the TTL, holding the draft worker's one
    graph workspace, and every later session there ran the eager path (seen on an H200: 24 tok/s)."""
    from specsplit import DraftConfig

    d_engine = DraftEngine(load_saved(model_dirs[1]), DraftConfig(cuda_graphs=True))
    t_engine = TargetEngine(load_saved(model_dirs[0]))
    inner, slow = d_engine._ingest, [1.5]

    def ingest(*args, **kwargs):  # inside the call, with the session created and locked
        if slow:
            time.sleep(slow.pop())
        return inner(*args, **kwargs)

    d_engine._ingest = ingest
    d_srv = serve_draft(d_engine)
    t_srv = serve_target(t_engine, draft_address=d_srv.address, draft_timeout_s=0.5)
    ids, _ = prompts(1, seed=11)
    ref = SpecSplitGenerator(transport=LocalTransport(None, engines[1])).generate(ids, max_new_tokens=12)
    try:
        with loop_gen(t_srv.address, TREES["chain4"]) as gen:
            out = gen.generate(ids, max_new_tokens=12, return_dict_in_generate=True)
        assert torch.equal(out.sequences, ref)
        assert out.spec_stats.draft_fallback and not slow  # the slow call happened and missed its deadline
        assert wait_until(lambda: d_engine.active_sessions == 0, timeout=10.0)
        assert d_engine._workspace.owner is None  # the next session gets the graph workspace
    finally:
        t_srv.stop(grace=1.0)
        d_srv.stop(grace=0.0)


def test_end_session_reaches_the_draft_worker_only_for_sessions_it_saw() -> None:
    """EndSession goes to the draft worker for a session that made a draft call, even one that failed
    and marked the worker down (once, no retries); a session that never reached it (target-only while
    it was down) costs it no call, so a hung draft worker does not slow every generation's end."""
    from specsplit import DraftRequest

    transport = GrpcTransport(None, "127.0.0.1:1", timeout_s=0.5)
    calls: list[tuple[str, str, bool]] = []

    def record(peer, method, msg, *, timeout, retry, wait=False):  # noqa: ARG001 - the _call signature
        calls.append((peer.role, method, retry))

    try:
        with pytest.raises(TransportError):
            transport.draft(DraftRequest("seen", [1, 2, 3], 0, TREES["chain4"]))
        assert not transport._draft_up()
        transport._call = record
        transport.end_session("never-drafted")
        transport.end_session("seen")
        transport.end_session("seen")  # told once
    finally:
        transport.close()
    assert calls == [("draft", "EndSession", False)]


class _SilentServicer(TargetServicer):
    def Generate(self, request, context):  # noqa: N802 - gRPC method name
        time.sleep(3.0)
        yield pb.GenerateResponse(done=True)


def test_client_watchdog_cancels_a_silent_worker(engines) -> None:
    server = grpc.server(ThreadPoolExecutor(2))
    pb_grpc.add_TargetServiceServicer_to_server(_SilentServicer(engines[1]), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        cfg = SpecSplitConfig(
            transport="grpc", grpc_loop="target", target_address=f"127.0.0.1:{port}", timeout_s=0.5
        )
        t0 = time.monotonic()
        with SpecSplitGenerator(config=cfg) as gen, pytest.raises(TransportError, match="sent nothing"):
            gen.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4)
        assert time.monotonic() - t0 < 2.5
    finally:
        server.stop(0)


def test_a_worker_without_generate_gives_a_clear_error(engines) -> None:
    """``grpc_loop="target"`` pointed at something that is not a target worker of this version."""
    srv = serve_draft(engines[0])  # a draft worker: no TargetService at all
    try:
        cfg = SpecSplitConfig(transport="grpc", grpc_loop="target", target_address=srv.address, timeout_s=10)
        with (
            SpecSplitGenerator(config=cfg) as gen,
            pytest.raises(TransportError, match="UNIMPLEMENTED.*grpc_loop"),
        ):
            gen.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4)
    finally:
        srv.stop(grace=0.0)


def test_grpc_loop_config_is_checked() -> None:
    with pytest.raises(ConfigError, match="grpc_loop"):
        SpecSplitConfig(grpc_loop="server")
    with pytest.raises(ConfigError, match="needs transport='grpc'"):
        SpecSplitConfig(grpc_loop="target")
    cfg = SpecSplitConfig.from_env(environ={"SPECSPLIT_TRANSPORT": "grpc", "SPECSPLIT_TARGET_ADDRESS": "h:1",
                                            "SPECSPLIT_GRPC_LOOP": "target"})  # fmt: skip
    assert cfg.grpc_loop == "target"


def test_loop_target_needs_a_transport_that_runs_rounds(engines) -> None:
    with pytest.raises(ConfigError, match="GrpcTransport"):
        decode(LocalTransport(*engines), [1, 2, 3], DecodeParams(max_new_tokens=4, loop="target"))
    with pytest.raises(TransportError, match="no target worker"):
        GrpcTransport(None, "127.0.0.1:1").generate_on_target(None)  # type: ignore[arg-type]


def test_serve_rejects_draft_peer_options_on_a_draft_worker(tmp_path: Path, capsys) -> None:
    from specsplit.cli import main

    assert main(["serve", "draft", "--model", str(tmp_path), "--draft-address", "127.0.0.1:5"]) == 2
    assert "target options" in capsys.readouterr().err
    assert main(["serve", "draft", "--model", str(tmp_path), "--draft-timeout", "600"]) == 2
    assert "--draft-timeout" in capsys.readouterr().err
    assert main(["serve", "target", "--model", str(tmp_path), "--draft-timeout", "0"]) == 2
    assert "--draft-timeout must be > 0" in capsys.readouterr().err
    assert main(["serve", "draft", "--model", str(tmp_path), "--lookahead", "7"]) == 2
    assert "--lookahead" in capsys.readouterr().err
    assert main(["serve", "target", "--model", str(tmp_path), "--lookahead", "7,x"]) == 2
    assert "WIDTH[,LEVELS[,NODES]]" in capsys.readouterr().err


def test_lookahead_flag_parses_width_and_levels() -> None:
    from specsplit.cli.common import lookahead_overrides

    assert lookahead_overrides(None) == {}
    assert lookahead_overrides("7") == {"lookahead": 7}
    assert lookahead_overrides("10,4") == {"lookahead": 10, "lookahead_levels": 4}
    assert lookahead_overrides("8,2,16") == {"lookahead": 8, "lookahead_levels": 2, "lookahead_nodes": 16}
    for bad in ("", "a", "1,2,3,4"):
        with pytest.raises(ConfigError, match="--lookahead"):
            lookahead_overrides(bad)


def test_an_engine_error_mid_generation_reaches_the_client_and_the_worker_keeps_serving(
    model_dirs, engines
) -> None:
    """An error in a round ends the call with its status code, frees the session on both workers,
    and the next generation runs normally."""
    from specsplit.errors import ResourceExhausted

    d_engine, t_engine = DraftEngine(load_saved(model_dirs[1])), TargetEngine(load_saved(model_dirs[0]))
    d_srv = serve_draft(d_engine)
    t_srv = serve_target(t_engine, draft_address=d_srv.address, draft_timeout_s=5.0)
    ids, _ = prompts(1, seed=2)
    expected = SpecSplitGenerator(
        transport=LocalTransport(*engines), config=SpecSplitConfig(tree=TREES["chain4"])
    )
    expected = expected.generate(ids, max_new_tokens=30)
    real_verify, calls = t_engine.verify, []

    def failing_verify(req):  # noqa: ANN001, ANN202
        calls.append(1)
        if len(calls) == 3:
            raise ResourceExhausted("scripted: out of KV blocks")
        return real_verify(req)

    t_engine.verify = failing_verify
    try:
        with loop_gen(t_srv.address, TREES["chain4"]) as gen:
            with pytest.raises(ResourceExhausted, match="scripted"):
                gen.generate(ids, max_new_tokens=30)
            assert wait_until(
                lambda: (t_engine.active_sessions, d_engine.active_sessions) == (0, 0), timeout=10
            )
            assert torch.equal(gen.generate(ids, max_new_tokens=30), expected)
    finally:
        t_srv.stop(grace=1.0)
        d_srv.stop(grace=0.0)


@pytest.mark.parametrize("draft_streams", [True, False])
def test_draft_calls_over_a_stream_or_unary_give_the_same_tokens(model_dirs, engines, draft_streams) -> None:
    """``specsplit serve target --no-draft-stream`` (unary draft calls) is the A/B of the draft stream."""
    d_engine, t_engine = DraftEngine(load_saved(model_dirs[1])), TargetEngine(load_saved(model_dirs[0]))
    d_srv = serve_draft(d_engine)
    t_srv = serve_target(t_engine, draft_address=d_srv.address, draft_streams=draft_streams)
    ids, mask = prompts(1, seed=6)
    local = SpecSplitGenerator(
        transport=LocalTransport(*engines), config=SpecSplitConfig(tree=TREES["dynamic16"])
    )
    for sampling in SAMPLING.values():
        ref = run(local, ids, mask, sampling, torch.Generator().manual_seed(3), n=30)
        try:
            with loop_gen(t_srv.address, TREES["dynamic16"], grpc_streams=draft_streams) as gen:
                out = run(gen, ids, mask, sampling, torch.Generator().manual_seed(3), n=30)
        except Exception:
            t_srv.stop(grace=0.0)
            d_srv.stop(grace=0.0)
            raise
        assert torch.equal(out.sequences, ref.sequences)
        assert round_stats(out) == round_stats(ref)
    stream = t_srv_loop_stream(t_srv)
    t_srv.stop(grace=1.0)
    d_srv.stop(grace=0.0)
    assert (stream is not None) == draft_streams  # the worker's draft client used its stream (or had none)


def t_srv_loop_stream(server) -> object:  # noqa: ANN001
    """The open draft stream of a target worker's draft client (``None``: none opened)."""
    loop = next(cb.__self__ for cb in server.on_stop if hasattr(getattr(cb, "__self__", None), "_draft"))
    draft = loop._draft  # noqa: SLF001
    return draft._draft_stream.call if draft._draft_stream is not None else None  # noqa: SLF001


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_batched_worker_serves_concurrent_clients_in_shared_rounds(engines, sampling):
    """A target worker with max_batch: concurrent n-gram Generate calls share batched rounds, and
    each client gets exactly what it gets from a worker without batching (same seeds)."""
    ids, _ = prompts(6, seed=21)
    outs: dict[int, list[torch.Tensor]] = {}
    for max_batch in (0, 4):
        srv = serve_target(engines[1], drafter="ngram", max_batch=max_batch, batch_capacity=256)
        start = threading.Barrier(ids.shape[0])

        def client(i: int, srv=srv, start=start) -> torch.Tensor:  # noqa: ANN001
            with loop_gen(srv.address, TREES["chain4"], drafter="ngram") as gen:
                start.wait()
                g = torch.Generator().manual_seed(i)
                return gen.generate(ids[i : i + 1], max_new_tokens=24, generator=g, return_dict_in_generate=True,
                                    **SAMPLING[sampling])  # fmt: skip

        try:
            with ThreadPoolExecutor(ids.shape[0]) as pool:
                res = list(pool.map(client, range(ids.shape[0])))
        finally:
            srv.stop(grace=1.0)
        outs[max_batch] = [r.sequences for r in res]
        if max_batch:
            assert srv.batch is not None
            assert 0 < srv.batch.rounds < sum(len(r.spec_stats.rounds) for r in res)  # rounds were shared
        else:
            assert srv.batch is None
    for i in range(ids.shape[0]):
        assert torch.equal(outs[0][i], outs[4][i]), f"client {i}"


def test_model_drafted_calls_share_batched_rounds_once_a_second_arrives(engines) -> None:
    """A batching target worker with a draft worker: a model-drafted Generate call alone runs its own
    speculative rounds on the draft worker; calls that arrive while it runs join the batched rounds
    (target-only there). Every client gets exactly what a worker without batching gives it, and
    once all have ended a lone call speculates again. A seeded sampled call keeps its own rounds."""
    ids, _ = prompts(5, seed=33)
    d_srv = serve_draft(engines[0])
    srvs = [serve_target(engines[1], draft_address=d_srv.address, max_batch=mb, batch_capacity=256)
            for mb in (0, 4)]  # fmt: skip
    try:
        with loop_gen(srvs[0].address, TREES["chain4"]) as gen:
            ref = [gen.generate(ids[i : i + 1], max_new_tokens=40) for i in range(ids.shape[0])]
        srv = srvs[1]
        assert srv.batch is not None
        holding, release = threading.Event(), threading.Event()

        class Hold:  # the first client's stream pauses at its first new tokens (its first put is the prompt)
            puts = 0

            def put(self, value) -> None:  # noqa: ANN001
                self.puts += 1
                if self.puts == 2:
                    holding.set()
                    release.wait(30)

            def end(self) -> None:
                pass

        def client(i: int):  # noqa: ANN202
            with loop_gen(srv.address, TREES["chain4"]) as g:
                kw = {"streamer": Hold()} if i == 0 else {}
                if i:
                    assert holding.wait(30)
                return g.generate(ids[i : i + 1], max_new_tokens=40, return_dict_in_generate=True, **kw)

        with ThreadPoolExecutor(ids.shape[0]) as pool:
            futs = [pool.submit(client, i) for i in range(ids.shape[0])]
            assert wait_until(lambda: srv.batch.rounds > 0, timeout=30)  # the later calls run batched
            release.set()
            res = [f.result(timeout=60) for f in futs]
        for i, r in enumerate(res):
            assert torch.equal(r.sequences, ref[i]), f"client {i}"
        drafted = [sum(x.tree_nodes for x in r.spec_stats.rounds) for r in res]
        assert drafted[0] > 0  # the first call's own rounds verified the draft worker's chains
        assert drafted[1:] == [0] * (ids.shape[0] - 1), drafted  # batched rows: target-only
        assert wait_until(lambda: srv.batch.live_rows == 0, timeout=10)
        rounds = srv.batch.rounds
        with loop_gen(srv.address, TREES["chain4"]) as g:  # alone again: its own speculative rounds
            again = g.generate(ids[:1], max_new_tokens=40, return_dict_in_generate=True)
        assert torch.equal(again.sequences, ref[0]) and srv.batch.rounds == rounds
        assert sum(x.tree_nodes for x in again.spec_stats.rounds) > 0
        # A seeded sampled call keeps its own rounds while others run: its seed gives its output.
        sampled = {"do_sample": True, "temperature": 0.8, "max_new_tokens": 24}
        with loop_gen(srvs[0].address, TREES["chain4"]) as g:
            want = g.generate(ids[1:2], generator=torch.Generator().manual_seed(7), **sampled)
        holding.clear()
        release.clear()
        with ThreadPoolExecutor(2) as pool:
            busy = pool.submit(client, 0)
            assert holding.wait(30)
            with loop_gen(srv.address, TREES["chain4"]) as g:
                got = g.generate(ids[1:2], generator=torch.Generator().manual_seed(7), return_dict_in_generate=True,
                                 **sampled)  # fmt: skip
            release.set()
            busy.result(timeout=60)
        # (the greedy call it found running moves to the batched rounds: only the sampled one stays)
        assert torch.equal(got.sequences, want)
        assert all(x.tree_nodes > 0 for x in got.spec_stats.rounds[:-1]), got.spec_stats.rounds
    finally:
        for s in (*srvs, d_srv):
            s.stop(grace=1.0)


def test_a_cancelled_model_drafted_call_leaves_the_worker_free_for_its_own_rounds(engines) -> None:
    """A lone model-drafted Generate call that its client cancels (a stop string) no longer counts
    as a running generation: the next lone call speculates on its own rounds again, as if the
    cancelled one had run to its end."""
    ids, _ = prompts(1, seed=12)
    tok = CharTokenizer()
    d_srv = serve_draft(engines[0])
    srv = serve_target(engines[1], draft_address=d_srv.address, max_batch=4, batch_capacity=256)
    try:
        with loop_gen(srv.address, TREES["chain4"], tokenizer=tok) as gen:
            full = gen.generate(ids, max_new_tokens=40)
            stop = f"<{full[0, ids.shape[1] + 12].item()}>"
            cut = gen.generate(ids, max_new_tokens=40, stop_strings=[stop])
            assert cut.shape[1] < full.shape[1]  # the call was cancelled mid-generation
            # the worker notices the cancel at its next round; then its session ends on both workers
            assert wait_until(lambda: sessions(srv.address, d_srv.address) == (0, 0), timeout=10)
            again = gen.generate(ids, max_new_tokens=40, return_dict_in_generate=True)
        assert torch.equal(again.sequences, full) and srv.batch.rounds == 0
        assert sum(x.tree_nodes for x in again.spec_stats.rounds) > 0
    finally:
        srv.stop(grace=1.0)
        d_srv.stop(grace=1.0)


def test_batched_worker_frees_a_cancelled_row_and_keeps_serving(engines) -> None:
    """On a batching worker: a stop string cancels a client's call mid-generation (its row leaves the
    pool), a bad request gets INVALID_ARGUMENT, and the next clients are served exactly."""
    ids, _ = prompts(2, seed=5)
    tok = CharTokenizer()
    local = SpecSplitGenerator(transport=LocalTransport(None, engines[1]), config=SpecSplitConfig(drafter="ngram"),
                               tokenizer=tok)  # fmt: skip
    full = local.generate(ids[:1], max_new_tokens=40)
    stop = f"<{full[0, 15].item()}>"
    ref = local.generate(ids[:1], max_new_tokens=40, stop_strings=[stop])
    srv = serve_target(engines[1], drafter="ngram", max_batch=4, batch_capacity=256)
    try:
        with loop_gen(srv.address, TREES["chain4"], tokenizer=tok, drafter="ngram") as gen:
            out = gen.generate(ids[:1], max_new_tokens=40, stop_strings=[stop])
            assert torch.equal(out, ref)
            assert wait_until(lambda: srv.batch.live_rows == 0 and srv.batch.waiting_rows == 0, timeout=10)
            stub = pb_grpc.TargetServiceStub(grpc.insecure_channel(srv.address))
            bad = pb.GenerateRequest(session_id="bad", prompt_token_ids=[VOCAB + 5], max_new_tokens=4)
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(bad, timeout=10))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert torch.equal(gen.generate(ids[:1], max_new_tokens=40), full)
    finally:
        srv.stop(grace=1.0)


@pytest.mark.parametrize("draft_batch", [False, True])
def test_batched_worker_gathers_client_loop_verifications(engines, draft_batch) -> None:
    """Client loop (the client calls the draft worker, then the target worker, every round) against a
    target worker with max_batch: concurrent greedy sessions' VerifyDrafts share forwards, every client
    gets what a non-batching worker gives it, and ended sessions free their slots. With max_batch on
    the draft worker too, the sessions' chain drafts share forwards there as well."""
    ids, _ = prompts(5, seed=31)
    outs: dict[int, list[torch.Tensor]] = {}
    for max_batch in (0, 4):
        d_srv = serve_draft(engines[0], max_batch=max_batch if draft_batch else 0, batch_capacity=256)
        try:
            t_srv = serve_target(engines[1], max_batch=max_batch, batch_capacity=256)
            start = threading.Barrier(ids.shape[0])

            def client(i: int, t_srv=t_srv, d_srv=d_srv, start=start) -> torch.Tensor:  # noqa: ANN001
                cfg = SpecSplitConfig(transport="grpc", draft_address=d_srv.address, target_address=t_srv.address,
                                      tree=TREES["chain4"], timeout_s=60.0)  # fmt: skip
                with SpecSplitGenerator(config=cfg) as gen:
                    start.wait()
                    return gen.generate(ids[i : i + 1], max_new_tokens=24, return_dict_in_generate=True)

            try:
                with ThreadPoolExecutor(ids.shape[0]) as pool:
                    res = list(pool.map(client, range(ids.shape[0])))
                if max_batch:
                    assert t_srv.sessions is not None
                    calls = sum(len(r.spec_stats.rounds) for r in res)
                    assert 0 < t_srv.sessions.rounds < calls  # verifications shared forwards
                    assert wait_until(lambda t=t_srv: t.sessions.live_sessions == 0, timeout=10)
                    # 5 clients, 4 slots: one session took the engine's own path, and ended there too
                    assert wait_until(lambda: engines[1].active_sessions == 0, timeout=10)
                    if draft_batch:
                        drafts = d_srv.sessions
                        assert drafts is not None and 0 < drafts.rounds
                        assert drafts.rounds < sum(
                            r.drafter == "model" for x in res for r in x.spec_stats.rounds
                        )
                        assert wait_until(lambda d=drafts: d.live_sessions == 0, timeout=10)
                        assert wait_until(lambda: engines[0].active_sessions == 0, timeout=10)
            finally:
                t_srv.stop(grace=1.0)
            outs[max_batch] = [r.sequences for r in res]
        finally:
            d_srv.stop(grace=1.0)
    for i in range(ids.shape[0]):
        assert torch.equal(outs[0][i], outs[4][i]), f"client {i}"


@pytest.mark.parametrize("own", [0, 2])
def test_a_lone_model_drafted_call_moves_to_the_batched_rounds_when_another_starts(engines, own) -> None:
    """A greedy model-drafted call running its own rounds moves to the batched rounds before its
    next verification once another generation runs, instead of sharing the GPU with the batch for
    the rest of its generation: after ``own`` rounds of its own, or before its first verification
    (its prompt's) when the other one starts while it drafts its first round. Its output is exactly
    a non-batching worker's; a stop string that spans the move (the client cancels the call) still
    cuts it where it would have."""
    ids, _ = prompts(2, seed=41)
    tok = CharTokenizer()
    d_srv = serve_draft(engines[0])
    srvs = [serve_target(engines[1], draft_address=d_srv.address, max_batch=mb, batch_capacity=256)
            for mb in (0, 4)]  # fmt: skip
    draft_engine = engines[0]
    real_generate = draft_engine.generate
    try:
        with loop_gen(srvs[0].address, TREES["chain4"], tokenizer=tok) as gen:
            ref = [gen.generate(ids[i : i + 1], max_new_tokens=40) for i in range(2)]
        srv = srvs[1]
        assert srv.batch is not None
        target = srv.batch.target
        real_round = target.round
        drafts, draft_gate, draft_held = [0], threading.Event(), threading.Event()
        round_gate, round_held = threading.Event(), threading.Event()

        def gated_draft(req):  # noqa: ANN001, ANN202  the lone call's draft after its own rounds waits
            drafts[0] += 1
            if drafts[0] == own + 1:
                draft_held.set()
                assert draft_gate.wait(30)
            return real_generate(req)

        def gated_round(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202  the batch holds its first round
            if not round_held.is_set():
                round_held.set()
                assert round_gate.wait(30)
            return real_round(*args, **kwargs)

        verifies, real_verify = [0], engines[1].verify

        def counted_verify(req):  # noqa: ANN001, ANN202  verifications on the lone call's own rounds
            verifies[0] += 1
            return real_verify(req)

        def first(stop: list[str] | None = None):  # noqa: ANN202
            with loop_gen(srv.address, TREES["chain4"], tokenizer=tok) as g:
                kw = {"stop_strings": stop} if stop else {}
                return g.generate(ids[:1], max_new_tokens=40, return_dict_in_generate=True, **kw)

        def second():  # noqa: ANN202
            with loop_gen(srv.address, TREES["chain4"], tokenizer=tok) as g:
                return g.generate(ids[1:2], max_new_tokens=40, return_dict_in_generate=True)

        def race(stop: list[str] | None = None):  # noqa: ANN202
            drafts[0] = verifies[0] = 0
            for e in (draft_gate, draft_held, round_gate, round_held):
                e.clear()
            with ThreadPoolExecutor(2) as pool:
                lone = pool.submit(first, stop)
                assert draft_held.wait(30)  # its own rounds verified, the next one drafting
                other = pool.submit(second)
                assert round_held.wait(30)  # the second call's row is live in the batch
                draft_gate.set()  # the lone call's next round ends; it sees the batch and moves
                assert wait_until(lambda: srv.batch.waiting_rows == 1, timeout=30)
                round_gate.set()
                return lone.result(timeout=60), other.result(timeout=60)

        draft_engine.generate = gated_draft
        target.round = gated_round
        engines[1].verify = counted_verify
        moved, other = race()
        assert torch.equal(moved.sequences, ref[0]) and torch.equal(other.sequences, ref[1])
        # the call's own sessions ended on both workers when it moved (and its row left the pool)
        assert wait_until(lambda: sessions(srv.address, d_srv.address) == (0, 0), timeout=10)
        assert wait_until(lambda: srv.batch.live_rows == 0, timeout=10)
        nodes = [x.tree_nodes for x in moved.spec_stats.rounds]
        assert nodes[:own] == [4] * own, nodes  # its own rounds verified the draft worker's chains ...
        assert len(nodes) > own and not any(nodes[own:]), nodes  # ... then it ran as a batched row
        assert verifies[0] == own  # the dropped draft was never verified
        if not own:
            return
        # A stop string made of tokens on both sides of the move cuts the output where it would have.
        n_own = sum(x.committed for x in moved.spec_stats.rounds[:own])
        at = ids.shape[1] + n_own
        stop = "".join(f"<{t}>" for t in ref[0][0, at - 1 : at + 1].tolist())
        with loop_gen(srvs[0].address, TREES["chain4"], tokenizer=tok) as gen:
            want = gen.generate(ids[:1], max_new_tokens=40, stop_strings=[stop])
        assert want.shape[1] == at + 1
        cut, _ = race([stop])
        assert torch.equal(cut.sequences, want)
    finally:
        draft_engine.generate = real_generate
        engines[1].__dict__.pop("verify", None)
        for s in (*srvs, d_srv):
            s.stop(grace=1.0)
