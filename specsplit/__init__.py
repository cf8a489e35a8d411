"""SpecSplit: speculative decoding with the draft and target on different devices or machines.

Quick start::

    from specsplit import SpecSplitGenerator, SpecSplitConfig
    gen = SpecSplitGenerator.from_pretrained(target="qwen2.5-coder-1.5b", draft="qwen2.5-coder-0.5b")
    print(gen.generate_text("Write a quicksort in Python", chat=True, max_new_tokens=128))
"""

from __future__ import annotations

from specsplit.config import (
    DraftConfig,
    EngineTuning,
    NgramConfig,
    PipelineTuning,
    SpecPVConfig,
    SpecSplitConfig,
    TargetConfig,
    TreeConfig,
)
from specsplit.core.sampling import SamplingParams
from specsplit.core.tree import TokenNode, TokenTree
from specsplit.core.tree_attention import bool_mask_to_float, build_tree_attention
from specsplit.engines.draft import DraftCacheState, DraftEngine
from specsplit.engines.target import KVCacheState, TargetEngine
from specsplit.errors import (
    CacheDesyncError,
    ConfigError,
    InvalidRequest,
    ModelLoadError,
    ResourceExhausted,
    SessionNotFound,
    SpecSplitError,
    TransportError,
)
from specsplit.generator import SpecSplitGenerator, SpecSplitOutput
from specsplit.local import LocalTransport
from specsplit.messages import DraftRequest, DraftResult, VerificationResult, VerifyRequest, VerifyResult
from specsplit.runtime.kv_cache import StaticKVCache
from specsplit.telemetry import SpecStats
from specsplit.transport import Transport

__version__ = "0.1.0"

__all__ = [
    "CacheDesyncError",
    "ConfigError",
    "DraftCacheState",
    "DraftConfig",
    "DraftEngine",
    "DraftRequest",
    "EngineTuning",
    "DraftResult",
    "InvalidRequest",
    "KVCacheState",
    "LocalTransport",
    "ModelLoadError",
    "NgramConfig",
    "PipelineTuning",
    "ResourceExhausted",
    "SamplingParams",
    "SessionNotFound",
    "SpecPVConfig",
    "SpecSplitConfig",
    "SpecSplitError",
    "SpecSplitGenerator",
    "SpecSplitOutput",
    "SpecStats",
    "StaticKVCache",
    "TargetConfig",
    "TargetEngine",
    "TokenNode",
    "TokenTree",
    "Transport",
    "TransportError",
    "TreeConfig",
    "VerificationResult",
    "VerifyRequest",
    "VerifyResult",
    "bool_mask_to_float",
    "build_tree_attention",
]
