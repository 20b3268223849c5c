"""`kvasir operator`: the HTTP endpoint, leader election, and the kopf loop, started and stopped in order."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import kopf

from kvasir.operator import naming
from kvasir.operator.autoscaler.loop import Autoscaler
from kvasir.operator.autoscaler.sources import MetricsSource, PodScraper, PrometheusSource
from kvasir.operator.handlers import HandlerConfig, build_registry, default_login
from kvasir.operator.index import ParentIndex, every
from kvasir.operator.kube import KubeClient
from kvasir.operator.leader import LeaderElector, LeaseConfig
from kvasir.operator.metrics import OperatorMetrics, bound_port, start_http
from kvasir.operator.reconcile import Reconciler

logger = logging.getLogger(__name__)


class LeadershipLost(RuntimeError):
    """The lease went to another replica: this process must exit (and restart as a standby)."""


@dataclass(frozen=True)
class OperatorConfig:
    """How one operator process runs; `namespaces` empty means cluster-wide."""

    handlers: HandlerConfig = field(default_factory=lambda: HandlerConfig(login=default_login))
    namespaces: tuple[str, ...] = ()
    leader: LeaseConfig | None = None
    http_host: str = "0.0.0.0"
    http_port: int | None = 8080  # /healthz and /metrics; None disables
    request_timeout_seconds: float = 30.0
    apply_backoff_seconds: float = 0.1
    # The autoscaler: where it reads pod metrics (None: each pod's /metrics directly).
    prometheus_url: str | None = None
    scrape_timeout_seconds: float = 2.0
    metrics_port: int = naming.RUNTIME_PORT
    autoscaler_poll_seconds: float = 1.0


class OperatorState:
    """What /healthz reports: alive while waiting for the lease or while the kopf loop runs."""

    def __init__(self) -> None:
        self.phase = "starting"
        self.http_port: int | None = None  # where /healthz and /metrics listen, once they do

    def healthy(self) -> tuple[bool, str]:
        return self.phase in {"starting", "standby", "leading"}, self.phase


async def _first(*awaitables: asyncio.Future[object] | asyncio.Task[object]) -> None:
    await asyncio.wait(awaitables, return_when=asyncio.FIRST_COMPLETED)


async def run_operator(
    config: OperatorConfig,
    *,
    stop: asyncio.Event | None = None,
    ready: asyncio.Event | None = None,
    metrics: OperatorMetrics | None = None,
    state: OperatorState | None = None,
) -> None:
    """Run until `stop` is set (or SIGTERM); raises LeadershipLost if the lease is taken away."""
    stop = stop or asyncio.Event()
    metrics = metrics or OperatorMetrics()
    state = state or OperatorState()
    elector: LeaderElector | None = None
    if config.leader is not None:
        # Its own client: lease requests are never fenced, and are cut off at the renew deadline.
        agent = f"{naming.MANAGER} (leader-election; {config.leader.identity})"
        lease_client = KubeClient(config.leader.renew_deadline_seconds, user_agent=agent)
        elector = LeaderElector(lease_client, config.leader)
    # Every write of the reconciler is fenced by the lease: nothing is written once it may have passed.
    client = KubeClient(config.request_timeout_seconds, may_write=elector.may_act if elector else None)
    reconciler = Reconciler(client, metrics, apply_backoff=config.apply_backoff_seconds)
    index = ParentIndex()
    autoscaler = Autoscaler(
        client, metrics, _metrics_source(config), poll_seconds=config.autoscaler_poll_seconds
    )
    http = None
    if config.http_port is not None:
        http = await start_http(metrics, state.healthy, config.http_host, config.http_port)
        state.http_port = bound_port(http)
    tasks: list[asyncio.Task[object]] = []
    kopf_stop = asyncio.Event()
    try:
        if elector is not None:
            info = config.handlers.login(settings=kopf.OperatorSettings(), logger=logger)
            if info is None:
                raise RuntimeError("no Kubernetes credentials (neither in-cluster nor a kubeconfig)")
            await elector.client.connect(info)
            state.phase = "standby"
            acquiring = asyncio.ensure_future(elector.acquire())
            stopping = asyncio.ensure_future(stop.wait())
            await _first(acquiring, stopping)
            if not acquiring.done():
                acquiring.cancel()
                stopping.cancel()
                return
            stopping.cancel()
            metrics.leader.set(1)
            tasks.append(asyncio.ensure_future(elector.hold()))
            tasks.append(asyncio.ensure_future(_relay(elector.lost, kopf_stop)))
        tasks.append(asyncio.ensure_future(_relay(stop, kopf_stop)))
        resync = config.handlers.resync_seconds
        if resync is not None:
            # Safety net for drift whose event was missed (a child deleted during a watch gap).
            async def resync_one(namespace: str, name: str) -> object:
                return await reconciler.reconcile(namespace, name, "resync")

            tasks.append(asyncio.ensure_future(every(resync, index, resync_one, "resync")))
        tasks.append(asyncio.ensure_future(autoscaler.run(index)))
        state.phase = "leading"
        # Tasks created above exist before kopf starts, so kopf's shutdown leaves them alone.
        await kopf.operator(
            registry=build_registry(client, reconciler, config.handlers, index),
            standalone=True,  # exclusivity comes from the Lease, not from kopf's peering
            clusterwide=not config.namespaces,
            namespaces=list(config.namespaces),
            stop_flag=kopf_stop,
            ready_flag=ready,
        )
        if elector is not None and elector.lost.is_set() and not stop.is_set():
            raise LeadershipLost(f"lease {config.leader.name if config.leader else ''} lost")
    finally:
        state.phase = "stopped"
        metrics.leader.set(0)
        for task in tasks:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*tasks, return_exceptions=True)
        if elector is not None:
            await elector.release()
            await elector.client.close()
        await autoscaler.source.close()
        await client.close()
        if http is not None:
            await http.cleanup()


def _metrics_source(config: OperatorConfig) -> MetricsSource:
    if config.prometheus_url:
        return PrometheusSource(config.prometheus_url, timeout=max(config.scrape_timeout_seconds, 5.0))
    return PodScraper(timeout=config.scrape_timeout_seconds, port=config.metrics_port)


async def _relay(source: asyncio.Event, target: asyncio.Event) -> None:
    await source.wait()
    target.set()


def namespaces_from(values: Sequence[str] | None) -> tuple[str, ...]:
    """Namespaces from repeated/comma-separated CLI values; empty means cluster-wide."""
    result: list[str] = []
    for value in values or ():
        result.extend(part.strip() for part in value.split(",") if part.strip())
    return tuple(result)
