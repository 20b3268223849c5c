"""Connections that never finish their request are answered 408 and closed after
--request-read-timeout (a real `kvasir serve` process), while complete requests are unaffected."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.runtime.server.harness import MODEL, TIMEOUT, send_raw, serve_process

pytestmark = pytest.mark.slow
READ_TIMEOUT = 1.0


@pytest.fixture(scope="module")
def server(tiny_checkpoint: Callable[..., Path]) -> Iterator[str]:
    with serve_process(tiny_checkpoint("llama"), "--request-read-timeout", str(READ_TIMEOUT)) as running:
        yield running.url


@pytest.mark.parametrize(
    "parts",
    [
        [],  # connects, never sends a byte
        [b"POST /v1/completions HTTP/1.1\r\n", b"Host: x\r\n", b"X-Slow: 1\r\n"]
        * 4,  # headers, a line at a time
        [
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
        ]
        + [b"{"] * 8,  # a body, a byte at a time
    ],
    ids=["silent", "slow-headers", "slow-body"],
)
def test_a_slow_request_is_answered_408_and_closed(server: str, parts: list[bytes]) -> None:
    reply, elapsed = send_raw(server, parts, gap=0.4)
    assert elapsed < READ_TIMEOUT + 3, f"the connection stayed open {elapsed:.1f}s"
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert b"request_timeout" in reply
    assert httpx.get(server + "/health", timeout=TIMEOUT).status_code == 200


def test_a_complete_request_is_not_cut(server: str) -> None:
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 40, "ignore_eos": True}
    response = httpx.post(
        server + "/v1/completions", json=body, timeout=TIMEOUT
    )  # takes longer than the timeout? fine
    assert response.status_code == 200
    with httpx.Client(timeout=TIMEOUT) as client:  # keep-alive: the second request on the same connection
        assert client.get(server + "/health").status_code == 200
        time.sleep(READ_TIMEOUT + 0.5)  # idle between requests: keep-alive's business (5 s), not ours
        assert client.get(server + "/health").status_code == 200
