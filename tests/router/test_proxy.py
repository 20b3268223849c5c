"""The router on a real uvicorn server in front of stub backends on real servers: the openai SDK
through it, streams passed through unbuffered, disconnects propagated, refusals retried."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from tests.router.harness import fleet
from tests.router.stub_backend import TIMEOUT, StubBackend


def _metric(url: str, line_start: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_the_openai_sdk_works_through_the_router_and_the_api_key_passes_through() -> None:
    with fleet([StubBackend("a"), StubBackend("b")]) as f:
        client = openai.OpenAI(base_url=f"{f.url}/v1", api_key="sk-secret", timeout=TIMEOUT, max_retries=0)
        answer = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        assert answer.choices[0].message.content in ("a", "b")
        stream = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        text = "".join(chunk.choices[0].delta.content or "" for chunk in stream)
        assert text.strip().endswith("2")
        completion = client.completions.create(model="m", prompt="hello")
        assert completion.choices[0].text in ("a", "b")
        assert [m.id for m in client.models.list()] == ["m"]
        seen = [r for stub in f.stubs for r in stub.requests]
        assert len(seen) == 4
        assert all(r["headers"]["authorization"] == "Bearer sk-secret" for r in seen)
        decisions = sum(
            float(line.rsplit(" ", 1)[1])
            for line in httpx.get(f"{f.url}/metrics").text.splitlines()
            if line.startswith("kvasir_router_decisions_total{")
        )
        assert decisions == 4


def test_a_stream_is_passed_through_without_buffering() -> None:
    hold = threading.Event()
    stub = StubBackend("a", hold=hold)
    with fleet([stub]) as f, httpx.Client(timeout=TIMEOUT) as client:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        with client.stream("POST", f"{f.url}/v1/chat/completions", json=body) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            lines = response.iter_lines()
            first = next(line for line in lines if line)
            # The backend is still holding the rest: the first event came through on its own.
            assert "a0" in first and not hold.is_set()
            hold.set()
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and "a2" in rest[-2]


def test_a_client_disconnect_reaches_the_backend() -> None:
    stub = StubBackend("a", hold=threading.Event())  # never released
    with fleet([stub]) as f, httpx.Client(timeout=TIMEOUT) as client:
        body = {"model": "m", "prompt": "hi", "stream": True}
        with client.stream("POST", f"{f.url}/v1/completions", json=body) as response:
            next(line for line in response.iter_lines() if line)
        assert stub.disconnected.wait(TIMEOUT), "the backend never saw the client go"
        deadline = time.monotonic() + TIMEOUT
        while f.router.lifecycle.in_flight and time.monotonic() < deadline:
            time.sleep(0.01)
        assert f.router.lifecycle.in_flight == 0


@pytest.mark.parametrize("status", [429, 503])
def test_a_refusal_is_retried_on_another_backend(status: int) -> None:
    full, fine = StubBackend("full", refuse_with=status, waiting=0), StubBackend("fine", waiting=3)
    with fleet([full, fine]) as f:
        time.sleep(0.2)  # a scrape: "full" looks idler, so it is asked first
        answer = httpx.post(f"{f.url}/v1/completions", json={"model": "m", "prompt": "x"}, timeout=TIMEOUT)
        assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == "fine"
        assert len(full.requests) == 1
        assert _metric(f.url, f'kvasir_router_retries_total{{reason="status_{status}"}}') == 1


def test_when_every_backend_refuses_the_last_refusal_reaches_the_client() -> None:
    with fleet([StubBackend("a", refuse_with=429), StubBackend("b", refuse_with=429)]) as f:
        answer = httpx.post(f"{f.url}/v1/completions", json={"model": "m", "prompt": "x"}, timeout=TIMEOUT)
        assert answer.status_code == 429 and answer.headers["retry-after"] == "1"
        assert answer.json()["error"]["code"] == "queue_full"


# 20 repeats: parsed on the event loop; 3,000 (87 kB): over OFF_LOOP_BYTES, parsed on a thread.
@pytest.mark.parametrize("repeats", [20, 3000])
def test_the_same_prefix_goes_back_to_the_same_backend(repeats: int) -> None:
    stubs = [StubBackend(name) for name in "abc"]
    system = "You are a careful assistant. " * repeats
    with fleet(stubs) as f, httpx.Client(timeout=TIMEOUT) as client:
        for user in range(6):
            body = {
                "model": "m",
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"q{user}"}],
            }
            assert client.post(f"{f.url}/v1/chat/completions", json=body).status_code == 200
        served = [len(stub.requests) for stub in stubs]
        assert sorted(served) == [0, 0, 6]
        assert _metric(f.url, 'kvasir_router_decisions_total{reason="prefix"}') == 5
