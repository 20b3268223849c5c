"""Qwen3 (dense): Llama with an RMSNorm on each head of q and k before the rotary embedding."""

from __future__ import annotations

from kvasir.runtime.config import ModelConfig
from kvasir.runtime.models.llama import LlamaForCausalLM, LlamaVariant
from kvasir.runtime.models.qwen2 import qwen_sliding_windows


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Parameters `self_attn.q_norm.weight` / `k_norm.weight` [head_dim]; biases per `attention_bias`."""

    @classmethod
    def variant(cls, config: ModelConfig) -> LlamaVariant:
        return LlamaVariant(
            qkv_bias=config.attention_bias,
            o_proj_bias=config.attention_bias,
            mlp_bias=False,
            qk_norm=True,
            sliding_windows=qwen_sliding_windows(config),
        )
