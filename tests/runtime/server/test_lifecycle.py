"""Readiness while loading, and SIGTERM's graceful drain of a real `kvasir serve` process."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from kvasir.runtime.engine.async_engine import AsyncEngine
from kvasir.runtime.engine.llm_engine import LLMEngine
from kvasir.runtime.server.app import build_app
from kvasir.runtime.server.config import ServerConfig
from tests.runtime.server.harness import MODEL, TIMEOUT, StderrLines, serve, serve_process, tiny_engine_config


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint: Callable[..., Path]) -> Path:
    return tiny_checkpoint("llama")


def test_not_ready_until_loaded_but_healthy_meanwhile(checkpoint: Path) -> None:
    engine_config = tiny_engine_config(checkpoint)
    release = threading.Event()

    def slow_engine() -> AsyncEngine:
        if not release.wait(TIMEOUT):  # stands for a large model's load
            raise TimeoutError("never released")
        return AsyncEngine(LLMEngine(engine_config))

    app = build_app(engine_config, ServerConfig(), engine_factory=slow_engine)
    with serve(app, wait_ready=False) as server, httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        assert client.get("/health").status_code == 200
        loading = client.get("/ready")
        assert loading.status_code == 503 and loading.json() == {"status": "loading"}
        refused = client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "loading"
        assert "retry-after" in refused.headers

        release.set()
        assert server.state.lifecycle.started.wait(TIMEOUT)
        assert client.get("/ready").json() == {"status": "ready"}
        assert (
            client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}).status_code
            == 200
        )


def test_a_model_that_fails_to_load_fails_health(tmp_path: Path) -> None:
    engine_config = tiny_engine_config(tmp_path)  # an empty folder is no model
    with serve(build_app(engine_config, ServerConfig()), wait_ready=False) as server:
        assert server.state.lifecycle.started.wait(TIMEOUT)
        assert httpx.get(server.url + "/health", timeout=TIMEOUT).status_code == 503
        assert httpx.get(server.url + "/ready", timeout=TIMEOUT).json() == {"status": "failed"}


@pytest.mark.parametrize("overlap", [(), ("--async-scheduling", "--output-process")], ids=["sync", "overlap"])
def test_sigterm_drains_in_flight_requests_then_exits_0(checkpoint: Path, overlap: tuple[str, ...]) -> None:
    # A keep-alive timeout longer than the test: only the drain may close the idle connection.
    keep_alive = ("--keep-alive-timeout", "3600")
    with serve_process(checkpoint, "--drain-timeout", str(TIMEOUT), *keep_alive, *overlap) as server:
        children = _children(server.process.pid)
        assert len(children) == (1 if overlap else 0)  # the output process
        asyncio.run(_drain_scenario(server.url, server.process, server.stderr))
        assert server.process.wait(TIMEOUT) == 0, "".join(server.stderr.seen)
    for pid in children:
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]


def _children(pid: int) -> list[int]:
    """The process's child pids (Linux)."""
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children += [int(child) for child in (task / "children").read_text().split()]
    return children


async def _drain_scenario(url: str, process: subprocess.Popen[str], stderr: StderrLines) -> None:
    body = {"model": MODEL, "prompt": "keep going", "max_tokens": 160, "ignore_eos": True, "stream": True}
    body["stream_options"] = {"include_usage": True}
    first_events: list[asyncio.Event] = [asyncio.Event() for _ in range(4)]

    async def stream(client: httpx.AsyncClient, index: int) -> tuple[int, str | None]:
        tokens, finish = 0, None
        async with client.stream("POST", url + "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                first_events[index].set()
                chunk = json.loads(line[6:])
                if chunk["usage"] is not None:
                    tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk["choices"]:
                    finish = choice["finish_reason"] or finish
        return tokens, finish

    async with httpx.AsyncClient(timeout=TIMEOUT) as client, httpx.AsyncClient(timeout=TIMEOUT) as fresh:
        streams = [asyncio.ensure_future(stream(client, i)) for i in range(4)]
        await asyncio.wait_for(asyncio.gather(*(event.wait() for event in first_events)), TIMEOUT)
        idle = await _kept_alive_connection(url)
        process.send_signal(signal.SIGTERM)
        await asyncio.to_thread(stderr.wait_for, r"draining: 4 sequences in flight")
        ready = await fresh.get(url + "/ready")
        refused = await fresh.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x"})
        # The idle kept-alive connection is closed at the drain's start, so its client reconnects
        # (to a replica that stays) instead of meeting a 503 at every request while this one
        # drains; uvicorn alone would close it only when the drain ends.
        assert await asyncio.wait_for(idle.read(), TIMEOUT) == b""
        still_running = sum(not task.done() for task in streams)
        results = await asyncio.wait_for(asyncio.gather(*streams), TIMEOUT)
    assert ready.status_code == 503 and ready.json() == {"status": "draining"}
    assert ready.headers["connection"] == "close"
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
    assert refused.headers["connection"] == "close"
    assert still_running == 4  # the 503s and the close came while all four streams were in flight
    assert results == [(160, "length")] * 4  # every in-flight request finished in full


async def _kept_alive_connection(url: str) -> asyncio.StreamReader:
    """A connection that has had one answer and stays open (HTTP/1.1 keep-alive), as a client
    pool holds it between requests; its reader, positioned after that answer."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), TIMEOUT)
    assert head.startswith(b"HTTP/1.1 200") and b"connection: close" not in head.lower()
    length = next(
        int(line.split(b":")[1]) for line in head.lower().split(b"\r\n") if line.startswith(b"content-length")
    )
    await reader.readexactly(length)
    return reader


def test_drain_timeout_aborts_what_is_still_running(checkpoint: Path) -> None:
    app = build_app(tiny_engine_config(checkpoint), ServerConfig())
    body = {"model": MODEL, "prompt": "x", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with serve(app) as server, httpx.Client(timeout=TIMEOUT) as client:
        with client.stream("POST", server.url + "/v1/completions", json=body) as stream:
            lines = stream.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))  # it is running
            # A zero drain timeout: the stream is aborted instead of waited for.
            finished_in_time = server.on_loop(server.state.lifecycle.drain(0.0))
            events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        assert finished_in_time is False
        assert events[-1]["choices"][0]["finish_reason"] == "abort"
        assert client.get(server.url + "/ready").status_code == 503
        server.wait_idle()
