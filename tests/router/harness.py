"""A real `kvasir router` app on uvicorn in front of stub backends, for the router's tests."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

from kvasir.router.config import RouterConfig
from kvasir.router.server import RouterApp
from tests.router.stub_backend import Served, StubBackend, serve_app


@dataclass
class Fleet:
    router: RouterApp
    url: str
    stubs: list[StubBackend]
    backends: list[Served]

    def by_url(self, url: str) -> StubBackend:
        return self.stubs[[b.url for b in self.backends].index(url)]


@contextmanager
def fleet(stubs: Sequence[StubBackend], **config: Any) -> Iterator[Fleet]:
    """The stubs on their own servers, and a router over them (scraping every 50 ms)."""
    with ExitStack() as stack:
        served = [stack.enter_context(serve_app(stub)) for stub in stubs]
        settings: dict[str, Any] = {
            "backends": tuple(s.url for s in served),
            "scrape_interval": 0.05,
            "scrape_timeout": 0.2,
            **config,
        }
        app = RouterApp(RouterConfig(**settings))
        router = stack.enter_context(serve_app(app, lifespan="on", kill=False))
        yield Fleet(app, router.url, list(stubs), served)
