"""The hold loop on its own (no sockets): it asks for a replica at once when a request is held,
again every ASK_EVERY seconds while none is ready (never two asks at once), not at all while
nothing is held, and releases the queue once a backend is ready."""

from __future__ import annotations

import asyncio

import pytest

from kvasir.router import activator
from kvasir.router.activator import Activator
from kvasir.router.backends import BackendPool
from kvasir.router.hold import HoldQueue
from kvasir.router.metrics import RouterMetrics
from kvasir.router.scale import Activation

TIMEOUT = 30.0


class SlowScale:
    """A stand-in ScaleFromZero whose every ask takes `delay` seconds."""

    def __init__(self, delay: float, answer: Activation = Activation.SCALED) -> None:
        self.delay = delay
        self.answer = answer
        self.asks = 0
        self.in_flight = 0
        self.most_in_flight = 0

    async def activate(self) -> Activation:
        self.asks += 1
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay)
        finally:
            self.in_flight -= 1
        return self.answer


async def _until(condition: object) -> None:
    async with asyncio.timeout(TIMEOUT):
        while not condition():  # type: ignore[operator]
            await asyncio.sleep(0.005)


def test_asks_at_once_then_every_interval_one_at_a_time_and_releases_when_ready(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(activator, "ASK_EVERY", 0.05)

    async def scenario() -> None:
        pool = BackendPool(1.0, probe_ready=True)
        pool.update(["http://backend"])  # not ready until the test says so
        metrics = RouterMetrics(pool)
        queue = HoldQueue(10, TIMEOUT, metrics)
        scale = SlowScale(delay=0.2)  # longer than ASK_EVERY: asks must not overlap

        async def refresh() -> None:
            pass

        loop = Activator(queue, pool, refresh, metrics, poll_interval=0.01, scale=scale)  # type: ignore[arg-type]
        running = asyncio.create_task(loop.run())
        await asyncio.sleep(0.1)
        assert scale.asks == 0  # nothing held, nothing asked
        place = queue.join()
        assert place is not None
        waiting = asyncio.create_task(queue.wait(place))
        await _until(lambda: scale.asks >= 3)
        assert scale.most_in_flight == 1
        pool.backends["http://backend"].ready = True
        assert await asyncio.wait_for(waiting, TIMEOUT) == "released"
        asked = scale.asks
        await asyncio.sleep(0.3)
        assert scale.asks == asked  # nothing held: no new ask
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running
        page = metrics.render().decode()
        counted = next(
            line for line in page.splitlines() if line.startswith("kvasir_router_activations_total ")
        )
        assert float(counted.split()[1]) >= 2  # every ask that scaled was counted

    asyncio.run(scenario())


def test_a_forbidden_ask_is_not_repeated(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without get/patch on the scale (a deployment that does not scale to zero) it only holds."""
    monkeypatch.setattr(activator, "ASK_EVERY", 0.01)

    async def scenario() -> None:
        pool = BackendPool(1.0, probe_ready=True)
        pool.update(["http://backend"])
        metrics = RouterMetrics(pool)
        queue = HoldQueue(10, TIMEOUT, metrics)
        scale = SlowScale(delay=0.0, answer=Activation.FORBIDDEN)

        async def refresh() -> None:
            pass

        loop = Activator(queue, pool, refresh, metrics, poll_interval=0.01, scale=scale)  # type: ignore[arg-type]
        running = asyncio.create_task(loop.run())
        place = queue.join()
        assert place is not None
        waiting = asyncio.create_task(queue.wait(place))
        await _until(lambda: scale.asks == 1)
        await asyncio.sleep(0.2)  # twenty ask intervals
        assert scale.asks == 1 and not waiting.done()
        pool.backends["http://backend"].ready = True
        assert await asyncio.wait_for(waiting, TIMEOUT) == "released"
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running

    asyncio.run(scenario())
