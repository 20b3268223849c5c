"""Frozen configuration dataclasses shared by the runtime's layers.

`ModelConfig` is what the loaders produce and the model files consume: the architecture's shape,
independent of where the weights came from (a Hugging Face folder or a GGUF file).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvasir.runtime.kv_events_config import KVEventsConfig, parse_kv_events_config
from kvasir.runtime.settings import check_settings, flags_of, setting
from kvasir.runtime.spec_decode.config import SpeculativeConfig, parse_speculative_config
from kvasir.runtime.structured.limits import (
    DEFAULT_COMPILE_TIMEOUT_S,
    DEFAULT_MAX_GRAMMAR_SIZE,
    DEFAULT_MAX_SPEC_BYTES,
    DEFAULT_MAX_WHITESPACE,
    GrammarLimits,
)

# The scheduling policies, by the name `--scheduling-policy` takes (core/request_queue.py maps each
# to its queue, and checks that it covers exactly these).
SCHEDULING_POLICIES = ("fcfs", "priority")

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
    # How the checkpoint stores its weights: one of QUANTIZATION_METHODS, or None (float). The
    # loader sets it; a quantized model builds its linear layers to receive packed weights.
    quantization: str | None = None
    # The raw Hugging Face config, for anything a model file needs beyond the fields above.
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def kv_elements_per_token(self) -> int:
        """KV-cache elements one token takes across all layers, K and V (times the element size: bytes)."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim


DTYPES = ("auto", "float32", "float16", "bfloat16")
# Weight formats kept packed, by vLLM's `--quantization` names (docs/quantization.md).
QUANTIZATION_METHODS = ("gguf", "fp8", "awq", "gptq")
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16", "fp8")
DEVICES = ("auto", "cpu", "cuda")
BLOCK_SIZES = (8, 16, 32, 64, 128)
# The step's token budget when none is given: a GPU step is cheap per token and wants long prefill
# chunks; a CPU step costs in proportion to its tokens, so shorter chunks keep decode latency even.
DEFAULT_BATCHED_TOKENS = {"cuda": 8192, "cpu": 2048}
EMBEDDED_SERVED_NAME = "SmolLM2-135M-Instruct"


# LoRA ranks a slot may be sized for (vLLM's --max-lora-rank choices).
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# What the adapter slot pool is stored in (vLLM's --lora-dtype; "auto" is the model's dtype). vLLM
# has no float32 (its GPU kernels take half types); here float32 is the CPU's own dtype.
LORA_DTYPES = ("auto", "float32", "float16", "bfloat16")


@dataclass(frozen=True)
class EngineConfig:
    """Everything `kvasir generate` / `kvasir serve` needs to build an engine.

    Each field declared with `setting(...)` is also the flag `--field-name` and the environment
    variable `KVASIR_FIELD_NAME`, with the default, choices and range written here and nowhere else.
    """

    model: str
    revision: str | None = setting(help="model revision (branch, tag or commit) for hub ids")
    download_dir: str | None = setting(
        help="where hub downloads are cached (default: the Hugging Face cache)"
    )
    hf_token: str | None = None  # from HF_TOKEN, never a flag: it would show in `ps`
    served_model_name: str | None = setting(
        help=f"the model name clients use (default: --model; '{EMBEDDED_SERVED_NAME}' for embedded)"
    )
    dtype: str = setting("auto", choices=DTYPES, help="auto: bfloat16 on CUDA, float32 on CPU")
    device: str = setting("auto", choices=DEVICES, help="auto: CUDA when available")
    quantization: str | None = setting(
        choices=QUANTIZATION_METHODS,
        help="how the weights are stored and run: gguf, fp8, awq or gptq; fp8 on a float "
        "checkpoint quantizes it at load (default: what the checkpoint declares, else none)",
    )
    seed: int = setting(0, type=int, minimum=0, help="seed for requests that give none")
    max_model_len: int | None = setting(
        type=int, minimum=1, help="context length (default: the model's max_position_embeddings)"
    )
    block_size: int = setting(16, type=int, choices=BLOCK_SIZES, help="tokens per KV-cache block")
    # KV pool size: an explicit block count wins; else a byte budget (CPU) or a fraction of the
    # device memory left free after loading the weights (CUDA).
    # Bounded again at start-up by the device's memory (worker/kv_budget.py); this ceiling keeps the
    # scheduler's block table (a Python object per block) within a few GB whatever the model.
    num_kv_blocks: int | None = setting(
        type=int,
        minimum=1,
        maximum=1 << 24,
        help="KV-cache blocks (overrides the memory budget; must fit in the device's memory)",
    )
    kv_cache_bytes: int = setting(
        1 << 30,
        type=int,
        minimum=1,
        help="KV-cache byte budget on CPU, each machine's: the tensor-parallel ranks on a machine share it (at most its memory)",
    )
    kv_cache_memory_fraction: float = setting(
        0.9,
        type=float,
        minimum=0.01,
        maximum=0.98,
        help="share of the GPU memory left free after loading the weights that the KV cache takes",
    )
    kv_cache_dtype: str = setting(
        "auto",
        choices=KV_CACHE_DTYPES,
        help="auto: float16 on CPU for a float32 model (half the bytes; the CPU attention kernel "
        "reads it as float32), else the model's dtype; fp8: float8 e4m3 (twice the tokens of a bf16 "
        "cache)",
    )
    max_num_seqs: int = setting(256, type=int, minimum=1, maximum=65536, help="most requests running at once")
    max_num_batched_tokens: int | None = setting(
        type=int,
        minimum=1,
        maximum=10_000_000,
        help="token budget per step (default: 8192 on CUDA, 2048 on CPU)",
    )
    long_prefill_token_threshold: int = setting(
        0,
        type=int,
        minimum=0,
        maximum=10_000_000,
        help="most prompt tokens one request may take in a step, so a long prompt shares the step "
        "with others' prefills (0: no cap beyond the step's budget)",
    )
    enable_prefix_caching: bool = setting(
        True, type=bool, help="reuse the KV of shared prompt prefixes (default: on)"
    )
    scheduling_policy: str = setting(
        "fcfs",
        choices=SCHEDULING_POLICIES,
        help="admission order: fcfs, or priority (lower `priority` first, then arrival)",
    )
    # On CUDA with the Triton kernels, decode-only steps replay captured graphs; eager mode is for
    # debugging, or to save the graphs' capture time and memory.
    enforce_eager: bool = setting(
        False,
        type=bool,
        help="never capture CUDA graphs; every step runs eagerly (default: graphs for decode steps on CUDA)",
    )
    # Plan and queue step N+1 while step N runs, feeding N's sampled tokens to N+1 on the device;
    # and detokenize in a child process. Both keep an asynchronous accelerator busy; on a CPU the
    # "accelerator" is the same cores, so None (auto) turns them on with CUDA only.
    async_scheduling: bool | None = setting(
        type=bool,
        help="plan the next step while the current one runs, so the accelerator does not wait for "
        "the host between steps; not with speculative decoding (default: on with CUDA, off on CPU)",
    )
    output_process: bool | None = setting(
        type=bool,
        help="detokenize, check stop strings and build outputs in a separate process, off the "
        "engine's GIL (default: on with CUDA, off on CPU)",
    )
    speculative_config: SpeculativeConfig | None = setting(
        type=parse_speculative_config,
        help='speculative decoding as JSON, e.g. {"method": "ngram", "num_speculative_tokens": 4}; '
        "methods ngram, draft_model (with model), layer_skip (with num_layers) (default: off)",
    )
    structured_outputs_compile_timeout: float = setting(
        DEFAULT_COMPILE_TIMEOUT_S,
        type=float,
        minimum=0.01,
        maximum=600,
        help="seconds a request waits for its grammar (JSON schema, regex, choice, Lark, tools) to "
        "compile; past it the request is refused with a 400 naming this limit",
    )
    structured_outputs_max_spec_bytes: int = setting(
        DEFAULT_MAX_SPEC_BYTES,
        type=int,
        minimum=1,
        maximum=64 * 1024 * 1024,
        help="largest schema, regex or grammar compiled, in bytes of its JSON or text",
    )
    structured_outputs_max_grammar_size: int = setting(
        DEFAULT_MAX_GRAMMAR_SIZE,
        type=int,
        minimum=100,
        maximum=10_000_000,
        help="largest compiled grammar, in symbols of its productions (the grammar engine's limit)",
    )
    structured_outputs_max_whitespace: int = setting(
        DEFAULT_MAX_WHITESPACE,
        type=int,
        minimum=0,
        maximum=1024,
        help="whitespace characters allowed between two tokens of constrained JSON output (0: "
        "compact JSON); bounded so a model fond of spaces still finishes",
    )
    kv_events_config: KVEventsConfig | None = setting(
        type=parse_kv_events_config,
        help="publish KV-cache events (blocks stored/removed) in vLLM's format on ZeroMQ, as JSON, "
        'e.g. {"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "topic": "kv@pod@model"} '
        "(needs pyzmq and msgpack: pip install 'kvasir[kv-events]') (default: off)",
    )

    enable_lora: bool = setting(
        False,
        type=bool,
        help="serve LoRA adapters (PEFT format) on the base model, batched and never merged",
    )
    max_loras: int = setting(
        4,
        type=int,
        minimum=1,
        maximum=256,
        help="adapter slots on the device: the most adapters one step runs (with --enable-lora)",
    )
    max_lora_rank: int = setting(
        16,
        type=int,
        choices=LORA_RANKS,
        help="the largest adapter rank served; slots are sized for it (with --enable-lora)",
    )
    lora_dtype: str = setting(
        "auto",
        choices=LORA_DTYPES,
        help="what the adapter slots hold: auto is the model's dtype (float32 on CPU); bfloat16 "
        "halves the bytes each step reads, its weights rounded to 8 bits of mantissa (with --enable-lora)",
    )
    max_cpu_loras: int | None = setting(
        type=int,
        minimum=1,
        maximum=4096,
        help="adapters kept in host memory, at least --max-loras; the least recently used "
        "beyond it are read from disk again when asked for (default: --max-loras)",
    )

    # One process per rank, rank 0 the serving one (runtime/engine/ranks/): N ranks each hold 1/N of
    # the sharded weights and KV heads. 1 runs the model in this process, as without the flag.
    tensor_parallel_size: int = setting(
        1,
        type=int,
        minimum=1,
        maximum=64,
        help="ranks the model is split across (vLLM's name): one process per rank, NCCL between "
        "GPUs (rank r on cuda:r), gloo on CPU (the CPU threads divided between the ranks)",
    )
    # A stuck collective must end as an error the orchestrator sees, never a silent hang: this
    # bounds every step and start-up collective, and is the process groups' own timeout.
    distributed_timeout_seconds: float = setting(
        120.0,
        type=float,
        minimum=1,
        maximum=3600,
        help="with --tensor-parallel-size above 1: longest a step (or a collective) may take before "
        "the ranks are declared hung, the engine dead and the server exits non-zero",
    )

    # Pipeline parallelism is not implemented; the flag exists (vLLM's name) so that a launcher
    # passing the default works and one asking for stages is refused in one line, not mid-load.
    pipeline_parallel_size: int = setting(
        1,
        type=int,
        minimum=1,
        maximum=64,
        help="pipeline stages (vLLM's name); only 1: Kvasir has no pipeline parallelism (split a "
        "model across nodes with --tensor-parallel-size and --nnodes)",
    )
    # A group spread over several machines (runtime/parallel/topology.py): node 0 serves the API and
    # hosts the rendezvous; nodes 1..N-1 run `kvasir serve --headless`, only their ranks. vLLM's names.
    nnodes: int = setting(
        1,
        type=int,
        minimum=1,
        maximum=64,
        help="machines the --tensor-parallel-size ranks are spread over, the same number on each",
    )
    node_rank: int = setting(
        0,
        type=int,
        minimum=0,
        maximum=63,
        help="this machine's index among --nnodes: 0 serves the API, the others run --headless",
    )
    master_addr: str = setting(
        "127.0.0.1",
        help="with --nnodes above 1: the address of node 0, where every rank meets (the rendezvous)",
    )
    master_port: int = setting(
        29501,
        type=int,
        minimum=1,
        maximum=65535,
        help="with --nnodes above 1: the rendezvous port node 0 listens on (every interface)",
    )

    def __post_init__(self) -> None:
        check_settings(self)
        if self.pipeline_parallel_size != 1:
            raise ValueError(
                f"--pipeline-parallel-size {self.pipeline_parallel_size}: pipeline parallelism is not "
                "implemented; split the model across nodes with --tensor-parallel-size and --nnodes"
            )
        if self.tensor_parallel_size % self.nnodes:
            raise ValueError(
                f"--tensor-parallel-size {self.tensor_parallel_size} does not divide evenly over "
                f"--nnodes {self.nnodes}: every node runs the same number of ranks"
            )
        if self.node_rank >= self.nnodes:
            raise ValueError(
                f"--node-rank {self.node_rank} is out of range for --nnodes {self.nnodes} (0 to {self.nnodes - 1})"
            )
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"--max-cpu-loras ({self.max_cpu_loras}) must be at least --max-loras ({self.max_loras})"
            )

    @property
    def cpu_lora_capacity(self) -> int:
        """Adapters kept in host memory: --max-cpu-loras, or --max-loras when unset."""
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras

    def batched_tokens_on(self, device_type: str) -> int:
        """The step's token budget on a device of this type ("cuda" or "cpu")."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return DEFAULT_BATCHED_TOKENS.get(device_type, DEFAULT_BATCHED_TOKENS["cpu"])

    def context_length(self, model: ModelConfig) -> int:
        """max_model_len for this model: the flag, else the model's own max_position_embeddings."""
        return self.max_model_len or model.max_position_embeddings

    @property
    def grammar_limits(self) -> GrammarLimits:
        """The bounds on compiling a request's grammar (structured output)."""
        return GrammarLimits(
            compile_timeout_s=self.structured_outputs_compile_timeout,
            max_spec_bytes=self.structured_outputs_max_spec_bytes,
            max_grammar_size=self.structured_outputs_max_grammar_size,
            max_whitespace=self.structured_outputs_max_whitespace,
        )

    @property
    def model_name(self) -> str:
        """The name clients use for this model (OpenAI `model` field)."""
        return self.served_model_name or self.model


ENGINE_FLAGS = flags_of(EngineConfig)
