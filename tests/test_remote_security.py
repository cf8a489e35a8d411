"""Remote mode security: TLS with a certificate made in the test, and the bearer token.

The target runs as a CLI subprocess (``--tls-cert --tls-key --auth-token-file``); the draft is
served in-process through :func:`specsplit.remote.serve_draft` with the same settings.
"""

from __future__ import annotations

import datetime
import ipaddress
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

pytest.importorskip("grpc")

from remote_support import VOCAB, Worker, load_saved, save_pair, start_all  # noqa: E402

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
from specsplit.remote import GrpcTransport, serve_draft  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # one torch thread, as the workers run

TOKEN = "s3cret-token-for-tests"
TREE = TreeConfig(shape="chain", num_draft_tokens=4)


def make_cert(directory: Path, name: str = "worker") -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1/localhost (``cryptography`` if installed, else openssl)."""
    cert, key = directory / f"{name}.pem", directory / f"{name}.key"
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:
        if shutil.which("openssl") is None:
            pytest.skip("neither the cryptography package nor the openssl CLI is available")
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
             "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
            check=True, capture_output=True,
        )  # fmt: skip
        return cert, key
    pk = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    crt = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(pk.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(pk, hashes.SHA256())
    )
    cert.write_bytes(crt.public_bytes(serialization.Encoding.PEM))
    key.write_bytes(
        pk.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return cert, key


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("secure")
    target_dir, draft_dir = save_pair(root)
    cert, key = make_cert(root)
    token_file = root / "token"
    token_file.write_text(TOKEN + "\n")
    (target,) = start_all(
        [
            Worker(
                "target",
                target_dir,
                ["--tls-cert", str(cert), "--tls-key", str(key), "--auth-token-file", str(token_file)],
            )
        ]  # fmt: skip
    )
    draft_engine = DraftEngine(load_saved(draft_dir))
    draft = serve_draft(draft_engine, tls=(cert, key), auth_token=TOKEN)
    engines = DraftEngine(load_saved(draft_dir)), TargetEngine(load_saved(target_dir))
    yield {"target": target, "draft": draft, "cert": cert, "root": root, "engines": engines}
    draft.stop(grace=1.0, shutdown_engine=True)
    assert target.terminate() == 0


def _transport(setup: dict, **kwargs) -> GrpcTransport:
    args = {"auth_token": TOKEN, "tls_ca_file": setup["cert"], "timeout_s": 30.0} | kwargs
    return GrpcTransport(setup["target"].address, f"127.0.0.1:{setup['draft'].port}", **args)


def test_tls_and_token_generation_matches_local(setup) -> None:
    ids = torch.randint(3, VOCAB, (1, 10), generator=torch.Generator().manual_seed(2))
    ref = SpecSplitGenerator(transport=LocalTransport(*setup["engines"]), config=SpecSplitConfig(tree=TREE))
    want = ref.generate(ids, max_new_tokens=24, do_sample=False, return_dict_in_generate=True)
    with SpecSplitGenerator(transport=_transport(setup), config=SpecSplitConfig(tree=TREE)) as gen:
        out = gen.generate(ids, max_new_tokens=24, do_sample=False, return_dict_in_generate=True)
        info = gen.transport.info()
    assert torch.equal(out.sequences, want.sequences)
    assert out.spec_stats.accepted_counts() == want.spec_stats.accepted_counts()
    assert not out.spec_stats.draft_fallback
    assert set(info) == {"target", "draft"}


def test_config_and_env_select_tls_and_token(setup, monkeypatch) -> None:
    monkeypatch.setenv("SPECSPLIT_TRANSPORT", "grpc")
    monkeypatch.setenv("SPECSPLIT_TARGET_ADDRESS", setup["target"].address)
    monkeypatch.setenv("SPECSPLIT_AUTH_TOKEN", TOKEN)
    monkeypatch.setenv("SPECSPLIT_TLS_CA_FILE", str(setup["cert"]))
    cfg = SpecSplitConfig.from_env()
    with SpecSplitGenerator(config=cfg) as gen:
        assert isinstance(gen.transport, GrpcTransport)
        assert gen.transport.info()["target"].worker_type == "target"


@pytest.mark.parametrize("token", [None, "wrong-token", TOKEN + "x"])
def test_calls_without_the_right_token_are_rejected(setup, token: str | None) -> None:
    with _transport(setup, auth_token=token) as transport:
        with pytest.raises(TransportError, match="UNAUTHENTICATED"):
            transport.info()
        with pytest.raises(TransportError, match="UNAUTHENTICATED"):
            transport.draft(DraftRequest("s", [1, 2, 3], 0, tree=TREE))


def test_plaintext_client_cannot_talk_to_a_tls_worker(setup) -> None:
    with GrpcTransport(setup["target"].address, auth_token=TOKEN, timeout_s=2.0) as transport:
        with pytest.raises(TransportError):
            transport.info()


def test_untrusted_certificate_is_refused(setup) -> None:
    other, _ = make_cert(setup["root"], "other")
    with _transport(setup, tls_ca_file=other, timeout_s=2.0) as transport:
        with pytest.raises(TransportError):
            transport.info()


def test_health_service_when_available(setup) -> None:
    health = pytest.importorskip("grpc_health.v1.health_pb2")
    import grpc
    from grpc_health.v1 import health_pb2_grpc

    creds = grpc.ssl_channel_credentials(setup["cert"].read_bytes())
    with grpc.secure_channel(setup["target"].address, creds) as ch:  # no token: health stays open
        resp = health_pb2_grpc.HealthStub(ch).Check(health.HealthCheckRequest(service=""), timeout=10)
    assert resp.status == health.HealthCheckResponse.SERVING
