"""Loud and self-healing faults, and safe defaults.

A target worker with a wrong draft token fails at start; a draft worker that comes back is used
again within seconds without anyone asking; a generation whose rounds run on the target worker
survives that worker's restart with identical output; tokens from the environment are trimmed;
``specsplit serve`` binds loopback and refuses an open non-loopback bind. Loopback only.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("grpc")

from remote_support import VOCAB, Worker, load_saved, start_all, wait_until  # noqa: E402

from specsplit import (  # noqa: E402
    DraftEngine,
    DraftRequest,
    LocalTransport,
    SpecSplitConfig,
    SpecSplitGenerator,
    TargetEngine,
    TransportError,
    TreeConfig,
)
from specsplit.errors import ConfigError  # noqa: E402
from specsplit.remote import GrpcTransport, serve_draft, serve_target  # noqa: E402
from specsplit.remote.client import AuthenticationError  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

TREE = TreeConfig(shape="chain", num_draft_tokens=4)


def test_a_target_worker_with_a_wrong_draft_token_fails_at_start(engines) -> None:
    draft, target = engines
    with serve_draft(draft, auth_token="right-token") as d:
        t0 = time.monotonic()
        with pytest.raises(ConfigError, match="refused this target worker's token"):
            serve_target(target, draft_address=d.address, draft_auth_token="wrong-token")
        assert time.monotonic() - t0 < 10
        with serve_target(target, draft_address=d.address, draft_auth_token="right-token\n"):
            pass  # the right token (trimmed like a token file) starts


def test_a_target_worker_starts_while_its_draft_worker_is_down(engines, caplog) -> None:
    _, target = engines
    with serve_target(target, draft_address="127.0.0.1:1", draft_timeout_s=2.0) as t:
        assert t.port
    assert any("does not answer yet" in r.getMessage() for r in caplog.records)


def test_a_returning_draft_worker_is_used_again_within_seconds(engines) -> None:
    draft, _ = engines
    first = serve_draft(draft)
    port = first.port
    client = GrpcTransport(None, f"127.0.0.1:{port}", timeout_s=5, draft_retry_interval_s=3600)
    req = DraftRequest("s", [5, 6, 7], 0, tree=TREE)
    client.draft(req)
    first.stop(grace=0)
    with pytest.raises(TransportError):
        client.draft(req)
    assert not client.has_draft
    time.sleep(1.0)
    second = serve_draft(draft, port=port)
    try:
        t0 = time.monotonic()
        # Nothing calls has_draft's own probe (its interval is an hour): the background probe finds it.
        assert wait_until(client._draft_up, timeout=8.0)
        assert time.monotonic() - t0 < 5.0
        assert client.has_draft
        client.draft(req)
    finally:
        client.close()
        second.stop(grace=0)


def test_check_draft_reports_a_wrong_token_as_authentication_error(engines) -> None:
    draft, _ = engines
    with serve_draft(draft, auth_token="right") as d:
        with GrpcTransport(None, d.address, auth_token="wrong", timeout_s=5) as c:
            with pytest.raises(AuthenticationError):
                c.check_draft(5.0)
        with GrpcTransport(None, d.address, auth_token=" right\n", timeout_s=5) as c:
            assert c.check_draft(5.0).worker_type == "draft"


@pytest.fixture(scope="module")
def reference(model_dirs: tuple[Path, Path]):
    target_dir, draft_dir = model_dirs
    engines = DraftEngine(load_saved(draft_dir)), TargetEngine(load_saved(target_dir))
    gen = SpecSplitGenerator(transport=LocalTransport(*engines), config=SpecSplitConfig(tree=TREE))
    ids = torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(5))
    return ids, gen.generate(ids, max_new_tokens=40, do_sample=False)


class KillAfter:
    """A streamer that restarts ``worker`` (SIGKILL, same port) after ``rounds`` rounds."""

    def __init__(self, worker: Worker, rounds: int):
        self.worker, self.rounds, self.seen = worker, rounds, -1  # the first put is the prompt
        self.ready: list[BaseException | None] = []

    def put(self, tokens: torch.Tensor) -> None:
        self.seen += 1
        if self.seen == self.rounds:
            self.worker.kill()
            self.worker.start()

            def wait() -> None:
                try:
                    self.worker.wait_ready()
                    self.ready.append(None)
                except BaseException as e:  # noqa: BLE001
                    self.ready.append(e)

            threading.Thread(target=wait, daemon=True).start()

    def end(self) -> None:
        pass


def test_target_loop_generation_survives_a_target_restart(model_dirs, reference) -> None:
    target_dir, draft_dir = model_dirs
    ids, want = reference
    (drafter,) = start_all([Worker("draft", draft_dir)])
    target = Worker("target", target_dir, ["--draft-address", drafter.address])
    start_all([target])
    try:
        cfg = SpecSplitConfig(transport="grpc", grpc_loop="target", tree=TREE, target_address=target.address,
                              draft_address=drafter.address, timeout_s=120.0)  # fmt: skip
        with SpecSplitGenerator(config=cfg) as gen:
            killer = KillAfter(target, rounds=3)
            out = gen.generate(ids, max_new_tokens=40, do_sample=False, streamer=killer,
                               return_dict_in_generate=True)  # fmt: skip
            assert killer.ready == [None]
            assert torch.equal(out.sequences, want)
            assert out.spec_stats.recoveries >= 1
    finally:
        for w in (target, drafter):
            w.kill()


def test_env_tokens_are_trimmed_like_token_files(monkeypatch) -> None:
    from specsplit.cli.serve import _client_tokens, _read_token

    monkeypatch.setenv("SPECSPLIT_AUTH_TOKEN", "  tok-123\n")
    assert _read_token(None, "SPECSPLIT_AUTH_TOKEN", "--auth-token-file") == "tok-123"
    assert _client_tokens(None).identify("Bearer tok-123") == "default"
    monkeypatch.setenv("SPECSPLIT_AUTH_TOKEN", " \n")
    assert _client_tokens(None) is None


def test_serve_binds_loopback_and_refuses_an_open_public_bind() -> None:
    from specsplit.cli import build_parser
    from specsplit.cli.serve import check_exposure

    args = build_parser().parse_args(["serve", "target", "--model", "m"])
    assert args.host == "127.0.0.1" and not args.insecure
    for host in ("127.0.0.1", "localhost", "::1", "[::1]"):
        check_exposure(host, tls=False, token=False, insecure=False)
    for tls, token in ((False, False), (True, False), (False, True)):
        with pytest.raises(ConfigError, match="--insecure"):
            check_exposure("0.0.0.0", tls=tls, token=token, insecure=False)
    check_exposure("0.0.0.0", tls=True, token=True, insecure=False)
    check_exposure("0.0.0.0", tls=False, token=False, insecure=True)


def test_serve_cli_refuses_an_open_public_bind_before_loading_a_model(tmp_path: Path, capsys) -> None:
    from specsplit.cli import main

    missing = tmp_path / "no-model-here"
    assert main(["serve", "target", "--model", str(missing), "--host", "0.0.0.0", "--port", "0"]) != 0
    assert "--insecure" in capsys.readouterr().err
