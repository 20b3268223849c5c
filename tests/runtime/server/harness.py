"""Run the real app on uvicorn in a background thread, on a loopback port, for the server tests."""

from __future__ import annotations

import asyncio
import os
import queue
import re
import socket
import subprocess
import sys
import threading
from collections.abc import Coroutine, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

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


@contextmanager
def serve_process(checkpoint: Path, *extra_args: str) -> Iterator[ServerProcess]:
    """A real `kvasir serve` process for the tiny checkpoint on a free loopback port, once ready;
    killed at the end of the block if it is still running."""
    command = [
        sys.executable, "-m", "kvasir.cli", "serve", "--model", str(checkpoint), "--served-model-name", MODEL,
        "--host", "127.0.0.1", "--port", "0", "--device", "cpu", "--num-kv-blocks", "512",
        "--max-model-len", "256", *extra_args,
    ]  # fmt: skip
    process = subprocess.Popen(
        command,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONSAFEPATH": "1"},
    )
    stderr = StderrLines(process.stderr)
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
