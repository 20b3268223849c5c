"""`kvasir operator`: the HTTP endpoint, leader election, and the kopf loop, started and stopped in order."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field

import kopf
from kopf._core.engines.peering import Identity  # kopf exports no public name for it

from kvasir.operator import naming
from kvasir.operator.autoscaler.loop import Autoscaler
from kvasir.operator.autoscaler.router_load import RouterScraper
from kvasir.operator.autoscaler.sources import MetricsSource, PodScraper, PrometheusSource
from kvasir.operator.children.routing import ROUTER_PORT
from kvasir.operator.crd_presence import served, wait_for_own_crd, watch_crds
from kvasir.operator.handlers import HandlerConfig, build_registry, default_login
from kvasir.operator.index import ParentIndex, every
from kvasir.operator.kube import KubeClient
from kvasir.operator.leader import LeaderElector, LeaseConfig
from kvasir.operator.metrics import OperatorMetrics, bound_port, start_http
from kvasir.operator.reconcile import Reconciler
from kvasir.operator.retries import RetryQueue
from kvasir.operator.signals import restore_signals, stop_on_signals

logger = logging.getLogger(__name__)


class LeadershipLost(RuntimeError):
    """The lease went to another replica: this process must exit (and restart as a standby)."""


class StartupError(RuntimeError):
    """What the operator was given cannot work (no credentials, a port it cannot listen on); the
    message says which, in one line, for `kvasir operator` to print."""


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
    router_metrics_port: int = ROUTER_PORT  # where scale to zero reads the router pods' /metrics
    autoscaler_poll_seconds: float = 1.0
    # How often discovery is asked whether the LLMDeployment, ServiceMonitor, InferencePool and
    # LeaderWorkerSet CRDs are served.
    discovery_seconds: float = 10.0


class OperatorState:
    """What /healthz reports: alive while waiting for the lease, while the kopf loop runs, and while
    it waits for the LLMDeployment CRD to be installed (a restart would not bring it)."""

    def __init__(self) -> None:
        self.phase = "starting"
        self.http_port: int | None = None  # where /healthz and /metrics listen, once they do

    def healthy(self) -> tuple[bool, str]:
        return self.phase in {"starting", "standby", "leading", "waiting-for-crd"}, self.phase


async def _first(*awaitables: asyncio.Future[object] | asyncio.Task[object]) -> None:
    await asyncio.wait(awaitables, return_when=asyncio.FIRST_COMPLETED)


async def run_operator(
    config: OperatorConfig,
    *,
    stop: asyncio.Event | None = None,
    ready: asyncio.Event | None = None,
    metrics: OperatorMetrics | None = None,
    state: OperatorState | None = None,
    handle_signals: bool = False,
) -> None:
    """Run until `stop` is set; raises LeadershipLost if the lease is taken away. With
    `handle_signals` (the CLI, on the main thread), SIGTERM and SIGINT set `stop` in every phase."""
    stop = stop or asyncio.Event()
    if handle_signals:
        stop_on_signals(stop)
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
        client,
        metrics,
        _metrics_source(config),
        poll_seconds=config.autoscaler_poll_seconds,
        routers=RouterScraper(timeout=config.scrape_timeout_seconds, port=config.router_metrics_port),
    )
    http = None
    if config.http_port is not None:
        try:
            http = await start_http(metrics, state.healthy, config.http_host, config.http_port)
        except OSError as exc:
            where = f"{config.http_host}:{config.http_port}"
            raise StartupError(
                f"cannot serve /healthz and /metrics on {where}: {exc.strerror or exc}"
            ) from exc
        state.http_port = bound_port(http)
    tasks: list[asyncio.Task[object]] = []
    try:
        try:
            info = config.handlers.login(settings=kopf.OperatorSettings(), logger=logger)
        except Exception as exc:  # kopf's parsers raise whatever a bad kubeconfig makes them raise
            detail = f"{exc.filename}: {exc.strerror}" if isinstance(exc, OSError) else f"{exc!r}"
            raise StartupError(f"cannot log in to Kubernetes: {detail}") from exc
        if info is None:
            raise StartupError("no Kubernetes credentials (neither in-cluster nor a kubeconfig)")
        await client.connect(info)
        if elector is not None:
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
        resync = config.handlers.resync_seconds
        if resync is not None:
            # Safety net for drift whose event was missed (a child deleted during a watch gap).
            async def resync_one(namespace: str, name: str) -> object:
                return await reconciler.reconcile(namespace, name, "resync")

            tasks.append(asyncio.ensure_future(every(resync, index, resync_one, "resync")))
        tasks.append(asyncio.ensure_future(autoscaler.run(index)))
        state.phase = "leading"

        def waiting() -> None:
            state.phase = "waiting-for-crd"

        while await wait_for_own_crd(client, stop, config.discovery_seconds, waiting):
            state.phase = "leading"
            crd_gone = await _run_kopf(
                config, client, reconciler, index, stop, elector, ready, handle_signals
            )
            if handle_signals:
                stop_on_signals(stop)  # kopf's own handlers outlive its loop
            if stop.is_set():
                return
            if elector is not None and elector.lost.is_set():
                raise LeadershipLost(f"lease {config.leader.name if config.leader else ''} lost")
            if not crd_gone:
                raise RuntimeError("the kopf loop stopped by itself")
            index.clear()  # the CRD went away with every LLMDeployment; kopf lists them anew
    finally:
        if handle_signals:
            restore_signals()
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
        await autoscaler.routers.close()
        await client.close()
        if http is not None:
            await http.cleanup()


async def _run_kopf(
    config: OperatorConfig,
    client: KubeClient,
    reconciler: Reconciler,
    index: ParentIndex,
    stop: asyncio.Event,
    elector: LeaderElector | None,
    ready: asyncio.Event | None,
    handle_signals: bool,
) -> bool:
    """One run of the kopf loop, until `stop`, a lost lease, or the LLMDeployment CRD going away
    (then it returns True, and the caller waits for the CRD to come back)."""
    kopf_stop, crd_gone, kopf_ready = asyncio.Event(), asyncio.Event(), asyncio.Event()
    retries = RetryQueue(config.handlers.retry_base_seconds, config.handlers.retry_max_seconds)
    now = await served(client)
    reconciler.monitoring, reconciler.inference_pools = now.service_monitors, now.inference_pools
    reconciler.leader_worker_sets = now.leader_worker_sets

    async def monitoring_changed(available: bool) -> None:
        reconciler.monitoring = available
        for namespace, name in index.snapshot():
            await reconciler.reconcile(namespace, name, "crd")

    async def inference_pools_changed(available: bool) -> None:
        reconciler.inference_pools = available
        for namespace, name in index.snapshot():
            await reconciler.reconcile(namespace, name, "crd")

    async def leader_worker_sets_changed(available: bool) -> None:
        reconciler.leader_worker_sets = available
        for namespace, name in index.snapshot():
            await reconciler.reconcile(namespace, name, "crd")

    watcher = watch_crds(
        client,
        config.discovery_seconds,
        own_crd_gone=crd_gone,
        monitoring_changed=monitoring_changed,
        monitoring=reconciler.monitoring,
        inference_pools_changed=inference_pools_changed,
        inference_pools=reconciler.inference_pools,
        leader_worker_sets_changed=leader_worker_sets_changed,
        leader_worker_sets=reconciler.leader_worker_sets,
    )
    # Created before kopf starts, so kopf's shutdown leaves them alone (it cancels later tasks).
    round_tasks = [asyncio.ensure_future(watcher)]
    for source in (stop, crd_gone, *([elector.lost] if elector is not None else [])):
        round_tasks.append(asyncio.ensure_future(_relay(source, kopf_stop)))
    round_tasks.append(asyncio.ensure_future(_on_kopf_ready(kopf_ready, stop, ready, handle_signals)))
    try:
        await kopf.operator(
            registry=build_registry(client, reconciler, config.handlers, index, retries),
            standalone=True,  # exclusivity comes from the Lease, not from kopf's peering
            clusterwide=not config.namespaces,
            namespaces=list(config.namespaces),
            stop_flag=kopf_stop,
            ready_flag=kopf_ready,
            # kopf would otherwise derive its identity from getpass.getuser(), which raises KeyError
            # for a uid without a passwd entry: the chart's image runs as 65532, which has none.
            identity=Identity(
                config.leader.identity if config.leader else f"{naming.MANAGER}@{socket.gethostname()}"
            ),
        )
    except Exception as exc:
        # kopf fails when a watched resource answers 404: the CRD was deleted under it.
        if stop.is_set() or await client.has_resource(naming.GROUP, naming.VERSION, naming.PLURAL):
            raise
        logger.warning("the kopf loop stopped because the LLMDeployment CRD was removed: %s", exc)
        return True
    finally:
        for task in round_tasks:
            task.cancel()
        await asyncio.gather(*round_tasks, return_exceptions=True)
        await retries.close()
    return crd_gone.is_set()


def _metrics_source(config: OperatorConfig) -> MetricsSource:
    if config.prometheus_url:
        return PrometheusSource(config.prometheus_url, timeout=max(config.scrape_timeout_seconds, 5.0))
    return PodScraper(timeout=config.scrape_timeout_seconds, port=config.metrics_port)


async def _on_kopf_ready(
    kopf_ready: asyncio.Event, stop: asyncio.Event, ready: asyncio.Event | None, handle_signals: bool
) -> None:
    """Once kopf is ready (its signal handlers are installed before that), take SIGTERM and SIGINT
    back, so that a signal stops kopf through `stop` and the runner knows why it stopped."""
    await kopf_ready.wait()
    if handle_signals:
        stop_on_signals(stop)
    if ready is not None:
        ready.set()


async def _relay(source: asyncio.Event, target: asyncio.Event) -> None:
    await source.wait()
    target.set()


def namespaces_from(values: Sequence[str] | None) -> tuple[str, ...]:
    """Namespaces from repeated/comma-separated CLI values; empty means cluster-wide."""
    result: list[str] = []
    for value in values or ():
        result.extend(part.strip() for part in value.split(",") if part.strip())
    return tuple(result)
