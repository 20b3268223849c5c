"""The operator's own Prometheus metrics and its HTTP endpoint (/metrics and the /healthz liveness)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from kvasir.observability import metric_names as m


class OperatorMetrics:
    """One registry per operator instance, so tests (and two operators in one process) never collide."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry
        deployment = ["namespace", "name"]

        def counter(declared: m.Metric, labels: list[str]) -> Counter:
            return Counter(declared.name, declared.help, labels, registry=registry)

        def gauge(declared: m.Metric, labels: list[str]) -> Gauge:
            return Gauge(declared.name, declared.help, labels, registry=registry)

        def histogram(declared: m.Metric) -> Histogram:
            return Histogram(declared.name, declared.help, buckets=declared.buckets, registry=registry)

        self.reconciles = counter(m.RECONCILES, ["trigger", "result"])
        self.errors = counter(m.RECONCILE_ERRORS, ["reason"])
        self.duration = histogram(m.RECONCILE_DURATION)
        self.writes = counter(m.CHILD_WRITES, ["kind", "action"])
        self.leader = gauge(m.LEADER, [])
        self.desired_replicas = gauge(m.DESIRED, deployment)
        self.replicas = gauge(m.REPLICAS, [*deployment, "state"])
        self.signal = gauge(m.SIGNAL, [*deployment, "signal"])
        self.target = gauge(m.TARGET, [*deployment, "signal"])
        self.decisions = counter(m.DECISIONS, [*deployment, "kind"])
        self.scrape_failures = counter(m.SCRAPE_FAILURES, deployment)
        self.tick_duration = histogram(m.TICK_DURATION)

    def forget(self, namespace: str, name: str) -> None:
        """Drop the per-LLMDeployment series of one that is gone or no longer autoscaled."""
        for metric in (self.desired_replicas, self.scrape_failures):
            with contextlib.suppress(KeyError):
                metric.remove(namespace, name)
        for labelled in (self.signal, self.target, self.decisions, self.replicas):
            for labels in [key for key in list(labelled._metrics) if key[:2] == (namespace, name)]:
                labelled.remove(*labels)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


async def start_http(
    metrics: OperatorMetrics, healthy: Callable[[], tuple[bool, str]], host: str, port: int
) -> web.AppRunner:
    """Serve /metrics and /healthz (200 while `healthy()` says so, else 503); returns the runner to stop."""

    async def healthz(_: web.Request) -> web.Response:
        ok, detail = healthy()
        return web.Response(status=200 if ok else 503, text=detail + "\n")

    async def scrape(_: web.Request) -> web.Response:
        response = web.Response(body=metrics.exposition())
        response.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return response

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", scrape)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner


def bound_port(runner: web.AppRunner) -> int:
    """The TCP port a runner listens on (useful when started with port 0)."""
    for site in runner.sites:
        server = getattr(site, "_server", None)
        if server is not None and server.sockets:
            return int(server.sockets[0].getsockname()[1])
    raise RuntimeError("the HTTP server is not listening")
