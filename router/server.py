"""Running the router: the ASGI app with its lifespan (HTTP client, discovery and scrape loops)
on uvicorn, drained on SIGTERM like `kvasir serve`."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from contextlib import suppress
from typing import Any

import aiohttp
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvasir.router.activator import LISTING_POLL, STATIC_POLL, Activator
from kvasir.router.backends import BackendPool
from kvasir.router.config import RouterConfig
from kvasir.router.discovery import Discovery, KubernetesPods, StaticBackends
from kvasir.router.hold import HoldQueue, dispatch_trace
from kvasir.router.lifecycle import RouterLifecycle
from kvasir.router.metrics import RouterMetrics
from kvasir.router.prefix import PrefixIndex
from kvasir.router.proxy import Receive, Router, Scope, Send, client_eof
from kvasir.router.scale import ScaleFromZero
from kvasir.router.scorer import Weights
from kvasir.runtime.server.draining import DrainingServer
from kvasir.runtime.server.http_protocol import kvasir_protocol, uvicorn_http_settings

logger = logging.getLogger(__name__)

_GRACEFUL_SHUTDOWN_SECONDS = 5
_REQUEST_READ_TIMEOUT = 30.0
_KEEP_ALIVE_TIMEOUT = 5.0

DiscoveryFactory = Callable[[aiohttp.ClientSession], Discovery]


class RouterApp:
    """The router as an ASGI app; its lifespan starts and stops the background loops."""

    def __init__(self, config: RouterConfig, discovery: DiscoveryFactory | None = None) -> None:
        self.config = config
        self.pool = BackendPool(
            config.scrape_timeout,
            config.scrape_max_bytes,
            config.backend_api_key,
            probe_ready=config.backends is not None,
        )
        self.metrics = RouterMetrics(self.pool)
        self.hold = (
            HoldQueue(config.max_held_requests, config.hold_timeout, self.metrics)
            if config.max_held_requests > 0
            else None
        )
        self.lifecycle = RouterLifecycle(on_drain=self.hold.drain if self.hold is not None else None)
        self.router = Router(
            self.pool,
            PrefixIndex(config.prefix_cache_blocks),
            self.metrics,
            self.lifecycle,
            Weights(
                prefix=config.prefix_weight,
                queue=config.queue_weight,
                kv=config.kv_weight,
                lora=config.lora_weight,
                balance_ratio=config.balance_ratio,
                balance_slack=config.balance_slack,
            ),
            block_chars=config.prefix_block_chars,
            max_attempts=config.max_attempts,
            connect_timeout=config.connect_timeout,
            first_byte_timeout=config.first_byte_timeout,
            api_key=config.api_key,
            max_body_bytes=config.max_request_bytes,
            max_buffered_bytes=config.max_buffered_request_bytes,
            aliases=config.lora_aliases or {},
            hold=self.hold,
            heartbeat_interval=config.heartbeat_interval,
        )
        self._discovery_factory = discovery or self._default_discovery
        self._tasks: list[asyncio.Task[None]] = []
        self.loop: asyncio.AbstractEventLoop | None = None  # the serving loop, once started

    def _default_discovery(self, session: aiohttp.ClientSession) -> Discovery:
        if self.config.backends is not None:
            return StaticBackends(self.config.backends)
        assert self.config.deployment is not None  # RouterConfig checks exactly one is set
        return KubernetesPods(
            session, self.config.deployment, self.config.namespace, self.config.backend_port
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        else:
            await self.router(scope, receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        await receive()  # lifespan.startup
        try:
            await self.start()
        except Exception as exc:
            await send({"type": "lifespan.startup.failed", "message": str(exc)})
            return
        await send({"type": "lifespan.startup.complete"})
        await receive()  # lifespan.shutdown
        await self.stop()
        await send({"type": "lifespan.shutdown.complete"})

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        # No limit on connections per backend: the backends' own queues (429) bound the load.
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=30)
        session = aiohttp.ClientSession(
            connector=connector, auto_decompress=False, trace_configs=[dispatch_trace()]
        )
        self.router.session = session
        discovery = self._discovery_factory(session)
        found = await discovery.backends()
        if found is not None:
            self.pool.update(found)
        await self._scrape_round(session)
        self._tasks = [
            asyncio.create_task(self._discover(discovery)),
            asyncio.create_task(self._scrape(session)),
        ]
        if self.hold is not None:
            self._tasks.append(asyncio.create_task(self._activator(session, discovery).run()))

    def _activator(self, session: aiohttp.ClientSession, discovery: Discovery) -> Activator:
        """The hold queue's loop: probes static backends' /ready, or lists the deployment's pods
        (and asks for a replica through its scale)."""
        assert self.hold is not None
        if isinstance(discovery, KubernetesPods) and self.config.deployment is not None:
            scale = ScaleFromZero(session, discovery.api, self.config.deployment)

            async def listing() -> None:
                await self._list(discovery)

            return Activator(
                self.hold, self.pool, listing, self.metrics, poll_interval=LISTING_POLL, scale=scale
            )

        async def probe() -> None:
            await self.pool.probe_ready_all(session)

        poll = LISTING_POLL if not isinstance(discovery, StaticBackends) else STATIC_POLL
        refresh = probe if self.pool.probe_ready else lambda: self._list(discovery)
        return Activator(self.hold, self.pool, refresh, self.metrics, poll_interval=poll)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with suppress(asyncio.CancelledError):
                await task
        if self.router.session is not None:
            await self.router.session.close()
        self.router.close()
        self.pool.close()

    async def _discover(self, discovery: Discovery) -> None:
        if isinstance(discovery, StaticBackends):
            return
        while True:
            await asyncio.sleep(self.config.discovery_interval)
            await self._list(discovery)

    async def _list(self, discovery: Discovery) -> None:
        found = await discovery.backends()
        if found is not None:
            for url in self.pool.update(found)[1]:
                self.router.prefix.forget(url)

    async def _scrape(self, session: aiohttp.ClientSession) -> None:
        while True:
            await asyncio.sleep(self.config.scrape_interval)
            try:
                await self._scrape_round(session)
            except Exception:  # a bug in one round must not stop the loop that keeps routing sane
                logger.exception("scrape round failed")

    async def _scrape_round(self, session: aiohttp.ClientSession) -> None:
        """Every backend's /metrics, and the static backends' /ready, at once."""
        probes = [self.pool.probe_ready_all(session)] if self.pool.probe_ready else []
        await asyncio.gather(self.pool.scrape_all(session), *probes)


def http_settings() -> dict[str, Any]:
    """The uvicorn.Config keyword arguments of the router's HTTP/1.1: `kvasir serve`'s protocol (a
    request read deadline, the header cap, ambiguous framing refused and the connection closed),
    which also tells a held request when its client closed its sending side (`client_eof`)."""
    return {**uvicorn_http_settings(_REQUEST_READ_TIMEOUT, _KEEP_ALIVE_TIMEOUT), "http": _ROUTER_PROTOCOL}


def _router_protocol(read_timeout: float) -> type[H11Protocol]:
    base = kvasir_protocol(read_timeout)

    class RouterH11Protocol(base):  # type: ignore[valid-type,misc]
        def eof_received(self) -> bool | None:
            keep: bool | None = super().eof_received()
            if keep and self.cycle is not None:  # a complete request whose answer is still to come
                client_eof(self.cycle.scope).set()
            return keep

    return RouterH11Protocol


_ROUTER_PROTOCOL = _router_protocol(_REQUEST_READ_TIMEOUT)


def run_router(config: RouterConfig, *, discovery: DiscoveryFactory | None = None) -> int:
    """Serve until drained after SIGTERM/SIGINT; returns the exit code."""
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    app = RouterApp(config, discovery)
    uvicorn_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_config=None,
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=_GRACEFUL_SHUTDOWN_SECONDS,
        **http_settings(),
    )
    server = DrainingServer(uvicorn_config, app.lifecycle, config.drain_timeout)
    server.run()
    return 0
