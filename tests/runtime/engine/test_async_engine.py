"""AsyncEngine: streaming outputs per request, concurrent requests, and cancellation freeing blocks."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kvasir.runtime.config import EngineConfig
from kvasir.runtime.engine.async_engine import AsyncEngine
from kvasir.runtime.engine.llm_engine import LLMEngine
from kvasir.runtime.sample.params import InvalidParameterError, SamplingParams
from tests.tiny_checkpoints import make_tiny_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture
def async_engine(checkpoint: Path):
    engine = AsyncEngine(LLMEngine(EngineConfig(model=str(checkpoint), device="cpu", max_model_len=256)))
    yield engine
    engine.shutdown()


async def _collect(engine: AsyncEngine, request_id: str, prompt: list[int], params: SamplingParams):
    tokens: list[int] = []
    finish = None
    async for output in engine.generate(request_id, params=params, prompt_token_ids=prompt):
        for delta in output.outputs:
            tokens.extend(delta.token_ids)
            finish = delta.finish_reason or finish
    return tokens, finish


def test_concurrent_streams_match_offline_results(async_engine: AsyncEngine, checkpoint: Path) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    prompts = [[5 + i] * (3 + 7 * i) for i in range(6)]

    async def main():
        return await asyncio.gather(
            *(_collect(async_engine, f"r{i}", p, params) for i, p in enumerate(prompts))
        )

    streamed = asyncio.run(main())
    offline = LLMEngine(EngineConfig(model=str(checkpoint), device="cpu", max_model_len=256))
    expected = offline.generate(prompts, params)
    assert [tokens for tokens, _ in streamed] == [r.choices[0].token_ids for r in expected]
    assert all(finish == "length" for _, finish in streamed)


def test_invalid_request_raises_in_the_caller(async_engine: AsyncEngine) -> None:
    async def main():
        async for _ in async_engine.generate("bad", params=SamplingParams(), prompt_token_ids=[]):
            pass

    with pytest.raises(InvalidParameterError):
        asyncio.run(main())


def test_cancelled_streams_free_their_blocks(async_engine: AsyncEngine) -> None:
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def consume_a_few(request_id: str, prompt: list[int]) -> None:
        count = 0
        async for _ in async_engine.generate(request_id, params=long, prompt_token_ids=prompt):
            count += 1
            if count == 3:
                break  # leaving the iterator aborts the request

    async def main() -> None:
        await asyncio.gather(*(consume_a_few(f"c{i}", [9 + i] * 20) for i in range(8)))
        # One more request runs to completion after the aborts: the loop is still healthy.
        tokens, finish = await _collect(
            async_engine, "after", [3, 4, 5], SamplingParams(max_tokens=4, ignore_eos=True)
        )
        assert len(tokens) == 4 and finish == "length"

    asyncio.run(main())
    async_engine.shutdown()
    engine = async_engine.engine
    assert not engine.has_unfinished()
    engine.kv_cache.check_integrity()
    assert engine.kv_cache.usage == 0.0
