"""Remote mode under faults: workers killed mid-generation, restarted, or never there.

The pipeline must finish every generation with the output it would have produced without the
fault: a restarted target loses its sessions (NOT_FOUND -> full-context resend), a dead draft turns
the rest of the generation target-only.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("grpc")

from remote_support import VOCAB, Worker, load_saved, start_all, wait_until  # noqa: E402

from specsplit import (  # noqa: E402
    DraftEngine,
    LocalTransport,
    SpecSplitConfig,
    SpecSplitGenerator,
    TargetEngine,
    TransportError,
    TreeConfig,
    VerifyRequest,
)
from specsplit.core.tree import TokenTree  # noqa: E402
from specsplit.remote import GrpcTransport  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # one torch thread, as the workers run

TREE = TreeConfig(shape="chain", num_draft_tokens=4)


@pytest.fixture(scope="module")
def workers(model_dirs: tuple[Path, Path]):
    target_dir, draft_dir = model_dirs
    ws = start_all([Worker("target", target_dir), Worker("draft", draft_dir)])
    yield ws
    for w in ws:
        if w.alive():
            w.terminate()


@pytest.fixture(scope="module")
def reference(model_dirs: tuple[Path, Path]):
    """Local greedy output for a prompt: what every faulty remote run must still produce."""
    target_dir, draft_dir = model_dirs
    engines = DraftEngine(load_saved(draft_dir)), TargetEngine(load_saved(target_dir))
    gen = SpecSplitGenerator(transport=LocalTransport(*engines), config=SpecSplitConfig(tree=TREE))
    ids = torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(5))
    return ids, gen.generate(ids, max_new_tokens=40, do_sample=False)


def test_target_killed_and_restarted_mid_generation(workers, reference) -> None:
    target, drafter = workers
    ids, want = reference
    transport = GrpcTransport(target.address, drafter.address, timeout_s=120.0)
    gen = SpecSplitGenerator(transport=transport, config=SpecSplitConfig(tree=TREE))
    real_verify = transport.verify
    calls = 0
    ready: list[BaseException | None] = []

    def verify(req: VerifyRequest):
        nonlocal calls
        calls += 1
        if calls == 3:  # round 3: the target crashes and comes back on the same port
            target.kill()
            target.start()

            def wait() -> None:
                try:
                    target.wait_ready()
                    ready.append(None)
                except BaseException as e:
                    ready.append(e)

            threading.Thread(target=wait, daemon=True).start()
        return real_verify(req)

    transport.verify = verify  # type: ignore[method-assign]
    out = gen.generate(ids, max_new_tokens=40, do_sample=False, return_dict_in_generate=True)
    gen.close()
    assert calls > 3 and ready == [None]
    assert torch.equal(out.sequences, want)
    assert out.spec_stats.recoveries >= 1  # the restarted target said NOT_FOUND; full context resent
    assert not out.spec_stats.draft_fallback


def test_draft_killed_mid_generation_then_back(workers, reference, caplog) -> None:
    target, drafter = workers
    ids, want = reference
    transport = GrpcTransport(target.address, drafter.address, timeout_s=60.0, draft_retry_interval_s=3600)
    gen = SpecSplitGenerator(transport=transport, config=SpecSplitConfig(tree=TREE))
    real_draft = transport.draft
    calls = 0

    def draft(req):
        nonlocal calls
        calls += 1
        if calls == 3:
            drafter.kill()
        return real_draft(req)

    transport.draft = draft  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="specsplit.remote.client"):
        out = gen.generate(ids, max_new_tokens=40, do_sample=False, return_dict_in_generate=True)
        assert torch.equal(out.sequences, want)
        assert out.spec_stats.draft_fallback
        assert [r.drafted_depth > 0 for r in out.spec_stats.rounds][:2] == [True, True]
        assert not transport.has_draft
        # The next generation is target-only from the start, with the same output.
        out2 = gen.generate(ids, max_new_tokens=40, do_sample=False, return_dict_in_generate=True)
        assert torch.equal(out2.sequences, want)
        assert all(r.drafted_depth == 0 for r in out2.spec_stats.rounds)
    unreachable = [
        r
        for r in caplog.records
        if r.name == "specsplit.remote.client" and "decoding target-only" in r.getMessage()
    ]
    assert len(unreachable) == 1, "the dead draft must be logged once"
    # The draft comes back: the next probe finds it and speculation resumes.
    start_all([drafter])
    transport.draft_retry_interval_s = 0.0
    assert transport.has_draft
    out3 = gen.generate(ids, max_new_tokens=40, do_sample=False, return_dict_in_generate=True)
    gen.close()
    assert torch.equal(out3.sequences, want)
    assert any(r.drafted_depth > 0 for r in out3.spec_stats.rounds) and not out3.spec_stats.draft_fallback


def test_draft_never_reachable_falls_back_to_target_only(workers, reference) -> None:
    target, _ = workers
    ids, want = reference
    dead = "127.0.0.1:1"  # nothing listens on port 1
    with SpecSplitGenerator(
        config=SpecSplitConfig(transport="grpc", tree=TREE, target_address=target.address, draft_address=dead)
    ) as gen:
        out = gen.generate(ids, max_new_tokens=40, do_sample=False, return_dict_in_generate=True)
        assert torch.equal(out.sequences, want)
        assert out.spec_stats.draft_fallback and not gen.transport.has_draft


def test_unreachable_target_raises_transport_error_within_deadline() -> None:
    t0 = time.monotonic()
    with GrpcTransport("127.0.0.1:1", timeout_s=1.5) as transport:
        req = VerifyRequest("s", TokenTree.empty(), [1, 2, 3], 0)
        with pytest.raises(TransportError, match="UNAVAILABLE"):
            transport.verify(req)
        transport.end_session("s")  # never raises
    assert time.monotonic() - t0 < 10
    transport.close()  # idempotent
    with pytest.raises(TransportError, match="closed"):
        transport.verify(req)


def test_abandoned_session_expires_on_the_worker(model_dirs) -> None:
    """A client that dies mid-generation never calls EndSession: the worker's TTL frees the session."""
    from specsplit.config import TargetConfig
    from specsplit.remote import serve_target

    engine = TargetEngine(load_saved(model_dirs[0]), TargetConfig(session_ttl_s=0.5))
    with serve_target(engine) as server, GrpcTransport(f"127.0.0.1:{server.port}", timeout_s=10) as client:
        client.verify(VerifyRequest("abandoned", TokenTree.empty(), [5, 6, 7], 0))
        assert client.info()["target"].active_sessions == 1
        assert wait_until(lambda: client.info()["target"].active_sessions == 0, timeout=10)
    engine.shutdown()
