"""Scale from zero, the router's side (issue 38): requests that arrive while no backend is ready
are held in a bounded FIFO and released in order once one is; a full queue and the hold timeout
answer 503 with Retry-After; a client that leaves is dropped; a held stream gets heartbeats; held
bodies count in the buffered budget. Against stub backends whose /ready the test turns on."""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from kvasir.router.held_stream import HeldStream
from tests.router.harness import Fleet, fleet
from tests.router.stub_backend import TIMEOUT, StubBackend


def _wait(condition: Callable[[], object], timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def _held(f: Fleet, count: int) -> None:
    assert f.router.hold is not None
    hold = f.router.hold
    _wait(lambda: len(hold) == count)


def _metric(url: str, line_start: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=TIMEOUT).text.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _post(url: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT)


def _stream(
    url: str, body: dict[str, Any], seen: list[tuple[float, str]] | None = None
) -> tuple[int, list[str]]:
    """A streamed request: its status and every line (comments included), each also appended to
    `seen` with its arrival time as it comes."""
    lines = []
    with httpx.stream(
        "POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=TIMEOUT
    ) as reply:
        for line in reply.iter_lines():
            if line:
                lines.append(line)
                if seen is not None:
                    seen.append((time.monotonic(), line))
        return reply.status_code, lines


def test_requests_held_while_no_backend_is_ready_are_released_in_arrival_order() -> None:
    stub = StubBackend("a", ready=False)
    with fleet([stub]) as f, ThreadPoolExecutor(6) as threads:
        # The router itself stays ready while it holds: at zero replicas it must keep its Service.
        assert httpx.get(f"{f.url}/ready", timeout=TIMEOUT).status_code == 200
        answers: list[Future[Any]] = []
        for index in range(6):
            body = {"model": "m", "prompt": f"r{index}"}
            answers.append(threads.submit(_stream if index % 2 else _post, f.url, body))
            _held(f, index + 1)
        assert _metric(f.url, "kvasir_router_held_requests ") == 6
        assert stub.requests == []
        stub.ready = True
        for index, answer in enumerate(answers):
            if index % 2:
                status, lines = answer.result(TIMEOUT)
                assert status == 200 and lines[-1] == "data: [DONE]" and any("a0" in line for line in lines)
            else:
                reply = answer.result(TIMEOUT)
                assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == "a"
        assert [r["body"]["prompt"] for r in stub.requests] == [f"r{i}" for i in range(6)]
        assert _metric(f.url, 'kvasir_router_held_total{outcome="released"}') == 6
        assert _metric(f.url, "kvasir_router_held_requests ") == 0
        # Nothing is held once a backend is ready.
        assert _post(f.url, {"model": "m", "prompt": "later"}).status_code == 200
        assert _metric(f.url, 'kvasir_router_held_total{outcome="released"}') == 6


def test_a_full_hold_queue_answers_503_with_retry_after_at_once() -> None:
    stub = StubBackend("a", ready=False)
    with fleet([stub], max_held_requests=2) as f, ThreadPoolExecutor(2) as threads:
        held = [threads.submit(_post, f.url, {"model": "m", "prompt": f"r{i}"}) for i in range(2)]
        _held(f, 2)
        for stream in (False, True):
            refused = _post(f.url, {"model": "m", "prompt": "third", "stream": stream})
            assert refused.status_code == 503 and refused.headers["retry-after"] == "5"
            assert refused.json()["error"]["code"] == "hold_queue_full"
            assert refused.json()["error"]["type"] == "service_unavailable"
        assert _metric(f.url, 'kvasir_router_held_total{outcome="rejected_full"}') == 2
        stub.ready = True
        assert all(answer.result(TIMEOUT).status_code == 200 for answer in held)


def test_the_hold_timeout_answers_503_and_ends_a_held_stream_with_an_error_event() -> None:
    with fleet([StubBackend("a", ready=False)], hold_timeout=0.5) as f:
        began = time.monotonic()
        reply = _post(f.url, {"model": "m", "prompt": "x"})
        assert time.monotonic() - began >= 0.5  # never before the hold time
        assert reply.status_code == 503 and reply.headers["retry-after"] == "5"
        error = reply.json()["error"]
        assert error["code"] == "hold_timeout" and "--hold-timeout" in error["message"]
        status, lines = _stream(f.url, {"model": "m", "prompt": "x"})
        assert status == 200  # begun when it was held
        assert lines[0] == ": heartbeat"
        assert lines[-1].startswith("data: {") and '"code":"hold_timeout"' in lines[-1]
        assert _metric(f.url, 'kvasir_router_held_total{outcome="timed_out"}') == 2
        assert _metric(f.url, "kvasir_router_held_requests ") == 0


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("protocol", [False, True], ids=["uvicorn-h11", "router-protocol"])
def test_a_held_client_that_leaves_is_dropped_from_the_queue(protocol: bool, stream: bool) -> None:
    """With uvicorn's protocol a closed socket is a disconnect; with the router's own (which keeps a
    half-closed client for its answer) the end of the client's input is the sign for a held plain
    request, and a heartbeat written to the closed socket for a held stream."""
    stub = StubBackend("a", ready=False)
    with fleet([stub], protocol=protocol, heartbeat_interval=0.2) as f:
        host, port = f.url.removeprefix("http://").split(":")
        body = b'{"model": "m", "prompt": "gone", "stream": %s}' % (b"true" if stream else b"false")
        head = f"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
        with socket.create_connection((host, int(port)), timeout=TIMEOUT) as client:
            client.sendall(head.encode() + body)
            _held(f, 1)
        _held(f, 0)
        _wait(lambda: _metric(f.url, 'kvasir_router_held_total{outcome="client_gone"}') == 1)
        stub.ready = True
        assert _post(f.url, {"model": "m", "prompt": "stayed"}).status_code == 200
        assert [r["body"]["prompt"] for r in stub.requests] == ["stayed"]  # the gone one never went out


def test_a_held_stream_gets_heartbeats_until_the_backend_answers() -> None:
    stub = StubBackend("a", ready=False)
    seen: list[tuple[float, str]] = []
    with fleet([stub], heartbeat_interval=0.2) as f, ThreadPoolExecutor(1) as threads:
        began = time.monotonic()
        answer = threads.submit(_stream, f.url, {"model": "m", "prompt": "x"}, seen)
        _wait(lambda: len(seen) >= 4)
        stub.ready = True
        status, lines = answer.result(TIMEOUT)
    assert status == 200
    data = [index for index, line in enumerate(lines) if line.startswith("data: ")]
    assert len(data) == 4 and lines[data[-1]] == "data: [DONE]"
    assert lines[: data[0]] == [": heartbeat"] * data[0] and data[0] >= 4
    assert all(not line.startswith(":") for line in lines[data[0] :])  # none once the backend writes
    # At least every 10 s (the bound; the interval here is 0.2 s): a loaded machine may
    # delay a heartbeat, never by that much.
    times = [began] + [at for at, line in seen if line == ": heartbeat"]
    assert max(b - a for a, b in itertools.pairwise(times)) < 10


def test_held_bodies_count_in_the_buffered_budget() -> None:
    stub = StubBackend("a", ready=False)
    with (
        fleet([stub], max_request_bytes=10_000, max_buffered_request_bytes=15_000) as f,
        ThreadPoolExecutor(1) as threads,
    ):
        body = {"model": "m", "prompt": "x" * 8000}
        held = threads.submit(_post, f.url, body)
        _held(f, 1)
        bodies = f.router.router.bodies
        assert bodies.buffered >= 8000
        refused = _post(f.url, body)
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "server_busy"
        stub.ready = True
        assert held.result(TIMEOUT).status_code == 200
        _wait(lambda: bodies.buffered == 0)


def test_holding_off_answers_503_at_once_as_before() -> None:
    loading = StubBackend("a", ready=False, refuse_with=503)  # as a server still loading its model
    with fleet([loading], max_held_requests=0) as f:
        assert f.router.hold is None
        reply = _post(f.url, {"model": "m", "prompt": "x"})
        # The backend is tried: a loading server's own 503 reaches the client.
        assert reply.status_code == 503 and reply.json()["error"]["code"] == "queue_full"


def test_a_backend_ready_again_is_seen_within_the_probe_interval_while_holding() -> None:
    """While requests are held, /ready is probed every 0.25 s whatever --scrape-interval says."""
    stub = StubBackend("a", ready=False)
    with fleet([stub], scrape_interval=60) as f, ThreadPoolExecutor(1) as threads:
        held = threads.submit(_post, f.url, {"model": "m", "prompt": "x"})
        _held(f, 1)
        stub.ready = True
        assert held.result(TIMEOUT).status_code == 200  # not after the 60 s scrape interval


def test_a_draining_router_answers_its_held_requests_503_at_once() -> None:
    """No backend is ready, so nothing would come: the clients may retry on another router."""
    with fleet([StubBackend("a", ready=False)], drain_timeout=30) as f, ThreadPoolExecutor(2) as threads:
        plain = threads.submit(_post, f.url, {"model": "m", "prompt": "x"})
        stream = threads.submit(_stream, f.url, {"model": "m", "prompt": "x"})
        _held(f, 2)
        assert f.router.loop is not None
        drained = asyncio.run_coroutine_threadsafe(f.router.lifecycle.drain(30), f.router.loop)
        reply = plain.result(TIMEOUT)
        assert reply.status_code == 503 and reply.json()["error"]["code"] == "draining"
        status, lines = stream.result(TIMEOUT)
        assert status == 200 and '"code":"draining"' in lines[-1]
        assert drained.result(TIMEOUT) is True
        assert _metric(f.url, 'kvasir_router_held_total{outcome="draining"}') == 2


def test_a_held_client_that_half_closes_reads_why_it_was_dropped(caplog: pytest.LogCaptureFixture) -> None:
    """A client that shuts its sending side while held looks like one that left (nothing has been
    written yet): it is dropped, and if it still reads, it reads a 503 saying so, not a 500."""
    with fleet([StubBackend("a", ready=False)], protocol=True) as f:
        host, port = f.url.removeprefix("http://").split(":")
        body = b'{"model": "m", "prompt": "x"}'
        head = f"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: {len(body)}\r\n\r\n".encode()
        with socket.create_connection((host, int(port)), timeout=TIMEOUT) as client:
            client.sendall(head + body)
            _held(f, 1)
            client.shutdown(socket.SHUT_WR)
            reply = b""
            while chunk := client.recv(65536):
                reply += chunk
        assert reply.startswith(b"HTTP/1.1 503"), reply[:200]
        assert b'"code":"client_closed"' in reply
        assert _metric(f.url, 'kvasir_router_held_total{outcome="client_gone"}') == 1
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def test_a_request_that_fails_before_its_wait_leaves_no_place_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever ends a held request between joining and waiting (its client leaving while its
    stream opens; here a failure), its place is given back: no ghost counts against the bound."""

    async def broken_open(self: HeldStream) -> None:
        raise RuntimeError("the stream could not be opened")

    monkeypatch.setattr(HeldStream, "open", broken_open)
    with fleet([StubBackend("a", ready=False)], max_held_requests=1) as f:
        reply = _post(f.url, {"model": "m", "prompt": "x", "stream": True})
        assert reply.status_code == 500 and reply.json()["error"]["code"] == "internal_error"
        _held(f, 0)
        assert _metric(f.url, 'kvasir_router_held_total{outcome="client_gone"}') == 1
