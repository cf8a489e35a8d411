"""The model runner: loading and placement of one causal LM, and its cached forward with explicit masks."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from specsplit.core.pinned import to_device
from specsplit.errors import ConfigError, InvalidRequest, ModelLoadError
from specsplit.runtime.attention import AVOID_CUDNN, ENGINE_KWARG, FOLD_KWARG, gqa_group
from specsplit.runtime.attention import install as install_attention
from specsplit.runtime.int8 import Int8Linear, quantizable, quantize_linears, wants_int8
from specsplit.runtime.kv_cache import StaticKVCache
from specsplit.runtime.packed import PackedLinear, pack_linears, packable
from specsplit.runtime.vocab_subset import SubsetHead, special_ids, subset_ids

logger = logging.getLogger(__name__)


def resolve_dtype(name: str | torch.dtype, device: torch.device | str | None) -> torch.dtype:
    """``"auto"`` → bf16 on CUDA, fp32 elsewhere (multi-token forwards are slow in bf16 on CPU)."""
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        dev = torch.device(device) if device is not None else default_device()
        return torch.bfloat16 if dev.type == "cuda" else torch.float32
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[name]


# Config fields of models whose logits are more than the output layer's product (the restricted
# output layer computes only that product).
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")

# ``h2d`` is the runtime's name for the pinned, non-blocking host-to-device copy.
h2d = to_device


def default_device() -> torch.device:
    return torch.device("cuda:0") if torch.cuda.is_available() else torch.device("cpu")


class ModelRunner:
    """Owns a causal LM and runs cached forwards with explicit masks and positions.

    Args:
        model: a loaded HF causal LM, or ``None`` to load ``model_name`` on :meth:`load_model`.
        model_name: alias / directory / HF id (used when ``model`` is None).
        device, device_map, dtype: placement (see the engine configs).
        fold_gqa: forwards fold a GQA model's head groups into the query rows
            (:mod:`specsplit.runtime.attention`).
        fuse_projections: fuse q/k/v and gate/up into one GEMM each (:mod:`specsplit.runtime.fused`),
            in place, once the model is placed.
        attention_kernel: ``"math"``: tree forwards attend through the folded matmul kernel at any
            prefix length (:mod:`specsplit.runtime.attention`); ``"sdpa"``: only from long prefixes on.
        pack_weights: pack the linear layers' weights for the CPU (:mod:`specsplit.runtime.packed`),
            in place; ``None``: only a model this runner loads itself, when it is float32 on a CPU.
        vocab_subset: score only this many best-ranked tokens in the output layer (a draft's
            option, :mod:`specsplit.runtime.vocab_subset`); the model itself is left as it is.
        vocab_ranking: token ids, best first, for ``vocab_subset`` (``None``: id order).
        quantize: ``"int8"``: int8 linear weights (:mod:`specsplit.runtime.int8`; a draft's option),
            in place; ``"auto"``: only a model this runner loads itself, on a CPU, where the int8
            kernel is the faster one here; ``"none"``: never.
    """

    def __init__(
        self,
        model: torch.nn.Module | None,
        model_name: str | None,
        device: str | None,
        device_map: Any,
        dtype: str,
        fold_gqa: bool = False,
        fuse_projections: bool = False,
        attention_kernel: str = "sdpa",
        pack_weights: bool | None = None,
        vocab_subset: int | None = None,
        vocab_ranking: Sequence[int] | None = None,
        quantize: str = "none",
    ):
        if pack_weights and fuse_projections:
            raise ConfigError("pack_weights and fuse_projections exclude each other: packing is for the "
                              "CPU, fused projections for the GPU")  # fmt: skip
        self.model = model
        self._pack = pack_weights
        self._quantize = quantize
        self._fold_gqa = fold_gqa
        self._fuse = fuse_projections
        self._attention_kernel = attention_kernel
        self._vocab_subset, self._vocab_ranking = vocab_subset, vocab_ranking
        self.head: SubsetHead | None = None  # the restricted output layer, when vocab_subset is set
        self.attention_kwargs: dict[str, Any] = {}  # reach the attention function on every forward
        self.model_name = model_name or (getattr(getattr(model, "config", None), "_name_or_path", "") or "")
        self._device = device
        self._device_map = device_map
        self._dtype = dtype
        self.forward_count = 0  # number of model forwards (tests count one per verify round)
        self._lock = threading.Lock()
        if model is not None:
            self._prepare(model, loaded=False)

    # ------------------------------------------------------------------ loading
    @property
    def is_loaded(self) -> bool:
        return self.model is not None

    def load_model(self) -> None:
        if self.model is not None:
            return
        if not self.model_name:
            raise ModelLoadError("no model given: pass a model object or set config.model")
        from specsplit.models import load_model

        dev = None if self._device_map is not None else (self._device or str(default_device()))
        dtype = resolve_dtype(self._dtype, dev)
        t0 = time.perf_counter()
        self.model = load_model(self.model_name, dtype=dtype, device=dev, device_map=self._device_map)
        self._prepare(self.model, loaded=True)
        logger.info("loaded %s on %s in %.1fs", self.model_name, self.input_device, time.perf_counter() - t0)

    def _prepare(self, model: Any, loaded: bool) -> None:
        model.eval()
        if self._device is not None and self._device_map is None and not hasattr(model, "hf_device_map"):
            model.to(self._device)
        if self._dtype != "auto" and self._device_map is None:
            want = resolve_dtype(self._dtype, self._device)
            if next(model.parameters()).dtype != want:
                model.to(want)
        cfg = model.config
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.config_vocab_size = int(getattr(cfg, "vocab_size", self.vocab_size))
        self.num_layers = int(cfg.num_hidden_layers)
        self.dtype = next(model.parameters()).dtype
        self.input_device = model.get_input_embeddings().weight.device
        self.output_device = model.get_output_embeddings().weight.device
        math = self._attention_kernel == "math"
        fold: bool | str = "math" if math else (self._fold_gqa and gqa_group(model) > 1)
        # On CUDA the attention function also keeps the engines' masked SDPA off cuDNN (a plan build
        # per new prompt length and thread: specsplit.runtime.attention); elsewhere a model that neither
        # folds nor uses the math kernel keeps its own attention.
        cuda = self.input_device.type == "cuda" and AVOID_CUDNN
        if (fold or cuda) and install_attention(model, allow_from=("sdpa",)):
            self.attention_kwargs = {ENGINE_KWARG: True, FOLD_KWARG: fold}
        if self._fuse:
            from specsplit.runtime.fused import fuse_projections

            logger.info("fused the projections of %d modules", fuse_projections(model))
        elif wants_int8(str(self._quantize), model, excluded=not loaded or bool(self._pack)):
            if not quantizable(model):
                raise ConfigError(
                    "quantize='int8' needs a model on a CPU and a torch with the int8 weight kernel"
                )
            quantize_linears(model)
        elif self._pack or (self._pack is None and loaded and packable(model)):
            if not packable(model):
                raise ConfigError("pack_weights needs a float32 model on a CPU and a torch with oneDNN")
            pack_linears(model)
        if self._vocab_subset is not None and self._vocab_subset < self.vocab_size:
            scaled = [a for a in _LOGIT_TRANSFORMS if getattr(cfg, a, None) not in (None, 1.0)]
            if scaled:
                raise ConfigError(f"vocab_subset: this model transforms its logits ({', '.join(scaled)}), "
                                  "which the restricted output layer would skip")  # fmt: skip
            head = model.get_output_embeddings()
            ids = subset_ids(self.vocab_size, self._vocab_subset, self._vocab_ranking, special_ids(model))
            self.head = SubsetHead(
                head, ids, pack=isinstance(head, PackedLinear), int8=isinstance(head, Int8Linear)
            )
            logger.info("the output layer scores %d of %d tokens", ids.numel(), self.vocab_size)

    def require(self) -> torch.nn.Module:
        if self.model is None:
            raise ModelLoadError("model not loaded: call load_model() first")
        return self.model

    # ------------------------------------------------------------------ forward
    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        mask: torch.Tensor,
        cache: StaticKVCache,
        logits_to_keep: int | torch.Tensor,
        **attention_kwargs: Any,
    ) -> torch.Tensor:
        """One cached forward.

        Args:
            input_ids: `[1, q]` int64.
            position_ids: `[1, q]` int64 absolute positions.
            mask: `[1, 1, q, cache.seq_len + q]` additive float mask (model dtype).
            cache: the session cache (appended to).
            logits_to_keep: how many trailing rows of logits to compute, or a `[k]` int64 tensor
                of the rows.
            **attention_kwargs: passed through the model to its attention function (e.g. the
                SpecPV query recorder, see :mod:`specsplit.engines.partial_kv`).

        Returns:
            `[logits_to_keep, vocab]` (or `[k, vocab]`) logits (on the output device).
        """
        dev = self.input_device
        logits = self.logits(
            h2d(input_ids, dev),
            h2d(position_ids, dev),
            h2d(mask, dev),
            cache,
            logits_to_keep,
            **self.attention_kwargs,
            **attention_kwargs,
        )
        self.forward_count += 1
        return logits[0]

    def logits(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        mask: torch.Tensor,
        cache: Any,
        logits_to_keep: int | torch.Tensor,
        **kwargs: Any,
    ) -> torch.Tensor:
        """The model's call on device tensors: `[B, k, vocab]` logits of the kept rows, through the
        restricted output layer when there is one (``kwargs`` reach the model's attention)."""
        model: Any = self.require()
        if self.head is None:
            out = model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask,
                        past_key_values=cache, use_cache=True, logits_to_keep=logits_to_keep, **kwargs)  # fmt: skip
            logits: torch.Tensor = out.logits
            return logits
        hidden = model.get_decoder()(input_ids=input_ids, position_ids=position_ids, attention_mask=mask,
                                     past_key_values=cache, use_cache=True, **kwargs).last_hidden_state  # fmt: skip
        if isinstance(logits_to_keep, torch.Tensor):
            hidden = hidden.index_select(1, logits_to_keep.to(hidden.device))
        elif logits_to_keep:  # 0 keeps every row, as in transformers
            hidden = hidden[:, -logits_to_keep:]
        out_logits: torch.Tensor = self.head(hidden)
        return out_logits

    def new_cache(self, capacity: int) -> StaticKVCache:
        return StaticKVCache(self.num_layers, max(capacity, 16))

    def check_token_ids(self, ids: list[int], what: str) -> None:
        """Raise InvalidRequest for non-int or out-of-vocab ids (host-side, no device work)."""
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool) or t < 0 or t >= self.vocab_size:
                raise InvalidRequest(
                    f"{what}: token id {t!r} is outside the vocabulary [0, {self.vocab_size})"
                )


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
