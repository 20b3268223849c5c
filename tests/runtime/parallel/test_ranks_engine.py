"""The engine at --tensor-parallel-size 2 on CPU (gloo): rank 0 drives a spawned rank, and greedy
tokens equal those of one process, synchronously (`execute`), with async scheduling (`prepare_step`
ahead, `run_prepared`) and with speculative decoding (`execute` with drafts; `propose_drafts` for
layer skip), for n > 1 and a prefix-cache hit; a model or a size that cannot be split is refused
before any process starts."""

from __future__ import annotations

import inspect
import multiprocessing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvasir.runtime.config import EngineConfig, ModelConfig
from kvasir.runtime.engine.llm_engine import LLMEngine
from kvasir.runtime.engine.ranks.driver import MirroredRunner
from kvasir.runtime.parallel.startup_check import check_tensor_parallel
from kvasir.runtime.sample.params import SamplingParams
from kvasir.runtime.spec_decode.config import parse_speculative_config
from kvasir.runtime.worker.model_runner import ModelRunner

PROMPTS: list[list[int]] = [[5, 9, 14, 3, 7, 7, 21, 40] * 3, [11, 12, 13], [5, 9, 14, 3, 7, 7, 21, 40] * 3]
PARAMS = [
    SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, n=2),
    SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
]


def _config(checkpoint: Path, **overrides: Any) -> EngineConfig:
    return EngineConfig(model=str(checkpoint), device="cpu", max_model_len=128, num_kv_blocks=64, **overrides)


def _generate(engine: LLMEngine) -> list[list[list[int]]]:
    # One prompt at a time: the third repeats the first after it has finished (a prefix-cache hit).
    results = []
    for prompt, params in zip(PROMPTS, PARAMS, strict=True):
        (result,) = engine.generate([prompt], params)
        results.append([choice.token_ids for choice in result.choices])
    return results


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint: Callable[..., Path]) -> Path:
    return tiny_checkpoint("llama")  # 4 heads, 4 KV heads


@pytest.fixture(scope="module")
def single(checkpoint: Path) -> list[list[list[int]]]:
    engine = LLMEngine(_config(checkpoint))
    try:
        return _generate(engine)
    finally:
        engine.close()


@pytest.mark.parametrize(
    "overrides",
    [
        {"async_scheduling": False},
        {"async_scheduling": True},
        {"speculative_config": parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3}')},
        {
            "speculative_config": parse_speculative_config(
                '{"method": "layer_skip", "num_layers": 1, "num_speculative_tokens": 2}'
            )
        },
    ],
    ids=["sync", "async-scheduling", "ngram-drafts", "layer-skip-drafts"],
)
def test_two_ranks_give_the_tokens_of_one(
    checkpoint: Path, single: list[list[list[int]]], overrides: dict[str, Any]
) -> None:
    engine = LLMEngine(_config(checkpoint, tensor_parallel_size=2, **overrides))
    ranks = []
    try:
        assert isinstance(engine.runner, MirroredRunner)
        ranks = list(engine.runner.ranks.processes.values())
        assert [process.is_alive() for process in ranks] == [True]
        assert _generate(engine) == single
        assert engine.stats().prefix_cache_hits > 0
    finally:
        engine.close()
    # Stop reached the rank: it left its loop and exited 0, reaped by close().
    assert [process.exitcode for process in ranks] == [0]


def test_a_size_the_model_cannot_split_is_refused_before_any_rank_starts(checkpoint: Path) -> None:
    with pytest.raises(
        ValueError, match=r"the MLP's intermediate_size \(128\) is not divisible by --tensor-parallel-size 3"
    ):
        LLMEngine(_config(checkpoint, tensor_parallel_size=3))
    assert multiprocessing.active_children() == []


def test_sizes_and_devices_are_checked_with_the_flag_named() -> None:
    def shape(heads: int, kv_heads: int) -> ModelConfig:
        return ModelConfig("LlamaForCausalLM", 64, 64, 128, 2, heads, kv_heads, 16, 1e-5, 1e4, 128)

    check_tensor_parallel(shape(8, 2), 4, "cpu", 0)  # 2 KV heads split over 4 ranks: replicated
    check_tensor_parallel(shape(8, 8), 4, "cuda", 4)
    with pytest.raises(ValueError, match=r"needs 4 CUDA devices on this node \(one per rank\); torch sees 2"):
        check_tensor_parallel(shape(8, 8), 4, "cuda", 2)
    # Across nodes each machine needs only its own ranks' GPUs.
    check_tensor_parallel(shape(8, 8), 8, "cuda", 4, nnodes=2)
    with pytest.raises(ValueError, match=r"8 over --nnodes 2 needs 4 CUDA devices on this node"):
        check_tensor_parallel(shape(8, 8), 8, "cuda", 3, nnodes=2)
    with pytest.raises(ValueError, match="multiple of the number of key/value heads"):
        check_tensor_parallel(shape(12, 4), 6, "cpu", 0)
    with pytest.raises(ValueError, match="tensor_parallel_size must be between 1 and 64, got 0"):
        EngineConfig(model="/m", tensor_parallel_size=0)


def test_every_public_runner_call_is_mirrored_to_the_ranks() -> None:
    """A public ModelRunner method the engine calls on rank 0 alone would leave the other ranks a
    call behind (their collectives would pair with the wrong ones): each is overridden to be
    announced, or named here as one the runner only calls on itself."""
    only_called_inside = {"prepare_inputs"}  # by prepare_step and execute, on every rank alike
    public = {
        name
        for name, member in inspect.getmembers(ModelRunner, inspect.isfunction)
        if not name.startswith("_")
    }
    mirrored = {name for name in public if MirroredRunner.__dict__.get(name) is not None}
    assert public - mirrored == only_called_inside
