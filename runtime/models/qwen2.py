"""Qwen2 / Qwen2.5: Llama with a bias on q/k/v (not on o_proj), and optional per-layer sliding windows."""

from __future__ import annotations

from kvasir.runtime.config import ModelConfig
from kvasir.runtime.loader.errors import ModelLoadError
from kvasir.runtime.models.llama import LlamaForCausalLM, LlamaVariant


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Sliding windows apply only when `use_sliding_window` is set (ModelConfig.sliding_window)."""

    @classmethod
    def variant(cls, config: ModelConfig) -> LlamaVariant:
        return LlamaVariant(
            qkv_bias=True,
            o_proj_bias=False,
            mlp_bias=False,
            qk_norm=False,
            sliding_windows=qwen_sliding_windows(config),
        )


def qwen_sliding_windows(config: ModelConfig) -> tuple[int | None, ...]:
    """Each layer's window: per `layer_types` when given, else layers from `max_window_layers` on."""
    num_layers = config.num_hidden_layers
    if config.sliding_window is None:
        return (None,) * num_layers
    layer_types = config.extra.get("layer_types")
    if layer_types is None:
        first = int(config.extra.get("max_window_layers", num_layers))
        layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    if len(layer_types) != num_layers:
        raise ModelLoadError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
    return tuple(config.sliding_window if t == "sliding_attention" else None for t in layer_types)
