"""Configuration dataclasses, validated on construction, with ``SPECSPLIT_*`` environment overrides.

Environment variables map onto fields by name: a top-level field ``foo`` is ``SPECSPLIT_FOO``, a
field ``bar`` of the section ``draft``/``target``/``tree`` is ``SPECSPLIT_DRAFT_BAR`` and so on
(e.g. ``SPECSPLIT_TRANSPORT=grpc``, ``SPECSPLIT_DRAFT_ADDRESS=10.0.0.5:50051``,
``SPECSPLIT_TREE_SHAPE=dynamic``, ``SPECSPLIT_TARGET_DEVICE=cuda:1``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from specsplit.core.tree import (
    DEFAULT_STATIC_PATHS,
    StaticTreePlan,
    chain_plan,
    dynamic_level_widths,
    static_plan_from_paths,
)
from specsplit.engines.partial_kv import SpecPVConfig
from specsplit.errors import ConfigError

TreeShape = Literal["chain", "static", "dynamic"]
_DTYPES = ("auto", "float32", "float16", "bfloat16")


@dataclass
class SamplingParams:
    """How tokens are chosen; ONE definition used by the draft, the target and the pipeline.

    ``top_k=0`` and ``top_p=1.0`` disable those filters. With ``do_sample=False`` the output is
    the target's greedy decoding and the other fields are ignored.
    """

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.do_sample and not self.temperature > 0:
            raise ConfigError(f"temperature must be > 0 when sampling, got {self.temperature}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass
class TreeConfig:
    """Shape of the draft tree.

    Attributes:
        shape: ``"chain"`` (K tokens in a line), ``"static"`` (fixed Medusa-style paths) or
            ``"dynamic"`` (EAGLE-2 style: expand the top-k children of the most probable frontier
            nodes by cumulative draft probability, within ``budget`` nodes and ``max_depth``).
        num_draft_tokens: chain length K.
        paths: static tree paths; ``None`` uses :data:`specsplit.core.tree.DEFAULT_STATIC_PATHS`.
        topk: dynamic tree: children proposed per expanded node.
        width: dynamic tree: frontier nodes expanded per level.
        budget: dynamic tree: maximum number of nodes.
        max_depth: dynamic tree: maximum depth.
    """

    shape: TreeShape = "chain"
    num_draft_tokens: int = 4
    paths: list[list[int]] | None = None
    topk: int = 4
    width: int = 4
    budget: int = 24
    max_depth: int = 6

    def __post_init__(self) -> None:
        if self.shape not in ("chain", "static", "dynamic"):
            raise ConfigError(f"tree shape must be 'chain', 'static' or 'dynamic', got {self.shape!r}")
        if self.num_draft_tokens < 0:
            raise ConfigError(f"num_draft_tokens must be >= 0, got {self.num_draft_tokens}")
        for name in ("topk", "width", "budget", "max_depth"):
            if getattr(self, name) < 1:
                raise ConfigError(f"tree.{name} must be >= 1, got {getattr(self, name)}")
        if self.shape == "static":
            try:
                self.static_plan()
            except ValueError as e:
                raise ConfigError(f"invalid static tree paths: {e}") from None

    def static_plan(self) -> StaticTreePlan:
        """The fixed plan for ``chain``/``static`` shapes."""
        if self.shape == "chain":
            return chain_plan(self.num_draft_tokens)
        if self.shape == "static":
            return static_plan_from_paths(self.paths if self.paths is not None else DEFAULT_STATIC_PATHS)
        raise ConfigError("a dynamic tree has no static plan")

    @property
    def max_nodes(self) -> int:
        """Upper bound on the node count (sizes caches and the verify budget)."""
        if self.shape == "dynamic":
            return self.budget
        return self.static_plan().num_nodes

    @property
    def draft_slots(self) -> int:
        """Cache slots a draft round may write past the committed context: the tree's nodes, or for
        a dynamic tree every forwarded frontier node when that is more than the budget."""
        if self.shape == "dynamic":
            return max(self.budget, sum(dynamic_level_widths(self.topk, self.width, self.max_depth)))
        return self.max_nodes

    @property
    def depth_limit(self) -> int:
        if self.shape == "dynamic":
            return self.max_depth
        return self.static_plan().depth


@dataclass
class DraftConfig:
    """Draft model and engine settings.

    Attributes:
        model: HF id, local directory or alias of the draft model (``None`` in remote mode).
        device: torch device, e.g. ``"cuda:0"``; ``None`` picks cuda:0 if present, else CPU.
        dtype: ``"auto"`` (bf16 on GPU, fp32 on CPU), ``"float32"``, ``"float16"``, ``"bfloat16"``.
        q_top_k: when sampling, the draft samples from its top-``q_top_k`` tokens (renormalised) so
            the distribution it drew from is exact and small enough to send sparsely.
        max_sessions: LRU bound on live sessions.
        session_ttl_s: idle sessions older than this are purged.
        cuda_graphs: run fixed-shape steps (padded ingest, tree levels) over a static workspace
            cache and replay them from CUDA graphs (on CPU the same static path runs eagerly).
        graph_capacity: slots of that workspace (the longest session it serves).
        compile: fuse the static-path forward with ``torch.compile`` (Inductor, default mode)
            before it is captured: fewer, larger kernels per layer. The first calls compile (tens
            of seconds on a GPU host); experimental, off by default.
        graph_rounds: with ``cuda_graphs``, a dynamic tree's whole growth (every level's forward
            and the top-k selection between them) is captured as ONE graph per tree shape and KV
            bucket, instead of one graph per level with eager selection ops in between.
        fuse_projections: rewrite the model's Llama/Qwen2 layers (in place, for every caller) to
            compute q/k/v with one GEMM and gate/up with one (:mod:`specsplit.runtime.fused`): fewer,
            larger kernels per layer at batch 1; same weights, no extra memory. Off by default.
        fold_gqa: tree forwards of a GQA model attend with the group folded into the query rows,
            reading K/V once per KV head instead of copying them to every query head
            (:mod:`specsplit.runtime.attention`; same attention, other kernels). Off: transformers' SDPA.
        attention_kernel: ``"math"``: tree forwards attend through the folded matmul kernel at
            every prefix length (under CUDA graphs at short prefixes: fewer kernels a layer, no K/V
            copy per query head, no cuDNN memset; on an H100 it cut the GPU time of a dynamic-tree
            round by 6% and of a target step by 7%, ``benchmarks/results/tree_sweep-h100-*``);
            ``"sdpa"``: transformers' SDPA below 2,048 cached tokens, the folded kernels above;
            ``"auto"`` (default): ``"math"`` with ``cuda_graphs``, else ``"sdpa"``.
        prefill_graphs: with ``cuda_graphs``, a prompt's forward (any ingest longer than a
            round's) runs over the static workspace padded to a bucket of 64, 128, 192, 256, 384,
            ... 8192 tokens (:data:`specsplit.runtime.graphs.PREFILL_BUCKETS`) and replays one CUDA graph
            per bucket, captured on first use with the plain (never ``torch.compile``-d) step.
            Eager PyTorch spends tens of microseconds of host time per op on such a forward, so
            at batch 1 the host, not the GPU, sets a prompt's cost. Exact (tests compare it with
            the eager path). Prompts that do not fit the workspace's free slots run eagerly. On
            by default (ignored without ``cuda_graphs``): on an H200 it cut a prompt's first
            round from 73 to 25 ms (draft and target, 64-227 tokens) and, side by side in one
            bench run, raised target-only decoding by 6% and dynamic-tree decoding by 14%
            (``benchmarks/results/h200-2026-11-27-prefill-ab.md``). False: eager prompt forwards.
        max_tree_nodes / max_tree_depth / max_context: limits a request may not exceed.
    """

    model: str | None = None
    device: str | None = None
    dtype: str = "auto"
    q_top_k: int = 32
    max_sessions: int = 64
    session_ttl_s: float = 600.0
    cuda_graphs: bool = False
    graph_capacity: int = 2048
    compile: bool = False
    graph_rounds: bool = True
    fuse_projections: bool = False
    fold_gqa: bool = True
    attention_kernel: str = "auto"
    prefill_graphs: bool = True
    max_tree_nodes: int = 256
    max_tree_depth: int = 64
    max_context: int = 32768

    def __post_init__(self) -> None:
        _check_dtype(self.dtype, "draft")
        _check_attention_kernel(self.attention_kernel, "draft")
        if self.q_top_k < 1:
            raise ConfigError(f"draft.q_top_k must be >= 1, got {self.q_top_k}")
        _check_sessions(self.max_sessions, self.session_ttl_s, "draft")


@dataclass
class TargetConfig:
    """Target model and engine settings.

    Attributes:
        model: HF id, local directory or alias of the target model.
        device: torch device for the whole target, e.g. ``"cuda:1"``.
        device_map: accelerate device map (``"auto"`` or a dict) to spread the target over GPUs;
            takes precedence over ``device``.
        dtype: as for :class:`DraftConfig`.
        max_tree_nodes / max_tree_depth: largest tree a request may carry.
        max_context: largest prompt + generation a session may grow to.
        stateless: keep no KV between requests (every request must carry the full context).
        cuda_graphs / graph_capacity / compile / fuse_projections / fold_gqa / attention_kernel /
            prefill_graphs: as for :class:`DraftConfig` (the verify step of a fixed tree; a
            prompt's first verification, prompt and tree in one padded forward).
        graph_rounds: with ``cuda_graphs``, a greedy round's whole verification (tree mask and
            positions, the forward, acceptance and the KV commit of the accepted path) replays as
            ONE graph per tree size and KV bucket, instead of the forward alone with eager ops
            around it. Sampling rounds keep the eager acceptance. Exact on CPU and on an H100
            (``tests/test_gpu.py``). On by default: in one process the eager ops hide behind the
            draft's GPU work (within run-to-run noise, ``benchmarks/results/tree_sweep-h100-*.md``),
            but a gRPC target worker runs them after the tree arrives, and there the one graph cut
            a verification from 9.1 to 6.7 ms (``benchmarks/results/h100-2026-11-26-grpc-graph-rounds*.md``).
        specpv: SpecPV partial verification for long contexts (opt-in, lossy; off by default).
            Settable as a dict in config files, as JSON in ``SPECSPLIT_TARGET_SPECPV`` or per field
            (``SPECSPLIT_TARGET_SPECPV_ENABLED=1``, ``SPECSPLIT_TARGET_SPECPV_PARTIAL_THRESHOLD=8192``).
            In gRPC mode it is the target worker's setting (``specsplit serve target --specpv``).
    """

    model: str | None = None
    device: str | None = None
    device_map: str | dict[str, Any] | None = None
    dtype: str = "auto"
    max_tree_nodes: int = 256
    max_tree_depth: int = 64
    max_context: int = 32768
    max_sessions: int = 64
    session_ttl_s: float = 600.0
    stateless: bool = False
    cuda_graphs: bool = False
    graph_capacity: int = 2048
    compile: bool = False
    graph_rounds: bool = True
    fuse_projections: bool = False
    fold_gqa: bool = True
    attention_kernel: str = "auto"
    prefill_graphs: bool = True
    specpv: SpecPVConfig = field(default_factory=SpecPVConfig)

    def __post_init__(self) -> None:
        _check_dtype(self.dtype, "target")
        _check_attention_kernel(self.attention_kernel, "target")
        self.specpv = SpecPVConfig.from_any(self.specpv)
        if self.max_tree_nodes < 1 or self.max_tree_depth < 1:
            raise ConfigError("target.max_tree_nodes and target.max_tree_depth must be >= 1")
        if self.max_context < 2:
            raise ConfigError(f"target.max_context must be >= 2, got {self.max_context}")
        _check_sessions(self.max_sessions, self.session_ttl_s, "target")


@dataclass
class SpecSplitConfig:
    """Top-level configuration.

    Attributes:
        transport: ``"local"`` (engines in this process) or ``"grpc"`` (remote workers).
        draft_address / target_address: ``host:port`` of the workers in gRPC mode.
        timeout_s: deadline of each remote call.
        auth_token: bearer token sent to the workers (gRPC mode).
        tls_ca_file: CA certificate that signs the workers' TLS certificates (gRPC mode).
        overlap: draft round N+1 while round N verifies (needs draft and target on different
            devices or machines to pay off; output is identical either way).
        overlap_policy: ``"adaptive"`` (default) times short probes with and without speculation
            and keeps whichever commits tokens faster, re-probing ever less often while the choice
            holds (the generator keeps what it measured across ``generate()`` calls); ``"always"``
            speculates every round.
        sync_timing: synchronise the device around each span so the draft/verify split in
            telemetry is exact (costs a little speed on GPU).
        grpc_loop: where the rounds run in gRPC mode: ``"client"`` (default; this process calls
            the draft and the target worker every round, two network hops a round) or
            ``"target"`` (one ``Generate`` call; the target worker calls the draft worker it was
            started with, ``specsplit serve target --draft-address``, one hop a round, and streams
            the committed tokens back; ``draft_address`` is then unused). Same tokens either way.
        grpc_streams: in gRPC mode, send each round's draft and verify calls over long-lived
            streams (``GenerateDraftsStream`` / ``VerifyDraftsStream``; about half a unary call's
            latency, same semantics, unary calls wherever a worker refuses or lacks them).
            ``False``: unary calls only. A target worker running the rounds has its own switch,
            ``specsplit serve target --no-draft-stream``.
    """

    transport: Literal["local", "grpc"] = "local"
    draft: DraftConfig = field(default_factory=DraftConfig)
    target: TargetConfig = field(default_factory=TargetConfig)
    tree: TreeConfig = field(default_factory=TreeConfig)
    draft_address: str | None = None
    target_address: str | None = None
    timeout_s: float = 60.0
    auth_token: str | None = None
    tls_ca_file: str | None = None
    overlap: bool = False
    overlap_policy: Literal["adaptive", "always"] = "adaptive"
    sync_timing: bool = False
    grpc_loop: Literal["client", "target"] = "client"
    grpc_streams: bool = True

    def __post_init__(self) -> None:
        if self.transport not in ("local", "grpc"):
            raise ConfigError(f"transport must be 'local' or 'grpc', got {self.transport!r}")
        if self.transport == "grpc" and not self.target_address:
            raise ConfigError(
                "transport='grpc' needs target_address='host:port' (or SPECSPLIT_TARGET_ADDRESS); "
                "draft_address is optional (without it the client decodes target-only)"
            )
        if self.overlap_policy not in ("adaptive", "always"):
            raise ConfigError(f"overlap_policy must be 'adaptive' or 'always', got {self.overlap_policy!r}")
        if self.grpc_loop not in ("client", "target"):
            raise ConfigError(f"grpc_loop must be 'client' or 'target', got {self.grpc_loop!r}")
        if self.grpc_loop == "target" and self.transport != "grpc":
            raise ConfigError(
                "grpc_loop='target' needs transport='grpc' (the rounds run on the target worker)"
            )
        if self.timeout_s <= 0:
            raise ConfigError(f"timeout_s must be > 0, got {self.timeout_s}")
        self.target.specpv.check_tree(self.tree.max_nodes, self.tree.depth_limit)

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SpecSplitConfig:
        d = dict(d)
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ConfigError(f"unknown config keys: {sorted(unknown)}")
        sections = {"draft": DraftConfig, "target": TargetConfig, "tree": TreeConfig}
        for key, sec_cls in sections.items():
            if isinstance(d.get(key), dict):
                sub = d[key]
                bad = set(sub) - {f.name for f in dataclasses.fields(sec_cls)}
                if bad:
                    raise ConfigError(f"unknown keys in config section {key!r}: {sorted(bad)}")
                d[key] = sec_cls(**sub)
        return cls(**d)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> SpecSplitConfig:
        """Load JSON (``.json``) or TOML (``.toml``), then apply environment overrides."""
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        if p.suffix == ".toml":
            import tomllib

            data = tomllib.loads(p.read_text())
        else:
            data = json.loads(p.read_text())
        return cls.from_env(base=cls.from_dict(data))

    @classmethod
    def from_env(
        cls, base: SpecSplitConfig | None = None, environ: dict[str, str] | None = None
    ) -> SpecSplitConfig:
        """``base`` (or defaults) with every ``SPECSPLIT_*`` variable applied."""
        env = os.environ if environ is None else environ
        d = base.to_dict() if base is not None else _defaults_dict()
        for f in dataclasses.fields(cls):
            if f.name in ("draft", "target", "tree"):
                sec_cls = {"draft": DraftConfig, "target": TargetConfig, "tree": TreeConfig}[f.name]
                for sf in dataclasses.fields(sec_cls):
                    key = f"SPECSPLIT_{f.name}_{sf.name}".upper()
                    if sf.name == "specpv":
                        d[f.name][sf.name] = _specpv_env(env, key, d[f.name][sf.name])
                    elif key in env:
                        d[f.name][sf.name] = _parse(env[key], sf.type, key)
            else:
                key = f"SPECSPLIT_{f.name}".upper()
                if key in env:
                    d[f.name] = _parse(env[key], f.type, key)
        return cls.from_dict(d)


def _defaults_dict() -> dict[str, Any]:
    return {
        "transport": "local",
        "draft": dataclasses.asdict(DraftConfig()),
        "target": dataclasses.asdict(TargetConfig()),
        "tree": dataclasses.asdict(TreeConfig()),
    }


def _specpv_env(env: Any, key: str, current: Any) -> dict[str, Any]:
    """SpecPV fields from ``KEY`` (a JSON object) and then ``KEY_<FIELD>`` variables."""
    out = dataclasses.asdict(SpecPVConfig.from_any(current))
    if key in env:
        try:
            raw = json.loads(env[key])
        except json.JSONDecodeError:
            raise ConfigError(f"environment variable {key} must be a JSON object") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"environment variable {key} must be a JSON object")
        out.update(raw)
    for sf in dataclasses.fields(SpecPVConfig):
        sub = f"{key}_{sf.name}".upper()
        if sub in env:
            out[sf.name] = _parse(env[sub], sf.type, sub)
    return out


def _parse(raw: str, typ: Any, key: str) -> Any:
    t = str(typ)
    try:
        if t.startswith("bool"):
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if t.startswith("int"):
            return int(raw)
        if t.startswith("float"):
            return float(raw)
        if "list" in t or "dict" in t:
            if raw.strip().startswith(("[", "{")):
                return json.loads(raw)
            return raw
    except (ValueError, json.JSONDecodeError):
        raise ConfigError(f"environment variable {key}={raw!r} is not a valid {t}") from None
    return None if raw.lower() == "none" and "None" in t else raw


_ATTENTION_KERNELS = ("auto", "math", "sdpa")  # see resolved_attention_kernel


def _check_dtype(dtype: str, section: str) -> None:
    if dtype not in _DTYPES:
        raise ConfigError(f"{section}.dtype must be one of {_DTYPES}, got {dtype!r}")


def resolved_attention_kernel(kernel: str, cuda_graphs: bool) -> str:
    """``attention_kernel`` with ``"auto"`` resolved (``"math"`` on the static path, else ``"sdpa"``)."""
    if kernel == "auto":
        return "math" if cuda_graphs else "sdpa"
    return kernel


def _check_attention_kernel(kernel: str, section: str) -> None:
    if kernel not in _ATTENTION_KERNELS:
        raise ConfigError(f"{section}.attention_kernel must be one of {_ATTENTION_KERNELS}, got {kernel!r}")


def _check_sessions(max_sessions: int, ttl: float, section: str) -> None:
    if max_sessions < 1:
        raise ConfigError(f"{section}.max_sessions must be >= 1, got {max_sessions}")
    if ttl <= 0:
        raise ConfigError(f"{section}.session_ttl_s must be > 0, got {ttl}")
