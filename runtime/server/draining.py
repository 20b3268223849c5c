"""A uvicorn server whose first SIGTERM/SIGINT drains before it shuts down (see runner.py for why);
`kvasir serve` and `kvasir router` both run on it. Imports nothing of the engine."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from types import FrameType
from typing import Any, Protocol

import uvicorn


class Drainable(Protocol):
    def begin_drain(self) -> None:
        """Turn /ready false and refuse new requests, at once."""

    async def drain(self, timeout: float) -> bool:
        """Let in-flight requests end (at most `timeout` s); True when all did."""
        ...


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose first SIGTERM/SIGINT drains before shutting down."""

    def __init__(self, config: uvicorn.Config, lifecycle: Drainable, drain_timeout: float) -> None:
        super().__init__(config)
        self._lifecycle = lifecycle
        self._drain_timeout = drain_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None
        self._draining = False

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        if not self.config.loaded:
            self.config.load()
        self.config.loaded_app = CloseWhileDraining(self.config.loaded_app, lambda: self._draining)
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._draining or self._loop is None:
            super().handle_exit(sig, frame)
            return
        # A signal handler runs between bytecodes of the main thread: hand the work to the loop.
        self._draining = True
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._lifecycle.begin_drain()  # /ready is false from this very moment
        # Kept-alive connections outlive the pod's removal from the Service: kube-proxy sends only
        # new connections elsewhere, so a client reusing one would meet a 503 at every request
        # until the pod exits (measured on a real kubelet: 11-50 of ~500 requests per rollout).
        # Close the idle ones now and the busy ones after their response (uvicorn's per-connection
        # graceful shutdown): the client's next request opens a connection the Service routes to
        # a replica that stays.
        for connection in list(self.server_state.connections):
            connection.shutdown()
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        await self._lifecycle.drain(self._drain_timeout)
        self.should_exit = True


class CloseWhileDraining:
    """ASGI wrapper: once `draining()` is true, every response says `Connection: close` (and h11
    then closes the connection after it), so no client keeps talking to a replica that leaves."""

    def __init__(self, app: Any, draining: Callable[[], bool]) -> None:
        self.app = app
        self._draining = draining

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_closing(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start" and self._draining():
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"connection"]
                message = {**message, "headers": [*headers, (b"connection", b"close")]}
            await send(message)

        await self.app(scope, receive, send_closing)
