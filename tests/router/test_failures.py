"""The router when backends fail: killed mid-stream, gone, silent, and the router's own drain."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx

from tests.router.harness import fleet
from tests.router.stub_backend import TIMEOUT, StubBackend


def _wait(condition: object, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def test_a_backend_dying_mid_stream_ends_the_clients_stream_with_an_error_event() -> None:
    stub = StubBackend("a", chunks=5, die_after=2)
    with fleet([stub]) as f, httpx.Client(timeout=TIMEOUT) as client:
        body = {"model": "m", "prompt": "x", "stream": True}
        # A stream that hung instead of ending would raise the client's timeout here; no wall-clock
        # bound of our own, which a busy machine could miss.
        with client.stream("POST", f"{f.url}/v1/completions", json=body) as response:
            events = [line for line in response.iter_lines() if line]
        assert "a0" in events[0] and "a1" in events[1]
        assert '"backend_lost"' in events[-1] and events[-1].startswith("data: ")
        assert "[DONE]" not in events[-1]
        text = httpx.get(f"{f.url}/metrics").text
        assert (
            f'kvasir_router_backend_errors_total{{backend="{f.label(0)}",kind="stream_broken"}} 1.0' in text
        )


def test_a_dead_backend_gets_no_new_requests_after_one_scrape() -> None:
    stubs = [StubBackend("a"), StubBackend("b")]
    with fleet(stubs) as f, httpx.Client(timeout=TIMEOUT) as client:
        f.backends[0].stop()
        gone = f.backends[0].url
        _wait(lambda: not f.router.pool.backends[gone].metrics_known)
        for _ in range(10):
            answer = client.post(f"{f.url}/v1/completions", json={"model": "m", "prompt": "x"})
            assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == "b"
        text = client.get(f"{f.url}/metrics").text
        assert f'kvasir_router_backend_metrics_known{{backend="{f.label(0)}"}} 0.0' in text


def test_a_backend_whose_metrics_stop_answering_is_unknown_not_idle() -> None:
    silent, busy = StubBackend("silent", metrics_hang=True), StubBackend("busy", waiting=6, kv_usage=0.8)
    with fleet([silent, busy]) as f, httpx.Client(timeout=TIMEOUT) as client:
        _wait(lambda: f.router.pool.backends[f.backends[1].url].metrics_known)
        assert not f.router.pool.backends[f.backends[0].url].metrics_known
        for _ in range(5):
            assert (
                client.post(f"{f.url}/v1/completions", json={"model": "m", "prompt": "x"}).json()["choices"][
                    0
                ]["text"]
                == "busy"
            )
        text = client.get(f"{f.url}/metrics").text
        assert 'kvasir_router_decisions_total{reason="load"} 5.0' in text
        assert f'kvasir_router_backend_waiting{{backend="{f.label(1)}"}} 6.0' in text
        assert f'kvasir_router_backend_waiting{{backend="{f.label(0)}"}}' not in text  # absent, not 0


def test_the_router_drains_in_flight_streams_and_refuses_new_requests() -> None:
    hold = threading.Event()
    stub = StubBackend("a", hold=hold)
    with fleet([stub], drain_timeout=10) as f, httpx.Client(timeout=TIMEOUT) as client:
        body = {"model": "m", "prompt": "x", "stream": True}
        with client.stream("POST", f"{f.url}/v1/completions", json=body) as response:
            lines = response.iter_lines()
            next(line for line in lines if line)
            assert f.router.loop is not None
            drained = asyncio.run_coroutine_threadsafe(f.router.lifecycle.drain(10), f.router.loop)
            _wait(lambda: not f.router.lifecycle.accepting)
            assert client.get(f"{f.url}/ready").status_code == 503
            refused = client.post(f"{f.url}/v1/completions", json={"model": "m", "prompt": "x"})
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
            assert not drained.done()
            hold.set()
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        assert drained.result(TIMEOUT) is True
