"""The slot pool (device tier) and the host tier: LRU in both, the per-step bound, removal, reads
again after a host eviction, and the pool's bytes taken out of the KV cache's budget."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from kvasir.runtime.config import EngineConfig, ModelConfig
from kvasir.runtime.loader.lora_adapter import load_lora_adapter, read_adapter_digest
from kvasir.runtime.loader.model_files import open_model
from kvasir.runtime.lora.errors import LoRAAdapterError
from kvasir.runtime.lora.params import LoRARequest
from kvasir.runtime.worker.kv_budget import bytes_per_block
from kvasir.runtime.worker.lora_host import LoRAHostCache
from kvasir.runtime.worker.lora_slots import LoRASlots
from kvasir.runtime.worker.model_runner import ModelRunner
from tests.lora_adapters import write_adapter

RANK = 8


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ModelConfig, list[LoRARequest]]:
    from tests.tiny_checkpoints import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("slots")
    base = make_tiny_checkpoint(root / "base", "llama", num_key_value_heads=2)
    config = open_model(str(base)).config
    loras = []
    for i in range(4):
        path = write_adapter(root / f"a{i}", config, 4 + i, seed=i, layers=(0,) if i == 3 else None)
        loras.append(LoRARequest(f"a{i}", i + 1, str(path), read_adapter_digest(path, config, RANK), 4 + i))
    return base, config, loras


def _slots(base: Path, config: ModelConfig, **settings: object) -> LoRASlots:
    engine_config = EngineConfig(model=str(base), enable_lora=True, max_lora_rank=RANK, **settings)  # type: ignore[arg-type]
    return LoRASlots(engine_config, config, torch.device("cpu"), torch.float32)


def test_slots_hold_the_adapter_zero_padded(setup) -> None:
    base, config, loras = setup
    slots = _slots(base, config, max_loras=2)
    slots.add(loras[3])  # rank 7, layer 0 only
    (slot,) = slots.assign((loras[3],))
    adapter = load_lora_adapter(loras[3].path, config, RANK)
    qkv = slots.layers[0].qkv
    q_out = config.num_attention_heads * config.head_dim
    k_out = config.num_key_value_heads * config.head_dim
    a_k, b_k = adapter.weights[(0, "k_proj")]
    assert torch.equal(qkv.a[slot, RANK : RANK + 7], a_k) and not qkv.a[slot, RANK + 7 : 2 * RANK].any()
    k_block = qkv.b[slot, RANK : 2 * RANK]
    assert torch.equal(k_block[:7, q_out : q_out + k_out], b_k.t()) and not k_block[7:].any()
    # Block-diagonal: the k rows add nothing to the q or v columns.
    assert not k_block[:, :q_out].any() and not k_block[:, q_out + k_out :].any()
    # Layer 1 is not in the adapter: zeros, so it adds nothing there.
    assert not slots.layers[1].down.a[slot].any() and not slots.layers[1].down.b[slot].any()
    assert slots.scalings[slot] == pytest.approx(adapter.scaling)


def test_least_recently_used_slot_not_in_the_step_is_reused(setup) -> None:
    base, config, loras = setup
    slots = _slots(base, config, max_loras=2, max_cpu_loras=4)
    for lora in loras[:3]:
        slots.add(lora)
    a, b, c = loras[:3]
    assert slots.assign((a, b)) == [0, 1] and slots.copies_total == 2
    assert slots.assign((b,)) == [1]  # resident: no copy; b is now the most recently used
    assert slots.assign((c, b)) == [0, 1] and slots.copies_total == 3  # a was the LRU slot
    assert slots.resident() == {c.adapter_id: 0, b.adapter_id: 1}
    assert slots.assign((a, c)) == [1, 0]  # b was LRU and is not in this step; c is kept
    with pytest.raises(RuntimeError, match="3 distinct LoRA adapters but there are 2 slots"):
        slots.assign((a, b, c))


def test_removed_adapter_frees_its_slot(setup) -> None:
    base, config, loras = setup
    slots = _slots(base, config, max_loras=2)
    slots.add(loras[0])
    slots.assign((loras[0],))
    slots.remove(loras[0].adapter_id)
    assert not slots.host.is_resident(loras[0].adapter_id)
    slots.add(loras[1])
    slots.assign((loras[1],))
    assert slots.resident() == {loras[1].adapter_id: 0}


def test_host_tier_evicts_lru_and_reads_again(setup) -> None:
    _, config, loras = setup
    reads: list[int] = []

    def read(lora: LoRARequest):
        reads.append(lora.adapter_id)
        return load_lora_adapter(lora.path, config, RANK)

    host = LoRAHostCache(2, read)
    for lora in loras[:3]:
        host.add(lora)
    assert host.resident_ids() == [2, 3]  # adapter 1 was dropped
    host.get(loras[1])  # 2 is now most recently used
    host.get(loras[0])  # read again (on this thread), dropping 3
    assert reads == [1, 2, 3, 1] and host.resident_ids() == [2, 1]
    # A prefetch reads in the background; get waits for that read instead of starting another.
    host.prefetch([loras[2]])
    adapter = host.get(loras[2])
    assert adapter.rank == 6 and reads.count(3) == 2
    host.close()


def test_add_reads_in_the_calling_thread_and_refuses_bad_files(setup, tmp_path: Path) -> None:
    base, config, loras = setup
    slots = _slots(base, config)
    threads: list[str] = []
    original = slots.host._read

    def read(lora: LoRARequest):
        threads.append(threading.current_thread().name)
        return original(lora)

    slots.host._read = read
    worker = threading.Thread(target=slots.add, args=(loras[0],), name="loader")
    worker.start()
    worker.join()
    assert threads == ["loader"] and slots.host.is_resident(loras[0].adapter_id)
    bad = write_adapter(tmp_path / "bad", config, 4, config={"use_dora": True})
    with pytest.raises(LoRAAdapterError, match="use_dora"):
        slots.add(LoRARequest("bad", 99, str(bad), b"", 4))
    assert not slots.host.is_resident(99)
    with pytest.raises(LoRAAdapterError, match="'r' is 4, the request says 5"):
        slots.add(LoRARequest("liar", 98, loras[0].path, b"", 5))


def test_the_pool_comes_out_of_the_kv_budget(setup) -> None:
    base, _, _ = setup
    budget = 1 << 20
    plain = ModelRunner(
        EngineConfig(model=str(base), device="cpu", kv_cache_bytes=budget), open_model(str(base))
    )
    with_lora = ModelRunner(
        EngineConfig(
            model=str(base),
            device="cpu",
            kv_cache_bytes=budget,
            enable_lora=True,
            max_loras=4,
            max_lora_rank=16,
        ),
        open_model(str(base)),
    )
    assert with_lora.lora is not None and plain.lora is None
    pool = sum(
        t.nbytes
        for layer in with_lora.lora.layers
        for p in (layer.qkv, layer.o, layer.gate_up, layer.down)
        for t in (p.a, p.b)
    )
    assert with_lora.lora.nbytes == pool
    block_bytes = bytes_per_block(
        plain.kv_elements_per_token, plain.kv_cache_dtype.itemsize, plain.block_size
    )
    assert plain.num_blocks == budget // block_bytes
    assert with_lora.num_blocks == (budget - pool) // block_bytes < plain.num_blocks
