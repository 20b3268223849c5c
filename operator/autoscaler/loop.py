"""The autoscaler in the operator: one loop for every autoscaled LLMDeployment, each on its own
`windows.intervalSeconds` tick. A tick reads the pods, scrapes the ready ones, updates the
metrics window, calls decide(), and acts: the scale subresource (the operator is the only writer
of replicas while `spec.autoscaling` is set), pod-deletion-cost before a scale-down, an Event on
every change, `.status.autoscaling` when something changed meaningfully, and the operator's
metrics. Deployments tick concurrently; one slow deployment or pod never holds up another."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from kvasir.operator import naming
from kvasir.operator.api.source import SpecError
from kvasir.operator.api.spec import parse_spec
from kvasir.operator.autoscaler.decide import Decision, History, ReplicaState, decide
from kvasir.operator.autoscaler.idle import IdleClock, Idleness, reading
from kvasir.operator.autoscaler.pods import (
    DELETION_COST,
    PodView,
    StartupTimes,
    deletion_costs,
    pod_view,
    replica_state,
)
from kvasir.operator.autoscaler.policy import Policy, Slo
from kvasir.operator.autoscaler.router_load import RouterScraper
from kvasir.operator.autoscaler.signals import MetricsWindow, Scrape, Signals
from kvasir.operator.autoscaler.sources import MetricsSource
from kvasir.operator.children.routing import router_selector
from kvasir.operator.events import EventRecorder
from kvasir.operator.index import ParentIndex
from kvasir.operator.kube import MERGE_PATCH, ApiError, KubeClient, resource_path
from kvasir.operator.metrics import OperatorMetrics

logger = logging.getLogger(__name__)


def rfc3339(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _rounded(value: float | None, step: float) -> float | None:
    return None if value is None else round(round(value / step) * step, 6)


def signals_status(signals: Signals | None, slo: Slo | None = None) -> dict[str, Any]:
    """`status.autoscaling.signals`, rounded so that noise alone never changes it; with an SLO,
    the observed percentiles it is judged on."""
    if signals is None:
        return {}
    slo_values = {}
    if slo is not None:
        slo_values = {
            "ttftPercentileSeconds": _rounded(signals.ttft_quantile(slo.attainment), 0.01),
            "timePerTokenPercentileSeconds": _rounded(signals.tpot_quantile(slo.attainment), 0.001),
        }
    values = {
        "readyReplicas": signals.ready_replicas,
        "reportingReplicas": signals.reporting_replicas,
        "kvCacheUsage": _rounded(signals.kv_usage_mean, 0.01),
        "kvCacheUsageMax": _rounded(signals.kv_usage_max, 0.01),
        "queuePerReplica": _rounded(signals.queue_per_replica, 0.5),
        "preemptionsPerSecond": _rounded(signals.preemption_rate, 0.1),
        "outputTokensPerSecond": _rounded(signals.generation_tokens_rate, 10.0),
        "itlRatio": _rounded(signals.itl_ratio, 0.5),
        "ttftRatio": _rounded(signals.ttft_ratio, 0.5),
        **slo_values,
    }
    # Unknown values are written as null: a merge patch keeps what it omits, so a stale value
    # would otherwise stay in the status after its signal went away.
    return values


def autoscaling_status(
    decision: Decision,
    signals: Signals | None,
    time_to_ready: float | None,
    last_scale: float | None,
    slo: Slo | None = None,
) -> dict[str, Any]:
    """The status fields the autoscaler owns, for one decision."""
    status: dict[str, Any] = {
        "desiredReplicas": decision.replicas,
        "recommendation": decision.recommendation,
        "kind": decision.kind,
        "reason": decision.reason,
        "panic": decision.panic,
        "signals": signals_status(signals, slo),
        "lastDecisions": [
            {"time": rfc3339(d.time), "from": d.replicas_from, "to": d.replicas_to, "reason": d.reason}
            for d in decision.history.decisions[-5:]
        ],
    }
    if last_scale is not None:
        status["lastScaleTime"] = rfc3339(last_scale)
    if time_to_ready is not None:
        status["timeToReadySeconds"] = round(time_to_ready, 1)
    if signals is not None and signals.time_to_ready is not None:
        status["serverTimeToReadySeconds"] = round(signals.time_to_ready, 1)
    top: dict[str, Any] = {"autoscaling": status}
    if signals is not None and signals.kv_usage_mean is not None:
        top["kvCacheUsagePercent"] = round(100 * signals.kv_usage_mean)
    if signals is not None and signals.waiting is not None:
        top["queueDepth"] = round(signals.waiting)
    if decision.replicas == 0 and signals is None:
        # Scaled to zero: no cache and no queue to show (null clears the printer columns).
        top["kvCacheUsagePercent"] = top["queueDepth"] = None
    return top


def cold_start(pod_seconds: float | None, signals: Signals | None) -> float | None:
    """The start-up time to plan on: the larger of pod creation to Ready (measured on the pods;
    it includes scheduling and the image pull) and what the servers report from their own start
    (weights, warm-up, CUDA graphs; known from the first scrape, and after restarts in place)."""
    server = None if signals is None else signals.time_to_ready
    known = [t for t in (pod_seconds, server) if t is not None]
    return max(known) if known else None


def _without_reason(status: Mapping[str, Any]) -> dict[str, Any]:
    """What decides whether a status write is worth it: the reason's numbers change every tick."""
    inner = {k: v for k, v in (status.get("autoscaling") or {}).items() if k != "reason"}
    return {**status, "autoscaling": inner}


@dataclass
class _Tracked:
    """What the autoscaler keeps per LLMDeployment between ticks."""

    window: MetricsWindow
    startup: StartupTimes = field(default_factory=StartupTimes)
    history: History | None = None
    next_tick: float = 0.0
    written: dict[str, Any] | None = None
    idle: IdleClock | None = None  # minReplicas 0 only


class Autoscaler:
    """Ticks every autoscaled LLMDeployment of the index; `tick` is one decision for one."""

    def __init__(
        self,
        client: KubeClient,
        metrics: OperatorMetrics,
        source: MetricsSource,
        *,
        clock: Callable[[], float] = time.time,
        poll_seconds: float = 1.0,
        tick_timeout_seconds: float = 30.0,
        routers: RouterScraper | None = None,
    ) -> None:
        self.client = client
        self.events = EventRecorder(client, f"{naming.MANAGER}/autoscaler")
        self.metrics = metrics
        self.source = source
        self.clock = clock
        self.poll_seconds = poll_seconds
        self.tick_timeout_seconds = tick_timeout_seconds
        self.routers = routers or RouterScraper()
        self._tracked: dict[tuple[str, str], _Tracked] = {}

    async def run(self, index: ParentIndex) -> None:
        """Forever: every `poll_seconds`, tick the deployments that are due, concurrently."""
        while True:
            await asyncio.sleep(self.poll_seconds)
            keys = index.snapshot(autoscaled_only=True)
            for gone in set(self._tracked) - set(keys):
                self._forget(*gone)
            now = self.clock()
            due = [key for key in keys if key not in self._tracked or self._tracked[key].next_tick <= now]
            await asyncio.gather(*(self._tick_safely(namespace, name) for namespace, name in due))

    async def _tick_safely(self, namespace: str, name: str) -> None:
        try:
            await asyncio.wait_for(self.tick(namespace, name), self.tick_timeout_seconds)
        except asyncio.TimeoutError:
            logger.warning(
                "autoscaler: the tick of %s/%s took longer than %.0fs",
                namespace,
                name,
                self.tick_timeout_seconds,
            )
        except ApiError as exc:
            logger.warning("autoscaler: %s/%s: %s", namespace, name, exc)
        except Exception:
            logger.exception("autoscaler: the tick of %s/%s failed", namespace, name)

    def _forget(self, namespace: str, name: str) -> None:
        self._tracked.pop((namespace, name), None)
        self.metrics.forget(namespace, name)

    async def tick(self, namespace: str, name: str) -> Decision | None:
        """One decision for one LLMDeployment; None when it is gone, deleting or not autoscaled."""
        with self.metrics.tick_duration.time():
            path = resource_path(naming.GROUP, naming.VERSION, naming.PLURAL, namespace, name)
            parent = await self.client.get(path)
            if parent is None or (parent.get("metadata") or {}).get("deletionTimestamp"):
                self._forget(namespace, name)
                return None
            try:
                spec = parse_spec(parent.get("spec") or {})
            except SpecError:
                return None  # the reconciler reports it
            if spec.autoscaling is None:
                self._forget(namespace, name)
                return None
            now = self.clock()
            tracked = self._tracked.get((namespace, name))
            if tracked is None:
                tracked = self._tracked[(namespace, name)] = _Tracked(
                    MetricsWindow(spec.autoscaling.metrics_window_seconds)
                )
            tracked.window.seconds = spec.autoscaling.metrics_window_seconds
            tracked.next_tick = now + spec.autoscaling.interval_seconds
            pods = await self._pods(namespace, name)
            tracked.startup.observe(pods)
            ready = [pod for pod in pods if pod.ready]
            scraped = await self.source.collect(namespace, name, ready)
            failures = len(ready) - len(scraped)
            if failures:
                self.metrics.scrape_failures.labels(namespace=namespace, name=name).inc(failures)
            tracked.window.add(Scrape(now, scraped))
            signals = tracked.window.signals([pod.name for pod in ready]) if ready else None
            current = spec.replicas
            if tracked.history is None:
                tracked.history = History.starting_at(now, current)
            time_to_ready = cold_start(tracked.startup.median, signals)
            state = replica_state(current, pods, now, time_to_ready, spec.runtime.max_num_seqs)
            policy = spec.autoscaling
            idle = None
            if policy.min_replicas == 0:
                idle = await self._idleness(namespace, name, tracked, now, current, ready, scraped)
            decision = decide(now, signals, tracked.history, policy, state, idle)
            tracked.history = decision.history
            await self._act(parent, decision, pods, scraped, current)
            self._record(namespace, name, decision, signals, policy, state)
            await self._write_status(parent, tracked, decision, signals, policy, time_to_ready)
            return decision

    async def _pods(self, namespace: str, name: str) -> list[PodView]:
        # A multi-node group is one replica: its leader is scraped and counted, its workers not.
        views = await self._list_pods(namespace, naming.selector_labels(name))
        return [view for view in views if view.serves]

    async def _list_pods(self, namespace: str, labels: Mapping[str, str]) -> list[PodView]:
        selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
        found = await self.client.request(
            "GET", resource_path("", "v1", "pods", namespace), params={"labelSelector": selector}
        )
        return [pod_view(pod) for pod in found.get("items") or []]

    async def _idleness(
        self,
        namespace: str,
        name: str,
        tracked: _Tracked,
        now: float,
        current: int,
        ready: list[PodView],
        scraped: Mapping[str, Any],
    ) -> Idleness:
        """Scale to zero: requests at the router pods and at the model pods, into the idle clock."""
        routers = [pod for pod in await self._list_pods(namespace, router_selector(name)) if pod.ready]
        loads = await self.routers.collect(routers)
        read = reading(scraped, [pod.name for pod in ready], loads, [pod.name for pod in routers])
        if tracked.idle is None:
            tracked.idle = IdleClock.starting_at(now, current)
        tracked.idle = tracked.idle.observe(now, read, current)
        return Idleness(tracked.idle.idle_seconds(now), read.held)

    async def _act(
        self,
        parent: Mapping[str, Any],
        decision: Decision,
        pods: list[PodView],
        scraped: Mapping[str, Any],
        current: int,
    ) -> None:
        if decision.replicas == current:
            return
        meta = parent["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        if decision.replicas < current:
            await self._set_deletion_costs(namespace, pods, scraped)
        scale = resource_path(naming.GROUP, naming.VERSION, naming.PLURAL, namespace, name, "scale")
        body: dict[str, Any] = {"spec": {"replicas": decision.replicas}}
        if decision.replicas == 0 and meta.get("resourceVersion"):
            # One write, on the object this tick read: the router's activation (0 -> 1), or any
            # other change since, makes it a 409 and the replica stays (the next tick decides again).
            body["metadata"] = {"resourceVersion": meta.get("resourceVersion")}
        try:
            await self.client.request("PATCH", scale, body, content_type=MERGE_PATCH)
        except ApiError as exc:
            if exc.status != 409:
                raise
            logger.info("autoscaler: %s/%s changed since it was read: not scaled to zero", namespace, name)
            return
        verb = "ScaledUp" if decision.replicas > current else "ScaledDown"
        message = f"{current} -> {decision.replicas} replicas: {decision.reason}"
        logger.info("autoscaler: %s/%s %s", namespace, name, message)
        await self.events.normal(parent, verb, message)

    async def _set_deletion_costs(
        self, namespace: str, pods: list[PodView], scraped: Mapping[str, Any]
    ) -> None:
        """Before a scale-down: the ReplicaSet removes the pod with the lowest cost first."""

        async def annotate(pod: str, cost: int) -> None:
            body = {"metadata": {"annotations": {DELETION_COST: str(cost)}}}
            try:
                await self.client.merge_patch(resource_path("", "v1", "pods", namespace, pod), body)
            except ApiError as exc:
                logger.warning("autoscaler: pod-deletion-cost of %s/%s not set: %s", namespace, pod, exc)

        costs = deletion_costs(pods, scraped)
        await asyncio.gather(*(annotate(pod, cost) for pod, cost in costs.items()))

    def _record(
        self,
        namespace: str,
        name: str,
        decision: Decision,
        signals: Signals | None,
        policy: Policy,
        state: ReplicaState,
    ) -> None:
        labels = {"namespace": namespace, "name": name}
        self.metrics.desired_replicas.labels(**labels).set(decision.replicas)
        self.metrics.scrape_failures.labels(
            **labels
        )  # a series at 0, so a dashboard shows "none", not "no data"
        for key in ("current", "ready", "starting", "stuck"):
            self.metrics.replicas.labels(**labels, state=key).set(getattr(state, key))
        self.metrics.decisions.labels(**labels, kind=decision.kind).inc()
        targets = {
            "kv_cache_usage": policy.target_kv_cache_usage,
            "queue_per_replica": policy.target_queue_per_replica,
        }
        if policy.target_latency_ratio is not None:
            targets["latency_ratio"] = policy.target_latency_ratio
        if policy.target_itl_seconds is not None:
            targets["itl_mean_seconds"] = policy.target_itl_seconds
        slo = policy.slo
        if slo is not None and slo.ttft_seconds is not None:
            targets["ttft_slo_percentile_seconds"] = slo.ttft_seconds
        if slo is not None and slo.itl_seconds is not None:
            targets["tpot_slo_percentile_seconds"] = slo.itl_seconds
        for signal, target in targets.items():
            self.metrics.target.labels(**labels, signal=signal).set(target)
        if signals is None:
            return
        values = {
            "kv_cache_usage": signals.kv_usage_mean,
            "kv_cache_usage_max": signals.kv_usage_max,
            "queue_per_replica": signals.queue_per_replica,
            "latency_ratio": signals.latency_ratio,
            "itl_ratio": signals.itl_ratio,
            "itl_mean_seconds": signals.itl_mean,
            "ttft_ratio": signals.ttft_ratio,
            "preemptions_per_second": signals.preemption_rate,
            "output_tokens_per_second": signals.generation_tokens_rate,
            "ttft_slo_percentile_seconds": None if slo is None else signals.ttft_quantile(slo.attainment),
            "tpot_slo_percentile_seconds": None if slo is None else signals.tpot_quantile(slo.attainment),
            "time_to_ready_seconds": state.time_to_ready_seconds,
            "reporting_replicas": float(signals.reporting_replicas),
            "ready_replicas": float(signals.ready_replicas),
        }
        for signal, value in values.items():
            if value is not None:
                self.metrics.signal.labels(**labels, signal=signal).set(value)

    async def _write_status(
        self,
        parent: Mapping[str, Any],
        tracked: _Tracked,
        decision: Decision,
        signals: Signals | None,
        policy: Policy,
        time_to_ready: float | None,
    ) -> None:
        """Merge-patch the autoscaler's status fields, only when they changed meaningfully."""
        history = decision.history
        last = max(
            (t for t in (history.last_scale_up, history.last_scale_down) if t is not None), default=None
        )
        wanted = autoscaling_status(decision, signals, time_to_ready, last, policy.slo)
        if tracked.written is None:
            current = parent.get("status") or {}
            tracked.written = {key: current.get(key) for key in wanted}
        if _without_reason(wanted) == _without_reason(tracked.written):
            return
        meta = parent["metadata"]
        path = resource_path(
            naming.GROUP, naming.VERSION, naming.PLURAL, meta["namespace"], meta["name"], "status"
        )
        await self.client.merge_patch(path, {"status": wanted})
        tracked.written = wanted
