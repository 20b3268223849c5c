"""Many bodies at once: each one under --max-request-bytes, together past
--max-buffered-request-bytes. A real `kvasir serve` process; raw sockets hold uploads open
half-sent, as a client that wants the server to buffer for it would."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.runtime.server.harness import MODEL, TIMEOUT, ServerProcess, serve_process

ONE = 400_000  # bytes each client sends of its declared body
CAP = 1_000_000  # --max-request-bytes
BUDGET = 1_000_000  # --max-buffered-request-bytes: two held uploads fit, a third does not


@pytest.fixture(scope="module")
def server(tiny_checkpoint: Callable[..., Path]) -> Iterator[ServerProcess]:
    with serve_process(
        tiny_checkpoint("llama"),
        f"--max-request-bytes={CAP}",
        f"--max-buffered-request-bytes={BUDGET}",
    ) as running:
        yield running


def _open_upload(url: str, sent: int, declared: int) -> socket.socket:
    """A POST whose body is declared `declared` bytes long, of which `sent` are sent now."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=TIMEOUT)
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {declared}\r\n\r\n"
    ).encode()
    sock.sendall(head + b" " * sent)
    return sock


def _reply(sock: socket.socket) -> bytes:
    sock.settimeout(TIMEOUT)
    reply = b""
    while b"\r\n\r\n" not in reply or len(reply) < 200:
        chunk = sock.recv(65536)
        if not chunk:
            break
        reply += chunk
    return reply


def _buffered(url: str) -> None:
    """Wait until the server has read what was sent (its reads are asynchronous)."""
    time.sleep(0.5)
    assert httpx.get(url + "/health", timeout=TIMEOUT).status_code == 200


def test_uploads_past_the_budget_are_refused_and_the_budget_comes_back(server: ServerProcess) -> None:
    held = [_open_upload(server.url, ONE, CAP - 10) for _ in range(2)]
    try:
        _buffered(server.url)
        third = _open_upload(server.url, ONE, CAP - 10)
        reply = _reply(third)
        third.close()
        assert reply.startswith(b"HTTP/1.1 503"), reply[:200]
        assert b"retry-after: 1" in reply.lower()
        assert b'"code":"server_busy"' in reply.replace(b" ", b"")
        # A small request still fits beside the two held uploads.
        small = {"model": MODEL, "prompt": "hello", "max_tokens": 1}
        assert httpx.post(server.url + "/v1/completions", json=small, timeout=TIMEOUT).status_code == 200
    finally:
        for sock in held:
            sock.close()
    # The clients left: their bytes no longer count, and a body as large as theirs is accepted.
    time.sleep(0.5)
    body = {"model": MODEL, "prompt": "a " * 200, "max_tokens": 1, "user": "x" * ONE}
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=TIMEOUT)
    assert response.status_code == 200, response.text
