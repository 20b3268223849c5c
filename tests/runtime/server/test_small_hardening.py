"""Small answers a careful server gets right: an empty body names the missing parameter, /v1/models
does not reveal where the model lives on disk, and /tokenize and /detokenize honour drain without
counting as refused generation requests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from kvasir.runtime.server.app import build_app
from kvasir.runtime.server.config import ServerConfig
from kvasir.runtime.server.endpoints import public_root
from kvasir.runtime.server.runner import open_to_the_network
from tests.runtime.server.harness import MODEL, TIMEOUT, RunningServer, serve, tiny_engine_config


@pytest.fixture
def server(tiny_checkpoint: Callable[..., Path]) -> Iterator[RunningServer]:
    with serve(build_app(tiny_engine_config(tiny_checkpoint("llama")), ServerConfig())) as running:
        yield running


@pytest.mark.parametrize(
    "path, first",
    [("/v1/completions", "prompt"), ("/v1/chat/completions", "messages"), ("/detokenize", "tokens")],
)
def test_an_empty_body_names_the_missing_parameter(server: RunningServer, path: str, first: str) -> None:
    response = httpx.post(server.url + path, timeout=TIMEOUT)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == first and "None" not in error["message"], error
    assert error["message"].startswith(f"Missing required parameter: {first}")


def test_models_do_not_reveal_the_local_path(
    server: RunningServer, tiny_checkpoint: Callable[..., Path]
) -> None:
    card = httpx.get(server.url + "/v1/models", timeout=TIMEOUT).json()["data"][0]
    local = str(tiny_checkpoint("llama"))
    assert card["root"] == Path(local).name and "/" not in card["root"]
    assert public_root("Qwen/Qwen3-0.6B") == "Qwen/Qwen3-0.6B"  # a Hub id is public already


def test_tokenize_and_detokenize_honour_drain(server: RunningServer) -> None:
    def rejected() -> str:
        text = httpx.get(server.url + "/metrics", timeout=TIMEOUT).text
        return "\n".join(
            line for line in text.splitlines() if line.startswith("kvasir_requests_rejected_total")
        )

    before = rejected()
    assert (
        httpx.post(
            server.url + "/tokenize", json={"model": MODEL, "prompt": "hi"}, timeout=TIMEOUT
        ).status_code
        == 200
    )
    server.state.lifecycle.begin_drain()
    for path, body in (
        ("/tokenize", {"model": MODEL, "prompt": "hi"}),
        ("/detokenize", {"model": MODEL, "tokens": [1, 2]}),
    ):
        response = httpx.post(server.url + path, json=body, timeout=TIMEOUT)
        assert response.status_code == 503 and response.json()["error"]["code"] == "draining", response.text
        assert response.headers.get("retry-after")
    assert rejected() == before  # utility calls are not refused generation requests


def test_an_open_server_says_so_at_start_up() -> None:
    warning = open_to_the_network(ServerConfig(host="0.0.0.0"))
    assert warning is not None and "no API key" in warning and "--api-key" in warning
    assert open_to_the_network(ServerConfig(host="0.0.0.0", api_key="k")) is None
    assert open_to_the_network(ServerConfig(host="127.0.0.1")) is None


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 1}'),
        ("/v1/completions", b'{"prompt": "a", "stop": ["\\udfff"], "max_tokens": 1}'),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x\\ud800"}], "max_tokens": 1}'),
        ("/tokenize", b'{"prompt": "\\ud800"}'),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"messages": []}}',
        ),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"add_generation_prompt": false}}',
        ),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"\\ud800": 1}}',
        ),
    ],
)
def test_unencodable_text_and_clashing_template_keys_get_400(
    server: RunningServer, path: str, body: bytes
) -> None:
    response = httpx.post(
        server.url + path, content=body, headers={"content-type": "application/json"}, timeout=TIMEOUT
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] in {"prompt", "stop", "messages", "chat_template_kwargs"}


def test_stop_lists_are_bounded(server: RunningServer) -> None:
    def ask(stop: list[str]) -> httpx.Response:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "stop": stop}
        return httpx.post(server.url + "/v1/completions", json=body, timeout=TIMEOUT)

    assert ask([f"s{i}" for i in range(64)]).status_code == 200
    for stop in ([f"s{i}" for i in range(65)], ["x" * 4097], [f"{i:0>100}" for i in range(50)]):
        response = ask(stop)
        assert response.status_code == 400 and response.json()["error"]["param"] == "stop", response.text
