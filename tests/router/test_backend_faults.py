"""Backends that misbehave (issue 34): an answer that is not HTTP, one that never comes, /metrics
pages too large or too slow to parse, and metric values no server would report. The router retries
elsewhere while no byte has reached the client, marks the backend down, never answers 500 with a
traceback, never lets one backend's page hold its event loop, and never trusts an impossible load."""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import Callable

import httpx
import pytest

from kvasir.router import backends
from tests.router.harness import Fleet, fleet
from tests.router.raw_backend import RawBackend
from tests.router.stub_backend import TIMEOUT, StubBackend

NOT_HTTP = {
    "garbage": b"garbage garbage\r\n\r\n",
    "bad-status-line": b"HTTP/1.1 2OO OK\r\ncontent-length: 0\r\n\r\n",
    "oversized-header": b"HTTP/1.1 200 OK\r\nx-big: " + b"a" * 70_000 + b"\r\ncontent-length: 2\r\n\r\n{}",
}
PROMPT = {"model": "m", "prompt": "x"}


def _wait(condition: Callable[[], object], timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def _metric(text: str, line_start: str) -> float:
    for line in text.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _add(f: Fleet, url: str) -> None:
    """Add backend `url` to the router's pool and scrape every backend once (the fleet's own scrape
    interval is long: nothing else changes what the router knows of them)."""
    f.router.pool.update([url, *(b.url for b in f.backends)])
    assert f.router.loop is not None and f.router.router.session is not None
    scrape = f.router.pool.scrape_all(f.router.router.session)
    asyncio.run_coroutine_threadsafe(scrape, f.router.loop).result(TIMEOUT)
    assert all(b.metrics_known for b in f.router.pool.backends.values())


def _no_traceback(caplog: pytest.LogCaptureFixture) -> None:
    assert "Traceback" not in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


@pytest.mark.parametrize("answer", list(NOT_HTTP.values()), ids=list(NOT_HTTP))
def test_an_answer_that_is_not_http_is_retried_elsewhere_and_the_backend_marked_down(
    answer: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    good = StubBackend("good", waiting=5)  # busier: the broken backend, idle, is asked first
    with RawBackend(answer).running() as raw, fleet([good], scrape_interval=60) as f:
        _add(f, raw.url)
        raw_label = f.router.pool.label(raw.url)
        reply = httpx.post(f"{f.url}/v1/completions", json=PROMPT, timeout=TIMEOUT)
        assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == "good"
        assert raw.hits == 1
        assert not f.router.pool.backends[raw.url].reachable
        text = httpx.get(f"{f.url}/metrics", timeout=TIMEOUT).text
        assert (
            _metric(text, f'kvasir_router_backend_errors_total{{backend="{raw_label}",kind="bad_response"}}')
            == 1
        )
        assert _metric(text, 'kvasir_router_retries_total{reason="bad_response"}') == 1
    _no_traceback(caplog)


@pytest.mark.parametrize("answer", list(NOT_HTTP.values()), ids=list(NOT_HTTP))
def test_when_the_only_backend_answers_garbage_the_client_gets_502(
    answer: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    # Holding off: the failure itself reaches the client. (With holding on, a backend whose /ready
    # gets no valid answer is not ready, and the request waits for one: tests/router/test_hold.py.)
    with RawBackend(answer).running() as raw, fleet([], backends=(raw.url,), max_held_requests=0) as f:
        reply = httpx.post(f"{f.url}/v1/completions", json=PROMPT, timeout=TIMEOUT)
        assert reply.status_code == 502, reply.text
        assert reply.json()["error"]["code"] == "bad_backend_response"
    _no_traceback(caplog)


def test_a_backend_that_never_answers_is_given_up_after_the_first_byte_timeout() -> None:
    good = StubBackend("good", waiting=5)
    with RawBackend(None).running() as silent, fleet([good], scrape_interval=60, first_byte_timeout=0.5) as f:
        _add(f, silent.url)
        # The hang guard is the client's timeout; the router gives up long before it.
        reply = httpx.post(f"{f.url}/v1/completions", json=PROMPT, timeout=TIMEOUT)
        assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == "good"
        assert silent.holding.is_set() and not f.router.pool.backends[silent.url].reachable
        text = httpx.get(f"{f.url}/metrics", timeout=TIMEOUT).text
        label = f.router.pool.label(silent.url)
        assert _metric(text, f'kvasir_router_backend_errors_total{{backend="{label}",kind="timeout"}}') == 1
        assert _metric(text, 'kvasir_router_retries_total{reason="timeout"}') == 1


def test_when_the_only_backend_never_answers_the_client_gets_504() -> None:
    with (
        RawBackend(None).running() as silent,
        fleet([], backends=(silent.url,), first_byte_timeout=0.5, max_held_requests=0) as f,  # as above
    ):
        reply = httpx.post(f"{f.url}/v1/completions", json=PROMPT, timeout=TIMEOUT)
        assert reply.status_code == 504, reply.text
        assert reply.json()["error"]["code"] == "backend_timeout"


@pytest.mark.parametrize(
    "field, value",
    [
        ("kv_usage", -100.0),
        ("kv_usage", math.nan),
        ("kv_usage", 7.0),
        ("waiting", -1e9),
        ("waiting", math.inf),
    ],
)
def test_an_implausible_metric_is_distrusted_not_followed(field: str, value: float) -> None:
    liar = StubBackend("liar", waiting=0, kv_usage=0.9)
    setattr(liar, field, value)
    honest = StubBackend("honest", waiting=2, kv_usage=0.5)
    with fleet([liar, honest]) as f, httpx.Client(timeout=TIMEOUT) as client:
        _wait(lambda: liar.metrics_served >= 2 and honest.metrics_served >= 2)  # a scrape round ended
        assert not f.router.pool.backends[f.backends[0].url].metrics_known
        assert f.router.pool.backends[f.backends[1].url].metrics_known
        for _ in range(6):
            answer = client.post(f"{f.url}/v1/completions", json=PROMPT)
            assert answer.json()["choices"][0]["text"] == "honest"
        text = client.get(f"{f.url}/metrics").text
        assert f'kvasir_router_backend_metrics_known{{backend="{f.label(0)}"}} 0.0' in text


def test_a_metrics_page_over_the_cap_counts_as_no_answer() -> None:
    big, small = StubBackend("big", metrics_padding=2 << 20), StubBackend("small", metrics_padding=100_000)
    with fleet([big, small]) as f:  # the default --scrape-max-bytes: 1 MiB
        _wait(lambda: big.metrics_served >= 2 and small.metrics_served >= 2)
        assert not f.router.pool.backends[f.backends[0].url].metrics_known
        assert f.router.pool.backends[f.backends[1].url].metrics_known


def test_a_slow_metrics_parse_holds_neither_the_loop_nor_the_start_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The parse runs on a worker thread and within --scrape-timeout: while one page's parse is
    stuck the router starts, answers /health and routes, and the page is not parsed twice at once."""
    release, entered = threading.Event(), threading.Event()
    slow_calls = []
    parse = backends.parse_metrics

    def stuck_parse(text: str) -> object:
        if 'model_name="slow"' in text:
            slow_calls.append(1)
            entered.set()
            release.wait(10)  # bounded, so that a router parsing on its loop fails instead of hanging
        return parse(text)

    monkeypatch.setattr(backends, "parse_metrics", stuck_parse)
    slow, good = StubBackend("slow"), StubBackend("good", waiting=3)
    try:
        with fleet([slow, good]) as f, httpx.Client(timeout=5) as client:
            assert entered.is_set() and not release.is_set()  # the start-up scrape did not wait for it
            assert client.get(f"{f.url}/health").status_code == 200
            served = good.metrics_served
            _wait(lambda: good.metrics_served >= served + 5)  # five more scrape rounds
            assert len(slow_calls) == 1 and not release.is_set()
            assert not f.router.pool.backends[f.backends[0].url].metrics_known
            answer = client.post(f"{f.url}/v1/completions", json=PROMPT)
            assert answer.json()["choices"][0]["text"] == "good"
            release.set()
            _wait(lambda: f.router.pool.backends[f.backends[0].url].metrics_known)
    finally:
        release.set()
