"""What a client can send the router that no OpenAI client would (issue 34): bodies past the same
size and shape bounds as `kvasir serve`, many bodies held at once, paths that normalise into another
backend route, a missing API key in front of a malformed body, and ambiguous framing hiding a second
request. Each is refused by the router itself, before any backend sees it, and never with a 500."""

from __future__ import annotations

import json
import logging
import posixpath
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import unquote

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvasir.router import proxy
from tests.router.harness import Fleet, fleet
from tests.router.stub_backend import TIMEOUT, StubBackend

PROBE = "x-probe"  # a header marking the test's own request among the router's scrapes


def _wait(condition: Callable[[], object], timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=TIMEOUT)


def _read_all(sock: socket.socket) -> bytes:
    """Everything the router sends until it closes the connection (the hang guard: TIMEOUT)."""
    reply = b""
    while chunk := sock.recv(65536):
        reply += chunk
    return reply


def _raw(url: str, data: bytes) -> bytes:
    """Send `data` (a request saying `Connection: close`) on a fresh connection, and read until the
    router closes it."""
    with _connect(url) as sock:
        sock.sendall(data)
        return _read_all(sock)


def _status(reply: bytes) -> int:
    return int(reply.split(b" ", 2)[1])


def _no_traceback(caplog: pytest.LogCaptureFixture) -> None:
    assert "Traceback" not in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def _probed(stub: StubBackend) -> list[str]:
    return [path for path, headers in stub.seen if PROBE in headers]


# ---- item 1: the same body limits as `kvasir serve`, and a bound on all bodies at once ----------------


def test_a_body_over_the_cap_is_refused_declared_or_chunked() -> None:
    stub = StubBackend("a")
    with fleet([stub], max_request_bytes=1000) as f, httpx.Client(timeout=TIMEOUT) as client:
        body = json.dumps({"model": "m", "prompt": "x" * 2000}).encode()
        declared = client.post(f"{f.url}/v1/completions", content=body)
        chunked = client.post(f"{f.url}/v1/completions", content=iter([body[:600], body[600:]]))
        for answer in (declared, chunked):
            assert answer.status_code == 413, answer.text
            assert answer.json()["error"]["code"] == "request_too_large"
            assert "1000 bytes" in answer.json()["error"]["message"]
        assert stub.requests == []


def _messages(count: int) -> bytes:
    return b'{"model": "m", "messages": [' + b",".join([b"{}"] * count) + b"]}"


def _nested(depth: int, key: bool) -> bytes:
    inner = b"[" * depth + b"1" + b"]" * depth
    return b'{"model": "m", "prompt": ' + inner + b"}" if key else inner


@pytest.mark.parametrize(
    "body, param",
    [
        (_messages(30_000), "messages"),  # 90 kB: checked on a worker thread
        (_messages(20_000), "messages"),  # 60 kB: on the event loop
        (_nested(2000, key=True), "prompt"),
        (_nested(2000, key=False), None),  # no key at all: json.loads overflowed (a 500)
    ],
    ids=["30k-messages", "20k-messages", "deep-prompt", "deep-no-key"],
)
def test_a_body_past_a_shape_bound_is_refused_before_it_is_parsed(
    body: bytes, param: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    stub = StubBackend("a")
    with fleet([stub]) as f:
        answer = httpx.post(
            f"{f.url}/v1/chat/completions",
            content=body,
            headers={"content-type": "application/json"},
            timeout=TIMEOUT,
        )
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["code"] == "request_too_complex" and error["param"] == param
        assert stub.requests == []
        assert httpx.get(f"{f.url}/health", timeout=TIMEOUT).status_code == 200
    _no_traceback(caplog)


def test_large_bodies_are_checked_and_parsed_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    threads: list[str] = []
    check = proxy.check_shape

    def spy(body: bytes, *args: Any) -> None:
        threads.append(threading.current_thread().name)
        check(body, *args)

    monkeypatch.setattr(proxy, "check_shape", spy)
    with fleet([StubBackend("a")]) as f, httpx.Client(timeout=TIMEOUT) as client:
        for prompt in ("small", "x" * (proxy.OFF_LOOP_BYTES + 1)):
            body = {"model": "m", "prompt": prompt}
            assert client.post(f"{f.url}/v1/completions", json=body).status_code == 200
    loop_thread, worker = threads
    assert not loop_thread.startswith("kvasir-router-parse")
    assert worker.startswith("kvasir-router-parse")


def _open_upload(url: str, sent: int, declared: int) -> socket.socket:
    """A POST declaring a body of `declared` bytes, of which `sent` are sent now."""
    sock = _connect(url)
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {declared}\r\n\r\n"
    )
    sock.sendall(head.encode() + b" " * sent)
    return sock


def _head(sock: socket.socket) -> bytes:
    reply = b""
    while b"\r\n\r\n" not in reply:
        chunk = sock.recv(65536)
        if not chunk:
            break
        reply += chunk
    return reply


def test_bodies_held_at_once_are_bounded_and_the_budget_comes_back() -> None:
    stub = StubBackend("a")
    with fleet([stub], max_request_bytes=10_000, max_buffered_request_bytes=15_000) as f:
        bodies = f.router.router.bodies
        first = _open_upload(f.url, 8000, 9000)
        try:
            _wait(lambda: bodies.buffered == 8000)
            with _open_upload(f.url, 8000, 9000) as second:
                reply = _head(second)
            assert reply.startswith(b"HTTP/1.1 429"), reply[:300]
            assert b"retry-after: 1" in reply.lower()
            small = httpx.post(f"{f.url}/v1/completions", json={"model": "m", "prompt": "x"}, timeout=TIMEOUT)
            assert small.status_code == 200  # a small body still fits beside the held one
            # Its bytes are released when its exchange ends, which may be just after the client
            # has read the answer.
            _wait(lambda: bodies.buffered == 8000)
        finally:
            first.close()
        _wait(lambda: bodies.buffered == 0)  # the client left: its bytes no longer count
        body = {"model": "m", "prompt": "x" * 8500}
        assert httpx.post(f"{f.url}/v1/completions", json=body, timeout=TIMEOUT).status_code == 200
        _wait(lambda: bodies.buffered == 0)


# ---- item 3: only the proxied routes, exactly, reach a backend ----------------------------------------

ESCAPING_PATHS = [
    "/v1/%2e%2e/metrics",
    "/v1/%2E%2E/metrics",
    "/v1/../docs",
    "/v1/..%2fopenapi.json",
    "/v1/..%2Fopenapi.json",
    "/v1/./models",
    "/v1/models/../../metrics",
    "/v1/models/%2e%2e/%2e%2e/metrics",
    "/v1/models/..%5cmetrics",
    "/v1%2fcompletions",
    "/v1/models/%252e%252e/metrics",
    "/v1/models//m",
    "/v1/embeddings",
    "/v1/completions/",
    "/docs",
    "/openapi.json",
]


@pytest.mark.parametrize("path", ESCAPING_PATHS)
def test_a_path_outside_the_proxied_routes_never_reaches_a_backend(path: str) -> None:
    stub = StubBackend("a")
    with fleet([stub]) as f:
        request = f"GET {path} HTTP/1.1\r\nHost: x\r\n{PROBE}: 1\r\nConnection: close\r\n\r\n"
        reply = _raw(f.url, request.encode())
        assert _status(reply) in (400, 404), reply[:300]
        assert b'"error"' in reply
        assert _probed(stub) == []


PATH_PIECES = [
    "/",
    "v1",
    "models",
    "completions",
    "m",
    ".",
    "..",
    "%2e",
    "%2E",
    "%2f",
    "%2F",
    "%5c",
    "%25",
    "%20",
    "\\",
]


@settings(max_examples=2000, deadline=None)
@given(pieces=st.lists(st.sampled_from(PATH_PIECES), max_size=12))
def test_no_forwarded_path_decodes_to_anything_but_a_proxied_route(pieces: list[str]) -> None:
    """Whatever the client's path, what the router forwards names a proxied route however many
    times the next hop decodes it, and normalising it changes nothing."""
    raw = "/" + "".join(pieces)
    target, refusal = proxy.proxied_target(
        {"raw_path": raw.encode(), "path": unquote(raw), "query_string": b""}
    )
    if target is None:
        assert refusal is not None and refusal[0] in (400, 404)
        return
    once, twice = unquote(target), unquote(unquote(target))
    for decoded in (once, twice):
        assert posixpath.normpath(decoded) == decoded and "\\" not in decoded
        assert decoded in proxy.PROXIED_PATHS or decoded.startswith("/v1/models/")


def test_the_proxied_routes_still_reach_a_backend_as_sent() -> None:
    stub = StubBackend("a")
    with fleet([stub]) as f:
        for path in ("/v1/models", "/v1/models/org/model%20name", "/version"):
            request = f"GET {path}?x=%2e%2e HTTP/1.1\r\nHost: x\r\n{PROBE}: 1\r\nConnection: close\r\n\r\n"
            assert _status(_raw(f.url, request.encode())) == 200
        assert _probed(stub) == ["/v1/models", "/v1/models/org/model name", "/version"]


def test_the_routers_metrics_name_backends_by_index_not_address() -> None:
    with fleet([StubBackend("a"), StubBackend("b")]) as f:
        text = httpx.get(f"{f.url}/metrics", timeout=TIMEOUT).text
        assert "127.0.0.1" not in text
        assert {f.label(0), f.label(1)} == {"0", "1"}
        for label in ("0", "1"):
            assert f'kvasir_router_backend_metrics_known{{backend="{label}"}} 1.0' in text


# ---- item 6: the router's key is checked before the body ---------------------------------------------


def test_the_routers_key_is_checked_before_the_body_is_read_or_validated() -> None:
    stub = StubBackend("a")
    with fleet([stub], api_key="router-key") as f, httpx.Client(timeout=TIMEOUT) as client:
        url = f"{f.url}/v1/completions"
        deep, json_type = _nested(2000, key=True), {"content-type": "application/json"}
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "Basic router-key"}):
            answer = client.post(url, content=deep, headers={**json_type, **headers})
            assert answer.status_code == 401, answer.text
            assert answer.json()["error"]["code"] == "invalid_api_key"
            assert answer.headers["www-authenticate"] == "Bearer"
        keyed = {**json_type, "authorization": "Bearer router-key"}
        assert client.post(url, content=deep, headers=keyed).status_code == 400
        ok = client.post(url, json={"model": "m", "prompt": "x"}, headers=keyed)
        assert ok.status_code == 200
        assert [r["headers"]["authorization"] for r in stub.requests] == ["Bearer router-key"]
        assert client.get(f"{f.url}/health").status_code == 200  # the probes stay open
        assert client.get(f"{f.url}/metrics").status_code == 200


# ---- item 5: ambiguous framing is refused and the connection closed -----------------------------------


@pytest.fixture
def protocol_fleet() -> Iterator[tuple[Fleet, StubBackend]]:
    stub = StubBackend("a")
    with fleet([stub], protocol=True) as f:
        yield f, stub


def test_content_length_with_transfer_encoding_is_refused_and_the_connection_closed(
    protocol_fleet: tuple[Fleet, StubBackend],
) -> None:
    f, stub = protocol_fleet
    body = json.dumps({"model": "m", "prompt": "x"}).encode()
    smuggled = f"GET /v1/models HTTP/1.1\r\nHost: x\r\n{PROBE}: smuggled\r\n\r\n".encode()
    data = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\nTransfer-Encoding: chunked\r\n{PROBE}: 1\r\n\r\n".encode()
        + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
        + smuggled
    )
    with _connect(f.url) as sock:
        sock.sendall(data)  # not shut: only the router may end this connection
        reply = _read_all(sock)
    assert reply.count(b"HTTP/1.1 ") == 1, reply[:600]
    assert _status(reply) == 400 and b"connection: close" in reply.lower()
    assert b"bad_framing" in reply
    assert _probed(stub) == []
    assert httpx.get(f"{f.url}/health", timeout=TIMEOUT).status_code == 200
