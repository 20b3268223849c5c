"""Request bodies past --max-request-bytes get 413 in the OpenAI shape, declared or chunked, and
framing two parsers could read differently gets 400 (raw sockets: no client library would send it)."""

from __future__ import annotations

import json
import socket
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


def _raw(server: RunningServer, head: str, body: bytes) -> tuple[int, bytes]:
    """Send `head` (request line and headers, CRLF-joined) and `body` on a raw socket: (status, reply)."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=TIMEOUT) as sock:
        sock.sendall(head.encode() + b"\r\n\r\n" + body)
        sock.shutdown(socket.SHUT_WR)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    return int(reply.split(b" ", 2)[1]), reply


def _chunked(body: bytes) -> bytes:
    return (
        b"".join(
            b"%x\r\n%s\r\n" % (len(part), part)
            for part in (body[i : i + 1000] for i in range(0, len(body), 1000))
        )
        + b"0\r\n\r\n"
    )


def test_content_length_with_chunked_is_refused_whatever_the_size(server: RunningServer) -> None:
    """The smuggling shape: a small declared length in front of a large chunked body."""
    for size in (10, 50 * LIMIT):
        head = (
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            "Content-Length: 10\r\nTransfer-Encoding: chunked\r\nConnection: close"
        )
        status, reply = _raw(server, head, _chunked(_body(size)))
        assert status == 400, reply[:300]
        assert b"bad_framing" in reply or b"Invalid" in reply or b"invalid" in reply


def test_a_body_longer_than_declared_never_passes_the_cap(server: RunningServer) -> None:
    """The bytes received count, not the header: a lie in Content-Length gets nothing past the cap."""
    body = _body(50 * LIMIT)
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {LIMIT - 1}\r\nConnection: close"
    )
    status, reply = _raw(server, head, body)
    assert status in (400, 413), reply[:300]  # the JSON cut at the declared length is not valid either


def test_repeated_or_invalid_content_length_is_refused(server: RunningServer) -> None:
    body = _body(10)
    for lengths in ((len(body), len(body) + 5), ("12abc",)):
        head = (
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + "".join(f"Content-Length: {n}\r\n" for n in lengths)
            + "Connection: close"
        )
        status, reply = _raw(server, head, body)
        assert status == 400, reply[:300]
    assert server.state.lifecycle is not None  # the server is still up
    ok = httpx.get(server.url + "/health", timeout=TIMEOUT)
    assert ok.status_code == 200
