"""Weight-only int8 linear layers for a draft model on a CPU.

On a CPU a one-token step is bound by reading the weights, so a draft step costs what its weights
weigh: a float32 0.5B draft reads ~2 GB a step. Stored as int8 with one scale per output channel, the
same layers read a quarter of that, and PyTorch's int8 weight kernel (``aten._weight_int8pack_mm``,
bfloat16 activations) runs a draft step about 2.5-3× faster than the packed float32 one
(``python benchmarks/draft_quant.py`` measures it on a given machine, with the draft's agreement).

Only a draft may be quantized: speculative decoding stays exact whatever the draft proposes, since
the target verifies every token and sampling corrects by the draft's own distribution ``q``, which
is computed from the quantized model. What quantization can cost is acceptance: per-channel int8
weights keep the draft's greedy choice on ~99% of the positions of the bench's answers
(RESULTS, "An int8 draft on the CPU").

:func:`quantize_linears` rewrites a loaded model in place: each ``nn.Linear`` becomes an
:class:`Int8Linear` holding its int8 weight and scales, which every step of a few rows reads (a
quarter of the float32 bytes). The int8 kernel is a matrix-vector product whose time grows with the
rows, so the hidden layers also keep their dense weight (packed for the CPU) for a prompt's forward:
the model then holds about what it held before plus the int8 copy. An output layer tied to the input
embeddings gets its own int8 copy and the embedding keeps the dense weight.
:func:`int8_pays` times both kernels on one of the model's own layers, so ``quantize="auto"`` turns
it on only where this machine's int8 kernel is the faster one.

Limits: a CPU, inference only; activations pass through bfloat16 inside each product.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

logger = logging.getLogger(__name__)


def available() -> bool:
    """Whether this torch build has the int8 weight kernel."""
    return hasattr(torch.ops.aten, "_weight_int8pack_mm")


def quantizable(model: torch.nn.Module) -> bool:
    """Whether :func:`quantize_linears` applies: floating-point weights on a CPU, the kernel present."""
    p = next(model.parameters(), None)
    return p is not None and p.device.type == "cpu" and p.dtype.is_floating_point and available()


def _int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: ``weight ≈ q * scale[:, None]``, the scale a bfloat16 (the kernel's)."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=torch.finfo(torch.bfloat16).tiny) / 127.0
    # Round each scale up to a bfloat16, so the row's largest weight still maps inside [-127, 127].
    bits = scale.view(torch.int32)
    scale = ((bits + 0xFFFF) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)
    q = torch.round(w / scale.float()[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
    return q, scale


# PyTorch's int8 weight kernel is a matrix-vector product: its time grows with every row, while a
# packed dense product of a few rows costs about one row's; on the 2-core CPU measured the two cross
# between 4 and 6 rows (NOTES, "An int8 draft on the CPU"). Calls with more rows than this (a prompt,
# a long ingest) take the dense weight the layer keeps for them.
DENSE_ROWS = 4


class Int8Linear(torch.nn.Module):
    """``nn.Linear``'s forward over an int8 weight with one scale per output channel.

    Args:
        linear: the layer to quantize.
        dense_rows: calls with more rows than this use a dense copy of the original weight (packed
            for the CPU's matmul where :mod:`specsplit.runtime.packed` applies), kept for them;
            ``None`` keeps no copy (every call takes the int8 kernel).
    """

    dense: torch.nn.Module | None

    def __init__(self, linear: torch.nn.Linear, dense_rows: int | None = DENSE_ROWS):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        q, scale = _int8_rows(linear.weight)
        self.qweight: torch.Tensor
        self.scale: torch.Tensor
        self.register_buffer("qweight", q)
        self.register_buffer("scale", scale)
        self.bias = linear.bias
        self.dense_rows = dense_rows
        self.dense = None
        if dense_rows is not None:
            from specsplit.runtime.packed import PackedLinear, packable

            dense = torch.nn.Linear(self.in_features, self.out_features, bias=False)
            dense.weight = torch.nn.Parameter(linear.weight.detach(), requires_grad=False)
            self.dense = PackedLinear(dense) if packable(dense) else dense

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight (a new float32 tensor on every access)."""
        return self.qweight.float() * self.scale.float()[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if self.dense is not None and self.dense_rows is not None and flat.shape[0] > self.dense_rows:
            out = self.dense(flat)
        else:
            out = torch.ops.aten._weight_int8pack_mm(flat.to(torch.bfloat16), self.qweight, self.scale)
        out = out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, int8"


def _linears(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, torch.nn.Linear]]:
    return [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is torch.nn.Linear
    ]


def _median_ms(fn: Any, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] * 1e3


# Below this many weights in its largest layer a model is read from the CPU's caches, not from memory:
# nothing for int8 to save, and a timing that small is noise.
MIN_LAYER_WEIGHTS = 1 << 20


@torch.inference_mode()
def int8_pays(model: torch.nn.Module, reps: int = 5) -> bool:
    """Whether the int8 kernel beats the model's current one on its largest hidden layer, one row.

    A few milliseconds: both products run ``reps`` times on that layer's own weight. A model whose
    layers are all smaller than :data:`MIN_LAYER_WEIGHTS` is left as it is.
    """
    if not quantizable(model):
        return False
    linears = [c for _, _, c in _linears(model) if c is not model.get_output_embeddings()]  # type: ignore[operator]
    if not linears:
        return False
    big = max(linears, key=lambda c: c.weight.numel())
    if big.weight.numel() < MIN_LAYER_WEIGHTS:
        return False
    x = torch.randn(1, big.in_features, dtype=big.weight.dtype)
    q = Int8Linear(big, dense_rows=None)
    dense_ms, int8_ms = _median_ms(lambda: big(x), reps), _median_ms(lambda: q(x), reps)
    logger.debug(
        "one-row product of %s: dense %.3f ms, int8 %.3f ms", tuple(big.weight.shape), dense_ms, int8_ms
    )
    return int8_ms < dense_ms


def wants_int8(mode: str, model: torch.nn.Module, excluded: bool = False) -> bool:
    """Whether a draft gets int8 weights under ``quantize=mode``: always for ``"int8"``; for
    ``"auto"`` where nothing else rewrites its weights (``excluded``: compiled, fused or packed on
    request) and :func:`int8_pays` on this machine; never for ``"none"``. The one rule the engines,
    ``specsplit serve draft`` and the bench's draft copy follow."""
    if mode == "int8":
        return True
    return mode == "auto" and not excluded and int8_pays(model)


def quantize_linears(model: torch.nn.Module, dense_rows: int | None = DENSE_ROWS) -> int:
    """Replace every ``nn.Linear`` of ``model`` by an :class:`Int8Linear` (in place); how many.

    The hidden layers keep a dense copy for calls of more than ``dense_rows`` rows (prompts); the
    output layer does not (the engines score a prompt's last position only). A model that is not on
    a CPU, or a torch without the kernel, is left alone (returns 0).
    """
    if not quantizable(model):
        return 0
    swaps = _linears(model)
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    with torch.no_grad():
        for parent, name, child in swaps:
            setattr(parent, name, Int8Linear(child, None if child is head else dense_rows))
    logger.info("int8 weights for %d linear layers of the draft", len(swaps))
    return len(swaps)
