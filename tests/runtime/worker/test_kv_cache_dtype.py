"""The KV cache's element type on CPU: float16 by default for a float32 model (as llama.cpp's f16
cache), float32 or bfloat16 on request; allocated without touching its pages."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvasir.kernels.cpu_ops import paged_attention as cpu_attention
from kvasir.runtime.config import EngineConfig
from kvasir.runtime.engine.llm_engine import LLMEngine
from kvasir.runtime.sample.params import SamplingParams

pytestmark = pytest.mark.skipif(
    cpu_attention.library() is None,
    reason="no C compiler: the CPU attention kernel (and its f16 default) is off",
)


def _engine(
    path: Path, kv_cache_dtype: str, dtype: str = "float32", kv_cache_bytes: int = 1 << 22
) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(path),
            device="cpu",
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
            kv_cache_bytes=kv_cache_bytes,
        )
    )


def test_cpu_default_is_float16_with_twice_the_blocks_and_the_same_greedy_tokens(
    tiny_checkpoint: Callable[..., Path],
) -> None:
    path = tiny_checkpoint("llama-gqa-llama3-rope")
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(4, 200, (n,), generator=generator).tolist() for n in (3, 16, 17, 45)]
    params = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12, logprobs=1)
    exact, half = _engine(path, "float32"), _engine(path, "auto")
    assert exact.runner.kv_caches[0][0].dtype == torch.float32
    assert half.runner.kv_caches[0][0].dtype == torch.float16
    assert half.runner.num_blocks // 2 == exact.runner.num_blocks  # the budget counts real bytes
    for a, b in zip(exact.generate(prompts, params), half.generate(prompts, params), strict=True):
        assert b.choices[0].token_ids == a.choices[0].token_ids
        for la, lb in zip(a.choices[0].logprobs, b.choices[0].logprobs, strict=True):  # type: ignore[arg-type]
            assert lb.logprob == pytest.approx(la.logprob, abs=2e-3)
    half.kv_cache.check_integrity()


def test_bfloat16_cache_on_request(tiny_checkpoint: Callable[..., Path]) -> None:
    engine = _engine(tiny_checkpoint("llama-gqa-llama3-rope"), "bfloat16")
    assert engine.runner.kv_caches[0][0].dtype == torch.bfloat16
    out = engine.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=4, min_tokens=4))
    assert len(out[0].choices[0].token_ids) == 4


def test_a_cache_wider_or_other_than_the_model_is_rejected(tiny_checkpoint: Callable[..., Path]) -> None:
    with pytest.raises(
        ValueError, match="--kv-cache-dtype float16 needs a float16 model, or a float32 one on CPU"
    ):
        _engine(tiny_checkpoint("llama-gqa-llama3-rope"), "float16", dtype="bfloat16")


def test_a_bfloat16_model_keeps_its_own_dtype_by_default(tiny_checkpoint: Callable[..., Path]) -> None:
    engine = _engine(tiny_checkpoint("llama-gqa-llama3-rope"), "auto", dtype="bfloat16")
    assert engine.runner.kv_caches[0][0].dtype == torch.bfloat16


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS line")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads Linux's /proc/self/status")
def test_the_cache_becomes_resident_only_as_tokens_fill_it(tiny_checkpoint: Callable[..., Path]) -> None:
    path = tiny_checkpoint("llama-gqa-llama3-rope")
    before = _rss_bytes()
    engine = _engine(path, "auto", kv_cache_bytes=256 << 20)
    cache_bytes = sum(k.nbytes + v.nbytes for k, v in engine.runner.kv_caches)
    assert cache_bytes > 250 << 20
    # Loading the tiny model takes a few MiB; a zeroed cache would have added all 256.
    assert _rss_bytes() - before < 64 << 20


def test_without_the_c_kernels_the_cache_keeps_the_models_dtype_and_is_zeroed(
    tiny_checkpoint: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No C attention kernel (no compiler, or KVASIR_CPU_KERNELS=0): the reference reads padded
    blocks and masks them, so the cache is the model's float32, zeroed."""
    from kvasir.kernels import cpu_ops

    monkeypatch.setenv(cpu_ops.DISABLE_ENV, "0")
    cpu_ops.clear_cache()
    cpu_attention._limits.cache_clear()
    try:
        engine = _engine(tiny_checkpoint("llama-gqa-llama3-rope"), "auto")
        k_cache = engine.runner.kv_caches[0][0]
        assert k_cache.dtype == torch.float32
        assert not k_cache.any()
        out = engine.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=3, min_tokens=3))
        assert len(out[0].choices[0].token_ids) == 3
    finally:
        monkeypatch.delenv(cpu_ops.DISABLE_ENV)
        cpu_ops.clear_cache()
        cpu_attention._limits.cache_clear()
