"""The router's picture of its backends: who they are, what their /metrics said, what it sent them.

Membership comes from a discovery source (static or Kubernetes, see `discovery.py`); a scrape loop
reads each backend's /metrics every `scrape_interval` with the operator's parser (Kvasir's names
or vLLM's). A backend whose scrape fails or times out has unknown metrics, never zero ones, and a
backend a proxied request could not connect to counts as unreachable until a scrape succeeds."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import aiohttp

from kvasir.operator.autoscaler.metrics import MetricsFormatError, parse_metrics
from kvasir.router.scorer import Candidate

logger = logging.getLogger(__name__)


@dataclass
class Backend:
    """One backend's state; mutated only on the event loop."""

    url: str
    in_flight: int = 0  # requests the router is proxying to it now
    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None
    metrics_known: bool = False  # the last scrape succeeded
    reachable: bool = True  # False once a connection failed, until the next successful scrape
    scraped_at: float = 0.0

    def candidate(self, remembered_blocks: int = 0) -> Candidate:
        scraped = (self.running or 0.0) + (self.waiting or 0.0)
        return Candidate(
            url=self.url,
            load=max(float(self.in_flight), scraped),
            kv_usage=self.kv_usage,
            metrics_known=self.metrics_known,
            reachable=self.reachable,
            remembered_blocks=remembered_blocks,
        )

    def forget_metrics(self) -> None:
        self.running = self.waiting = self.kv_usage = None
        self.metrics_known = False


class BackendPool:
    """The current backends by URL. `update()` applies a discovery result; `scrape_all()` one round."""

    def __init__(self, scrape_timeout: float) -> None:
        self.backends: dict[str, Backend] = {}
        self._scrape_timeout = aiohttp.ClientTimeout(total=scrape_timeout)

    def update(self, urls: Iterable[str]) -> tuple[list[str], list[str]]:
        """Make the pool exactly `urls`; returns (added, removed). A removed backend's in-flight
        requests go on (they hold their own connections)."""
        wanted = list(dict.fromkeys(urls))
        added = [url for url in wanted if url not in self.backends]
        removed = [url for url in self.backends if url not in wanted]
        for url in removed:
            del self.backends[url]
        for url in added:
            self.backends[url] = Backend(url)
        if added or removed:
            logger.info("backends: %s (added %s, removed %s)", sorted(self.backends), added, removed)
        return added, removed

    def candidates(self, remembered: Callable[[str], int] = lambda url: 0) -> list[Candidate]:
        """Every backend as the scorer sees it; `remembered(url)`: its prefix blocks in the index."""
        return [backend.candidate(remembered(backend.url)) for backend in self.backends.values()]

    def mark_unreachable(self, url: str) -> None:
        backend = self.backends.get(url)
        if backend is not None:
            backend.reachable = False
            backend.forget_metrics()

    async def scrape_all(self, session: aiohttp.ClientSession) -> None:
        """Scrape every backend concurrently; one slow or dead backend never delays the others."""
        await asyncio.gather(*(self._scrape(session, b) for b in list(self.backends.values())))

    async def _scrape(self, session: aiohttp.ClientSession, backend: Backend) -> None:
        try:
            async with session.get(f"{backend.url}/metrics", timeout=self._scrape_timeout) as response:
                if response.status != 200:
                    raise MetricsFormatError(f"/metrics answered {response.status}")
                text = await response.text()
            metrics = parse_metrics(text)
        except (aiohttp.ClientError, asyncio.TimeoutError, MetricsFormatError, UnicodeDecodeError) as exc:
            if backend.metrics_known or backend.reachable:
                logger.warning("backend %s: metrics unknown (%s)", backend.url, type(exc).__name__)
            backend.forget_metrics()
            if isinstance(exc, aiohttp.ClientConnectorError):
                backend.reachable = False
            return
        backend.running = metrics.gauges.get("running")
        backend.waiting = metrics.gauges.get("waiting")
        backend.kv_usage = metrics.gauges.get("kv_usage")
        backend.metrics_known = True
        backend.reachable = True
        backend.scraped_at = time.monotonic()
