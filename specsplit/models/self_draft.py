"""Drafts made from the target itself: its first layers (layer skipping), sharing the weights."""

from __future__ import annotations

import copy
from typing import Any

import torch


def truncated_draft(model: torch.nn.Module, num_layers: int) -> torch.nn.Module:
    """A draft that runs only the first ``num_layers`` decoder layers of ``model``.

    The returned model shares every parameter with ``model`` (no extra memory); useful when a
    checkpoint has no smaller sibling (e.g. SmolLM2-135M).

    Args:
        model: an HF Llama/Qwen2-style causal LM (``model.model.layers``).
        num_layers: how many leading decoder layers to keep (>= 1).
    """
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if inner is None or layers is None:
        raise ValueError("truncated_draft needs a decoder with model.model.layers (Llama/Qwen2 style)")
    if not 1 <= num_layers <= len(layers):
        raise ValueError(f"num_layers must be in [1, {len(layers)}], got {num_layers}")
    cfg: Any = copy.deepcopy(model.config)
    cfg.num_hidden_layers = num_layers
    if getattr(cfg, "layer_types", None) is not None:
        cfg.layer_types = list(cfg.layer_types)[:num_layers]
    draft = copy.copy(model)  # shallow: shares submodules and parameters
    draft._modules = dict(model._modules)
    new_inner = copy.copy(inner)
    new_inner._modules = dict(inner._modules)
    new_inner._modules["layers"] = torch.nn.ModuleList(list(layers)[:num_layers])
    new_inner.config = cfg
    draft._modules["model"] = new_inner
    draft.config = cfg
    return draft
