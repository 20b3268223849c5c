"""The router in front of two real `kvasir serve` processes (the tiny checkpoint): the openai SDK
through it, a stream, and the backends' own /metrics read by the router's scraper."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import openai
import pytest

from kvasir.router.config import RouterConfig
from kvasir.router.server import RouterApp
from tests.router.stub_backend import TIMEOUT, serve_app
from tests.runtime.server.harness import MODEL, serve_process


@pytest.mark.slow
def test_two_real_servers_behind_the_router(tiny_checkpoint: Callable[..., Path]) -> None:
    checkpoint = tiny_checkpoint("llama")
    with serve_process(checkpoint) as one, serve_process(checkpoint) as two:
        app = RouterApp(RouterConfig(backends=(one.url, two.url), scrape_interval=0.1))
        with serve_app(app, lifespan="on", kill=False) as router:
            deadline = time.monotonic() + TIMEOUT
            while not all(b.metrics_known for b in app.pool.backends.values()):
                assert time.monotonic() < deadline, "the router never read the servers' /metrics"
                time.sleep(0.05)
            assert all(b.kv_usage == 0.0 and b.waiting == 0.0 for b in app.pool.backends.values())
            client = openai.OpenAI(
                base_url=f"{router.url}/v1", api_key="unused", timeout=TIMEOUT, max_retries=0
            )
            system = "Answer in one word. " * 8
            for turn in range(3):
                messages = [
                    {"role": "system", "content": system},
                    {"role": "user", "content": f"turn {turn}"},
                ]
                answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)  # type: ignore[arg-type]
                assert answer.usage is not None and answer.usage.completion_tokens == 4
            stream = client.completions.create(model=MODEL, prompt="hello", max_tokens=5, stream=True)
            assert len([chunk for chunk in stream if chunk.choices and chunk.choices[0].text]) >= 1
            # The shared system prompt sent every chat to one server.
            routed = app.metrics.render().decode()
            assert 'kvasir_router_decisions_total{reason="prefix"} 2.0' in routed
