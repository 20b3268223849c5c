"""A config that lies about the model's shape is refused before the model is built: layer count,
vocabulary, hidden size, heads and MLP width are checked against the tensors the checkpoint holds
(GGUF metadata, config.json, quantized checkpoints), and the error names the field and tensor.

Without the check, a GGUF claiming 1,000,000 layers over tensors for 2 loads (open_model returns)
and the model runner then builds a million layers; these tests only open the files, so on code
without the check they fail at `pytest.raises` instead of allocating anything."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvasir.runtime.loader.errors import ModelLoadError
from kvasir.runtime.loader.model_files import open_model
from tests.quantized_checkpoints import make_quantized_checkpoint
from tests.runtime.loader.tiny_gguf import HIDDEN, TOKENS, tiny_tensors, write_tiny_gguf


@pytest.mark.parametrize(
    ("meta", "layers", "message"),
    [
        (
            {"llama.block_count": 1_000_000},
            2,
            r"llama\.block_count is 1,000,000, but the checkpoint holds tensors for 2 layers; none for "
            r"layer 2 \(blk\.2\.\*\)",
        ),
        (
            {"llama.block_count": 1},
            2,
            r"llama\.block_count is 1, but the checkpoint holds tensors for layer 1",
        ),
        (
            {"llama.vocab_size": 2**40},
            2,
            r"token_embd\.weight has shape \[278, 64\], but the config makes it \[1099511627776 "
            r"\(llama\.vocab_size\), 64 \(llama\.embedding_length\)\]",
        ),
        (
            {"llama.embedding_length": 4096},
            2,
            r"token_embd\.weight has shape \[278, 64\].*4096 \(llama\.embedding_length\)",
        ),
        (
            {"llama.attention.head_count": 64, "llama.attention.key_length": 16},
            2,
            r"blk\.0\.attn_q\.weight has shape \[64, 64\], but the config makes it \[1024 "
            r"\(llama\.attention\.head_count x llama\.attention\.key_length\), 64",
        ),
        (
            {"llama.attention.head_count_kv": 1},
            2,
            r"blk\.0\.attn_k\.weight has shape \[32, 64\].*\[16 \(llama\.attention\.head_count_kv x head_dim\)",
        ),
        ({"llama.feed_forward_length": 10**9}, 2, r"blk\.0\.ffn_gate\.weight has shape \[96, 64\]"),
    ],
)
def test_gguf_metadata_must_describe_its_tensors(
    tmp_path: Path, meta: dict[str, Any], layers: int, message: str
) -> None:
    path = write_tiny_gguf(tmp_path / "lie.gguf", meta=meta, layers=layers)
    with pytest.raises(ModelLoadError, match=message):
        open_model(str(path))


def test_gguf_with_a_missing_middle_layer_is_refused(tmp_path: Path) -> None:
    tensors = {name: values for name, values in tiny_tensors(3).items() if not name.startswith("blk.1.")}
    path = write_tiny_gguf(tmp_path / "hole.gguf", meta={"llama.block_count": 3}, tensors=tensors)
    with pytest.raises(ModelLoadError, match=r"holds tensors for 2 layers; none for layer 1 \(blk\.1\.\*\)"):
        open_model(str(path))


def test_gguf_without_an_embedding_is_refused(tmp_path: Path) -> None:
    tensors = {name: values for name, values in tiny_tensors().items() if name != "token_embd.weight"}
    with pytest.raises(ModelLoadError, match=r"no token embedding \(token_embd\.weight\)"):
        open_model(str(write_tiny_gguf(tmp_path / "noembd.gguf", tensors=tensors)))


def test_a_truthful_gguf_still_opens(tmp_path: Path) -> None:
    files = open_model(str(write_tiny_gguf(tmp_path / "ok.gguf")))
    assert (files.config.num_hidden_layers, files.config.vocab_size) == (2, len(TOKENS))
    assert files.config.hidden_size == HIDDEN


def _lying_copy(folder: Path, target: Path, **fields: Any) -> Path:
    shutil.copytree(folder, target)
    config = json.loads((target / "config.json").read_text())
    config.update(fields)
    (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"num_hidden_layers": 1_000_000},
            r"config\.json: num_hidden_layers is 1,000,000, but the checkpoint holds tensors for 2 layers",
        ),
        (
            {"vocab_size": 10**9},
            r"model\.embed_tokens\.weight has shape \[384, 64\], but the config makes it "
            r"\[1000000000 \(vocab_size\), 64 \(hidden_size\)\]",
        ),
        ({"hidden_size": 8192}, r"model\.embed_tokens\.weight has shape \[384, 64\]"),
        (
            {"num_attention_heads": 8, "head_dim": 16},
            r"model\.layers\.0\.self_attn\.o_proj\.weight has shape \[64, 64\], but the config makes it "
            r"\[64 \(hidden_size\), 128 \(num_attention_heads x head_dim\)\]",
        ),
        ({"num_key_value_heads": 2}, r"model\.layers\.0\.self_attn\.k_proj\.weight has shape \[64, 64\]"),
        ({"intermediate_size": 4096}, r"model\.layers\.0\.mlp\.down_proj\.weight has shape \[64, 128\]"),
    ],
)
def test_config_json_must_describe_its_tensors(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path, fields: dict[str, Any], message: str
) -> None:
    folder = _lying_copy(tiny_checkpoint("llama"), tmp_path / "lie", **fields)
    with pytest.raises(ModelLoadError, match=message):
        open_model(str(folder))


@pytest.mark.parametrize("method", ["awq", "gptq", "fp8"])
def test_quantized_checkpoints_are_checked_on_their_logical_shapes(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path, method: str
) -> None:
    made = make_quantized_checkpoint(tiny_checkpoint("llama"), tmp_path / "q", method)
    assert open_model(str(made)).config.num_hidden_layers == 2  # packed shapes read as [out, in]
    lying = _lying_copy(made, tmp_path / "lie", intermediate_size=256)
    with pytest.raises(
        ModelLoadError,
        match=r"model\.layers\.0\.mlp\.down_proj\.weight has shape \[64, 128\].*256 \(intermediate_size\)",
    ):
        open_model(str(lying))
