"""The KV cache's size is held to the device's memory before anything is allocated, and an
allocation the device refuses anyway is a ValueError naming the setting (issue 34, item 10)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvasir.runtime.config import EngineConfig
from kvasir.runtime.worker import model_runner
from kvasir.runtime.worker.kv_budget import check_fits, machine_memory_bytes


def test_check_fits_names_the_setting() -> None:
    check_fits(10, 1 << 20, 10 << 20, "this machine's memory", "--num-kv-blocks")
    check_fits(10**12, 1 << 20, None, "unknown", "--num-kv-blocks")  # nothing to check against
    with pytest.raises(ValueError) as refused:
        check_fits(11, 1 << 20, 10 << 20, "this machine's memory", "--num-kv-blocks (KVASIR_NUM_KV_BLOCKS)")
    assert str(refused.value) == (
        "--num-kv-blocks (KVASIR_NUM_KV_BLOCKS): a KV cache of 11 blocks needs 11.0 MiB, more than "
        "this machine's memory (10.0 MiB); lower it"
    )
    memory = machine_memory_bytes()
    assert memory is None or memory > 1 << 20


def _build(checkpoint: Path, **settings: object) -> None:
    from kvasir.runtime.engine.llm_engine import LLMEngine

    LLMEngine(EngineConfig(model=str(checkpoint), device="cpu", max_model_len=64, **settings))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"num_kv_blocks": 100_000}, "--num-kv-blocks (KVASIR_NUM_KV_BLOCKS): a KV cache of 100000 blocks"),
        ({"kv_cache_bytes": 1 << 40}, "--kv-cache-bytes (KVASIR_KV_CACHE_BYTES): a KV cache of "),
    ],
)
def test_a_cache_beyond_the_machines_memory_is_refused(
    tiny_checkpoint: Callable[..., Path],
    monkeypatch: pytest.MonkeyPatch,
    settings: dict[str, int],
    named: str,
) -> None:
    monkeypatch.setattr(model_runner, "machine_memory_bytes", lambda: 64 << 20)
    with pytest.raises(ValueError) as refused:
        _build(tiny_checkpoint("llama"), **settings)
    assert str(refused.value).startswith(named)
    assert "more than this machine's memory (64.0 MiB)" in str(refused.value)


def test_an_allocation_the_device_refuses_is_a_value_error(
    tiny_checkpoint: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    real = model_runner.ModelRunner._allocate_kv_caches

    def refusing(self: model_runner.ModelRunner, shape: tuple[int, ...], allocate: object) -> object:
        def fail(*args: object, **kwargs: object) -> torch.Tensor:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 42 bytes")

        return real(self, shape, fail)

    monkeypatch.setattr(model_runner.ModelRunner, "_allocate_kv_caches", refusing)
    with pytest.raises(ValueError) as refused:
        _build(tiny_checkpoint("llama"), num_kv_blocks=8)
    assert str(refused.value) == (
        "--num-kv-blocks (KVASIR_NUM_KV_BLOCKS): cannot allocate a KV cache of 8 blocks on cpu: "
        "DefaultCPUAllocator: can't allocate memory: you tried to allocate 42 bytes; lower it"
    )
