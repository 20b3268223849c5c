"""Scale from zero: while requests are held, look for a ready backend often, ask for a replica, and
release the held requests as soon as one is ready.

While nothing is held the router's usual loops (scrapes every `--scrape-interval`, pod listings
every `--discovery-interval`) keep the backends' state. Once a request is held this loop takes
over the pace: it refreshes readiness every `poll_interval` (static backends' /ready, or the
deployment's pod listing), so the first held request goes out within about that of the first
backend turning ready. With an LLMDeployment it asks for a replica at once (scale.py: only when
the replicas are 0), and again every `ASK_EVERY` seconds while requests are still held and no
backend is ready (the operator's autoscaler may have scaled back to zero in between); at most one
request to the API is in flight. A router whose service account may not read the scale (the
operator grants it only to a deployment that scales to zero) stops asking and only holds."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from contextlib import suppress

from kvasir.router.backends import BackendPool
from kvasir.router.hold import HoldQueue
from kvasir.router.metrics import RouterMetrics
from kvasir.router.scale import Activation, ScaleFromZero

logger = logging.getLogger(__name__)

ASK_EVERY = 10.0  # seconds between two requests for a replica while requests are still held
STATIC_POLL = 0.25  # seconds between /ready probes of static backends while requests are held
LISTING_POLL = (
    0.5  # seconds between pod listings while requests are held (each one costs the API server a list)
)


class Activator:
    def __init__(
        self,
        queue: HoldQueue,
        pool: BackendPool,
        refresh: Callable[[], Awaitable[None]],
        metrics: RouterMetrics,
        *,
        poll_interval: float,
        scale: ScaleFromZero | None = None,
    ) -> None:
        self._queue = queue
        self._pool = pool
        self._refresh = refresh
        self._metrics = metrics
        self._poll = poll_interval
        self._scale = scale
        self._asking: asyncio.Task[None] | None = None
        self._forbidden = False  # the API refused: never ask again
        self._asked_at = -ASK_EVERY

    async def run(self) -> None:
        """Forever (cancelled at shutdown)."""
        try:
            while True:
                while not len(self._queue):
                    await self._queue.wait_change(3600)
                try:
                    await self._while_held()
                except Exception:  # a bug in one round must not strand the held requests
                    logger.exception("the hold loop failed; retrying")
                    await asyncio.sleep(self._poll)
        finally:
            if self._asking is not None:
                self._asking.cancel()
                with suppress(asyncio.CancelledError):
                    await self._asking

    async def _while_held(self) -> None:
        while len(self._queue):
            if self._pool.any_ready():
                await self._queue.release()
                continue
            self._ask()
            await self._refresh()
            if not self._pool.any_ready():
                await asyncio.sleep(self._poll)

    def _ask(self) -> None:
        """Ask for a replica, unless a request is in flight or the last one was under ASK_EVERY ago."""
        now = time.monotonic()
        busy = self._asking is not None and not self._asking.done()
        if self._scale is None or self._forbidden or busy or now - self._asked_at < ASK_EVERY:
            return
        self._asked_at = now
        self._asking = asyncio.create_task(self._activate(self._scale))

    async def _activate(self, scale: ScaleFromZero) -> None:
        result = await scale.activate()
        if result is Activation.SCALED:
            self._metrics.activated()
        elif result is Activation.FORBIDDEN:
            self._forbidden = True
            logger.info(
                "not allowed to scale the LLMDeployment (no get/patch on llmdeployments/scale: it does "
                "not scale to zero): requests are held until a pod is ready, without asking for one"
            )
