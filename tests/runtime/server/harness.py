"""Run the real app on uvicorn in a background thread, on a loopback port, for the server tests."""

from __future__ import annotations

import asyncio
import socket
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
