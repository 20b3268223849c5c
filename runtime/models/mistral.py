"""Mistral: Llama without biases, with sliding-window attention in every layer when configured."""

from __future__ import annotations

from kvasir.runtime.config import ModelConfig
from kvasir.runtime.models.llama import LlamaForCausalLM, LlamaVariant


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral 7B v0.1 uses a 4096-token window; later versions set `sliding_window` to null."""

    @classmethod
    def variant(cls, config: ModelConfig) -> LlamaVariant:
        return LlamaVariant(
            qkv_bias=False,
            o_proj_bias=False,
            mlp_bias=False,
            qk_norm=False,
            sliding_windows=(config.sliding_window,) * config.num_hidden_layers,
        )
