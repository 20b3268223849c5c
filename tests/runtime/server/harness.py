"""Run the real app on uvicorn in a background thread, on a loopback port, for the server tests."""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import uvicorn
from fastapi import FastAPI

from kvasir.runtime.config import EngineConfig
from kvasir.runtime.server.state import ServerState

T = TypeVar("T")

MODEL = "tiny"
TIMEOUT = 60.0  # seconds: the bound on every wait in these tests


def tiny_engine_config(checkpoint: Path, **overrides: Any) -> EngineConfig:
    """The tiny random Llama, small enough that a server starts in about a second."""
    values: dict[str, Any] = {
        "model": str(checkpoint),
        "served_model_name": MODEL,
        "device": "cpu",
        "max_model_len": 256,
        "num_kv_blocks": 512,
        **overrides,
    }
    return EngineConfig(**values)


class _ThreadServer(uvicorn.Server):
    loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)


@dataclass
class RunningServer:
    app: FastAPI
    url: str
    server: _ThreadServer

    @property
    def state(self) -> ServerState:
        state: ServerState = self.app.state.kvasir
        return state

    def on_loop(self, coroutine: Coroutine[Any, Any, T], timeout: float = TIMEOUT) -> T:
        """Run `coroutine` on the server's event loop (where the server's state lives) and wait for it."""
        assert self.server.loop is not None
        return asyncio.run_coroutine_threadsafe(coroutine, self.server.loop).result(timeout)

    def wait_idle(self, timeout: float = TIMEOUT) -> None:
        """Until no request is in flight (every stream closed, every ticket released)."""
        self.on_loop(asyncio.wait_for(self.state.lifecycle.wait_idle(), timeout), timeout + 1)


@contextmanager
def serve(app: FastAPI, *, wait_ready: bool = True) -> Iterator[RunningServer]:
    """Serve `app` on 127.0.0.1 (a free port) until the block ends; by default, wait until loaded."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(256)  # connections queue here until uvicorn accepts: no start-up race
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_config=None, access_log=False, timeout_graceful_shutdown=5)
    server = _ThreadServer(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    running = RunningServer(app, f"http://127.0.0.1:{port}", server)
    try:
        if wait_ready:
            if not running.state.lifecycle.started.wait(TIMEOUT):
                raise TimeoutError("the server did not finish loading in time")
            if not running.state.lifecycle.ready:
                raise RuntimeError(f"the server did not become ready: {running.state.lifecycle.phase}")
        yield running
    finally:
        server.should_exit = True
        thread.join(TIMEOUT)
        sock.close()
        if thread.is_alive():
            raise TimeoutError("the server did not stop in time")


class StderrLines:
    """A subprocess's stderr lines, read on a thread so that every wait has a timeout."""

    def __init__(self, stream: object) -> None:
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream: object) -> None:
        for line in stream:  # type: ignore[attr-defined]
            self.lines.put(line)

    def wait_for(self, pattern: str, timeout: float = TIMEOUT) -> re.Match[str]:
        regex = re.compile(pattern)
        while True:
            line = self.lines.get(timeout=timeout)
            self.seen.append(line)
            match = regex.search(line)
            if match:
                return match


@dataclass
class ServerProcess:
    url: str
    process: subprocess.Popen[str]
    stderr: StderrLines


def spawn_serve(checkpoint: Path, *args: str) -> tuple[subprocess.Popen[str], StderrLines]:
    """`kvasir serve` (or, with --headless, a worker node) for the tiny checkpoint on a free
    loopback port, started and not waited for: the process and its stderr's lines."""
    command = [
        sys.executable, "-m", "kvasir.cli", "serve", "--model", str(checkpoint), "--host", "127.0.0.1",
        "--port", "0", "--device", "cpu", "--num-kv-blocks", "512", "--max-model-len", "256", *args,
    ]  # fmt: skip
    process = subprocess.Popen(
        command,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        # One thread: the server shares the cores with the test process that drives it.
        env={**os.environ, "PYTHONSAFEPATH": "1", "KVASIR_THREADS": "1"},
    )
    return process, StderrLines(process.stderr)


@contextmanager
def serve_process(checkpoint: Path, *extra_args: str) -> Iterator[ServerProcess]:
    """A real `kvasir serve` process for the tiny checkpoint on a free loopback port, once ready;
    killed at the end of the block if it is still running."""
    process, stderr = spawn_serve(checkpoint, "--served-model-name", MODEL, *extra_args)
    try:
        url = "http://" + stderr.wait_for(r"Uvicorn running on http://([\d.]+:\d+)").group(1)
        stderr.wait_for(r"ready: serving")
        yield ServerProcess(url, process, stderr)
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(TIMEOUT)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(TIMEOUT)


def rss_mb(pid: int) -> float:
    """A process's resident memory now, in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for process {pid}")


@dataclass
class Watched:
    response: httpx.Response
    slowest_health_s: float  # the slowest /health answer while the request ran
    rss_growth_mb: float  # the highest RSS seen while it ran, less the RSS before it (0: not read)


def watch(url: str, pid: int | None, send: Callable[[], httpx.Response]) -> Watched:
    """Run `send()` on a thread while /health is asked, and process `pid`'s RSS read, every 50 ms."""
    baseline = peak = rss_mb(pid) if pid is not None else 0.0
    answer: list[httpx.Response | BaseException] = []

    def run() -> None:
        try:
            answer.append(send())
        except BaseException as error:  # re-raised below, on the test's thread
            answer.append(error)

    sender = threading.Thread(target=run)
    sender.start()
    slowest = 0.0
    with httpx.Client(timeout=TIMEOUT) as client:
        while sender.is_alive():
            began = time.monotonic()
            assert client.get(url + "/health").status_code == 200
            slowest = max(slowest, time.monotonic() - began)
            if pid is not None:
                peak = max(peak, rss_mb(pid))
            sender.join(0.05)
    sender.join()
    if isinstance(answer[0], BaseException):
        raise answer[0]
    return Watched(answer[0], slowest, peak - baseline)


def send_raw(
    url: str, parts: list[bytes], *, gap: float = 0.0, half_close: bool = False
) -> tuple[bytes, float]:
    """Send `parts` on a fresh connection, `gap` seconds apart (stopping if the server closes), then
    optionally shut our sending side; read until the server closes. (What came back, how long it took.)"""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=TIMEOUT) as sock:
        began = time.monotonic()
        for part in parts:
            try:
                sock.sendall(part)
            except OSError:  # the server answered and closed before the rest
                break
            time.sleep(gap)
        if half_close:
            with contextlib.suppress(OSError):  # the server may have closed already
                sock.shutdown(socket.SHUT_WR)
        reply = b""
        while True:
            try:
                chunk = sock.recv(65536)
            except OSError:
                break
            if not chunk:
                break
            reply += chunk
        return reply, time.monotonic() - began
