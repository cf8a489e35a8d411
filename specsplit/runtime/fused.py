"""Fused projections: one GEMM for q/k/v and one for gate/up in every decoder layer.

At batch 1 a decode or verify step is a chain of small GEMMs, and each costs a kernel's latency far
more than its weight read (see benchmarks/NOTES.md, "Fused projections"). A Llama/Qwen2 layer runs
seven: q, k, v, o, gate, up, down. Concatenating the weights of q/k/v and of gate/up leaves four,
with the same arithmetic.

:func:`fuse_projections` rewrites a loaded model in place:

- the fused weight is ONE new tensor (a non-persistent buffer), and the original
  ``q_proj``/``k_proj``/``v_proj`` (and ``gate_proj``/``up_proj``) parameters become views of it.
  No memory is added, and ``state_dict()`` has exactly the original keys. Fuse after placing the
  model: moving it later copies the buffer and the views apart;
- each supported attention and MLP module gets a forward that multiplies once and splits the
  result. Everything after the split is transformers' own code path.

It applies to the module classes whose forward it reproduces: Llama and Qwen2 (Qwen2.5) attention
and their gated MLPs. Other modules are left alone. The switch is opt-in
(``DraftConfig/TargetConfig.fuse_projections``). It changes the model for every caller, HF
``generate()`` included: same weights and arithmetic, other GEMM shapes, so low-order bits can differ.
"""

from __future__ import annotations

import importlib
import logging
import types
from typing import Any

import torch
import torch.nn.functional as F
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

logger = logging.getLogger(__name__)

ATTENTION_CLASSES = ("LlamaAttention", "Qwen2Attention")
MLP_CLASSES = ("LlamaMLP", "Qwen2MLP")


def _concat_as_views(linears: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) holding every linear's rows; each linear's parameters become views of it."""
    weight = torch.cat([m.weight.detach() for m in linears])
    bias = None
    if any(m.bias is not None for m in linears):
        parts = [
            m.bias.detach() if m.bias is not None else m.weight.new_zeros(m.out_features) for m in linears
        ]
        bias = torch.cat(parts)
    start = 0
    for m in linears:
        end = start + m.out_features
        m.weight = torch.nn.Parameter(weight[start:end], requires_grad=False)
        if m.bias is not None and bias is not None:
            m.bias = torch.nn.Parameter(bias[start:end], requires_grad=False)
        start = end
    return weight, bias


def _fused_attention_forward(
    self: Any,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor | None,
    past_key_values: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' Llama/Qwen2 attention forward (5.x) with q/k/v from one GEMM."""
    modeling = self._specsplit_modeling
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    qkv = F.linear(hidden_states, self.qkv_weight, self.qkv_bias)
    q, k, v = qkv.split(self._specsplit_qkv_sizes, dim=-1)
    query_states = q.reshape(hidden_shape).transpose(1, 2)
    key_states = k.reshape(hidden_shape).transpose(1, 2)
    value_states = v.reshape(hidden_shape).transpose(1, 2)
    cos, sin = position_embeddings
    query_states, key_states = modeling.apply_rotary_pos_emb(query_states, key_states, cos, sin)
    if past_key_values is not None:
        key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx)
    attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(
        self.config._attn_implementation, modeling.eager_attention_forward
    )
    extra = {"sliding_window": self.sliding_window} if hasattr(self, "sliding_window") else {}
    attn_output, attn_weights = attention_interface(
        self,
        query_states,
        key_states,
        value_states,
        attention_mask,
        dropout=0.0 if not self.training else self.attention_dropout,
        scaling=self.scaling,
        **extra,
        **kwargs,
    )
    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    return self.o_proj(attn_output), attn_weights


def _fused_mlp_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x, self.gate_up_weight).chunk(2, dim=-1)
    return self.down_proj(self.act_fn(gate) * up)


def _fuse_attention(attn: Any) -> bool:
    projs = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj")]
    linears = [p for p in projs if isinstance(p, torch.nn.Linear)]
    if type(attn).__name__ not in ATTENTION_CLASSES or len(linears) != 3:
        return False
    attn._specsplit_modeling = importlib.import_module(type(attn).__module__)
    attn._specsplit_qkv_sizes = [p.out_features for p in linears]
    weight, bias = _concat_as_views(linears)
    # Non-persistent buffers: not in state_dict() or parameters(); the projections' parameters are views.
    attn.register_buffer("qkv_weight", weight, persistent=False)
    attn.register_buffer("qkv_bias", bias, persistent=False)
    attn.forward = types.MethodType(_fused_attention_forward, attn)
    return True


def _fuse_mlp(mlp: Any) -> bool:
    gate, up = getattr(mlp, "gate_proj", None), getattr(mlp, "up_proj", None)
    if type(mlp).__name__ not in MLP_CLASSES or not (
        isinstance(gate, torch.nn.Linear) and isinstance(up, torch.nn.Linear)
    ):
        return False
    if gate.bias is not None or up.bias is not None or gate.out_features != up.out_features:
        return False
    mlp.register_buffer("gate_up_weight", _concat_as_views([gate, up])[0], persistent=False)
    mlp.forward = types.MethodType(_fused_mlp_forward, mlp)
    return True


def _hooked_or_offloaded(module: torch.nn.Module) -> bool:
    """accelerate wraps ``forward`` of hooked modules (device alignment, offload): leave those alone,
    and any module whose weights are not materialised on a device."""
    return any(
        hasattr(m, "_hf_hook") or any(p.device.type == "meta" for p in m.parameters(recurse=False))
        for m in module.modules()
    )


def fuse_projections(model: torch.nn.Module) -> int:
    """Fuse q/k/v and gate/up of every supported layer of ``model`` in place; how many modules were fused.

    Idempotent: modules fused before are skipped. A model spread over devices is fused per module
    (each fused weight stays on its module's device).
    """
    n = 0
    for module in model.modules():
        if getattr(module, "_specsplit_fused", False):
            continue
        name = type(module).__name__
        if name not in ATTENTION_CLASSES + MLP_CLASSES or _hooked_or_offloaded(module):
            continue
        done = (name in ATTENTION_CLASSES and _fuse_attention(module)) or (
            name in MLP_CLASSES and _fuse_mlp(module)
        )
        if done:
            setattr(module, "_specsplit_fused", True)  # noqa: B010 (not a declared attribute)
            n += 1
    if n == 0:
        logger.info("fuse_projections: no supported attention or MLP module in %s", type(model).__name__)
    return n
