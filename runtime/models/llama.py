"""Llama (2, 3.x) over the paged KV cache; the base the other families vary through `LlamaVariant`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from kvasir.kernels.cpu_ops.decoder_stack import DecoderStack
from kvasir.runtime.config import ModelConfig
from kvasir.runtime.layers.attention import Attention, AttentionMetadata
from kvasir.runtime.layers.embedding import VocabEmbedding
from kvasir.runtime.layers.linear import Linear, MergedLinear
from kvasir.runtime.layers.lora import LoRAStep
from kvasir.runtime.layers.mlp import GatedMLP
from kvasir.runtime.layers.norm import RMSNorm
from kvasir.runtime.layers.rotary import RotaryEmbedding
from kvasir.runtime.layers.tensor_parallel import RowParallelLinear, VocabParallelEmbedding, gather_logits
from kvasir.runtime.models.base import CausalLM
from kvasir.runtime.models.cpu_decoder_stack import bind_decoder_stack
from kvasir.runtime.models.sharding import llama_weight_shards
from kvasir.runtime.parallel.group import SINGLE, TensorParallel
from kvasir.runtime.parallel.partition import TensorShard, head_shard, vocab_shard


@dataclass(frozen=True)
class LlamaVariant:
    """How a family's layers differ from plain Llama; each model class derives one from its config."""

    qkv_bias: bool
    o_proj_bias: bool
    mlp_bias: bool
    # Qwen3: RMSNorm over each head of q and k, before the rotary embedding.
    qk_norm: bool
    # One entry per layer: that layer's sliding attention window, or None for full attention.
    sliding_windows: tuple[int | None, ...]


class LlamaAttention(nn.Module):
    """q/k/v projections (one GEMM), rotary embedding and paged attention; named `self_attn` as in HF.

    Under tensor parallelism a rank holds its heads' rows of q/k/v (column-parallel, no
    communication), attends over them alone, and o_proj (row-parallel) sums the ranks' shares."""

    def __init__(
        self, config: ModelConfig, variant: LlamaVariant, layer_idx: int, parallel: TensorParallel = SINGLE
    ) -> None:
        super().__init__()
        hidden, head_dim = config.hidden_size, config.head_dim
        quantized = config.quantization is not None
        heads = head_shard(parallel, config.num_attention_heads, config.num_key_value_heads)
        num_heads, num_kv_heads = heads.num_heads, heads.num_kv_heads
        self.head_dim = head_dim
        self.layer_idx = layer_idx  # which of the LoRA pool's layers this one reads
        self.qkv_proj = MergedLinear(
            hidden,
            {
                "q_proj": num_heads * head_dim,
                "k_proj": num_kv_heads * head_dim,
                "v_proj": num_kv_heads * head_dim,
            },
            bias=variant.qkv_bias,
            quantized=quantized,
        )
        # Row-parallel at every size: size 1 sums its partial as N ranks do (layers/tensor_parallel.py).
        self.o_proj = RowParallelLinear(
            num_heads * head_dim, hidden, parallel, bias=variant.o_proj_bias, quantized=quantized
        )
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps) if variant.qk_norm else None
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps) if variant.qk_norm else None
        self.attn = Attention(
            num_heads,
            num_kv_heads,
            head_dim,
            scale=head_dim**-0.5,
            sliding_window=variant.sliding_windows[layer_idx],
        )

    def forward(
        self,
        hidden: Tensor,
        rotary: tuple[Tensor, Tensor],
        kv_cache: tuple[Tensor, Tensor],
        attn: AttentionMetadata,
    ) -> Tensor:
        num_tokens = hidden.shape[0]
        if attn.lora is not None:
            return self._forward_lora(hidden, rotary, kv_cache, attn, attn.lora)
        q, k, v = (part.view(num_tokens, -1, self.head_dim) for part in self.qkv_proj.forward_parts(hidden))
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return self.o_proj.forward(self.attn.forward(q, k, v, kv_cache, attn, rotary))

    def _forward_lora(
        self,
        hidden: Tensor,
        rotary: tuple[Tensor, Tensor],
        kv_cache: tuple[Tensor, Tensor],
        attn: AttentionMetadata,
        lora: LoRAStep,
    ) -> Tensor:
        """`forward` with the step's adapters added to q, k, v and o (only steps with adapter rows)."""
        num_tokens, weights = hidden.shape[0], lora.layers[self.layer_idx]
        qkv = lora.linear(self.qkv_proj, weights.qkv, hidden)
        q, k, v = (
            part.view(num_tokens, -1, self.head_dim)
            for part in qkv.split_with_sizes(self.qkv_proj.output_sizes, dim=-1)
        )
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return lora.linear(self.o_proj, weights.o, self.attn.forward(q, k, v, kv_cache, attn, rotary))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks; the residual stream is carried between layers un-added.

    Inside the decoder stack submodules are called through `forward`, not `__call__`: a CPU decode
    step makes about 240 such calls, and `nn.Module.__call__`'s hook bookkeeping costs about a
    microsecond each (Kvasir registers no hooks on these modules)."""

    def __init__(
        self, config: ModelConfig, variant: LlamaVariant, layer_idx: int, parallel: TensorParallel = SINGLE
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, variant, layer_idx, parallel)
        self.mlp = GatedMLP(
            config.hidden_size,
            config.intermediate_size,
            bias=variant.mlp_bias,
            quantized=config.quantization is not None,
            parallel=parallel,
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        hidden: Tensor,
        residual: Tensor | None,
        rotary: tuple[Tensor, Tensor],
        kv_cache: tuple[Tensor, Tensor],
        attn: AttentionMetadata,
    ) -> tuple[Tensor, Tensor]:
        """Returns (this layer's MLP output, the residual it still has to be added to)."""
        # Adding the residual inside the next norm saves a pass over the activations; the sums
        # are the same ones transformers computes, in the same order.
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm.forward(hidden)
        else:
            hidden, residual = self.input_layernorm.forward(hidden, residual)
        hidden = self.self_attn.forward(hidden, rotary, kv_cache, attn)
        hidden, residual = self.post_attention_layernorm.forward(hidden, residual)
        if attn.lora is not None:
            return self.mlp.forward_lora(
                hidden, attn.lora, attn.lora.layers[self.self_attn.layer_idx]
            ), residual
        return self.mlp.forward(hidden), residual


class LlamaModel(nn.Module):
    """The transformer body (`model.*` in HF names): embedding, decoder layers, final norm."""

    def __init__(self, config: ModelConfig, variant: LlamaVariant, parallel: TensorParallel = SINGLE) -> None:
        super().__init__()
        quantized = config.quantization is not None
        self.parallel = parallel
        self.embed_tokens: VocabEmbedding
        if parallel.size > 1:
            start, stop, _padded = vocab_shard(parallel, config.vocab_size)
            self.embed_tokens = VocabParallelEmbedding(
                start, stop, config.hidden_size, parallel, quantized=quantized
            )
        else:
            self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, quantized=quantized)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, variant, i, parallel) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        # The layers bound to the CPU decoder stack (`cpu_decoder_stack`), at the first forward pass
        # (the weights are loaded by then); forgotten when the parameters move (`_apply`).
        self._cpu_stack: DecoderStack | None = None
        self._cpu_stack_bound = False

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> LlamaModel:
        self._cpu_stack, self._cpu_stack_bound = None, False
        return super()._apply(fn, recurse)

    def _run_cpu_stack(
        self,
        hidden: Tensor,
        rotary: tuple[Tensor, Tensor],
        kv_caches: list[tuple[Tensor, Tensor]],
        attn: AttentionMetadata,
    ) -> Tensor | None:
        """Every layer and the final norm in one C call (adapter rows with their LoRA terms), where
        this step and model allow it."""
        if not self._cpu_stack_bound:
            self._cpu_stack, self._cpu_stack_bound = bind_decoder_stack(self), True
        stack = self._cpu_stack
        if stack is None or hidden.dtype != torch.float32 or hidden.device.type != "cpu":
            return None
        lora = None
        if attn.lora is not None:
            if attn.lora.stack_pool is None:
                return None  # a pool the C code cannot read: the layers add the adapters' terms
            lora = (attn.lora.stack_pool, attn.lora.rows)
        # The step's C attention (checked once per step, shared with the layer-by-layer path): None
        # where those kernels do not take this step (a long prompt chunk runs SDPA, layer by layer).
        step = attn.cpu_step(
            hidden.new_empty((hidden.shape[0], stack.num_heads, stack.head_dim)), kv_caches[0][0]
        )
        if step is None:
            return None
        # `hidden` is the embedding's fresh output: the stack overwrites it with the result.
        return stack.run(hidden.contiguous(), step, *rotary, kv_caches, lora)

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        kv_caches: list[tuple[Tensor, Tensor]],
        attn: AttentionMetadata,
        num_layers: int | None = None,
    ) -> Tensor:
        layers = self.layers if num_layers is None else self.layers[:num_layers]
        if len(kv_caches) != len(layers):
            raise ValueError(f"got {len(kv_caches)} KV caches for {len(layers)} layers")
        hidden = self.embed_tokens(input_ids)
        rotary = self.rotary_emb(positions)
        if len(layers) > 0:
            stacked = self._run_cpu_stack(hidden, rotary, kv_caches, attn)
            if stacked is not None:
                return stacked
        residual: Tensor | None = None
        for layer, kv_cache in zip(layers, kv_caches, strict=True):
            hidden, residual = layer.forward(hidden, residual, rotary, kv_cache, attn)
        if residual is None:  # no layers at all
            return self.norm(hidden)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(CausalLM):
    """Llama 2/3.x, and the base of Mistral, Qwen2 and Qwen3 (see `variant`).

    With a `parallel` of size N, every rank builds its 1/N of the model (`models.sharding` names
    the slice of each checkpoint weight it reads); `compute_logits` returns the full logits on
    every rank."""

    def __init__(self, config: ModelConfig, parallel: TensorParallel = SINGLE) -> None:
        super().__init__(config, parallel)
        self.model = LlamaModel(config, self.variant(config), parallel)
        # The LM head holds the same vocabulary rows as the embedding (all of them at size 1).
        start, stop, self._padded_vocab = vocab_shard(parallel, config.vocab_size)
        self.lm_head: nn.Linear
        if config.quantization is not None:
            # The head follows the file: its own tensor, or (tied) the embedding's, kept packed.
            self.lm_head = Linear(config.hidden_size, stop - start, quantized=True, online_quantizable=False)
            if config.tie_word_embeddings:
                self.tied_weights["model.embed_tokens.weight"] = "lm_head.weight"
        elif config.tie_word_embeddings:
            # Built on "meta" so no second vocab x hidden matrix is allocated just to be replaced.
            self.lm_head = nn.Linear(config.hidden_size, stop - start, bias=False, device="meta")
            self.lm_head.weight = self.model.embed_tokens.weight
        else:
            self.lm_head = Linear(config.hidden_size, stop - start, bias=False)
        # Inference only: never build an autograd graph, even if a caller forgets inference_mode.
        self.requires_grad_(False)

    @classmethod
    def variant(cls, config: ModelConfig) -> LlamaVariant:
        """Llama: `attention_bias` on all four projections, `mlp_bias` on the MLP, full attention."""
        return LlamaVariant(
            qkv_bias=config.attention_bias,
            o_proj_bias=config.attention_bias,
            mlp_bias=bool(config.extra.get("mlp_bias", False)),
            qk_norm=False,
            sliding_windows=(None,) * config.num_hidden_layers,
        )

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        kv_caches: list[tuple[Tensor, Tensor]],
        attn: AttentionMetadata,
        num_layers: int | None = None,
    ) -> Tensor:
        return self.model(input_ids, positions, kv_caches, attn, num_layers)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        if self.parallel.size > 1:
            local = self.lm_head(hidden).float()
            return gather_logits(local, self.parallel, self._padded_vocab, self.config.vocab_size)
        return self.lm_head(hidden).float()

    def weight_shards(self) -> dict[str, TensorShard]:
        return llama_weight_shards(self.config, self.parallel)
