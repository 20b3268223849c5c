"""A Llama-family model's decoder layers bound to the CPU decoder stack (one C call per step).

On a CPU a decode step of a small quantized model is short (a few milliseconds for SmolLM2-135M),
and calling each layer's kernels from Python costs a large share of it: some ten calls a layer,
each with its checks, allocations and ctypes conversion. Where every layer is made of the C
kernels' parts (packed GGUF projections, with or without biases, RMSNorm, optional per-head q/k
norms, rotary, paged attention, a gated SiLU MLP) the whole stack runs in
`kvasir.kernels.cpu_ops.decoder_stack` instead; otherwise (float weights, a projection split into
several kernels, an fp8 cache, a GPU) the layers run one by one as before. Steps with LoRA adapter
rows run in the stack too, reading the worker's slot pool (`LlamaModel._run_cpu_stack`).

`KVASIR_CPU_DECODER_STACK=0` keeps the layer-by-layer path (for comparison and debugging).
Under tensor parallelism each rank's stack runs its shard of the layers (its heads, KV heads and
slice of the MLP), and the C loop calls back for the model's all-reduce after the o and down
GEMMs, where the row-parallel layers do theirs: two a layer, in float64, as the layers'
`RowParallelLinear` sums them, so the stack and the layers agree at every size.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, cast

import torch

from kvasir.kernels.cpu_ops import decoder_stack
from kvasir.kernels.cpu_ops.decoder_stack import DecoderStack, StackLayer
from kvasir.runtime.settings import env_bool

if TYPE_CHECKING:
    from kvasir.runtime.models.llama import LlamaDecoderLayer, LlamaModel

logger = logging.getLogger(__name__)

DISABLE_ENV = "KVASIR_CPU_DECODER_STACK"


def enabled() -> bool:
    """False where `KVASIR_CPU_DECODER_STACK` turns the stack off; ValueError naming it for junk."""
    return env_bool(DISABLE_ENV, True)


def bind_decoder_stack(model: LlamaModel) -> DecoderStack | None:
    """The model's layers bound to the C stack; None (and why, at debug level) where it cannot
    run them all."""
    reason = _unsupported(model)
    layers = [] if reason is not None else [_stack_layer(layer) for layer in _layers(model)]
    if reason is None and None in layers:
        reason = f"layer {layers.index(None)}'s projections are not all packed CPU kernels (float32 norms and biases)"
    if reason is not None:
        logger.debug("decoder layers run one by one on CPU: %s", reason)
        return None
    attention = _layers(model)[0].self_attn.attn
    return DecoderStack(
        [layer for layer in layers if layer is not None],
        model.norm.weight.detach(),
        eps=model.norm.eps,
        num_heads=attention.num_heads,
        num_kv_heads=attention.num_kv_heads,
        head_dim=attention.head_dim,
        scale=attention.scale,
        all_reduce=model.parallel.all_reduce if model.parallel.size > 1 else None,
    )


def _unsupported(model: LlamaModel) -> str | None:
    """Why the stack cannot run this model's layers (beyond their projections), or None."""
    if not enabled():
        return f"{DISABLE_ENV} is off"
    if decoder_stack.library() is None:
        return "the C stack is not built here"
    if len(_layers(model)) == 0:
        return "the model has no layers"
    if not _is_float32_cpu(model.norm.weight):
        return "the final norm's weight is not float32 on the CPU"
    first = _layers(model)[0].self_attn.attn
    shape = (first.num_heads, first.num_kv_heads, first.head_dim, first.scale)
    for index, layer in enumerate(_layers(model)):
        attention = layer.self_attn.attn
        qk_norms = (layer.self_attn.q_norm, layer.self_attn.k_norm)
        if any(norm is not None and norm.eps != model.norm.eps for norm in qk_norms):
            return f"layer {index}'s q/k norms have another epsilon than the final norm's"
        if (attention.num_heads, attention.num_kv_heads, attention.head_dim, attention.scale) != shape:
            return f"layer {index}'s attention differs in shape from layer 0's"
        if attention.k_scale != 1.0 or attention.v_scale != 1.0:
            return f"layer {index} scales its KV cache"
        if {layer.input_layernorm.eps, layer.post_attention_layernorm.eps} != {model.norm.eps}:
            return f"layer {index}'s norms have another epsilon than the final norm's"
    return None


def _layers(model: LlamaModel) -> list[LlamaDecoderLayer]:
    return cast("list[LlamaDecoderLayer]", list(model.layers))


def _stack_layer(layer: LlamaDecoderLayer) -> StackLayer | None:
    """The layer as the C stack takes it; None where a projection is not one packed CPU kernel or
    a norm or bias is not float32 on the CPU."""
    attention, mlp = layer.self_attn, layer.mlp
    projections = {
        "qkv": attention.qkv_proj,
        "o": attention.o_proj,
        "gate_up": mlp.gate_up_proj,
        "down": mlp.down_proj,
    }
    qkv, o, gate_up, down = (linear.tiled_gemm() for linear in projections.values())
    biases = {name: linear.bias.detach() for name, linear in projections.items() if linear.bias is not None}
    q_norm = None if attention.q_norm is None else attention.q_norm.weight.detach()
    k_norm = None if attention.k_norm is None else attention.k_norm.weight.detach()
    input_norm = layer.input_layernorm.weight.detach()
    post_norm = layer.post_attention_layernorm.weight.detach()
    if qkv is None or o is None or gate_up is None or down is None:
        return None
    norms = [input_norm, post_norm, *(norm for norm in (q_norm, k_norm) if norm is not None)]
    if not all(_is_float32_cpu(vector) for vector in (*norms, *biases.values())):
        return None
    return StackLayer(
        qkv,
        o,
        gate_up,
        down,
        input_norm,
        post_norm,
        sliding_window=attention.attn.sliding_window,
        biases=biases,
        q_norm=q_norm,
        k_norm=k_norm,
    )


def _is_float32_cpu(weight: torch.Tensor) -> bool:
    return weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.is_contiguous()
