"""A random-weight GGUF of a real model's shape, in F16, for llama.cpp's `llama-quantize` to turn
into any preset (Q4_K_M, ...): the benchmarks' stand-in for a public file when no hub is reachable.

The default shape is Qwen2.5-0.5B's (hidden 896, 24 layers, 14 query heads and 2 KV heads of 64,
intermediate 4864, a 151,936-token vocabulary tied to the head, q/k/v biases): 494M parameters,
and a hidden size that is not a multiple of 256, so `llama-quantize` falls back from the K-quants
to Q5_0/Q8_0 for every matrix whose rows are 896 long, as it does for the real file. The
tokenizer is the embedded SmolLM2's (byte-level BPE, 49,152 tokens) padded with never-produced
tokens to the vocabulary size, so both servers tokenize the same text the same way. Weights are
Gaussian with transformers' default standard deviation (0.02), norms 1, biases 0.01 * N(0, 1).
With random weights most greedy tokens are padding (68% of the vocabulary), which llama.cpp's
server streams as empty text: compare the servers' per-token times, not counted text chunks.

    python benchmarks/_random_gguf.py /tmp/qwen-0.5b-f16.gguf
    llama-quantize /tmp/qwen-0.5b-f16.gguf /tmp/qwen-0.5b-q4_k_m.gguf Q4_K_M
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from kvasir.runtime.loader.embedded import embedded_model_path


@dataclass(frozen=True)
class GGUFShape:
    hidden: int = 896
    layers: int = 24
    heads: int = 14
    kv_heads: int = 2
    head_dim: int = 64
    intermediate: int = 4864
    vocab: int = 151936


QWEN2_5_0_5B = GGUFShape()


def _copy_tokenizer(writer: gguf.GGUFWriter, vocab: int) -> None:
    """The embedded model's tokenizer keys, its token list padded to `vocab` entries."""
    reader = gguf.GGUFReader(str(embedded_model_path()))
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value = field.contents()
        if key == "tokenizer.ggml.tokens":
            value = [*value, *(f"<|unused_{i}|>" for i in range(vocab - len(value)))]
        elif key == "tokenizer.ggml.token_type":
            value = [*value, *([int(gguf.TokenType.UNUSED)] * (vocab - len(value)))]
        sub_type = field.types[1] if field.types[0] is gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, field.types[0], sub_type)


def write_random_gguf(path: Path, shape: GGUFShape = QWEN2_5_0_5B, seed: int = 0) -> Path:
    """Write the qwen2-architecture F16 file; returns `path`."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_name(f"random qwen2 {shape.hidden}x{shape.layers}")
    writer.add_block_count(shape.layers)
    writer.add_context_length(32768)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(1000000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    _copy_tokenizer(writer, shape.vocab)

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16)

    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    writer.add_tensor("token_embd.weight", matrix(shape.vocab, shape.hidden))
    writer.add_tensor("output_norm.weight", np.ones(shape.hidden, dtype=np.float32))
    for i in range(shape.layers):
        block = f"blk.{i}."
        for name, rows, cols in (
            ("attn_q", q, shape.hidden), ("attn_k", kv, shape.hidden), ("attn_v", kv, shape.hidden),
            ("attn_output", shape.hidden, q), ("ffn_gate", shape.intermediate, shape.hidden),
            ("ffn_up", shape.intermediate, shape.hidden), ("ffn_down", shape.hidden, shape.intermediate),
        ):  # fmt: skip
            writer.add_tensor(f"{block}{name}.weight", matrix(rows, cols))
        for name, size in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
            writer.add_tensor(f"{block}{name}.bias", rng.standard_normal(size, dtype=np.float32) * 0.01)
        writer.add_tensor(f"{block}attn_norm.weight", np.ones(shape.hidden, dtype=np.float32))
        writer.add_tensor(f"{block}ffn_norm.weight", np.ones(shape.hidden, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("path", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    write_random_gguf(args.path, seed=args.seed)
