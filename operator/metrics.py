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


class OperatorMetrics:
    """One registry per operator instance, so tests (and two operators in one process) never collide."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.reconciles = Counter(
            "kvasir_operator_reconciles_total",
            "Reconciles of an LLMDeployment, by trigger and result.",
            ["trigger", "result"],
            registry=self.registry,
        )
        self.errors = Counter(
            "kvasir_operator_reconcile_errors_total",
            "Failed reconciles, by reason.",
            ["reason"],
            registry=self.registry,
        )
        self.duration = Histogram(
            "kvasir_operator_reconcile_duration_seconds",
            "Wall time of one reconcile.",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=self.registry,
        )
        self.writes = Counter(
            "kvasir_operator_child_writes_total",
            "Children created or patched, by kind and action.",
            ["kind", "action"],
            registry=self.registry,
        )
        self.leader = Gauge(
            "kvasir_operator_leader", "1 while this replica holds the leader lease.", registry=self.registry
        )
        deployment = ["namespace", "name"]
        self.desired_replicas = Gauge(
            "kvasir_operator_autoscaler_desired_replicas",
            "The replica count the autoscaler asks for, per LLMDeployment.",
            deployment,
            registry=self.registry,
        )
        self.replicas = Gauge(
            "kvasir_operator_autoscaler_replicas",
            "The pods of each autoscaled LLMDeployment by state (current: spec.replicas; ready; "
            "starting: created, not ready, within the learned time-to-ready; stuck: long past it).",
            [*deployment, "state"],
            registry=self.registry,
        )
        self.signal = Gauge(
            "kvasir_operator_autoscaler_signal",
            "The autoscaler's signals of the last decision (kv_cache_usage, queue_per_replica, itl_ratio, ...).",
            [*deployment, "signal"],
            registry=self.registry,
        )
        self.target = Gauge(
            "kvasir_operator_autoscaler_target",
            "The autoscaler's targets, to plot next to the signals.",
            [*deployment, "signal"],
            registry=self.registry,
        )
        self.decisions = Counter(
            "kvasir_operator_autoscaler_decisions",
            "Autoscaler decisions by kind (scale_up, scale_down, hold, stabilizing, blocked, no_metrics).",
            [*deployment, "kind"],
            registry=self.registry,
        )
        self.scrape_failures = Counter(
            "kvasir_operator_autoscaler_scrape_failures",
            "Pod metrics the autoscaler could not read (timeouts, errors, bad expositions).",
            deployment,
            registry=self.registry,
        )
        self.tick_duration = Histogram(
            "kvasir_operator_autoscaler_tick_duration_seconds",
            "Wall time of one autoscaler tick of one LLMDeployment (pods, scrapes, decision, writes).",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30),
            registry=self.registry,
        )

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
