"""A uvicorn server whose first SIGTERM/SIGINT drains before it shuts down (see runner.py for why);
`kvasir serve` and `kvasir router` both run on it. Imports nothing of the engine."""

from __future__ import annotations

import asyncio
import socket
from types import FrameType
from typing import Protocol

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
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        await self._lifecycle.drain(self._drain_timeout)
        self.should_exit = True
