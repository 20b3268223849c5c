"""A real `kvasir router` app on uvicorn in front of stub backends, for the router's tests."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

from kvasir.router.config import RouterConfig
from kvasir.router.server import RouterApp, http_settings
from tests.router.stub_backend import Served, StubBackend, serve_app


@dataclass
class Fleet:
    router: RouterApp
    url: str
    stubs: list[StubBackend]
    backends: list[Served]

    def by_url(self, url: str) -> StubBackend:
        return self.stubs[[b.url for b in self.backends].index(url)]

    def label(self, index: int) -> str:
        """How the router's /metrics names backend `index` (of those given to `fleet`)."""
        return self.router.pool.label(self.backends[index].url)


@contextmanager
def fleet(stubs: Sequence[StubBackend], *, protocol: bool = False, **config: Any) -> Iterator[Fleet]:
    """The stubs on their own servers, and a router over them (scraping every 50 ms). `protocol`:
    served with `kvasir router`'s own HTTP/1.1 protocol (its framing and header rules; a client that
    closes its socket is then noticed at the next write to it, as a half-closed one), else with
    uvicorn's (a closed client is a disconnect at once)."""
    with ExitStack() as stack:
        served = [stack.enter_context(serve_app(stub)) for stub in stubs]
        settings: dict[str, Any] = {
            "backends": tuple(s.url for s in served),
            "scrape_interval": 0.05,
            "scrape_timeout": 1.0,  # a loaded test machine must not make a backend look unknown
            **config,
        }
        app = RouterApp(RouterConfig(**settings))
        router = stack.enter_context(
            serve_app(app, lifespan="on", kill=False, **(http_settings() if protocol else {}))
        )
        yield Fleet(app, router.url, list(stubs), served)
