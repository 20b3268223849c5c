"""`--lora-dtype`: what the slot pool and the host tier hold, and what that costs in memory.

"auto" is the model's dtype (float32 on the CPU, so the float32 parity with PEFT holds by default);
bfloat16 stores every adapter rounded once, at load, and halves the pool's bytes, which the KV
cache's budget gets back. The parity of a bfloat16 pool with PEFT is in `test_lora_parity`.
"""

from __future__ import annotations

import pytest
import torch

from kvasir.runtime.config import EngineConfig
from kvasir.runtime.loader.lora_adapter import load_lora_adapter
from kvasir.runtime.loader.model_files import open_model
from kvasir.runtime.worker.kv_budget import bytes_per_block
from kvasir.runtime.worker.lora_slots import pool_dtype
from kvasir.runtime.worker.model_runner import ModelRunner
from tests.runtime.lora.test_lora_slots import RANK, _slots, setup  # noqa: F401 (a fixture)


def _pool_tensors(slots) -> list[torch.Tensor]:
    return [
        t
        for layer in slots.layers
        for p in (layer.qkv, layer.o, layer.gate_up, layer.down)
        for t in (p.a, p.b)
    ]


def test_auto_is_the_models_dtype() -> None:
    assert pool_dtype("auto", torch.float32) == torch.float32  # the CPU's activations
    assert pool_dtype("auto", torch.bfloat16) == torch.bfloat16  # a CUDA model's
    assert pool_dtype("bfloat16", torch.float32) == torch.bfloat16
    assert pool_dtype("float16", torch.bfloat16) == torch.float16
    assert EngineConfig(model="/m").lora_dtype == "auto"


def test_the_python_api_names_the_field() -> None:
    with pytest.raises(
        ValueError, match="lora_dtype must be one of auto, float32, float16, bfloat16, got 'fp8'"
    ):
        EngineConfig(model="/m", lora_dtype="fp8")


def test_a_bfloat16_pool_holds_each_adapter_rounded_once(setup) -> None:  # noqa: F811
    base, config, loras = setup
    slots = _slots(base, config, max_loras=2, lora_dtype="bfloat16")
    full = _slots(base, config, max_loras=2)
    assert slots.dtype == torch.bfloat16 and full.dtype == torch.float32
    assert all(t.dtype == torch.bfloat16 for t in _pool_tensors(slots))
    assert slots.nbytes == sum(t.nbytes for t in _pool_tensors(slots)) == full.nbytes // 2
    # The C stack reads this very pool, as bfloat16; the scalings stay float32.
    assert slots.stack_pool is not None and slots.stack_pool.dtype == torch.bfloat16
    assert slots.scalings.dtype == torch.float32
    slots.add(loras[2])
    # The host tier holds the pool's dtype: half the memory, and the copy into a slot is exact.
    held = slots.host.get(loras[2])
    assert {w.dtype for pair in held.weights.values() for w in pair} == {torch.bfloat16}
    (slot,) = slots.assign((loras[2],))
    a_q, b_q = load_lora_adapter(loras[2].path, config, RANK).weights[(0, "q_proj")]  # float32
    rank = loras[2].rank
    q_out = config.num_attention_heads * config.head_dim
    assert torch.equal(slots.layers[0].qkv.a[slot, :rank], a_q.to(torch.bfloat16))
    assert torch.equal(slots.layers[0].qkv.b[slot, :rank, :q_out], b_q.t().to(torch.bfloat16))


def test_a_float16_pool_runs_layer_by_layer_on_the_cpu(setup) -> None:  # noqa: F811
    base, config, _ = setup
    slots = _slots(base, config, lora_dtype="float16")
    assert slots.dtype == torch.float16 and slots.stack_pool is None  # the C stack reads float32 or bf16


@pytest.mark.parametrize("lora_dtype", ["auto", "bfloat16"])
def test_the_pool_comes_out_of_the_kv_budget_at_its_dtype(setup, lora_dtype: str) -> None:  # noqa: F811
    base, _, _ = setup
    budget = 1 << 20
    settings = {"model": str(base), "device": "cpu", "kv_cache_bytes": budget}
    runner = ModelRunner(
        EngineConfig(**settings, enable_lora=True, max_loras=4, max_lora_rank=16, lora_dtype=lora_dtype),  # type: ignore[arg-type]
        open_model(str(base)),
    )
    assert runner.lora is not None
    itemsize = 4 if lora_dtype == "auto" else 2  # auto: the CPU model's float32
    assert runner.lora.dtype.itemsize == itemsize
    pool = sum(t.nbytes for t in _pool_tensors(runner.lora))
    assert runner.lora.nbytes == pool
    block_bytes = bytes_per_block(
        runner.kv_elements_per_token, runner.kv_cache_dtype.itemsize, runner.block_size
    )
    assert runner.num_blocks == (budget - pool) // block_bytes
