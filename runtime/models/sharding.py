"""Which slice of each checkpoint weight a rank of a Llama-family model reads (tensor parallelism).

The layers are built with a rank's share (`LlamaAttention`, `GatedMLP`, the vocabulary-parallel
embedding and head); this names, in Hugging Face terms, the rows or columns of the stored tensors
that fill them, so the loader reads only those (`TensorShard`, logical [out, in] coordinates):

- q/k/v rows of this rank's heads (KV heads replicated when fewer than ranks), gate/up rows of
  its share of the intermediate size, and their biases: column-parallel;
- o_proj and down_proj columns matching those rows: row-parallel (their biases are held whole);
- embed_tokens and lm_head rows of this rank's vocabulary range.

Norms (q/k norms included: they act on one head at a time) are held whole by every rank.
"""

from __future__ import annotations

from kvasir.runtime.config import ModelConfig
from kvasir.runtime.parallel.group import TensorParallel
from kvasir.runtime.parallel.partition import TensorShard, head_shard, vocab_shard


def llama_weight_shards(config: ModelConfig, parallel: TensorParallel) -> dict[str, TensorShard]:
    """Checkpoint name -> this rank's slice, for every sharded weight; empty at size 1."""
    if parallel.size == 1:
        return {}
    head_dim = config.head_dim
    heads = head_shard(parallel, config.num_attention_heads, config.num_key_value_heads)
    q_rows = TensorShard(0, heads.q_start * head_dim, (heads.q_start + heads.num_heads) * head_dim)
    kv_rows = TensorShard(0, heads.kv_start * head_dim, (heads.kv_start + heads.num_kv_heads) * head_dim)
    mlp_start, mlp_stop = parallel.shard(config.intermediate_size, "the MLP's intermediate_size")
    mlp_rows = TensorShard(0, mlp_start, mlp_stop)
    column_parallel = {
        "self_attn.q_proj": q_rows,
        "self_attn.k_proj": kv_rows,
        "self_attn.v_proj": kv_rows,
        "mlp.gate_proj": mlp_rows,
        "mlp.up_proj": mlp_rows,
    }
    row_parallel = {
        "self_attn.o_proj": TensorShard(1, q_rows.start, q_rows.stop),
        "mlp.down_proj": TensorShard(1, mlp_start, mlp_stop),
    }
    vocab_start, vocab_stop, _padded = vocab_shard(parallel, config.vocab_size)
    vocab_rows = TensorShard(0, vocab_start, vocab_stop)
    shards = {"model.embed_tokens.weight": vocab_rows, "lm_head.weight": vocab_rows}
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}."
        for name, rows in column_parallel.items():
            shards[f"{prefix}{name}.weight"] = rows
            shards[f"{prefix}{name}.bias"] = rows
        for name, columns in row_parallel.items():
            shards[f"{prefix}{name}.weight"] = columns
    return shards
