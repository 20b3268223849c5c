"""Overload and disconnects: a full queue answers 429, and a client that leaves frees its KV blocks."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from contextlib import AsyncExitStack
from pathlib import Path

import httpx
import openai
import pytest

from kvasir.runtime.server.app import build_app
from kvasir.runtime.server.config import ServerConfig
from tests.runtime.server.harness import MODEL, TIMEOUT, RunningServer, serve, tiny_engine_config

LONG = {"model": MODEL, "prompt": "a long answer", "max_tokens": 200, "ignore_eos": True}


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint: Callable[..., Path]) -> Path:
    return tiny_checkpoint("llama")


def finished_count(server: RunningServer, reason: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=TIMEOUT).text
    prefix = f'kvasir_requests_finished_total{{finish_reason="{reason}",model_name="{MODEL}"}} '
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(prefix))


def assert_engine_clean(server: RunningServer) -> None:
    """Nothing left in the engine and every KV block free (call after the server stopped)."""
    engine = server.state.engine
    assert engine is not None and not engine.is_running
    assert not engine.engine.scheduler.has_unfinished_requests()
    engine.engine.kv_cache.check_integrity()
    assert engine.engine.kv_cache.usage == 0.0


def test_a_full_queue_answers_429_with_retry_after(checkpoint: Path) -> None:
    # One sequence runs and one may wait: the third concurrent request is one too many.
    engine_config = tiny_engine_config(checkpoint, max_num_seqs=1)
    app = build_app(engine_config, ServerConfig(max_queue_len=1, retry_after=3))
    with serve(app) as server:

        async def scenario() -> None:
            async with AsyncExitStack() as streams, httpx.AsyncClient(timeout=TIMEOUT) as client:
                for _ in range(2):  # admitted: the response headers arrive before any token
                    response = await streams.enter_async_context(
                        client.stream("POST", server.url + "/v1/completions", json={**LONG, "stream": True})
                    )
                    assert response.status_code == 200
                # Refused before any tokenizing or chat rendering: a full server does no work for it.
                tokenizer = server.state.tokenizer
                calls: list[str] = []
                encode, render = tokenizer.encode, tokenizer.apply_chat_template
                tokenizer.encode = lambda *a, **k: calls.append("encode") or encode(*a, **k)  # type: ignore[method-assign]
                tokenizer.apply_chat_template = lambda *a, **k: calls.append("render") or render(*a, **k)  # type: ignore[method-assign]
                chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
                assert (await client.post(server.url + "/v1/chat/completions", json=chat)).status_code == 429
                rejected = await client.post(server.url + "/v1/completions", json=LONG)
                assert calls == [], calls
                tokenizer.encode, tokenizer.apply_chat_template = encode, render  # type: ignore[method-assign]
                assert rejected.status_code == 429
                assert rejected.headers["retry-after"] == "3"
                assert rejected.json()["error"]["code"] == "queue_full"
                sdk = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
                with pytest.raises(openai.RateLimitError):
                    await sdk.completions.create(model=MODEL, prompt="x", max_tokens=1)
            # Leaving the block closed both streams: their capacity comes back.

        asyncio.run(scenario())
        server.wait_idle()
        after = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT)
        assert after.completions.create(model=MODEL, prompt="x", max_tokens=2).choices
        assert finished_count(server, "abort") == 2
    assert_engine_clean(server)


def test_100_streams_half_cancelled_leave_nothing_running(checkpoint: Path) -> None:
    app = build_app(tiny_engine_config(checkpoint, num_kv_blocks=2048), ServerConfig())
    body = {"model": MODEL, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}

    async def one(client: httpx.AsyncClient, url: str, index: int) -> int | None:
        """Stream one completion; odd ones leave after 3 events. The full ones return their token count."""
        # The ones that leave ask for far more tokens: only an abort ends them soon.
        request = {**body, "prompt": f"request number {index}", "max_tokens": 200 if index % 2 else 24}
        events = 0
        async with client.stream("POST", url + "/v1/completions", json=request) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                events += 1
                if index % 2 and events == 3:
                    return None  # leaving the block closes the connection mid-stream
                if line == "data: [DONE]":
                    break
                payload = json.loads(line[6:])
                if payload["usage"] is not None:
                    usage: int = payload["usage"]["completion_tokens"]
        return usage

    async def scenario(url: str) -> list[int | None]:
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=TIMEOUT, limits=limits) as client:
            return await asyncio.gather(*(one(client, url, i) for i in range(100)))

    with serve(app) as server:
        counts = asyncio.run(scenario(server.url))
        server.wait_idle()
        assert counts[0::2] == [24] * 50 and counts[1::2] == [None] * 50
        assert finished_count(server, "abort") == 50
        assert finished_count(server, "length") == 50
    assert_engine_clean(server)


def test_a_non_streaming_client_that_leaves_aborts_its_request(checkpoint: Path) -> None:
    app = build_app(tiny_engine_config(checkpoint), ServerConfig())
    with serve(app) as server:

        async def leave_after_the_request_is_running() -> None:
            async with httpx.AsyncClient(timeout=TIMEOUT) as client:
                request = asyncio.ensure_future(client.post(server.url + "/v1/completions", json=LONG))
                # Leave once the server has admitted the request (it runs for 200 steps).
                await asyncio.wait_for(_until(lambda: server.state.lifecycle.in_flight == 1), TIMEOUT)
                request.cancel()
                await asyncio.gather(request, return_exceptions=True)

        asyncio.run(leave_after_the_request_is_running())
        server.wait_idle()
        assert finished_count(server, "abort") == 1
        assert finished_count(server, "length") == 0
    assert_engine_clean(server)


async def _until(condition: Callable[[], bool]) -> None:
    """Await a condition set by another thread (the server's), checking at every event-loop turn."""
    while not condition():
        await asyncio.sleep(0.005)
