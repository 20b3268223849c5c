"""Frozen configuration dataclasses shared by the runtime's layers.

`ModelConfig` is what the loaders produce and the model files consume: the architecture's shape,
independent of where the weights came from (a Hugging Face folder or a GGUF file).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from kvasir.runtime.spec_decode.config import SpeculativeConfig

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


DTYPES = ("auto", "float32", "float16", "bfloat16")
KV_CACHE_DTYPES = ("auto", "fp8")
DEVICES = ("auto", "cpu", "cuda")
BLOCK_SIZES = (8, 16, 32, 64, 128)
SCHEDULING_POLICIES = ("fcfs", "priority")
# The step's token budget when none is given: a GPU step is cheap per token and wants long prefill
# chunks; a CPU step costs in proportion to its tokens, so shorter chunks keep decode latency even.
DEFAULT_BATCHED_TOKENS = {"cuda": 8192, "cpu": 2048}


@dataclass(frozen=True)
class EngineConfig:
    """Everything `kvasir generate` / `kvasir serve` needs to build an engine (CLI flags map 1:1)."""

    model: str
    revision: str | None = None
    download_dir: str | None = None
    hf_token: str | None = None
    served_model_name: str | None = None
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    device: str = "auto"  # auto: CUDA when available
    seed: int = 0
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    block_size: int = 16
    # KV pool size: an explicit block count wins; else a byte budget (CPU) or a fraction of the
    # device memory left free after loading the weights (CUDA).
    num_kv_blocks: int | None = None
    kv_cache_bytes: int = 1 << 30
    kv_cache_memory_fraction: float = 0.9
    # auto: the model's dtype; fp8: float8 e4m3 with a per-tensor scale (half a bf16 cache's bytes).
    kv_cache_dtype: str = "auto"
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None: DEFAULT_BATCHED_TOKENS for the device
    enable_prefix_caching: bool = True
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    # Never capture CUDA graphs (on CUDA with the Triton kernels, decode-only steps replay them):
    # for debugging, or to keep the graphs' capture time and memory.
    enforce_eager: bool = False
    # Speculative decoding (None: off); see kvasir.runtime.spec_decode.config.
    speculative_config: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}"
            )
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.block_size not in BLOCK_SIZES:
            raise ValueError(
                f"block_size must be one of {', '.join(map(str, BLOCK_SIZES))}, got {self.block_size}"
            )
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be at least 1, got {self.num_kv_blocks}")
        if self.kv_cache_bytes < 1:
            raise ValueError(f"kv_cache_bytes must be positive, got {self.kv_cache_bytes}")
        if not 0.0 < self.kv_cache_memory_fraction <= 1.0:
            raise ValueError(
                f"kv_cache_memory_fraction must be in (0, 1], got {self.kv_cache_memory_fraction}"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be at least 1, got {self.max_model_len}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be fcfs or priority, got {self.scheduling_policy!r}")

    def batched_tokens_on(self, device_type: str) -> int:
        """The step's token budget on a device of this type ("cuda" or "cpu")."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return DEFAULT_BATCHED_TOKENS.get(device_type, DEFAULT_BATCHED_TOKENS["cpu"])

    @property
    def model_name(self) -> str:
        """The name clients use for this model (OpenAI `model` field)."""
        return self.served_model_name or self.model
