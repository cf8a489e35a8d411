"""``specsplit serve draft|target``: run one engine as a gRPC worker.

Prints exactly one line ``READY <port>`` to stdout once the worker accepts calls (scripts and tests
wait for it; with ``--port 0`` it names the port picked). SIGTERM and SIGINT stop the worker
gracefully: new calls are refused, in-flight ones get ``--grace`` seconds to finish.

Safe by default: the worker binds 127.0.0.1; binding any other interface needs TLS and a token
(``--tls-cert/--tls-key`` and ``--auth-token-file``) unless ``--insecure`` says otherwise.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specsplit.cli.common import (
    add_draft_flags,
    add_drafter_flag,
    add_engine_flags,
    add_heads_flags,
    add_tuning_flags,
    check_engine_flags,
    draft_overrides,
    engine_overrides,
    heads_overrides,
    lookahead_overrides,
)

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


def add_cli(sub: argparse._SubParsersAction) -> None:
    """Register ``serve`` on the ``specsplit`` command line."""
    p = sub.add_parser("serve", help="serve a draft or target model as a gRPC worker")
    p.add_argument("role", choices=["draft", "target"], help="which engine to run")
    p.add_argument("--model", required=True, help="alias, local directory or HF id")
    p.add_argument("--port", type=int, default=50051, help="TCP port (0 picks a free one)")
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="interface to bind (default 127.0.0.1; any other needs TLS and a token, or --insecure)",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        help="allow a non-loopback --host without TLS or without a token (anyone who reaches the port "
        "can use the worker and read its traffic)",
    )
    p.add_argument("--device", default=None, help="torch device, e.g. cuda:0 (default: cuda:0 or cpu)")
    add_engine_flags(p)
    add_draft_flags(p)
    p.add_argument("--tls-cert", default=None, help="PEM certificate chain (enables TLS, needs --tls-key)")
    p.add_argument("--tls-key", default=None, help="PEM private key")
    p.add_argument(
        "--auth-token-file",
        default=None,
        help="file holding the bearer token clients must send, or one 'name:token' line per client "
        "(each client's sessions are its own); or set SPECSPLIT_AUTH_TOKEN",
    )
    p.add_argument("--max-sessions", type=int, default=None, help="most live sessions (default 64)")
    p.add_argument("--session-ttl", type=float, default=None, help="seconds before an idle session expires")
    p.add_argument(
        "--max-sessions-per-client",
        type=int,
        default=None,
        help="live sessions one named client may hold (default: all, or half with several clients)",
    )
    p.add_argument(
        "--evict-idle",
        type=float,
        default=30.0,
        help="a full worker evicts only sessions idle this many seconds; new sessions are refused otherwise",
    )
    p.add_argument("--max-workers", type=int, default=8, help="calls served at once (streams included)")
    p.add_argument(
        "--max-queued", type=int, default=None, help="calls waiting for a slot (default: --max-workers)"
    )
    p.add_argument(
        "--max-calls-per-client",
        type=int,
        default=None,
        help="calls one named client may have open (default: all, or half with several clients)",
    )
    p.add_argument(
        "--compute-slots",
        type=int,
        default=None,
        help="engine calls (or rounds of generations run here) at once, shared fairly between clients "
        "(default: 2 on a GPU, 1 on a CPU)",
    )
    p.add_argument("--queue-timeout", type=float, default=10.0, help="seconds a queued call waits for a slot")
    p.add_argument(
        "--stream-idle-timeout",
        type=float,
        default=60.0,
        help="seconds before an idle request stream is closed",
    )
    p.add_argument(
        "--kv-budget-mb",
        type=float,
        default=None,
        help="KV cache all sessions may hold (default: 80%% of the GPU memory free after loading, or half "
        "the host's available memory); sessions past it are refused",
    )
    p.add_argument("--max-message-mb", type=float, default=16.0, help="largest request or response")
    p.add_argument("--max-tree-nodes", type=int, default=256, help="largest tree accepted")
    p.add_argument("--max-tree-depth", type=int, default=64, help="deepest tree accepted")
    p.add_argument(
        "--max-tree-work",
        type=int,
        default=65536,
        help="most nodes x depth x width a requested tree may cost",
    )
    p.add_argument("--max-context", type=int, default=32768, help="most tokens one session may hold")
    p.add_argument("--grace", type=float, default=5.0, help="seconds in-flight calls get on shutdown")
    p.add_argument(
        "--draft-address",
        default=None,
        help="target: host:port of the draft worker this worker calls when it runs a client's rounds "
        "(clients with grpc_loop='target': one network hop a round instead of two)",
    )
    add_drafter_flag(
        p,
        "target: what drafts the rounds this worker runs (clients with grpc_loop='target') when a "
        "request names none: the draft worker's model (default), or n-gram drafting on this worker itself "
        "(ngram, suffix: no draft worker needed), or both (hybrid, auto)",
    )
    add_heads_flags(p)
    p.add_argument(
        "--max-batch",
        type=int,
        default=0,
        help="rows a batched forward holds. Target: concurrent Generate calls (grpc_loop='target') "
        "share one target forward per round (continuous batching; with --draft-address a greedy "
        "model-drafted call drafts on the draft worker only while it is the only generation), and "
        "greedy client-loop sessions' VerifyDrafts calls are verified together. Draft: greedy "
        "client-loop sessions' chain drafts are drafted together. 0 (default): each call runs its "
        "own rounds",
    )
    p.add_argument(
        "--batch-capacity",
        type=int,
        default=4096,
        help="with --max-batch: positions (prompt + new tokens) a batched row or session may need; longer "
        "generations run their own rounds",
    )
    p.add_argument(
        "--draft-timeout",
        type=float,
        default=None,
        help="target: deadline in seconds of each call to the draft worker (default 60). A call past it "
        "makes the round target-only and the draft worker is probed again later; raise it when the "
        "draft worker compiles (--compile) new shapes on first use, which can take longer",
    )
    p.add_argument(
        "--draft-auth-token-file",
        default=None,
        help="target: file holding the draft worker's bearer token (or set SPECSPLIT_DRAFT_AUTH_TOKEN)",
    )
    p.add_argument(
        "--draft-tls-ca", default=None, help="target: PEM CA of the draft worker's TLS certificate"
    )
    p.add_argument(
        "--specpv", action="store_true", help="target: SpecPV partial verification for long contexts (lossy)"
    )
    p.add_argument("--specpv-threshold", type=int, default=None, help="target: SpecPV from this many tokens")
    p.add_argument("--specpv-retrieval-blocks", type=int, default=None, help="target: SpecPV blocks/KV head")
    p.add_argument(
        "--specpv-retrieval-refresh",
        type=int,
        default=None,
        help="target: SpecPV re-selects retrieved blocks every N partial steps (experimental)",
    )
    p.add_argument(
        "--specpv-query-window", type=int, default=None, help="target: SpecPV re-selection query window"
    )
    p.add_argument(
        "--specpv-rectify-margin",
        type=float,
        default=None,
        help="target: SpecPV verifies a round in full when a partial step decides a token by a smaller logit margin",
    )
    add_tuning_flags(p)
    g = next(g for g in p._action_groups if g.title == "tuning")
    g.add_argument(
        "--grpc-streams",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="target: call the draft worker over one long-lived gRPC stream (default on; about half a "
        "unary call's latency); --no-grpc-streams: one unary call a round",
    )
    g.add_argument(
        "--tree-ipc",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="with the two workers on one host's CUDA GPUs, pass each round's tree through the draft worker's "
        "GPU memory (CUDA IPC) instead of its reply (default on; falls back to replies where it cannot); "
        "--no-tree-ipc on either worker: trees always travel in replies",
    )
    p.set_defaults(func=_cmd_serve)


def _read_token(file: str | None, env: str, flag: str) -> str | None:
    """A single token from ``file`` or the environment variable ``env``, trimmed alike."""
    from specsplit.errors import ConfigError

    if file:
        path = Path(file)
        if not path.is_file():
            raise ConfigError(f"{flag} {path} does not exist")
        token = path.read_text().strip()
        if not token:
            raise ConfigError(f"{flag} {path} is empty")
        return token
    return (os.environ.get(env) or "").strip() or None


def _client_tokens(file: str | None) -> Any:
    """The worker's accepted tokens: ``--auth-token-file`` (one token or named clients) or
    ``SPECSPLIT_AUTH_TOKEN``; ``None`` when neither is set."""
    from specsplit.remote.clients import ClientTokens

    if file:
        return ClientTokens.from_file(file)
    token = _read_token(None, "SPECSPLIT_AUTH_TOKEN", "--auth-token-file")
    return ClientTokens.single(token) if token else None


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps the worker reachable from this machine only."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, tls: bool, token: bool, insecure: bool) -> None:
    """Refuse a non-loopback bind without TLS and a token unless ``--insecure``."""
    from specsplit.errors import ConfigError

    if is_loopback(host) or (tls and token) or insecure:
        if not is_loopback(host) and not (tls and token):
            logger.warning("serving on %s without %s (--insecure)", host, "TLS" if not tls else "a token")
        return
    missing = " and ".join(
        w for w, ok in (("TLS (--tls-cert/--tls-key)", tls), ("a token (--auth-token-file)", token)) if not ok
    )
    raise ConfigError(
        f"--host {host} exposes the worker beyond this machine without {missing}; "
        "add them, bind 127.0.0.1, or pass --insecure"
    )


def _int8_note(model: torch.nn.Module | None) -> str:
    """``", int8 weights (<kernel>)"`` for a model whose linear layers run in int8, else ``""``."""
    from specsplit.runtime.int8 import Int8Linear

    layers = (m for m in model.modules() if isinstance(m, Int8Linear)) if model is not None else iter(())
    first = next(layers, None)
    return f", int8 weights ({first.kernel})" if first is not None else ""


def _load(args: argparse.Namespace, cfg: Any) -> torch.nn.Module:
    """The worker's model, loaded here; unless told otherwise a draft's weights become int8 and a
    target's get packed where that pays on a CPU, as the engines do with the models they load
    themselves."""
    from specsplit.models import load_model
    from specsplit.runtime.int8 import wants_int8
    from specsplit.runtime.packed import packable
    from specsplit.runtime.runner import default_device, resolve_dtype

    device = args.device or str(default_device())
    model = load_model(args.model, dtype=resolve_dtype(args.dtype or "auto", device), device=device)
    if getattr(cfg, "quantize", "none") == "auto":
        busy = bool(cfg.fuse_projections or cfg.compile or cfg.pack_weights)
        cfg.quantize = "int8" if wants_int8("auto", model, excluded=busy) else "none"
    if cfg.pack_weights is None and not cfg.fuse_projections and not cfg.compile:
        cfg.pack_weights = packable(model) and getattr(cfg, "quantize", "none") != "int8"
    return model


def specpv_config(args: argparse.Namespace) -> Any:
    """The target's ``SpecPVConfig`` from the ``--specpv*`` options (defaults where not given)."""
    from specsplit.config import SpecPVConfig

    given = {
        "partial_threshold": args.specpv_threshold,
        "n_retrieval_blocks": args.specpv_retrieval_blocks,
        "retrieval_refresh_interval": args.specpv_retrieval_refresh,
        "retrieval_query_window": args.specpv_query_window,
        "rectify_margin": args.specpv_rectify_margin,
    }
    return SpecPVConfig(enabled=args.specpv, **{k: v for k, v in given.items() if v is not None})


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine-config fields both roles take from ``serve``'s flags (``tuning`` as a dict)."""
    common = engine_overrides(args)
    if args.max_sessions is not None:
        common["max_sessions"] = args.max_sessions
    if args.session_ttl is not None:
        common["session_ttl_s"] = args.session_ttl
    return common


def _cmd_serve(args: argparse.Namespace) -> int:
    from specsplit.config import BATCH_LIMIT, DraftConfig, NgramConfig, TargetConfig
    from specsplit.errors import ConfigError
    from specsplit.remote.admission import AdmissionLimits
    from specsplit.remote.server import ServerLimits
    from specsplit.remote.worker import serve_draft, serve_target

    if (args.tls_cert is None) != (args.tls_key is None):
        raise ConfigError("--tls-cert and --tls-key go together")
    check_engine_flags(args)
    tls = (args.tls_cert, args.tls_key) if args.tls_cert else None
    token = _client_tokens(args.auth_token_file)
    check_exposure(args.host, tls is not None, token is not None, args.insecure)
    try:
        admission = AdmissionLimits(
            max_calls=args.max_workers,
            max_queued=args.max_workers if args.max_queued is None else args.max_queued,
            max_calls_per_client=args.max_calls_per_client,
            queue_timeout_s=args.queue_timeout,
            compute_slots=args.compute_slots,
            stream_idle_s=args.stream_idle_timeout,
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None
    draft_peer: dict[str, Any] = {}
    if args.role == "draft" and (
        args.draft_address
        or args.draft_auth_token_file
        or args.draft_tls_ca
        or args.grpc_streams is not None
        or args.draft_timeout is not None
        or args.drafter is not None
        or args.lookahead is not None
    ):
        raise ConfigError(
            "--draft-address, --draft-auth-token-file, --draft-tls-ca, --draft-timeout, --drafter, "
            "--lookahead and --[no-]grpc-streams are target options"
        )
    if args.role == "target" and draft_overrides(args):
        raise ConfigError("--draft-quantize, --draft-vocab and --draft-vocab-ranking are draft options")
    if args.draft_timeout is not None and args.draft_timeout <= 0:
        raise ConfigError(f"--draft-timeout must be > 0, got {args.draft_timeout}")
    if args.drafter is not None:
        draft_peer["drafter"] = args.drafter
    if args.lookahead is not None:
        draft_peer["ngram"] = NgramConfig(**lookahead_overrides(args.lookahead))
    if args.max_batch:
        if not 0 <= args.max_batch <= BATCH_LIMIT or args.batch_capacity < 16:
            raise ConfigError(f"--max-batch must be in 0..{BATCH_LIMIT} and --batch-capacity >= 16")
        draft_peer |= {"max_batch": args.max_batch, "batch_capacity": args.batch_capacity}
    if args.draft_address:
        draft_peer |= {
            "draft_address": args.draft_address,
            "draft_auth_token": _read_token(
                args.draft_auth_token_file, "SPECSPLIT_DRAFT_AUTH_TOKEN", "--draft-auth-token-file"
            ),
            "draft_tls_ca_file": args.draft_tls_ca,
            "draft_streams": args.grpc_streams is not False,
            "tree_slots": args.tree_ipc is not False,
        }
        if args.draft_timeout is not None:
            draft_peer["draft_timeout_s"] = args.draft_timeout
    common = engine_options(args)
    limits = ServerLimits(
        max_message_bytes=int(args.max_message_mb * 1024 * 1024),
        max_tree_nodes=args.max_tree_nodes,
        max_tree_depth=args.max_tree_depth,
        max_context=args.max_context,
        max_tree_work=args.max_tree_work,
        kv_budget_bytes=None if args.kv_budget_mb is None else int(args.kv_budget_mb * 2**20),
        max_sessions_per_client=args.max_sessions_per_client,
        evict_idle_s=args.evict_idle,
    )
    engine: object
    if args.role == "draft":
        from specsplit.engines.draft import DraftEngine

        dcfg = DraftConfig(model=args.model, device=args.device, **common, **draft_overrides(args))
        engine = DraftEngine(_load(args, dcfg), config=dcfg)
    else:
        from specsplit.engines.target import TargetEngine

        pv = specpv_config(args)
        tcfg = TargetConfig(
            specpv=pv,
            model=args.model,
            device=args.device,
            max_tree_nodes=args.max_tree_nodes,
            max_tree_depth=args.max_tree_depth,
            max_context=args.max_context,
            **heads_overrides(args),
            **common,
        )
        engine = TargetEngine(_load(args, tcfg), config=tcfg)
    if args.role == "draft":
        batching = {k: v for k, v in draft_peer.items() if k in ("max_batch", "batch_capacity")}
        server = serve_draft(engine, port=args.port, host=args.host, max_workers=args.max_workers, tls=tls,
                             auth_token=token, limits=limits, admission=admission,
                             tree_slots=args.tree_ipc is not False, **batching)  # fmt: skip
    else:
        server = serve_target(engine, port=args.port, host=args.host, max_workers=args.max_workers, tls=tls,
                              auth_token=token, limits=limits, admission=admission, **draft_peer)  # fmt: skip

    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        logger.info("received %s; shutting down", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    info = engine.info()  # type: ignore[attr-defined]
    runner = getattr(engine, "runner", None)
    head = getattr(runner, "head", None)
    scored = f", drafts from the {head.ids.numel()} best-ranked tokens" if head is not None else ""
    scored += _int8_note(getattr(runner, "model", None))
    print(f"READY {server.port}", flush=True)
    print(
        f"[specsplit] {args.role} worker: {info.model_name} ({info.dtype}, {info.device}, vocab "
        f"{info.vocab_size}{scored}) on {args.host}:{server.port}{' with TLS' if tls else ''}"
        f"{f', {len(token.names)} client token(s) required' if token else ''}"
        f"{f', runs rounds with the draft worker at {args.draft_address}' if args.draft_address else ''}",
        file=sys.stderr,
        flush=True,
    )
    while not stop.wait(0.5):
        pass
    server.stop(grace=args.grace, shutdown_engine=True)
    return 0
