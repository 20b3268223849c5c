"""Metadata that would make the loader allocate from a lie, or crash on a shape it does not expect,
is refused with a ModelLoadError naming the key: a context length past the KV budget, zero or
non-numeric sizes, arrays nested or counted past the file, malformed token lists, and NaN scales
in quantized tensors (GGUF blocks, AWQ/GPTQ scales)."""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGUFValueType
from safetensors.torch import load_file, save_file

from kvasir.runtime.config import EngineConfig
from kvasir.runtime.loader.errors import ModelLoadError
from kvasir.runtime.loader.gguf_checkpoint import GGUFCheckpoint
from kvasir.runtime.loader.model_files import open_engine_model, open_model
from tests.gguf_encode import encode
from tests.quantized_checkpoints import make_quantized_checkpoint
from tests.runtime.loader.tiny_gguf import (
    Q,
    field,
    gguf_bytes,
    gguf_string,
    nested_array,
    tiny_tensors,
    write_tiny_gguf,
)

# --- the context length against the KV cache ---------------------------------------------------


def test_a_context_length_past_the_kv_budget_is_refused_before_loading(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "long.gguf", meta={"llama.context_length": 2**28})
    with pytest.raises(
        ModelLoadError,
        match=r"long\.gguf: one sequence of 268,435,456 tokens \(the model's context length\) needs "
        r"16,777,216 KV-cache blocks of 16 tokens, and --kv-cache-bytes holds at most 262,144; lower "
        r"--max-model-len or give the KV cache more memory",
    ):
        open_engine_model(EngineConfig(model=str(path), device="cpu", kv_cache_bytes=1 << 30))
    with pytest.raises(ModelLoadError, match=r"--num-kv-blocks holds at most 8"):
        open_engine_model(EngineConfig(model=str(path), device="cpu", num_kv_blocks=8))


def test_the_model_is_built_for_the_engines_context_only(tmp_path: Path) -> None:
    # Its rotary table is sized by max_position_embeddings: 2**28 positions would be gigabytes.
    path = write_tiny_gguf(tmp_path / "long.gguf", meta={"llama.context_length": 2**28})
    files = open_engine_model(EngineConfig(model=str(path), device="cpu", max_model_len=64))
    assert files.config.max_position_embeddings == 64
    short = open_engine_model(EngineConfig(model=str(write_tiny_gguf(tmp_path / "short.gguf")), device="cpu"))
    assert short.config.max_position_embeddings == 256  # a context that fits is left as it is


def test_a_config_json_context_length_is_checked_the_same_way(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    folder = _edited_copy(tiny_checkpoint("llama"), tmp_path / "long", max_position_embeddings=2**28)
    with pytest.raises(ModelLoadError, match=r"one sequence of 268,435,456 tokens"):
        open_engine_model(EngineConfig(model=str(folder), device="cpu"))


# --- numbers that must be positive ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("meta", "message"),
    [
        ({"llama.attention.head_count": 0}, r"llama\.attention\.head_count is 0: must be a positive integer"),
        ({"llama.attention.head_count_kv": 0}, r"llama\.attention\.head_count_kv is 0"),
        ({"llama.attention.key_length": 0}, r"llama\.attention\.key_length is 0"),
        ({"llama.embedding_length": 0}, r"llama\.embedding_length is 0"),
        ({"llama.attention.head_count": 128}, r"llama\.embedding_length / llama\.attention\.head_count is 0"),
        ({"llama.block_count": 0}, r"llama\.block_count is 0"),
        ({"llama.context_length": 0}, r"llama\.context_length is 0"),
        ({"llama.attention.head_count": "four"}, r"llama\.attention\.head_count is 'four'"),
        ({"llama.feed_forward_length": [96, 128]}, r"llama\.feed_forward_length differs between layers"),
        ({"llama.rope.freq_base": float("nan")}, r"llama\.rope\.freq_base is nan: must be a finite number"),
        ({"llama.vocab_size": 0}, r"llama\.vocab_size is 0"),
    ],
)
def test_gguf_sizes_must_be_positive_numbers(tmp_path: Path, meta: dict[str, Any], message: str) -> None:
    with pytest.raises(ModelLoadError, match=message):
        open_model(str(write_tiny_gguf(tmp_path / "bad.gguf", meta=meta)))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"num_attention_heads": 0}, r"num_attention_heads is 0: must be a positive integer"),
        ({"num_key_value_heads": -2}, r"num_key_value_heads is -2"),
        ({"hidden_size": "64"}, r"hidden_size is '64'"),
        ({"head_dim": 15}, r"head_dim 15 is odd"),
        ({"max_position_embeddings": 0}, r"max_position_embeddings is 0"),
        ({"rms_norm_eps": "tiny"}, r"rms_norm_eps is 'tiny': must be a finite number"),
        ({"eos_token_id": "</s>"}, r"eos_token_id is '</s>': must be a token id"),
    ],
)
def test_config_json_sizes_must_be_positive_numbers(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path, fields: dict[str, Any], message: str
) -> None:
    with pytest.raises(ModelLoadError, match=message):
        open_model(str(_edited_copy(tiny_checkpoint("llama"), tmp_path / "bad", **fields)))


def _edited_copy(folder: Path, target: Path, **fields: Any) -> Path:
    shutil.copytree(folder, target)
    config = json.loads((target / "config.json").read_text())
    config.update(fields)
    (target / "config.json").write_text(json.dumps(config))
    return target


# --- the file's structure ----------------------------------------------------------------------------


def _architecture() -> bytes:
    return field("general.architecture", GGUFValueType.STRING, gguf_string("llama"))


@pytest.mark.parametrize(
    ("fields", "tensors", "message"),
    [
        # 5000 arrays deep: reading it recursively overflows Python's stack.
        (
            [_architecture(), field("x.nested", GGUFValueType.ARRAY, nested_array(5000))],
            0,
            "nests arrays more than 4 deep",
        ),
        # A token list claiming 2**40 strings in a file of a few bytes.
        (
            [
                _architecture(),
                field(
                    "tokenizer.ggml.tokens",
                    GGUFValueType.ARRAY,
                    struct.pack("<IQ", GGUFValueType.STRING, 2**40),
                ),
            ],
            0,
            r"a metadata array of 1,099,511,627,776 items",
        ),
        (
            [
                _architecture(),
                field("t", GGUFValueType.ARRAY, struct.pack("<IQ", GGUFValueType.STRING, 5_000)),
            ],
            0,
            r"5,000 strings would run past the end of the file",
        ),
        ([_architecture()], 10**12, r"1,000,000,000,000 tensors would run past the end of the file"),
        (
            [_architecture()],
            1,
            r"tensor 'w' has 4294967295 dimensions",
        ),
    ],
)
def test_malformed_gguf_structure_is_a_clear_error(
    tmp_path: Path, fields: list[bytes], tensors: int, message: str
) -> None:
    data = gguf_bytes(fields, tensors=tensors)
    if tensors == 1:  # one tensor info: name "w", 2**32-1 dimensions
        data += gguf_string("w") + struct.pack("<I", 2**32 - 1)
    path = tmp_path / "bad.gguf"
    path.write_bytes(data + bytes(64))
    with pytest.raises(ModelLoadError, match=rf"bad\.gguf: not a readable GGUF file \(.*{message}"):
        open_model(str(path))


@pytest.mark.parametrize(
    ("meta", "message"),
    [
        (
            {"tokenizer.ggml.tokens": list(range(300))},
            r"tokenizer\.ggml\.tokens must be an array of strings; item 0 is 0",
        ),
        ({"tokenizer.ggml.tokens": 7}, r"tokenizer\.ggml\.tokens must be an array of strings, not int"),
        (
            {"tokenizer.ggml.tokens": [["a"], ["b"]]},
            r"tokenizer\.ggml\.tokens must be an array of strings, not an array of arrays",
        ),
        (
            {"tokenizer.ggml.token_type": ["normal"] * 278},
            r"tokenizer\.ggml\.token_type must be an array of integers",
        ),
        ({"tokenizer.ggml.scores": ["high"] * 278}, r"tokenizer\.ggml\.scores must be an array of numbers"),
        (
            {"tokenizer.ggml.bos_token_id": 10**6},
            r"tokenizer\.ggml\.bos_token_id is 1000000, not a token id of the 278",
        ),
        ({"tokenizer.ggml.eos_token_id": "</s>"}, r"eos_token_id is '</s>'"),
        ({"tokenizer.ggml.unknown_token_id": 4096}, r"tokenizer\.ggml\.unknown_token_id is 4096"),
        (
            {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.merges": ["a b", "cd"]},
            r"tokenizer\.ggml\.merges item 1 \('cd'\) is not two tokens separated by a space",
        ),
        (
            {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.merges": ["zz yy"]},
            r"the GGUF tokenizer metadata does not make a tokenizer",
        ),
        ({"tokenizer.chat_template": 5}, r"tokenizer\.chat_template must be a string, not int"),
    ],
)
def test_malformed_token_metadata_is_a_clear_error(
    tmp_path: Path, meta: dict[str, Any], message: str
) -> None:
    with pytest.raises(ModelLoadError, match=message):
        open_model(str(write_tiny_gguf(tmp_path / "bad.gguf", meta=meta)))


def test_a_padding_id_outside_the_vocabulary_is_ignored(tmp_path: Path) -> None:
    files = open_model(
        str(write_tiny_gguf(tmp_path / "pad.gguf", meta={"tokenizer.ggml.padding_token_id": 10**6}))
    )
    assert files.tokenizer.pad_token is None


# --- NaN and infinite scales -------------------------------------------------------------------------

_HALF_NAN, _HALF_INF = (
    np.array([np.nan], dtype=np.float16).view(np.uint8),
    np.array([np.inf], dtype=np.float16).view(np.uint8),
)


@pytest.mark.parametrize(
    ("qtype", "offset", "bad"),
    [
        (Q.Q8_0, 0, _HALF_NAN),  # d: packed, kept as blocks
        (Q.Q4_K, 2, _HALF_NAN),  # dmin of a K-quant
        (Q.Q6_K, 208, _HALF_INF),  # Q6_K keeps d at its end
        (Q.Q5_0, 0, _HALF_NAN),  # a 32-value type with a fifth bit plane
    ],
    ids=["Q8_0 d", "Q4_K dmin", "Q6_K d inf", "Q5_0 d"],
)
def test_gguf_nan_scales_are_refused_naming_the_tensor(
    tmp_path: Path, qtype: Q, offset: int, bad: np.ndarray
) -> None:
    tensors = tiny_tensors()
    k_quant = qtype in (Q.Q4_K, Q.Q6_K)
    target = "blk.1.ffn_up.weight"
    if k_quant:  # a K-quant needs rows of 256 values: this one matrix is widened (and others stay F32)
        tensors[target] = np.random.default_rng(1).standard_normal((96, 256)).astype(np.float32)
    blocks = encode(tensors[target], qtype)
    block_bytes = {Q.Q8_0: 34, Q.Q4_K: 144, Q.Q6_K: 210, Q.Q5_0: 22}[qtype]
    blocks.reshape(-1, block_bytes)[5, offset : offset + 2] = bad  # the sixth block
    tensors[target] = blocks
    path = write_tiny_gguf(
        tmp_path / "nan.gguf", tensors=tensors, matrix_type=qtype, encode_floats=not k_quant
    )
    with pytest.raises(
        ModelLoadError, match=rf"tensor '{target}' \({qtype.name}\) has a NaN or infinite scale"
    ):
        list(GGUFCheckpoint(path).iter_weights())


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_int4_nan_scales_are_refused_naming_the_tensor(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path, method: str
) -> None:
    folder = make_quantized_checkpoint(tiny_checkpoint("llama"), tmp_path / method, method)
    tensors = load_file(folder / "model.safetensors")
    scales = tensors["model.layers.1.mlp.up_proj.scales"].clone()
    scales[0, 3] = float("nan")
    tensors["model.layers.1.mlp.up_proj.scales"] = scales
    save_file(tensors, folder / "model.safetensors")
    files = open_model(str(folder))
    with pytest.raises(
        ModelLoadError,
        match=r"model\.layers\.1\.mlp\.up_proj: scales hold a NaN or infinite value \(group 0, output 3\)",
    ):
        for _ in files.iter_weights():
            pass
    assert torch.isnan(scales).any()
