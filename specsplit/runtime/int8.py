"""int8 linear layers for a draft model on a CPU.

On a CPU a one-token step is bound by reading the weights, so a draft step costs what its weights
weigh: a float32 0.5B draft reads ~2 GB a step. Stored as int8 with one scale per output channel, the
same layers read a quarter of that. Two kernels run them, the faster one where the build has it:

- ``"fbgemm"``: PyTorch's dynamically quantized linear (``quantized::linear_dynamic``). Each call
  also quantizes its input to uint8 with one scale, then multiplies int8 by int8 (VNNI dot products
  where the CPU has them). It is several times faster than the float32 product at every row count,
  prompts included, so the layer keeps no dense weight. Rows share the input scale in groups of
  :data:`SCALE_ROWS` consecutive rows: a prompt's rows are quantized in such groups, never with one
  scale for the whole prompt, which would cost the draft some of its hits.
- ``"int8pack"``: ``aten._weight_int8pack_mm``, weight-only (bfloat16 activations, each row on its
  own). A matrix-vector product whose time grows with every row, so the hidden layers also keep
  their dense weight (packed for the CPU) for calls of more than :data:`DENSE_ROWS` rows.

Only a draft may be quantized: speculative decoding stays exact whatever the draft proposes, since
the target verifies every token and sampling corrects by the draft's own distribution ``q``, which
is computed from the quantized model. What quantization can cost is acceptance, and it costs
little: on the bench's recorded answers either kernel keeps the float32 draft's hits to within a few
tenths of a percent (``python benchmarks/draft_quant.py`` measures steps and hits on a machine).

:func:`quantize_linears` rewrites a loaded model in place: each ``nn.Linear`` becomes an
:class:`Int8Linear`. An output layer tied to the input embeddings gets its own int8 copy and the
embedding keeps the dense weight. :func:`int8_pays` times the int8 kernel against the dense product
on one of the model's own layers, so ``quantize="auto"`` turns it on only where this machine's int8
kernel is the faster one.

Limits: a CPU, inference only. With the ``"fbgemm"`` kernel a row's result depends slightly on the
other rows of its scale group (their shared input scale); the draft's ``q`` is still what it drew
from, so the output stays exact. PyTorch marks its quantized-tensor constructors deprecated; where a
build no longer has or runs them the ``"int8pack"`` kernel is used.
"""

from __future__ import annotations

import functools
import logging
import time
import warnings
from typing import Any, Literal

import torch

logger = logging.getLogger(__name__)


Kernel = Literal["fbgemm", "int8pack"]


@functools.cache
def fbgemm_available() -> bool:
    """Whether this torch build runs FBGEMM's dynamically quantized linear (x86 CPUs): checked once
    by packing and running a tiny layer, so a build that lists the ops but refuses them (PyTorch has
    deprecated the quantized-tensor constructors they need) falls back to the weight-only kernel."""
    ops = getattr(torch.ops, "quantized", None)
    if not (
        "fbgemm" in torch.backends.quantized.supported_engines
        and hasattr(torch, "_make_per_channel_quantized_tensor")
        and ops is not None
        and hasattr(ops, "linear_dynamic")
        and hasattr(ops, "linear_prepack")
    ):
        return False
    try:
        packed = _fbgemm_pack(torch.ones(2, 4, dtype=torch.int8), torch.ones(2, dtype=torch.bfloat16))
        out = torch.ops.quantized.linear_dynamic(torch.ones(1, 4), packed, True)
    except (RuntimeError, NotImplementedError, AttributeError) as e:
        logger.info("FBGEMM's quantized linear does not run here (%s): int8 weights only", e)
        return False
    return bool(torch.allclose(out, torch.full((1, 2), 4.0)))


def available() -> bool:
    """Whether this torch build has an int8 kernel for :class:`Int8Linear`."""
    return fbgemm_available() or hasattr(torch.ops.aten, "_weight_int8pack_mm")


def default_kernel() -> Kernel:
    """The faster kernel this build has: ``"fbgemm"``, else ``"int8pack"``."""
    return "fbgemm" if fbgemm_available() else "int8pack"


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
# a long ingest) take the dense weight the layer keeps for them ("int8pack" kernel only).
DENSE_ROWS = 4

# The "fbgemm" kernel quantizes its input with one scale a call. A prompt quantized with one scale for
# all its rows loses ~1% of the draft's hits on the bench's answers, groups of up to this many rows
# lose nothing measurable (NOTES, "An int8 draft on the CPU"); a tree level, a chain step or the
# tokens a round accepted fit in one group.
SCALE_ROWS = 16


@functools.cache
def _reduce_range() -> bool:
    """FBGEMM's uint8 inputs use 7 bits unless the CPU has VNNI: without it the int8 products are
    summed in pairs into 16 bits, which a full-range input can overflow."""
    vnni = getattr(torch.cpu, "_is_vnni_supported", None)
    return not (callable(vnni) and vnni())


def _fbgemm_pack(q: torch.Tensor, scale: torch.Tensor) -> Any:
    """FBGEMM's packed form of an int8 weight with one scale a row (the same int8 values)."""
    zero = torch.zeros(q.shape[0], dtype=torch.long)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the quantized-tensor constructors' deprecation
        qt = torch._make_per_channel_quantized_tensor(q, scale.double(), zero, 0)
    return torch.ops.quantized.linear_prepack(qt, None)


class Int8Linear(torch.nn.Module):
    """``nn.Linear``'s forward over an int8 weight with one scale per output channel.

    Args:
        linear: the layer to quantize.
        dense_rows: calls with more rows than this use a dense copy of the original weight (packed
            for the CPU's matmul where :mod:`specsplit.runtime.packed` applies), kept for them;
            ``None`` keeps no copy (every call takes the int8 kernel). ``"auto"``: the kernel's own
            choice (:data:`DENSE_ROWS` for ``"int8pack"``, none for ``"fbgemm"``, which is faster
            than the dense product at any row count).
        kernel: ``"fbgemm"`` or ``"int8pack"`` (module docstring); default the faster one the build
            has (:func:`default_kernel`).
    """

    dense: torch.nn.Module | None

    def __init__(self, linear: torch.nn.Linear, dense_rows: int | None | Literal["auto"] = "auto",
                 kernel: Kernel | None = None):  # fmt: skip
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.kernel: Kernel = kernel or default_kernel()
        if self.kernel == "fbgemm" and not fbgemm_available():
            raise RuntimeError("this torch build has no FBGEMM quantized linear")
        if dense_rows == "auto":
            dense_rows = None if self.kernel == "fbgemm" else DENSE_ROWS
        q, scale = _int8_rows(linear.weight)
        self._packed: Any = None
        self._q: torch.Tensor | None
        self._s: torch.Tensor | None
        fbgemm = self.kernel == "fbgemm"
        # With FBGEMM the int8 weight and its scales live in its packed form only (one copy).
        self.register_buffer("_q", None if fbgemm else q)
        self.register_buffer("_s", None if fbgemm else scale)
        if fbgemm:
            self._packed = _fbgemm_pack(q, scale)
        self.bias = linear.bias
        self.dense_rows = dense_rows
        self.dense = None
        if dense_rows is not None:
            from specsplit.runtime.packed import PackedLinear, packable

            dense = torch.nn.Linear(self.in_features, self.out_features, bias=False)
            dense.weight = torch.nn.Parameter(linear.weight.detach(), requires_grad=False)
            self.dense = PackedLinear(dense) if packable(dense) else dense

    @property
    def qweight(self) -> torch.Tensor:
        """The int8 weight, ``[out_features, in_features]`` (unpacked on every access for FBGEMM)."""
        if self._q is not None:
            return self._q
        return torch.ops.quantized.linear_unpack(self._packed)[0].int_repr()  # type: ignore[no-any-return]

    @property
    def scale(self) -> torch.Tensor:
        """Each output row's scale, a bfloat16 (the int8pack kernel's type; FBGEMM holds the same values)."""
        if self._s is not None:
            return self._s
        scales = torch.ops.quantized.linear_unpack(self._packed)[0].q_per_channel_scales()
        return scales.to(torch.bfloat16)  # type: ignore[no-any-return]

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight (a new float32 tensor on every access)."""
        return self.qweight.float() * self.scale.float()[:, None]

    def _fbgemm(self, flat: torch.Tensor) -> torch.Tensor:
        parts = flat.float().split(SCALE_ROWS)  # one input scale per group (a step: one group)
        outs = [torch.ops.quantized.linear_dynamic(p, self._packed, _reduce_range()) for p in parts]
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if self.dense is not None and self.dense_rows is not None and flat.shape[0] > self.dense_rows:
            out = self.dense(flat)
        elif self._packed is not None:
            out = self._fbgemm(flat)
        else:
            out = torch.ops.aten._weight_int8pack_mm(flat.to(torch.bfloat16), self._q, self._s)
        out = out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, int8 ({self.kernel})")  # fmt: skip


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


def quantize_linears(
    model: torch.nn.Module, dense_rows: int | None | Literal["auto"] = "auto", kernel: Kernel | None = None
) -> int:
    """Replace every ``nn.Linear`` of ``model`` by an :class:`Int8Linear` (in place); how many.

    The hidden layers keep a dense copy for calls of more than ``dense_rows`` rows (prompts) where
    their kernel needs one (``"auto"``: the ``"int8pack"`` kernel only); the output layer never does
    (the engines score a prompt's last position only). ``kernel``: :class:`Int8Linear`'s. A model
    that is not on a CPU, or a torch without the kernel, is left alone (returns 0).
    """
    if not quantizable(model):
        return 0
    swaps = _linears(model)
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    with torch.no_grad():
        for parent, name, child in swaps:
            setattr(parent, name, Int8Linear(child, None if child is head else dense_rows, kernel))
    logger.info(
        "int8 weights for %d linear layers of the draft (%s kernel)", len(swaps), kernel or default_kernel()
    )
    return len(swaps)
