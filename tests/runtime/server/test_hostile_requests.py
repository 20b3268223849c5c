"""Hostile requests other than big bodies, against a real `kvasir serve` process with an API key, on
raw sockets where a client library would tidy the attack away: echoed token ids out of the
vocabulary, control characters in the path, oversized headers however they arrive, non-streamed
answers too large to hold, a Host header steering a redirect, out-of-range priority, `stream: null`,
a client that half-closes its socket once its request is sent (it gets its answer), and clients
that reset or close theirs mid-request (their requests are aborted)."""

from __future__ import annotations

import json
import re
import socket
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.runtime.server.harness import MODEL, TIMEOUT, ServerProcess, send_raw, serve_process

pytestmark = pytest.mark.slow
KEY = "hostile-test-key"
AUTH = {"authorization": f"Bearer {KEY}"}
RECORD_START = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z]+ [\w.]+: ")


@pytest.fixture(scope="module")
def server(tiny_checkpoint: Callable[..., Path]) -> Iterator[ServerProcess]:
    with serve_process(tiny_checkpoint("llama"), "--api-key", KEY) as running:
        yield running


def _raw(url: str, data: bytes, *, half_close: bool = True, pieces: int = 1) -> bytes:
    """Send `data` on a fresh connection in `pieces` writes, shut our sending side (by default), and
    read until the server closes."""
    step = -(-len(data) // pieces)
    parts = [data[start : start + step] for start in range(0, len(data), step)]
    return send_raw(url, parts, gap=0.01 if pieces > 1 else 0.0, half_close=half_close)[0]


def _post(path: str, body: dict[str, Any]) -> bytes:
    content = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(content)}\r\n\r\n"
    )
    return head.encode() + content


@pytest.mark.parametrize("prompt", [[-5], [2**40], [[1], [-1]]])
@pytest.mark.parametrize("stream", [False, True])
def test_echoed_token_ids_are_checked_before_they_are_decoded(
    server: ServerProcess, prompt: list[Any], stream: bool
) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "echo": True, "stream": stream}
    response = httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=TIMEOUT)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "prompt"


def test_control_characters_in_the_path_cannot_forge_log_lines(server: ServerProcess) -> None:
    forged = "%0a2026-11-25%2000:00:00,000%20INFO%20kvasir.access:%20POST%20/v1/completions%20200%20FAKE"
    target = f"/x{forged}%0d%1b[31m%c2%9b%e2%80%a8"
    reply = _raw(server.url, f"GET {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
    assert reply.startswith(b"HTTP/1.1 404"), reply[:200]
    line = server.stderr.wait_for(r"kvasir\.access: GET /x").string
    assert line.count("\n") == 1 and line.endswith("\n"), repr(line)
    assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029]", line), repr(line)
    assert "\\x0a2026-11-25" in line and "\\x1b[31m" in line and "\\x9b" in line and "\\u2028" in line
    assert all(RECORD_START.match(seen) or seen.startswith(" ") for seen in server.stderr.seen), [
        s for s in server.stderr.seen if not RECORD_START.match(s)
    ]


@pytest.mark.parametrize(
    "head, pieces",
    [
        (b"".join(b"X-Header-%d: y\r\n" % i for i in range(10_000)), 1),  # 10,000 headers, one write
        (b"X-Big: " + b"a" * 20_000 + b"\r\n", 1),  # one 20 KB header, one write
        (b"".join(b"X-Pad-%d: %s\r\n" % (i, b"b" * 1000) for i in range(30)), 30),  # 30 KB, in pieces
    ],
    ids=["10k-headers", "20KB-header", "in-pieces"],
)
def test_headers_over_16_kib_get_431_however_they_arrive(
    server: ServerProcess, head: bytes, pieces: int
) -> None:
    request = b"GET /health HTTP/1.1\r\nHost: x\r\n" + head + b"\r\n"
    reply = _raw(server.url, request, pieces=pieces)
    assert reply.startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n"), reply[:200]
    error = json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]
    assert error["code"] == "request_header_fields_too_large" and "16384" in error["message"]
    just_under = (
        b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 15_000 + b"\r\nConnection: close\r\n\r\n"
    )
    assert _raw(server.url, just_under).startswith(b"HTTP/1.1 200")


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": "hi", "n": 64, "max_tokens": 200, "logprobs": 20}, "logprobs"),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "hi"}],
                "n": 64,
                "max_completion_tokens": 200,
                "logprobs": True,
                "top_logprobs": 20,
            },
            "top_logprobs",
        ),
    ],
)
def test_a_non_streamed_answer_too_large_to_hold_is_refused(
    server: ServerProcess, path: str, body: dict[str, Any], param: str
) -> None:
    response = httpx.post(server.url + path, json={**body, "model": MODEL}, headers=AUTH, timeout=TIMEOUT)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and "stream" in error["message"], error
    # Streamed, nothing is held back: the same request is admitted (its first event is enough here).
    streamed = {**body, "model": MODEL, "stream": True}
    with httpx.stream("POST", server.url + path, json=streamed, headers=AUTH, timeout=TIMEOUT) as stream:
        assert stream.status_code == 200
        assert next(stream.iter_lines()).startswith("data: ")


def test_the_trailing_slash_redirect_ignores_the_host_header(server: ServerProcess) -> None:
    request = b"GET /health/?probe=1 HTTP/1.1\r\nHost: evil.example\r\nConnection: close\r\n\r\n"
    reply = _raw(server.url, request)
    assert reply.startswith(b"HTTP/1.1 307"), reply[:200]
    assert re.search(rb"\r\nlocation: /health\?probe=1\r\n", reply, re.IGNORECASE), reply[:300]
    assert b"evil.example" not in reply


def test_priority_is_bounded_and_stream_may_be_null(server: ServerProcess) -> None:
    def ask(**fields: Any) -> httpx.Response:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 1, **fields}
        return httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=TIMEOUT)

    for priority in (2**31, -(2**31) - 1, 2**63):
        response = ask(priority=priority)
        assert response.status_code == 400 and response.json()["error"]["param"] == "priority", response.text
    assert ask(priority=2**31 - 1).status_code == 200
    assert ask(stream=None, echo=None).json()["object"] == "text_completion"
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    answer = httpx.post(
        server.url + "/v1/chat/completions",
        json={**chat, "stream": None, "logprobs": None},
        headers=AUTH,
        timeout=TIMEOUT,
    )
    assert answer.status_code == 200 and answer.json()["object"] == "chat.completion", answer.text


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_half_closes_still_gets_its_answer(server: ServerProcess, stream: bool) -> None:
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 20, "ignore_eos": True, "stream": stream}
    reply = _raw(server.url, _post("/v1/completions", body), half_close=True)
    assert reply.startswith(b"HTTP/1.1 200"), reply[:300]
    payload = reply.split(b"\r\n\r\n", 1)[1]
    if stream:  # chunked: the last event, then the last chunk
        assert payload.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"), payload[-300:]
    else:
        assert json.loads(payload)["usage"]["completion_tokens"] == 20


def _metric(url: str, prefix: str) -> float:
    text = httpx.get(url + "/metrics", timeout=TIMEOUT).text
    return next((float(line.split()[-1]) for line in text.splitlines() if line.startswith(prefix)), 0.0)


ABORTED = f'kvasir_requests_finished_total{{finish_reason="abort",model_name="{MODEL}"}} '
RUNNING = f'kvasir_requests_running{{model_name="{MODEL}"}} '


def _until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_a_client_that_resets_its_connection_aborts_its_request(server: ServerProcess) -> None:
    before = _metric(server.url, ABORTED)
    # 32 choices of 240 tokens: seconds of work, so the reset comes while it runs.
    body = {"model": MODEL, "prompt": "hello", "n": 32, "max_tokens": 240, "ignore_eos": True}
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=TIMEOUT)
    sock.sendall(_post("/v1/completions", body))
    _until(lambda: _metric(server.url, RUNNING) > 0, "the request never ran")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()  # an RST, not a FIN: the client is gone, not half-closed
    _until(lambda: _metric(server.url, ABORTED) >= before + 32, "the reset request was not aborted")


def test_a_streaming_client_that_closes_is_aborted_at_its_next_writes(server: ServerProcess) -> None:
    """Closed mid-stream (a FIN, which looks like a half-close until a write fails, or an RST when
    data was left unread), a stream is aborted soon: it writes at every token."""
    before = _metric(server.url, ABORTED)
    body = {"model": MODEL, "prompt": "hello", "n": 32, "max_tokens": 240, "ignore_eos": True, "stream": True}
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=TIMEOUT) as sock:
        sock.sendall(_post("/v1/completions", body))
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
    _until(lambda: _metric(server.url, ABORTED) >= before + 32, "the closed stream was not aborted")
