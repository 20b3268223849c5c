"""The engine with an fp8 KV cache (`--kv-cache-dtype fp8`): more blocks, nearly the same outputs."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvasir.runtime.config import EngineConfig
from kvasir.runtime.engine.llm_engine import LLMEngine
from kvasir.runtime.engine_args import add_engine_args, engine_config_from_args
from kvasir.runtime.sample.params import SamplingParams


def _engine(path: Path, kv_cache_dtype: str) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(path),
            device="cpu",
            dtype="float32",
            kv_cache_dtype=kv_cache_dtype,
            kv_cache_bytes=1 << 22,
        )
    )


def test_fp8_cache_holds_four_times_the_tokens_of_fp32_and_stays_close(
    tiny_checkpoint: Callable[..., Path],
) -> None:
    path = tiny_checkpoint("llama-gqa-llama3-rope")
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(4, 200, (n,), generator=generator).tolist() for n in (5, 16, 23, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=4, min_tokens=4, logprobs=3)
    full, fp8 = _engine(path, "float32"), _engine(path, "fp8")
    assert fp8.runner.kv_caches[0][0].dtype == torch.float8_e4m3fn
    # Same byte budget, a quarter of the bytes per element.
    assert fp8.runner.num_blocks >= 4 * full.runner.num_blocks
    for a, b in zip(full.generate(prompts, params), fp8.generate(prompts, params), strict=True):
        first_a, first_b = a.choices[0].logprobs[0], b.choices[0].logprobs[0]  # type: ignore[index]
        # The prompt's K/V went through e4m3 (3 mantissa bits): close, not equal.
        assert first_b.token_id == first_a.token_id
        assert first_b.logprob == pytest.approx(first_a.logprob, abs=0.1)
        assert first_b.logprob != first_a.logprob  # the cache really was quantized
    fp8.kv_cache.check_integrity()
    assert fp8.kv_cache.usage == 0.0


@pytest.mark.parametrize(("argv", "expected"), [([], "auto"), (["--kv-cache-dtype", "fp8"], "fp8")])
def test_flag(argv: list[str], expected: str) -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args(["--model", "m", *argv])).kv_cache_dtype == expected


def test_unknown_kv_cache_dtype_is_rejected() -> None:
    with pytest.raises(
        ValueError, match="kv_cache_dtype must be one of auto, float32, float16, bfloat16, fp8"
    ):
        EngineConfig(model="m", kv_cache_dtype="int4")


def test_fp8_cache_doubles_the_blocks_of_a_bf16_cache(tiny_checkpoint: Callable[..., Path]) -> None:
    path = tiny_checkpoint("llama-gqa-llama3-rope")
    blocks = {
        kv: LLMEngine(
            EngineConfig(
                model=str(path), device="cpu", dtype="bfloat16", kv_cache_dtype=kv, kv_cache_bytes=1 << 22
            )
        ).runner.num_blocks
        for kv in ("auto", "fp8")
    }
    assert blocks["fp8"] >= 2 * blocks["auto"]
