"""The kernel warm-up's dummy batches run through the real model and write nothing to the KV cache."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvasir.runtime.config import EngineConfig
from kvasir.runtime.loader.model_files import open_model
from kvasir.runtime.worker.kernel_warmup import warm_up_kernels
from kvasir.runtime.worker.model_runner import ModelRunner


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_warm_up_leaves_the_kv_cache_untouched(
    tiny_checkpoint: Callable[..., Path], monkeypatch: pytest.MonkeyPatch, kernels: str
) -> None:
    monkeypatch.setenv("KVASIR_KERNELS", kernels)  # triton: the interpreter, as on a GPU minus speed
    path = tiny_checkpoint("llama-gqa-llama3-rope")
    config = EngineConfig(model=str(path), device="cpu", dtype="float32", num_kv_blocks=32, block_size=16)
    runner = ModelRunner(config, open_model(str(path)))
    for k_cache, v_cache in runner.kv_caches:
        k_cache.normal_()
        v_cache.normal_()
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    calls: list[int] = []
    model_forward = runner.model.forward

    def counting(input_ids: torch.Tensor, *args: object) -> torch.Tensor:
        calls.append(input_ids.shape[0])
        return model_forward(input_ids, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(runner.model, "forward", counting)
    warm_up_kernels(
        runner.model, runner.kv_caches, block_size=16, max_tokens=64, device=runner.device, workspace=None
    )
    assert calls == [1, 16, 64]  # a decode, a short chunk, a long prompt capped at the token budget
    for (k, v), (k0, v0) in zip(runner.kv_caches, before, strict=True):
        assert torch.equal(k, k0) and torch.equal(v, v0)
