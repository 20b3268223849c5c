"""Adapter directories as untrusted input: each thing the runtime cannot serve exactly is refused
with a one-line LoRAAdapterError naming the file and field; a good adapter reads back as written."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from kvasir.runtime.config import ModelConfig
from kvasir.runtime.loader.lora_adapter import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    load_lora_adapter,
    read_adapter_digest,
)
from kvasir.runtime.loader.model_files import open_model
from kvasir.runtime.lora.errors import LoRAAdapterError
from tests.lora_adapters import write_adapter

MAX_RANK = 16
PREFIX = "base_model.model.model.layers.0.self_attn.q_proj"


@pytest.fixture(scope="module")
def model_config(tmp_path_factory: pytest.TempPathFactory) -> ModelConfig:
    from tests.tiny_checkpoints import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path_factory.mktemp("base"), "llama", num_key_value_heads=2)
    return open_model(str(path)).config


def _refused(path: Path, config: ModelConfig, match: str) -> str:
    with pytest.raises(LoRAAdapterError, match=match) as info:
        load_lora_adapter(path, config, MAX_RANK)
    message = str(info.value)
    assert "\n" not in message and len(message) < 300, message
    return message


def test_reads_back_what_was_written(tmp_path: Path, model_config: ModelConfig) -> None:
    path = write_adapter(tmp_path / "a", model_config, 8, alpha=32)
    adapter = load_lora_adapter(path, model_config, MAX_RANK)
    assert adapter.rank == 8 and adapter.scaling == 4.0
    assert len(adapter.weights) == 7 * model_config.num_hidden_layers
    a, b = adapter.weights[(0, "k_proj")]
    assert a.shape == (8, model_config.hidden_size)
    assert b.shape == (model_config.num_key_value_heads * model_config.head_dim, 8)
    assert adapter.digest == read_adapter_digest(path, model_config, MAX_RANK)


def test_rslora_scales_by_the_root_of_the_rank(tmp_path: Path, model_config: ModelConfig) -> None:
    path = write_adapter(tmp_path / "a", model_config, 16, alpha=8, config={"use_rslora": True})
    assert load_lora_adapter(path, model_config, MAX_RANK).scaling == pytest.approx(8 / math.sqrt(16))


def test_digest_follows_the_bytes(tmp_path: Path, model_config: ModelConfig) -> None:
    one = write_adapter(tmp_path / "one", model_config, 4, seed=1)
    same = write_adapter(tmp_path / "same", model_config, 4, seed=1)
    other = write_adapter(tmp_path / "other", model_config, 4, seed=2)
    rescaled = write_adapter(tmp_path / "alpha", model_config, 4, seed=1, alpha=1)
    digests = [read_adapter_digest(p, model_config, MAX_RANK) for p in (one, same, other, rescaled)]
    assert digests[0] == digests[1] and len({digests[0], digests[2], digests[3]}) == 3


def test_a_subset_of_layers_and_modules_and_a_regex_target(tmp_path: Path, model_config: ModelConfig) -> None:
    path = write_adapter(
        tmp_path / "a", model_config, 4, layers=(1,), config={"target_modules": r".*\.(q|v)_proj|.*mlp.*"}
    )
    adapter = load_lora_adapter(path, model_config, MAX_RANK)
    assert {layer for layer, _ in adapter.weights} == {1}


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"use_dora": True}, "'use_dora' is set: DoRA"),
        ({"bias": "all"}, "'bias' is 'all'"),
        ({"modules_to_save": ["lm_head"]}, "'modules_to_save' is set"),
        ({"rank_pattern": {"q_proj": 4}}, "'rank_pattern' is set"),
        ({"fan_in_fan_out": True}, "'fan_in_fan_out' is set"),
        ({"peft_type": "IA3"}, "'peft_type' is 'IA3'"),
        ({"r": 32}, "'r' is 32, more than --max-lora-rank 16"),
        ({"r": "8"}, "'r' must be a positive integer"),
        ({"lora_alpha": float("nan")}, "'lora_alpha' must be a finite number"),
        ({"target_modules": ["q_proj", "embed_tokens"]}, "names 'embed_tokens'"),
        ({"target_modules": ["q_proj", "lm_head"]}, "names 'lm_head'"),
        ({"target_modules": ".*(lm_head|q_proj)"}, "regex names the embedding or LM head"),
        ({"target_modules": ["q_proj", "mlp.fc1"]}, "names 'mlp.fc1'"),
        ({"target_modules": ["q_proj"]}, "a module 'target_modules' does not name"),
    ],
    ids=lambda v: str(v)[:40],
)
def test_refused_configs(tmp_path: Path, model_config: ModelConfig, config: dict, match: str) -> None:
    message = _refused(write_adapter(tmp_path / "a", model_config, 8, config=config), model_config, match)
    assert message.startswith(CONFIG_FILE) or message.startswith(WEIGHTS_FILE)


@pytest.mark.parametrize(
    ("tensors", "match"),
    [
        ({f"{PREFIX}.lora_A.weight": torch.zeros(8, 63)}, r"has shape \[8, 63\], expected \[8, 64\]"),
        ({f"{PREFIX}.lora_B.weight": torch.zeros(64, 8, dtype=torch.float64)}, "has dtype 'F64'"),
        ({f"{PREFIX}.lora_A.weight": torch.zeros(8, 64, dtype=torch.int32)}, "has dtype 'I32'"),
        ({f"{PREFIX}.lora_A.weight": torch.full((8, 64), float("nan"))}, "NaN or infinite"),
        ({f"{PREFIX}.lora_B.weight": torch.full((64, 8), float("inf"))}, "NaN or infinite"),
        ({"base_model.model.lm_head.lora_A.weight": torch.zeros(8, 64)}, "is not a LoRA A/B weight"),
        (
            {"base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(8, 64)},
            "is not a LoRA A/B weight",
        ),
        (
            {"base_model.model.model.layers.9.mlp.up_proj.lora_A.weight": torch.zeros(8, 64)},
            "layer 9; the model has 2",
        ),
        (
            {"base_model.model.model.layers.0.mlp.q_proj.lora_A.weight": torch.zeros(8, 64)},
            "unsupported module",
        ),
        (
            {"base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector": torch.zeros(64)},
            "not a LoRA",
        ),
    ],
    ids=lambda v: str(v)[:40],
)
def test_refused_tensors(tmp_path: Path, model_config: ModelConfig, tensors: dict, match: str) -> None:
    _refused(write_adapter(tmp_path / "a", model_config, 8, tensors=tensors), model_config, match)


def test_a_missing_half_is_refused(tmp_path: Path, model_config: ModelConfig) -> None:
    path = write_adapter(tmp_path / "a", model_config, 4, layers=())
    from safetensors.torch import save_file

    save_file({f"{PREFIX}.lora_A.weight": torch.zeros(4, 64)}, str(path / WEIGHTS_FILE))
    _refused(path, model_config, "layer 0 q_proj has no lora_B tensor")


def _rewrite_header(path: Path, edit) -> None:
    raw = (path / WEIGHTS_FILE).read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header = edit(json.loads(raw[8 : 8 + length]))
    text = json.dumps(header).encode()
    (path / WEIGHTS_FILE).write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + length :])


def test_corrupt_safetensors_files(tmp_path: Path, model_config: ModelConfig) -> None:
    path = write_adapter(tmp_path / "a", model_config, 4)
    raw = (path / WEIGHTS_FILE).read_bytes()
    (path / WEIGHTS_FILE).write_bytes((10**12).to_bytes(8, "little") + raw[8:])
    _refused(path, model_config, "header length 1000000000000 does not fit the file")
    (path / WEIGHTS_FILE).write_bytes(raw[:4])
    _refused(path, model_config, "too short to be a safetensors file")
    (path / WEIGHTS_FILE).write_bytes(raw[: len(raw) // 2])
    _refused(path, model_config, "outside the file")
    (path / WEIGHTS_FILE).write_bytes(raw)

    def overlap(header: dict) -> dict:
        names = sorted(k for k in header if k != "__metadata__")
        header[names[1]]["data_offsets"] = header[names[0]]["data_offsets"]
        return header

    _rewrite_header(path, overlap)
    _refused(path, model_config, "outside the file or overlapping another")


def test_missing_or_unsafe_files(tmp_path: Path, model_config: ModelConfig) -> None:
    _refused(tmp_path / "absent", model_config, "is not a directory")
    path = write_adapter(tmp_path / "a", model_config, 4)
    (path / WEIGHTS_FILE).rename(path / "adapter_model.bin")
    _refused(path, model_config, "pickled weights are not read")
    (path / "adapter_model.bin").unlink()
    _refused(path, model_config, f"{WEIGHTS_FILE}: not found")
    (path / CONFIG_FILE).write_text("{not json")
    _refused(path, model_config, "not valid JSON")
    (path / CONFIG_FILE).write_text(" " * (2 << 20))
    _refused(path, model_config, "larger than")


def test_a_weight_file_larger_than_any_valid_adapter_is_not_read(
    tmp_path: Path, model_config: ModelConfig
) -> None:
    path = write_adapter(tmp_path / "a", model_config, 4)
    with (path / WEIGHTS_FILE).open("ab") as handle:
        handle.truncate(64 << 20)  # sparse: tens of MiB that would otherwise be read and hashed
    _refused(path, model_config, "more than an adapter of this model at the maximum rank can be")
