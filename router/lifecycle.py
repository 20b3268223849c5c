"""The router's drain: on SIGTERM /ready turns false and new requests get 503, while requests in
flight (streams included) run to their end, for at most --drain-timeout seconds (then the server
closes them), like `kvasir serve`. Requests still held for a first backend are answered 503 at
once (`on_drain`): no backend is ready, and the client may retry on another router replica."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress

logger = logging.getLogger(__name__)


class RouterLifecycle:
    def __init__(self, on_drain: Callable[[], None] | None = None) -> None:
        self.accepting = True
        self._on_drain = on_drain
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @contextmanager
    def hold(self) -> Iterator[None]:
        """One request in flight for the duration of the block."""
        self._in_flight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.set()

    def begin_drain(self) -> None:
        if self.accepting:
            logger.info("draining: %d requests in flight", self._in_flight)
            if self._on_drain is not None:
                self._on_drain()
        self.accepting = False

    async def drain(self, timeout: float) -> bool:
        """Stop accepting; True once every request in flight has ended, False after `timeout`."""
        self.begin_drain()
        with suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout)
            logger.info("drained: every request in flight ended")
            return True
        logger.warning("drain timeout (%.1fs): %d requests still in flight", timeout, self._in_flight)
        return False
