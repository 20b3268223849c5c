"""Scale from zero with a real backend: the official openai client (its default timeout) sends a
streamed and a non-streamed request to a router whose only backend does not exist yet; a real
`kvasir serve` (the tiny checkpoint) is then started on that backend's address, and both answers
come from it."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from kvasir.router.config import RouterConfig
from kvasir.router.server import RouterApp
from tests.router.stub_backend import TIMEOUT, serve_app
from tests.runtime.server.harness import MODEL, serve_process


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait(condition: Callable[[], object]) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


@pytest.mark.slow
def test_requests_held_before_the_server_exists_are_answered_by_it(
    tiny_checkpoint: Callable[..., Path],
) -> None:
    checkpoint = tiny_checkpoint("llama")
    port = _free_port()
    app = RouterApp(RouterConfig(backends=(f"http://127.0.0.1:{port}",), heartbeat_interval=1.0))
    with serve_app(app, lifespan="on", kill=False) as router, ThreadPoolExecutor(2) as threads:
        client = openai.OpenAI(
            base_url=f"{router.url}/v1", api_key="unused", max_retries=0
        )  # default timeout

        def chat() -> str | None:
            answer = client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "hello"}],
                max_tokens=4,
            )
            assert answer.usage is not None and answer.usage.completion_tokens == 4
            return answer.choices[0].message.content

        def stream() -> list[str]:
            chunks = client.completions.create(model=MODEL, prompt="hello", max_tokens=5, stream=True)
            return [chunk.choices[0].text for chunk in chunks if chunk.choices]

        chatted, streamed = threads.submit(chat), threads.submit(stream)
        assert app.hold is not None
        hold = app.hold
        _wait(lambda: len(hold) == 2)
        with serve_process(checkpoint, "--port", str(port)):  # the later of two --port flags wins
            content, texts = chatted.result(TIMEOUT), streamed.result(TIMEOUT)
        assert isinstance(content, str)
        assert len(texts) >= 1 and "".join(texts)
        assert 'kvasir_router_held_total{outcome="released"} 2.0' in app.metrics.render().decode()
