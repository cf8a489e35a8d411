"""The decoders ``specsplit bench`` knows: one table of named configurations.

Each row of :data:`DECODERS` is a :class:`DecoderSpec`: what to run (a Hugging Face baseline or
SpecSplit), and for SpecSplit the tree, the pipeline, the transport and the engine switches that
differ from the run's flags. :func:`specsplit.bench.decoders.build_decoders` reads nothing but these
fields, so a new decoder is a new row, and a new kind of difference is one new field.

Names are stable: scripts and committed results refer to them. The suffixes are a naming habit only
(``-compiled``: CUDA graphs fused by torch.compile; ``-prefill``: prompts padded to graph buckets;
``-levels``: one draft graph per tree level; ``-split``: sequential rounds with the draft on the
overlap device; ``-targetloop``: rounds run by the target worker; ``-unary``: unary gRPC calls instead
of streams; ``-noipc``: trees in the draft worker's replies instead of tree slots; ``-frspec``: the draft's output
layer over a subset of the vocabulary).

Labels are format strings: ``{k}`` (draft tokens of the chain and of ``hf-assisted``), ``{lookup}``
(prompt-lookup tokens), ``{vocab}`` (tokens an ``-frspec`` draft scores), ``{tree}`` (the tree in
words), ``{draft_device}`` and ``{device}`` (where the
decoder's draft and target run). The builder appends what the run's flags add (CUDA graphs, fused
projections, where gRPC workers run).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from specsplit.config import DRAFTERS, Drafter

Kind = Literal["hf", "specsplit"]
HfMode = Literal["generate", "assisted", "assisted-default", "prompt-lookup"]
TreeKey = Literal["chain", "static", "dynamic"]
Transport = Literal["local", "grpc-client", "grpc-target"]
Workers = Literal["process", "thread"]
Placement = Literal["same", "overlap-device"]

_CHOICES: dict[str, tuple[object, ...]] = {
    "kind": ("hf", "specsplit"),
    "hf_mode": (None, "generate", "assisted", "assisted-default", "prompt-lookup"),
    "tree": ("chain", "static", "dynamic"),
    "transport": ("local", "grpc-client", "grpc-target"),
    "workers": (None, "process", "thread"),
    "draft_placement": ("same", "overlap-device"),
    "drafter": DRAFTERS,
    "lookahead": ("", "adaptive", "always"),
    "heads": ("", "adaptive", "always"),
    "guesses": ("always", "adaptive"),
}


@dataclass(frozen=True)
class DecoderSpec:
    """One named way to generate, as data.

    Attributes:
        name: the name ``--decoders`` takes.
        label: what it runs, in words (a format string, see the module docstring).
        kind: ``"hf"`` (transformers' ``generate()``) or ``"specsplit"``.
        default: run when ``--decoders`` is not given.
        hf_mode: ``kind="hf"`` only: plain ``generate()``, assisted generation with the draft (K
            tokens a round, constant), assisted generation with the library's default schedule, or
            prompt-lookup decoding.
        tree: which of the run's trees: the chain of K, the default static tree, or the dynamic
            tree (``--dynamic-tree``).
        target_only: no drafting at all (our own target-only decode).
        drafter: what proposes each round's tree (``SpecSplitConfig.drafter``): ``"model"``,
            ``"ngram"``, ``"suffix"``, ``"hybrid"`` or ``"auto"``. Other than ``"model"``: local
            decoders only, for now (the bench's gRPC decoders start a draft-model worker, and a
            target worker that runs the rounds drafts with the model).
        overlap: draft round N+1 while round N verifies (``SpecSplitConfig.overlap``).
        transport: ``"local"`` (engines in this process), ``"grpc-client"`` (gRPC workers, this
            process calls both every round) or ``"grpc-target"`` (the target worker runs the rounds,
            ``SpecSplitConfig.grpc_loop="target"``).
        workers: gRPC workers as ``specsplit serve`` processes or servers in this process; ``None``
            follows ``--grpc-workers``.
        draft_placement: ``"same"`` (the draft on ``--draft-device``) or ``"overlap-device"`` (the
            draft copy on ``--overlap-draft-device`` when there is one).
        compile: CUDA graphs fused by torch.compile, whatever ``--cuda-graphs`` / ``--compile`` say.
        draft_graph_rounds: the draft's ``EngineTuning.graph_rounds`` (``None``: ``--graph-rounds``).
        prefill_graphs: prompts padded to graph buckets (``True``: whatever ``--prefill-graphs``
            says, which then needs CUDA graphs; ``None``: the flag).
        grpc_streams: ``PipelineTuning.grpc_streams`` and the target worker's draft calls
            (``None``: ``--grpc-streams``).
        tree_ipc: a target worker that runs the rounds reads trees from the draft worker's GPU
            memory (``specsplit serve target --tree-ipc``); off, trees travel in replies.
        draft_vocab: the draft's output layer scores only the ``--frspec-vocab`` best-ranked tokens
            (``DraftConfig.vocab_subset``, FR-Spec).
        lookahead: n-gram rounds carry a lookahead window (``NgramConfig.lookahead``, the run's
            ``--lookahead`` width) under its ``"adaptive"`` or ``"always"`` policy; ``""``: none.
        heads: the target runs the run's ``--draft-heads`` and n-gram rounds carry their guesses
            (fixed rounds) under the ``"adaptive"`` or ``"always"`` policy; ``""``: no heads.
        eagle: those heads are the run's ``--eagle-heads`` (an EAGLE head) instead.
        guesses: which rounds grow the heads' guesses (``NgramConfig.guess_policy``): ``"always"``,
            or ``"adaptive"`` (where they have added tokens worth their cost).
    """

    name: str
    label: str
    kind: Kind = "specsplit"
    default: bool = False
    hf_mode: HfMode | None = None
    tree: TreeKey = "chain"
    target_only: bool = False
    drafter: Drafter = "model"
    overlap: bool = False
    transport: Transport = "local"
    workers: Workers | None = None
    draft_placement: Placement = "same"
    compile: bool = False
    draft_graph_rounds: bool | None = None
    prefill_graphs: bool | None = None
    grpc_streams: bool | None = None
    tree_ipc: bool = True
    draft_vocab: bool = False
    lookahead: str = ""
    heads: str = ""
    eagle: bool = False
    guesses: str = "always"

    def __post_init__(self) -> None:
        for field_name, allowed in _CHOICES.items():
            if getattr(self, field_name) not in allowed:
                raise ValueError(
                    f"decoder {self.name}: {field_name}={getattr(self, field_name)!r} is not one of {allowed}"
                )
        if self.eagle and not self.heads:
            raise ValueError(f"decoder {self.name}: eagle names which heads run, so it needs heads")
        if (self.kind == "hf") != (self.hf_mode is not None):
            raise ValueError(f"decoder {self.name}: hf_mode is set for kind='hf' decoders, and only for them")

    @property
    def grpc(self) -> bool:
        """Runs over gRPC workers."""
        return self.transport != "local"

    @property
    def uses_draft_model(self) -> bool:
        """Runs the draft model when there is one (``"auto"`` may also run without)."""
        if self.kind == "hf":
            return self.hf_mode in ("assisted", "assisted-default")
        return not self.target_only and self.drafter in ("model", "hybrid", "auto")

    @property
    def needs_draft(self) -> bool:
        """Cannot run without the draft model (skipped in a run without one)."""
        return self.uses_draft_model and self.drafter != "auto"


_TARGET_ONLY = "SpecSplit engine without a draft (our target-only decode)"
_LOCAL = "SpecSplit local, {tree}"
_GRPC = "SpecSplit {tree} over gRPC"
_OVERLAP = "overlapped pipeline (draft on {draft_device}, target on {device})"
_OVERLAP_WORKERS = "overlapped pipeline (draft worker on {draft_device}, target worker on {device})"
_TARGET_LOOP = "rounds run by the target worker (one hop a round)"
_COMPILED = "CUDA graphs fused by torch.compile"
_PREFILL = "prompts padded to CUDA-graph buckets (prefill_graphs)"
_UNARY = "unary calls instead of streams"
_NO_IPC = "trees in the draft worker's replies (no tree slots)"
_NGRAM = "SpecSplit local, n-gram trees from the prompt and output (no draft model)"
_SUFFIX = "SpecSplit local, n-gram trees from the prompt, output and earlier generations (no draft model)"
_HYBRID = "SpecSplit local, {tree} with n-gram nodes merged in"
_AUTO = "SpecSplit local, the cost model's choice each round (none, n-gram, {tree} or both)"
_LOOKAHEAD = "n-gram rounds with a lookahead window of {lookahead}"
_ALWAYS = "in every n-gram round"
_HEADS = "the target's draft heads' guesses ({heads})"
_EAGLE = "the target's EAGLE head's tree ({eagle})"
_FRSPEC = "draft output layer over the {vocab} best-ranked tokens (FR-Spec)"

# In run order: results list decoders in this order. The default set first, then the optional ones:
# compiled twins (compiling is slow, on CPU too) and the A/B pairs of single switches.
_TABLE = (
    DecoderSpec("hf-target", "HF generate(), target only, greedy (baseline a)",
                kind="hf", hf_mode="generate", default=True),
    DecoderSpec("hf-assisted", "HF assisted generation, {k} draft tokens a round, constant schedule, "
                "no confidence stop", kind="hf", hf_mode="assisted", default=True),
    DecoderSpec("hf-assisted-default", "HF assisted generation, library default schedule and confidence "
                "threshold", kind="hf", hf_mode="assisted-default", default=True),
    DecoderSpec("hf-prompt-lookup", "HF prompt-lookup decoding, {lookup} tokens",
                kind="hf", hf_mode="prompt-lookup", default=True),
    DecoderSpec("specsplit-target-only", _TARGET_ONLY, target_only=True, default=True),
    DecoderSpec("specsplit-chain", _LOCAL, tree="chain", default=True),
    DecoderSpec("specsplit-static", "SpecSplit local, default {tree}", tree="static", default=True),
    DecoderSpec("specsplit-dynamic", _LOCAL, tree="dynamic", default=True),
    DecoderSpec("specsplit-overlap-chain", f"{_LOCAL}, {_OVERLAP}", tree="chain", overlap=True,
                draft_placement="overlap-device", default=True),
    DecoderSpec("specsplit-overlap-dynamic", f"{_LOCAL}, {_OVERLAP}", tree="dynamic", overlap=True,
                draft_placement="overlap-device", default=True),
    DecoderSpec("specsplit-grpc", _GRPC, tree="chain", transport="grpc-client", default=True),
    # optional
    DecoderSpec("specsplit-target-only-compiled", f"{_TARGET_ONLY}, {_COMPILED}", target_only=True,
                compile=True),
    DecoderSpec("specsplit-dynamic-compiled", f"{_LOCAL}, {_COMPILED}", tree="dynamic", compile=True),
    DecoderSpec("specsplit-dynamic-levels-compiled", f"{_LOCAL}, one graph per tree level, {_COMPILED}",
                tree="dynamic", compile=True, draft_graph_rounds=False),
    DecoderSpec("specsplit-overlap-dynamic-compiled", f"{_LOCAL}, {_OVERLAP}, {_COMPILED}", tree="dynamic",
                overlap=True, draft_placement="overlap-device", compile=True),
    DecoderSpec("specsplit-split-dynamic-compiled",
                f"{_LOCAL}, sequential, draft on {{draft_device}}, target on {{device}}, {_COMPILED}",
                tree="dynamic", draft_placement="overlap-device", compile=True),
    DecoderSpec("specsplit-grpc-dynamic-compiled", f"{_GRPC}, {_COMPILED}", tree="dynamic",
                transport="grpc-client", compile=True),
    DecoderSpec("specsplit-grpc-overlap-dynamic-compiled", f"{_GRPC}, {_OVERLAP_WORKERS}, {_COMPILED}",
                tree="dynamic", transport="grpc-client", overlap=True, draft_placement="overlap-device",
                compile=True),
    DecoderSpec("specsplit-grpc-targetloop-dynamic-compiled", f"{_GRPC}, {_TARGET_LOOP}, {_COMPILED}",
                tree="dynamic", transport="grpc-target", compile=True),
    DecoderSpec("specsplit-grpc-targetloop-overlap-dynamic-compiled",
                f"{_GRPC}, {_TARGET_LOOP}, {_OVERLAP_WORKERS}, {_COMPILED}", tree="dynamic",
                transport="grpc-target", overlap=True, draft_placement="overlap-device", compile=True),
    DecoderSpec("specsplit-grpc-dynamic", _GRPC, tree="dynamic", transport="grpc-client"),
    DecoderSpec("specsplit-grpc-targetloop-dynamic", f"{_GRPC}, {_TARGET_LOOP}", tree="dynamic",
                transport="grpc-target"),
    DecoderSpec("specsplit-grpc-dynamic-unary", f"{_GRPC}, {_UNARY}", tree="dynamic",
                transport="grpc-client", grpc_streams=False),
    DecoderSpec("specsplit-grpc-targetloop-dynamic-unary", f"{_GRPC}, {_TARGET_LOOP}, {_UNARY}",
                tree="dynamic", transport="grpc-target", grpc_streams=False),
    DecoderSpec("specsplit-grpc-targetloop-dynamic-noipc", f"{_GRPC}, {_TARGET_LOOP}, {_NO_IPC}",
                tree="dynamic", transport="grpc-target", tree_ipc=False),
    DecoderSpec("specsplit-target-only-prefill", f"{_TARGET_ONLY}, {_PREFILL}", target_only=True,
                prefill_graphs=True),
    DecoderSpec("specsplit-dynamic-prefill", f"{_LOCAL}, {_PREFILL}", tree="dynamic", prefill_graphs=True),
    DecoderSpec("specsplit-target-only-prefill-compiled", f"{_TARGET_ONLY}, {_PREFILL}, {_COMPILED}",
                target_only=True, prefill_graphs=True, compile=True),
    DecoderSpec("specsplit-dynamic-prefill-compiled", f"{_LOCAL}, {_PREFILL}, {_COMPILED}", tree="dynamic",
                prefill_graphs=True, compile=True),
    # Drafters beside the model (SpecSplitConfig.drafter): n-gram lookup in the prompt and output,
    # plus earlier generations (suffix; the bench clears that cache before every call, so a prompt
    # never drafts from its own earlier runs), n-gram nodes merged into the model's dynamic tree
    # (hybrid), and the cost model's choice each round (auto).
    DecoderSpec("specsplit-ngram", _NGRAM, drafter="ngram"),
    DecoderSpec("specsplit-ngram-compiled", f"{_NGRAM}, {_COMPILED}", drafter="ngram", compile=True),
    DecoderSpec("specsplit-suffix", _SUFFIX, drafter="suffix"),
    DecoderSpec("specsplit-suffix-compiled", f"{_SUFFIX}, {_COMPILED}", drafter="suffix", compile=True),
    DecoderSpec("specsplit-hybrid", _HYBRID, tree="dynamic", drafter="hybrid"),
    DecoderSpec("specsplit-hybrid-compiled", f"{_HYBRID}, {_COMPILED}", tree="dynamic", drafter="hybrid",
                compile=True),
    DecoderSpec("specsplit-auto", _AUTO, tree="dynamic", drafter="auto"),
    DecoderSpec("specsplit-auto-compiled", f"{_AUTO}, {_COMPILED}", tree="dynamic", drafter="auto", compile=True),
    # n-gram drafting with lookahead (NgramConfig.lookahead): a Jacobi window in every lookahead round,
    # its outputs an n-gram pool; adaptive: timed against the planner's rounds, always: every round.
    DecoderSpec("specsplit-lookahead", f"{_NGRAM}, {_LOOKAHEAD}", drafter="ngram", lookahead="adaptive"),
    DecoderSpec("specsplit-lookahead-compiled", f"{_NGRAM}, {_LOOKAHEAD}, {_COMPILED}", drafter="ngram",
                lookahead="adaptive", compile=True),
    DecoderSpec("specsplit-lookahead-always-compiled", f"{_NGRAM}, {_LOOKAHEAD} {_ALWAYS}, {_COMPILED}",
                drafter="ngram", lookahead="always", compile=True),
    # The target's draft heads (TargetConfig.draft_heads, `--draft-heads`): their guesses in every
    # n-gram round, beside the n-gram nodes, without and with the lookahead window.
    DecoderSpec("specsplit-heads", f"{_NGRAM}, {_HEADS}", drafter="ngram", heads="adaptive"),
    DecoderSpec("specsplit-heads-always-compiled", f"{_NGRAM}, {_HEADS} {_ALWAYS}, {_COMPILED}",
                drafter="ngram", heads="always", compile=True),
    DecoderSpec("specsplit-heads-lookahead-always-compiled",
                f"{_NGRAM}, {_HEADS} and a lookahead window of {{lookahead}} {_ALWAYS}, {_COMPILED}",
                drafter="ngram", heads="always", lookahead="always", compile=True),
    # An EAGLE head (`--eagle-heads`, `specsplit heads train --kind eagle`): the tree it grows inside
    # each round, beside the n-gram nodes, without and with the lookahead window.
    DecoderSpec("specsplit-eagle-always", f"{_NGRAM}, {_EAGLE} {_ALWAYS}", drafter="ngram", heads="always",
                eagle=True),
    DecoderSpec("specsplit-eagle-always-compiled", f"{_NGRAM}, {_EAGLE} {_ALWAYS}, {_COMPILED}",
                drafter="ngram", heads="always", eagle=True, compile=True),
    DecoderSpec("specsplit-eagle-lookahead-always-compiled",
                f"{_NGRAM}, {_EAGLE} and a lookahead window of {{lookahead}} {_ALWAYS}, {_COMPILED}",
                drafter="ngram", heads="always", lookahead="always", eagle=True, compile=True),
    # ... growing its tree only in rounds where it has added tokens worth its cost (GuessPolicy)
    DecoderSpec("specsplit-eagle-always-adaptive-compiled",
                f"{_NGRAM}, {_EAGLE} {_ALWAYS}, grown where it pays, {_COMPILED}",
                drafter="ngram", heads="always", eagle=True, compile=True, guesses="adaptive"),
    DecoderSpec("specsplit-eagle-lookahead-always-adaptive-compiled",
                f"{_NGRAM}, {_EAGLE} and a lookahead window of {{lookahead}} {_ALWAYS}, grown where it "
                f"pays, {_COMPILED}",
                drafter="ngram", heads="always", lookahead="always", eagle=True, compile=True,
                guesses="adaptive"),
    # auto with lookahead, the dynamic tree as the model's
    DecoderSpec("specsplit-auto-lookahead-compiled", f"{_AUTO}, {_LOOKAHEAD}, {_COMPILED}", tree="dynamic",
                drafter="auto", lookahead="adaptive", compile=True),
    # auto with the chain of K as the model's tree: on a CPU a verification grows with its nodes, and
    # a chain of 4 costs about one row there (packed weights) where a 24-node tree does not. With
    # `--num-draft-tokens 8 --chain-confidence 0.5`, `specsplit generate`'s tree: on a GPU without a
    # lookahead window, with one under the adaptive policy, and with one in every round (the
    # defaults there: lookahead="auto", lookahead_policy="always").
    DecoderSpec("specsplit-auto-chain", _AUTO, tree="chain", drafter="auto"),
    DecoderSpec("specsplit-auto-chain-compiled", f"{_AUTO}, {_COMPILED}", tree="chain", drafter="auto",
                compile=True),
    DecoderSpec("specsplit-auto-chain-lookahead-compiled", f"{_AUTO}, {_LOOKAHEAD}, {_COMPILED}", tree="chain",
                drafter="auto", lookahead="adaptive", compile=True),
    DecoderSpec("specsplit-auto-chain-lookahead-always-compiled", f"{_AUTO}, {_LOOKAHEAD} {_ALWAYS}, {_COMPILED}",
                tree="chain", drafter="auto", lookahead="always", compile=True),
    # The model draft with a restricted output layer (DraftConfig.vocab_subset), beside the same
    # decoders with the whole vocabulary.
    DecoderSpec("specsplit-chain-frspec", f"{_LOCAL}, {_FRSPEC}", tree="chain", draft_vocab=True),
    DecoderSpec("specsplit-dynamic-frspec", f"{_LOCAL}, {_FRSPEC}", tree="dynamic", draft_vocab=True),
    DecoderSpec("specsplit-auto-frspec", f"{_AUTO}, {_FRSPEC}", tree="dynamic", drafter="auto", draft_vocab=True),
    DecoderSpec("specsplit-dynamic-frspec-compiled", f"{_LOCAL}, {_FRSPEC}, {_COMPILED}", tree="dynamic",
                draft_vocab=True, compile=True),
)  # fmt: skip

DECODERS: dict[str, DecoderSpec] = {spec.name: spec for spec in _TABLE}
DEFAULT_DECODERS = tuple(name for name, spec in DECODERS.items() if spec.default)
OPTIONAL_DECODERS = tuple(name for name, spec in DECODERS.items() if not spec.default)
BASELINE, ASSISTED = "hf-target", "hf-assisted"
