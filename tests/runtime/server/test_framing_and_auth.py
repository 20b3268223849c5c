"""Issue 34 on `kvasir serve`: a request with both Content-Length and Transfer-Encoding is refused
and its connection closed, so a second request hidden in its bytes is never answered (RFC 9112
section 6.3; raw sockets, since no client library sends it), whether the server runs its own HTTP
protocol or the app is served by plain uvicorn; and without the API key a malformed body gets 401,
never a validation message."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from kvasir.runtime.server.app import build_app
from kvasir.runtime.server.config import ServerConfig
from kvasir.runtime.server.http_protocol import uvicorn_http_settings
from tests.runtime.server.harness import MODEL, TIMEOUT, serve, tiny_engine_config

KEY = "framing-test-key"
AUTH = {"authorization": f"Bearer {KEY}"}


class _ThreadServer(uvicorn.Server):
    def install_signal_handlers(self) -> None:  # not the main thread
        pass


@contextmanager
def _serve_with_protocol(app: FastAPI) -> Iterator[str]:
    """`app` served as `kvasir serve` serves it (its h11 protocol and limits), once loaded."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    config = uvicorn.Config(
        app,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=5,
        **uvicorn_http_settings(30.0, 5.0),
    )
    server = _ThreadServer(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        if not app.state.kvasir.lifecycle.started.wait(TIMEOUT):
            raise TimeoutError("the server did not finish loading in time")
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(TIMEOUT)
        sock.close()


@pytest.fixture(scope="module", params=["kvasir-protocol", "plain-uvicorn"])
def server(request: pytest.FixtureRequest, tiny_checkpoint: Callable[..., Path]) -> Iterator[str]:
    app = build_app(tiny_engine_config(tiny_checkpoint("llama")), ServerConfig(api_key=KEY))
    if request.param == "kvasir-protocol":
        with _serve_with_protocol(app) as url:
            yield url
    else:
        with serve(app) as running:
            yield running.url


def _exchange(url: str, data: bytes) -> bytes:
    """Send `data` without shutting our side (only the server may end the connection), and read
    everything until the server closes it (TIMEOUT: the hang guard)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=TIMEOUT) as sock:
        sock.sendall(data)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
        return reply


def test_a_request_with_both_framings_is_refused_and_its_connection_closed(server: str) -> None:
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1}).encode()
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    smuggled = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {KEY}\r\nContent-Length: {len(chunked)}\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    reply = _exchange(server, head.encode() + chunked + smuggled)
    assert reply.count(b"HTTP/1.1 ") == 1, reply[:800]  # the hidden GET /health got no answer
    assert reply.startswith(b"HTTP/1.1 400"), reply[:300]
    assert b"connection: close" in reply.lower() and b"bad_framing" in reply
    assert httpx.get(f"{server}/health", timeout=TIMEOUT).status_code == 200  # the server is fine


MALFORMED = {
    "not-json": b'{"model": ',
    "unknown-field": json.dumps({"model": MODEL, "prompt": "hi", "no_such_field": 1}).encode(),
    "wrong-type": json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": "many"}).encode(),
    "too-deep": b'{"model": "tiny", "prompt": ' + b"[" * 2000 + b"]" * 2000 + b"}",
    "lone-surrogate": b'{"model": "tiny", "prompt": "\\ud800"}',
}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"])
@pytest.mark.parametrize("body", list(MALFORMED.values()), ids=list(MALFORMED))
def test_without_the_key_a_malformed_body_gets_401_not_its_validation(
    server: str, path: str, body: bytes
) -> None:
    headers = {"content-type": "application/json"}
    with httpx.Client(timeout=TIMEOUT) as client:
        for auth in ({}, {"authorization": "Bearer wrong"}):
            answer = client.post(f"{server}{path}", content=body, headers={**headers, **auth})
            assert answer.status_code == 401, answer.text
            assert answer.json()["error"]["code"] == "invalid_api_key"
            assert answer.headers["www-authenticate"] == "Bearer"
        # With the key, the same body is judged on its merits.
        assert client.post(f"{server}{path}", content=body, headers={**headers, **AUTH}).status_code == 400


def test_with_the_key_a_valid_request_is_served(server: str) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    answer = httpx.post(f"{server}/v1/completions", json=body, headers=AUTH, timeout=TIMEOUT)
    assert answer.status_code == 200, answer.text
