"""Request bodies past --max-request-bytes get 413 in the OpenAI shape, declared or chunked."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from kvasir.runtime.server.app import build_app
from kvasir.runtime.server.config import ServerConfig
from tests.runtime.server.harness import MODEL, TIMEOUT, RunningServer, serve, tiny_engine_config

LIMIT = 2048


@pytest.fixture(scope="module")
def server(tiny_checkpoint: Callable[..., Path]) -> Iterator[RunningServer]:
    app = build_app(tiny_engine_config(tiny_checkpoint("llama")), ServerConfig(max_request_bytes=LIMIT))
    with serve(app) as running:
        yield running


def _body(prompt_chars: int) -> bytes:
    return json.dumps({"model": MODEL, "prompt": "a" * prompt_chars, "max_tokens": 1}).encode()


def _assert_413(response: httpx.Response) -> None:
    assert response.status_code == 413
    error = response.json()["error"]
    assert error["code"] == "request_too_large" and error["type"] == "invalid_request_error"
    assert str(LIMIT) in error["message"]


def test_a_declared_oversized_body_is_refused(server: RunningServer) -> None:
    response = httpx.post(
        server.url + "/v1/completions",
        content=_body(LIMIT),
        headers={"content-type": "application/json"},
        timeout=TIMEOUT,
    )
    _assert_413(response)


def test_a_chunked_oversized_body_is_refused(server: RunningServer) -> None:
    body = _body(4 * LIMIT)

    def chunks() -> Iterator[bytes]:  # no Content-Length: the server must count
        for start in range(0, len(body), 512):
            yield body[start : start + 512]

    response = httpx.post(
        server.url + "/v1/completions",
        content=chunks(),
        headers={"content-type": "application/json"},
        timeout=TIMEOUT,
    )
    _assert_413(response)


def test_a_body_within_the_limit_is_served(server: RunningServer) -> None:
    response = httpx.post(
        server.url + "/v1/completions",
        content=_body(100),
        headers={"content-type": "application/json"},
        timeout=TIMEOUT,
    )
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 1
