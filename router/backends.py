"""The router's picture of its backends: who they are, what their /metrics said, what it sent them.

Membership comes from a discovery source (static or Kubernetes, see `discovery.py`); a scrape loop
reads each backend's /metrics every `scrape_interval` with the operator's parser (Kvasir's names
or vLLM's). A backend whose scrape fails, times out, is larger than `scrape_max_bytes` or reports
an implausible value (negative, infinite, NaN, a KV usage past 1) has unknown metrics, never zero
ones, and a backend a proxied request could not connect to counts as unreachable until a scrape
succeeds.

A scrape is bounded as a whole: `scrape_timeout` covers connecting, the download and the parse,
and the parse runs on a worker thread (a slow page never holds the event loop, so /health and the
streams keep moving). Each backend is named in the router's own /metrics by an index, given in the
order backends first appear and logged with their address, never by its address."""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import aiohttp

from kvasir.operator.autoscaler.metrics import GAUGES, MetricsFormatError, parse_metrics
from kvasir.router.lora import LoraInfo, read_lora_info
from kvasir.router.scorer import Candidate

logger = logging.getLogger(__name__)

_SIGNALS = ("running", "waiting", "kv_usage")  # what the router reads of a backend's /metrics
# The lines of a page that can hold them (their samples and their HELP and TYPE lines): only these
# are parsed, so the parse costs a regular-expression scan of the page, not a full exposition parse.
_NAMES = "|".join(re.escape(name) for signal in _SIGNALS for name in GAUGES[signal])
_WANTED = re.compile(rf"^(?:# (?:HELP|TYPE) )?(?:{_NAMES})(?:[{{ \t].*)?$", re.MULTILINE)


@dataclass
class Backend:
    """One backend's state; mutated only on the event loop."""

    url: str
    label: str = ""  # how the router's /metrics names it (an index: never its address)
    in_flight: int = 0  # requests the router is proxying to it now
    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None
    metrics_known: bool = False  # the last scrape succeeded
    reachable: bool = True  # False once a connection failed, until the next successful scrape
    scraped_at: float = 0.0
    parsing: bool = False  # a parse of its /metrics is still running on a worker thread
    lora: LoraInfo | None = None  # adapters running or waiting, and slots (from /metrics)
    adapters: frozenset[str] | None = None  # every adapter it serves (/v1/models); None: unknown
    # Takes requests now: a listed pod is (Kubernetes checked its /ready); a static backend once
    # its /ready answers below 500 (a 503 is a server loading or draining; a 404 or 401, a server
    # without an open /ready, such as vLLM's, which listens only once loaded). While no backend is
    # ready the router holds requests (hold.py).
    ready: bool = True

    def candidate(self, remembered_blocks: int = 0) -> Candidate:
        scraped = (self.running or 0.0) + (self.waiting or 0.0)
        return Candidate(
            url=self.url,
            load=max(float(self.in_flight), scraped),
            kv_usage=self.kv_usage,
            metrics_known=self.metrics_known,
            reachable=self.reachable,
            remembered_blocks=remembered_blocks,
            adapters=self.adapters,
            active_adapters=self.lora.active if self.lora is not None else frozenset(),
            free_lora_slot=self.lora.free_slot if self.lora is not None else None,
        )

    def forget_metrics(self) -> None:
        self.running = self.waiting = self.kv_usage = None
        self.lora = None
        self.adapters = None
        self.metrics_known = False


class ScrapeError(Exception):
    """A /metrics answer the router does not use (too large, implausible, still being parsed)."""


def read_page(page: bytes) -> tuple[dict[str, float], LoraInfo | None]:
    """The gauges (`read_gauges`) and the LoRA info of a /metrics page (off the event loop)."""
    gauges = read_gauges(page)
    try:
        return gauges, read_lora_info(page.decode("utf-8"))
    except (ValueError, TypeError, IndexError):
        return gauges, None


def read_gauges(page: bytes) -> dict[str, float]:
    """running, waiting and kv_usage from a /metrics page (CPU work: run it off the event loop).

    Raises ScrapeError or MetricsFormatError for a page that is not UTF-8, has neither running nor
    waiting, or reports a value no real server would: negative, infinite or NaN, or a KV usage past
    1. One backend reporting -1e9 waiting requests would otherwise draw every request."""
    try:
        text = page.decode("utf-8")
    except UnicodeDecodeError:
        raise ScrapeError("/metrics is not UTF-8") from None
    wanted = "\n".join(match.group() for match in _WANTED.finditer(text)) + "\n"
    gauges = {k: v for k, v in parse_metrics(wanted).gauges.items() if k in _SIGNALS}
    if "running" not in gauges and "waiting" not in gauges:
        raise ScrapeError("/metrics has no running or waiting requests")
    for signal, value in gauges.items():
        ceiling = 1.0 if signal == "kv_usage" else math.inf
        if not (math.isfinite(value) and 0.0 <= value <= ceiling):
            raise ScrapeError(f"/metrics reports an implausible {signal}: {value!r}")
    return gauges


class BackendPool:
    """The current backends by URL. `update()` applies a discovery result; `scrape_all()` one round."""

    def __init__(
        self,
        scrape_timeout: float,
        scrape_max_bytes: int = 1 << 20,
        backend_api_key: str | None = None,
        *,
        probe_ready: bool = False,
    ) -> None:
        self.backends: dict[str, Backend] = {}
        # Static backends are probed (`probe_ready_all`); listed pods are Ready by the listing.
        self.probe_ready = probe_ready
        # The backends' API key, for their /v1/models (their /metrics is open, as the server's is).
        self._models_headers = {"Authorization": f"Bearer {backend_api_key}"} if backend_api_key else {}
        self._scrape_timeout = scrape_timeout
        self._scrape_max_bytes = scrape_max_bytes
        self._labels: dict[str, str] = {}  # every URL seen, with its index (kept if it comes back)
        self._parser: ThreadPoolExecutor | None = None

    def update(self, urls: Iterable[str]) -> tuple[list[str], list[str]]:
        """Make the pool exactly `urls`; returns (added, removed). A removed backend's in-flight
        requests go on (they hold their own connections)."""
        wanted = list(dict.fromkeys(urls))
        added = [url for url in wanted if url not in self.backends]
        removed = [url for url in self.backends if url not in wanted]
        for url in removed:
            del self.backends[url]
        for url in added:
            if url not in self._labels:
                self._labels[url] = str(len(self._labels))
                logger.info("backend %s is %s (its label in /metrics)", self._labels[url], url)
            self.backends[url] = Backend(url, label=self._labels[url], ready=not self.probe_ready)
        if added or removed:
            logger.info("backends: %s (added %s, removed %s)", sorted(self.backends), added, removed)
        return added, removed

    def labels(self) -> Mapping[str, str]:
        """Every backend URL seen so far, with its label in /metrics."""
        return dict(self._labels)

    def label(self, url: str) -> str:
        return self._labels.get(url, "?")

    def candidates(self, remembered: Callable[[str], int] = lambda url: 0) -> list[Candidate]:
        """Every backend as the scorer sees it; `remembered(url)`: its prefix blocks in the index."""
        return [backend.candidate(remembered(backend.url)) for backend in self.backends.values()]

    def any_ready(self) -> bool:
        return any(backend.ready for backend in self.backends.values())

    async def probe_ready_all(self, session: aiohttp.ClientSession) -> None:
        """Ask every backend's /ready at once (each within the scrape timeout)."""
        await asyncio.gather(*(self._probe_ready(session, b) for b in list(self.backends.values())))

    async def _probe_ready(self, session: aiohttp.ClientSession, backend: Backend) -> None:
        async def ask() -> int:
            async with session.get(f"{backend.url}/ready") as response:
                return response.status

        try:
            status = await asyncio.wait_for(ask(), self._scrape_timeout)
        except (aiohttp.ClientError, asyncio.TimeoutError):
            status = 0
        ready = 0 < status < 500
        if ready != backend.ready:
            logger.info(
                "backend %s is %s",
                backend.label,
                "ready" if ready else f"not ready ({status or 'no answer'})",
            )
        backend.ready = ready

    def mark_unreachable(self, url: str) -> None:
        backend = self.backends.get(url)
        if backend is not None:
            backend.reachable = False
            backend.forget_metrics()
            if self.probe_ready:  # until its /ready says otherwise: the next requests are held
                backend.ready = False

    def close(self) -> None:
        if self._parser is not None:
            self._parser.shutdown(wait=False, cancel_futures=True)
            self._parser = None

    async def scrape_all(self, session: aiohttp.ClientSession) -> None:
        """Scrape every backend concurrently; one slow or dead backend never delays the others."""
        await asyncio.gather(*(self._scrape(session, b) for b in list(self.backends.values())))

    async def _scrape(self, session: aiohttp.ClientSession, backend: Backend) -> None:
        try:
            gauges, lora = await asyncio.wait_for(self._read(session, backend), self._scrape_timeout)
        except (
            aiohttp.ClientError,
            asyncio.TimeoutError,
            MetricsFormatError,
            ScrapeError,
            UnicodeDecodeError,
        ) as exc:
            if backend.metrics_known or backend.reachable:
                logger.warning(
                    "backend %s: metrics unknown (%s: %s)", backend.url, type(exc).__name__, str(exc)[:200]
                )
            backend.forget_metrics()
            if isinstance(exc, aiohttp.ClientConnectorError):
                backend.reachable = False
            return
        backend.running = gauges.get("running")
        backend.waiting = gauges.get("waiting")
        backend.kv_usage = gauges.get("kv_usage")
        backend.lora = lora
        if lora is not None:
            backend.adapters = await self._adapters(session, backend)
        backend.metrics_known = True
        backend.reachable = True
        backend.scraped_at = time.monotonic()

    async def _adapters(self, session: aiohttp.ClientSession, backend: Backend) -> frozenset[str] | None:
        """The adapters a backend serves (its /v1/models cards with a `parent`); None when it does
        not say (an error, a timeout, an API key the router does not hold)."""

        async def read() -> list[object] | None:
            async with session.get(f"{backend.url}/v1/models", headers=self._models_headers) as response:
                if response.status != 200:
                    return None
                return list((await response.json(content_type=None)).get("data") or [])

        try:
            cards = await asyncio.wait_for(read(), self._scrape_timeout)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, AttributeError, TypeError):
            return None
        if cards is None:
            return None
        return frozenset(
            str(card["id"])
            for card in cards
            if isinstance(card, dict) and card.get("parent") and card.get("id")
        )

    async def _read(
        self, session: aiohttp.ClientSession, backend: Backend
    ) -> tuple[dict[str, float], LoraInfo | None]:
        """Download (at most `scrape_max_bytes`) and parse one backend's /metrics."""
        if backend.parsing:
            raise ScrapeError("the previous /metrics page is still being parsed")
        cap = self._scrape_max_bytes
        async with session.get(f"{backend.url}/metrics") as response:
            if response.status != 200:
                raise MetricsFormatError(f"/metrics answered {response.status}")
            if response.content_length is not None and response.content_length > cap:
                raise ScrapeError(f"/metrics is {response.content_length} bytes (--scrape-max-bytes {cap})")
            page = bytearray()
            async for chunk in response.content.iter_chunked(64 << 10):
                page += chunk
                if len(page) > cap:
                    raise ScrapeError(f"/metrics is over {cap} bytes (--scrape-max-bytes)")
        if self._parser is None:
            self._parser = ThreadPoolExecutor(2, thread_name_prefix="kvasir-router-scrape")
        backend.parsing = True
        parse = asyncio.get_running_loop().run_in_executor(self._parser, read_page, bytes(page))
        parse.add_done_callback(lambda _: setattr(backend, "parsing", False))
        # Shielded: a timeout abandons the wait, not the parse (a thread cannot be stopped), and
        # `parsing` stays set until it ends, so a page too slow to parse is never queued twice.
        return await asyncio.shield(parse)
