"""Each rank reads only its slice of the weights, and the slice holds exactly the values it should.

For every format, the weights a rank of two reads (`iter_weights(shards)`, the model's own shard
map) are compared with the whole checkpoint read at size 1 and cut afterwards: dequantized, they
must be the same numbers. Packed formats must stay packed (a `QuantizedWeight`), except where a
GGUF row-parallel split falls inside a quantization block: that rank's columns come dequantized
to float32, and the loader says so in one log line. No process group is needed: building a rank's
model and reading its shards does not communicate.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType

from kvasir.runtime.config import EngineConfig
from kvasir.runtime.layers.quantization.gguf import GGUFWeight
from kvasir.runtime.layers.quantization.weights import QuantizedWeight
from kvasir.runtime.loader.errors import ModelLoadError
from kvasir.runtime.loader.model_files import ModelFiles, open_engine_model, open_model
from kvasir.runtime.models.registry import get_model_class
from kvasir.runtime.parallel.group import TensorParallel
from kvasir.runtime.parallel.partition import TensorShard
from kvasir.runtime.worker.model_runner import load_model
from tests.quantized_checkpoints import make_quantized_checkpoint
from tests.runtime.models.test_gguf_packed import write_gguf

SIZE = 2
QUANTIZED: dict[str, tuple[str, dict[str, Any]]] = {
    "awq-g32": ("awq", {"group_size": 32}),
    "gptq-g32-sym": ("gptq", {"group_size": 32, "sym": True}),
    "gptq-v2-whole-rows": ("gptq", {"group_size": -1, "v1": False}),
    "fp8-per-tensor": ("fp8", {"fp8_kind": "fp8"}),
    "compressed-tensors-per-channel": ("fp8", {"fp8_kind": "compressed-tensors", "per_channel": True}),
}


def shard_maps(files: ModelFiles) -> list[dict[str, TensorShard]]:
    config = files.config
    model_class = get_model_class(config.architecture)
    return [model_class(config, TensorParallel(rank=rank, size=SIZE)).weight_shards() for rank in range(SIZE)]


def values(weight: Any) -> torch.Tensor:
    return weight.dequantize() if isinstance(weight, QuantizedWeight) else weight.float()


def assert_rank_slices(files: ModelFiles) -> dict[str, Any]:
    """Every rank's weights equal the whole ones cut to its shard; returns rank 0's weights."""
    whole = dict(files.iter_weights())
    ranks = []
    for shards in shard_maps(files):
        ours = dict(files.iter_weights(shards.get))
        assert ours.keys() == whole.keys()
        for name, weight in whole.items():
            expected = values(weight)
            shard = shards.get(name)
            if shard is not None:
                expected = expected.narrow(shard.dim, shard.start, shard.size)
            assert torch.equal(values(ours[name]), expected), name
        ranks.append(ours)
    return ranks[0]


@pytest.mark.parametrize("case", list(QUANTIZED))
def test_quantized_projections_are_read_as_packed_slices(
    case: str, tiny_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    method, options = QUANTIZED[case]
    source = tiny_checkpoint("llama", num_key_value_heads=2, attention_bias=True)
    files = open_model(str(make_quantized_checkpoint(source, tmp_path, method, **options)))
    rank0 = assert_rank_slices(files)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight"):
        assert isinstance(rank0[name], QuantizedWeight), name  # kept packed, column- and row-parallel


def test_gptq_act_order_row_parallel_layers_are_refused(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    source = tiny_checkpoint("llama", num_key_value_heads=2, attention_bias=True)
    files = open_model(str(make_quantized_checkpoint(source, tmp_path, "gptq", act_order=True)))
    with pytest.raises(
        ModelLoadError, match=r"(o|down)_proj: GPTQ act-order \(desc_act\).*--tensor-parallel-size 1"
    ):
        dict(files.iter_weights(shard_maps(files)[0].get))


def test_gguf_shards_stay_packed_and_a_split_inside_a_block_is_dequantized(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # down_proj's 96 inputs split at 48: inside Q8_0's second 32-value block.
    source = tiny_checkpoint("llama", num_key_value_heads=2, intermediate_size=96)
    path = write_gguf(source, GGMLQuantizationType.Q8_0, tmp_path / "tiny.gguf", vocabulary=True)
    files = open_model(str(path))
    with caplog.at_level(logging.INFO, logger="kvasir.runtime.loader.gguf_checkpoint"):
        rank0 = assert_rank_slices(files)
    for name in ("q_proj", "k_proj", "o_proj"):  # q/k rows un-permuted per head, o on a boundary
        assert isinstance(rank0[f"model.layers.0.self_attn.{name}.weight"], GGUFWeight)
    assert isinstance(rank0["model.embed_tokens.weight"], GGUFWeight)
    assert isinstance(rank0["model.layers.0.mlp.gate_proj.weight"], GGUFWeight)
    assert isinstance(rank0["model.layers.0.mlp.down_proj.weight"], torch.Tensor)
    lines = [
        record.getMessage() for record in caplog.records if "run dense in float32" in record.getMessage()
    ]
    assert len(lines) == SIZE  # the loader's one summary line per rank's read, naming count and cause
    assert "2 split inside a block by tensor parallelism" in lines[0]


def test_safetensors_ranks_read_slices(tiny_checkpoint: Callable[..., Path]) -> None:
    assert_rank_slices(open_model(str(tiny_checkpoint("qwen2", sharded=True))))


def test_online_fp8_quantizes_each_ranks_float_slice(tiny_checkpoint: Callable[..., Path]) -> None:
    files = open_model(str(tiny_checkpoint("llama")), quantization="fp8")
    assert files.quantization.at_load
    for rank in range(SIZE):
        # Building and loading a rank's share needs no process group: only its forward does.
        model = load_model(files, torch.device("cpu"), torch.float32, TensorParallel(rank=rank, size=SIZE))
        attention: Any = model.model.layers[0].self_attn  # type: ignore[index,union-attr]
        assert (attention.qkv_proj.in_features, attention.qkv_proj.out_features) == (64, 96)
        assert (attention.o_proj.in_features, attention.o_proj.out_features) == (32, 64)
        assert any("fp8" in kind for kind in attention.qkv_proj.describe())


def test_the_context_check_counts_a_ranks_kv_heads(tiny_checkpoint: Callable[..., Path]) -> None:
    # Tiny Llama: 2 layers x 4 KV heads x 16 x (K, V) x 2 bytes = 512 bytes a token, 128 KiB for
    # one sequence of 256 tokens; each of two ranks caches 2 of the KV heads: 64 KiB.
    path = str(tiny_checkpoint("llama"))
    settings: dict[str, Any] = {
        "model": path,
        "device": "cpu",
        "max_model_len": 256,
        "kv_cache_bytes": 96 << 10,
    }
    with pytest.raises(ModelLoadError, match="needs 16 KV-cache blocks"):
        open_engine_model(EngineConfig(**settings))
    assert open_engine_model(EngineConfig(**settings, tensor_parallel_size=2)).config.num_key_value_heads == 4
