"""Requests at Kvasir's router, for scale to zero: each ready router pod's /metrics, read like the
model pods' (concurrently, each within a short timeout; a pod that fails is absent, which makes
the deployment's idleness unknown, never idle)."""

from __future__ import annotations

import asyncio

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvasir.operator.autoscaler.idle import ROUTER_HELD, ROUTER_IN_FLIGHT, ROUTER_ROUTED, RouterLoad
from kvasir.operator.autoscaler.pods import PodView
from kvasir.operator.autoscaler.sources import fetch_exposition
from kvasir.operator.children.routing import ROUTER_PORT


def parse_router_load(text: str) -> RouterLoad:
    """Held, in-flight and routed requests from a router's exposition; ValueError if unparseable.
    A series the router does not expose (an older router has no hold) counts as zero."""
    sums = {ROUTER_HELD: 0.0, ROUTER_IN_FLIGHT: 0.0, ROUTER_ROUTED: 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in sums:
                sums[sample.name] += float(sample.value)
    return RouterLoad(held=sums[ROUTER_HELD], in_flight=sums[ROUTER_IN_FLIGHT], routed=sums[ROUTER_ROUTED])


class RouterScraper:
    """GET http://POD_IP:PORT/metrics of every ready router pod at once."""

    def __init__(self, *, timeout: float = 2.0, port: int = ROUTER_PORT) -> None:
        self.timeout = timeout
        self.port = port
        self._session: aiohttp.ClientSession | None = None

    async def _scrape(self, pod: PodView) -> RouterLoad | None:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout))
        text = await fetch_exposition(self._session, pod, self.port, lambda pod, why: None)
        if text is None:
            return None
        try:
            return parse_router_load(text)
        except ValueError:
            return None

    async def collect(self, pods: list[PodView]) -> dict[str, RouterLoad]:
        results = await asyncio.gather(*(self._scrape(pod) for pod in pods))
        return {pod.name: load for pod, load in zip(pods, results, strict=True) if load is not None}

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
