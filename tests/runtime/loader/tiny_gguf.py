"""A complete tiny Llama GGUF (weights, SentencePiece vocabulary, chat template) whose metadata a test
can override key by key, and GGUF bytes written by hand for what GGUFWriter cannot write.

`write_tiny_gguf(path, meta={...})`: each `meta` key replaces the default value (None removes it);
`layers` is how many layers' tensors are written, whatever `llama.block_count` claims.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter, TokenType

from tests.gguf_encode import encode

Q = GGMLQuantizationType
HIDDEN, HEADS, KV_HEADS, FFN, LAYERS = 64, 4, 2, 96, 2
HEAD_DIM = HIDDEN // HEADS
PIECES = ["▁", "h", "e", "l", "o", "▁h", "he", "ll", "lo", "hel", "llo", "▁hello", "w", "r", "d", "▁w", "or"]
SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
TOKENS = [*SPECIALS, *(f"<0x{b:02X}>" for b in range(256)), *PIECES]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def default_metadata() -> dict[str, Any]:
    types = [
        TokenType.UNKNOWN,
        *[TokenType.CONTROL] * 4,
        *[TokenType.BYTE] * 256,
        *[TokenType.NORMAL] * len(PIECES),
    ]
    return {
        "llama.block_count": LAYERS,
        "llama.embedding_length": HIDDEN,
        "llama.feed_forward_length": FFN,
        "llama.attention.head_count": HEADS,
        "llama.attention.head_count_kv": KV_HEADS,
        "llama.context_length": 256,
        "llama.attention.layer_norm_rms_epsilon": 1e-5,
        "llama.rope.freq_base": 10000.0,
        "llama.vocab_size": len(TOKENS),
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": TOKENS,
        "tokenizer.ggml.scores": [0.0] * 261 + [-float(i) for i in range(len(PIECES))],
        "tokenizer.ggml.token_type": [int(t) for t in types],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.chat_template": CHAT_TEMPLATE,
    }


def tiny_tensors(layers: int = LAYERS, vocab: int = len(TOKENS)) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / cols**0.5).astype(np.float32)

    tensors = {
        "token_embd.weight": matrix(vocab, HIDDEN),
        "output_norm.weight": np.ones(HIDDEN, dtype=np.float32),
        "output.weight": matrix(vocab, HIDDEN),
    }
    for i in range(layers):
        tensors |= {
            f"blk.{i}.attn_norm.weight": np.ones(HIDDEN, dtype=np.float32),
            f"blk.{i}.ffn_norm.weight": np.ones(HIDDEN, dtype=np.float32),
            f"blk.{i}.attn_q.weight": matrix(HEADS * HEAD_DIM, HIDDEN),
            f"blk.{i}.attn_k.weight": matrix(KV_HEADS * HEAD_DIM, HIDDEN),
            f"blk.{i}.attn_v.weight": matrix(KV_HEADS * HEAD_DIM, HIDDEN),
            f"blk.{i}.attn_output.weight": matrix(HIDDEN, HEADS * HEAD_DIM),
            f"blk.{i}.ffn_gate.weight": matrix(FFN, HIDDEN),
            f"blk.{i}.ffn_up.weight": matrix(FFN, HIDDEN),
            f"blk.{i}.ffn_down.weight": matrix(HIDDEN, FFN),
        }
    return tensors


def write_tiny_gguf(
    path: Path,
    *,
    meta: dict[str, Any] | None = None,
    layers: int = LAYERS,
    matrix_type: GGMLQuantizationType = Q.F32,
    tensors: dict[str, np.ndarray] | None = None,
    encode_floats: bool = True,
) -> Path:
    """The tiny model with `meta` over the default metadata; matrices stored as `matrix_type`
    (`tensors` may hold raw blocks, uint8, already encoded in it; with `encode_floats` false, float
    matrices stay F32)."""
    metadata = default_metadata()
    metadata.update(meta or {})
    writer = GGUFWriter(str(path), "llama")
    for key, value in metadata.items():
        if value is not None:
            _add(writer, key, value)
    for name, values in (tensors if tensors is not None else tiny_tensors(layers)).items():
        if values.dtype == np.uint8:
            writer.add_tensor(name, values, raw_dtype=matrix_type)
        elif values.ndim == 1 or matrix_type == Q.F32 or not encode_floats:
            writer.add_tensor(name, values)
        else:
            writer.add_tensor(name, encode(values, matrix_type), raw_dtype=matrix_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add(writer: GGUFWriter, key: str, value: Any) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        (writer.add_uint32 if 0 <= value < 2**32 else writer.add_int64 if value < 0 else writer.add_uint64)(
            key, value
        )
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    else:
        writer.add_array(key, value)


def gguf_bytes(fields: list[bytes], *, tensors: int = 0) -> bytes:
    """A GGUF v3 header holding these already-encoded metadata fields (see `field`) and no data."""
    return b"GGUF" + struct.pack("<IQQ", 3, tensors, len(fields)) + b"".join(fields)


def gguf_string(text: str) -> bytes:
    data = text.encode()
    return struct.pack("<Q", len(data)) + data


def field(key: str, kind: GGUFValueType, payload: bytes) -> bytes:
    return gguf_string(key) + struct.pack("<I", kind) + payload


def nested_array(depth: int) -> bytes:
    """The payload of an ARRAY value holding one array `depth` levels deep (an empty one inside)."""
    level = struct.pack("<IQ", GGUFValueType.ARRAY, 1)
    return level * depth + struct.pack("<IQ", GGUFValueType.UINT8, 0)
