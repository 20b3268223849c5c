"""Quantized safetensors checkpoints (AWQ, GPTQ, FP8): detection, component tensors gathered into one
`QuantizedWeight` per projection in any order and across shards, and errors that name the field."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvasir.runtime.layers.quantization.awq import AwqWeight
from kvasir.runtime.layers.quantization.fp8_linear import Fp8CheckpointWeight
from kvasir.runtime.layers.quantization.gptq import GptqWeight
from kvasir.runtime.loader.errors import ModelLoadError
from kvasir.runtime.loader.model_files import open_model
from tests.quantized_checkpoints import PROJECTION, make_quantized_checkpoint

PROJECTIONS_PER_LAYER = 7


@pytest.fixture(scope="module")
def checkpoint(
    tiny_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[..., Path]:
    def make(method: str, **options: object) -> Path:
        dst = tmp_path_factory.mktemp(method)
        return make_quantized_checkpoint(tiny_checkpoint("llama"), dst, method, **options)  # type: ignore[arg-type]

    return make


def shard_shuffled(path: Path, seed: int = 0) -> Path:
    """Rewrite the checkpoint as two shards with the tensors in random order (components of one
    projection end up in different files)."""
    tensors = load_file(path / "model.safetensors")
    names = list(tensors)
    random.Random(seed).shuffle(names)
    half = len(names) // 2
    weight_map = {}
    for i, chunk in enumerate((names[:half], names[half:])):
        file = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n].contiguous() for n in chunk}, path / file)
        weight_map.update(dict.fromkeys(chunk, file))
    (path / "model.safetensors").unlink()
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return path


@pytest.mark.parametrize(
    ("method", "options", "kind"),
    [
        ("awq", {}, AwqWeight),
        ("gptq", {"act_order": True}, GptqWeight),
        ("fp8", {"fp8_kind": "compressed-tensors", "static": True}, Fp8CheckpointWeight),
    ],
)
def test_components_are_gathered_across_shards_in_any_order(
    checkpoint: Callable[..., Path], method: str, options: dict, kind: type
) -> None:
    path = shard_shuffled(checkpoint(method, **options))
    files = open_model(str(path))
    assert files.quantization.method == method and files.config.quantization == method
    weights = dict(files.iter_weights())
    quantized = {name: w for name, w in weights.items() if isinstance(w, kind)}
    assert set(quantized) == {n for n in weights if PROJECTION.fullmatch(n)}
    assert len(quantized) == PROJECTIONS_PER_LAYER * files.config.num_hidden_layers
    # nothing else of the format leaks through as a plain tensor
    assert not [
        n
        for n in weights
        if n.rpartition(".")[2] in ("qweight", "qzeros", "scales", "g_idx", "weight_scale", "input_scale")
    ]
    # each projection dequantizes to what the published reader computes
    reference = load_file(path / "reference" / "model.safetensors")
    for name, weight in quantized.items():
        torch.testing.assert_close(weight.dequantize(), reference[name], rtol=0, atol=1e-6)


def test_a_projection_missing_a_component_is_named(checkpoint: Callable[..., Path]) -> None:
    path = checkpoint("awq")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.qzeros"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.down_proj has only qweight, scales"):
        list(open_model(str(path)).iter_weights())


def test_a_component_of_the_wrong_shape_is_named(checkpoint: Callable[..., Path]) -> None:
    path = checkpoint("gptq")
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.0.self_attn.o_proj.scales"
    tensors[name] = tensors[name][:, :8].contiguous()
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"o_proj: scales must be"):
        list(open_model(str(path)).iter_weights())


@pytest.mark.parametrize(
    ("method", "change", "message"),
    [
        ("awq", {"bits": 8}, "quantization_config.bits"),
        ("gptq", {"checkpoint_format": "marlin"}, "quantization_config.checkpoint_format"),
        ("fp8", {"weight_block_size": [128, 128]}, "quantization_config.weight_block_size"),
    ],
)
def test_unsupported_quantization_configs_name_the_field(
    checkpoint: Callable[..., Path], method: str, change: dict, message: str
) -> None:
    path = checkpoint(method)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"].update(change)
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=message):
        open_model(str(path))


def test_fp8_dynamic_checkpoints_skip_stored_input_and_kv_scales(checkpoint: Callable[..., Path]) -> None:
    path = checkpoint("fp8")
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.self_attn.q_proj.input_scale"] = torch.tensor(0.5)  # written, but dynamic
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(1.0)  # an FP8 KV cache's scale
    save_file(tensors, path / "model.safetensors")
    weights = dict(open_model(str(path)).iter_weights())
    assert not any(n.endswith(("input_scale", "k_scale")) for n in weights)
    assert weights["model.layers.0.self_attn.q_proj.weight"].fp8().input_scale is None
