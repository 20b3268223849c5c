"""Frozen configuration dataclasses shared by the runtime's layers.

`ModelConfig` is what the loaders produce and the model files consume: the architecture's shape,
independent of where the weights came from (a Hugging Face folder or a GGUF file).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a decoder-only transformer of the Llama family."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    # Qwen2 puts a bias on q/k/v; Llama may too (`attention_bias`).
    attention_bias: bool = False
    # Qwen3 normalises q and k per head before rotary embedding.
    qk_norm: bool = False
    # Hugging Face `rope_scaling` dict (`rope_type`/`type` of "llama3" or "linear"), or None.
    rope_scaling: dict[str, Any] | None = None
    # Mistral-style sliding-window attention (None: full attention).
    sliding_window: int | None = None
    hidden_act: str = "silu"
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    # The raw Hugging Face config, for anything a model file needs beyond the fields above.
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes one token takes across all layers, per byte of element size."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim
