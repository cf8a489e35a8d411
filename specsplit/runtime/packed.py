"""Prepacked CPU weights: every linear layer's weight reordered once into oneDNN's blocked layout.

On a CPU a forward of a few rows (a verified tree, a short batch) is bound by reading the weights,
as a one-row step is. But PyTorch's default float32 matmul repacks the whole weight matrix on every
call once a few rows come in: a 4-row projection of Qwen2.5-1.5B then costs about twice a 1-row one
(``python benchmarks/small_gemm.py`` shows it on a given machine). Packed once, the same weights
serve 1 to ~5 rows for about the price of one (a single row costs ~10% more than the plain
product), which is what tree verification and batched rounds need on a CPU.

:func:`pack_linears` rewrites a loaded model in place: each ``nn.Linear`` becomes a
:class:`PackedLinear` that holds only its packed weight, so no memory is added; an output layer that
shares its weight with the input embeddings keeps that dense weight too (the embedding reads it),
which adds one packed copy of it. Results equal ``F.linear``'s up to the low-order bits (another
summation order); a row's result does not depend on the other rows of its call.

Limits: float32 on a CPU, inference only (no gradients), and the packed weights stay on the CPU
(move the model before packing). ``state_dict()`` no longer holds the packed layers' weights, and
``PackedLinear.weight`` unpacks a copy on every access. The engines pack models they load
themselves on a float32 CPU (``pack_weights=None``); models passed in are packed only when asked
(``DraftConfig/TargetConfig.pack_weights=True``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)


def available() -> bool:
    """Whether this torch build can pack linear weights (oneDNN on a CPU)."""
    ops = getattr(torch.ops, "mkldnn", None)
    try:
        return bool(
            torch.backends.mkldnn.is_available()
            and ops is not None
            and hasattr(ops, "_reorder_linear_weight")
            and hasattr(ops, "_linear_pointwise")
        )
    except (AttributeError, RuntimeError):
        return False


def packable(model: torch.nn.Module) -> bool:
    """Whether :func:`pack_linears` applies: float32 weights on a CPU, oneDNN present."""
    p = next(model.parameters(), None)
    return p is not None and p.device.type == "cpu" and p.dtype == torch.float32 and available()


class PackedLinear(torch.nn.Module):
    """``nn.Linear``'s forward over a weight packed once (module docstring)."""

    _dense: torch.Tensor | None

    def __init__(self, linear: torch.nn.Linear, keep_dense: bool = False):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        self.bias = linear.bias
        # A weight the model shares with another module (tied embeddings) stays as it is; kept as a
        # plain attribute, so it is not registered twice (the embedding owns it).
        object.__setattr__(self, "_dense", linear.weight if keep_dense else None)

    @property
    def weight(self) -> torch.Tensor:
        """The dense weight: the shared one when kept, else a copy unpacked on every access."""
        if self._dense is not None:
            return self._dense
        dense: torch.Tensor = self.packed.to_dense()
        return dense

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return out

    def __deepcopy__(self, memo: dict[int, Any]) -> PackedLinear:
        import copy

        plain = torch.nn.Linear(self.in_features, self.out_features, bias=self.bias is not None)
        if self._dense is not None:  # the copy's embedding weight (the memo maps the shared one)
            plain.weight = copy.deepcopy(self._dense, memo)
        else:
            plain.weight = torch.nn.Parameter(self.packed.to_dense(), requires_grad=False)
        if self.bias is not None:
            plain.bias = copy.deepcopy(self.bias, memo)
        return PackedLinear(plain, keep_dense=self._dense is not None)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, packed"


def pack_linears(model: torch.nn.Module) -> int:
    """Replace every ``nn.Linear`` of ``model`` by a :class:`PackedLinear` (in place); how many.

    A model that is not float32 on a CPU, or a torch without oneDNN, is left alone (returns 0).
    """
    if not packable(model):
        return 0
    shared = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    swaps = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is torch.nn.Linear
    ]
    with torch.no_grad():
        for parent, name, child in swaps:
            setattr(parent, name, PackedLinear(child, keep_dense=id(child.weight) in shared))
    logger.info("packed the weights of %d linear layers for the CPU", len(swaps))
    return len(swaps)
