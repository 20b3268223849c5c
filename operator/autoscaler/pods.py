"""The deployment's pods as the autoscaler sees them: ready or starting, how long a pod takes to
become ready (learned from the pods' own history), and which pod a scale-down should remove."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from kvasir.operator import naming
from kvasir.operator.autoscaler.decide import DEFAULT_TIME_TO_READY, ReplicaState
from kvasir.operator.autoscaler.metrics import PodMetrics

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
# A pod not ready after this many times the learned time-to-ready is stuck, not on its way.
STUCK_FACTOR = 3.0


def _seconds(timestamp: str | None) -> float | None:
    if not timestamp:
        return None
    return datetime.fromisoformat(timestamp.replace("Z", "+00:00")).timestamp()


@dataclass(frozen=True)
class PodView:
    name: str
    ip: str | None
    ready: bool
    created: float  # epoch seconds
    ready_since: float | None  # when its Ready condition last turned True
    deleting: bool
    # A Deployment's pod or a multi-node group's leader: the one pod of a replica that answers
    # requests and /metrics (a group's workers only compute).
    serves: bool = True


def pod_view(pod: Mapping[str, Any]) -> PodView:
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    ready: Mapping[str, Any] = next(
        (c for c in status.get("conditions") or [] if c.get("type") == "Ready"), {}
    )
    is_ready = ready.get("status") == "True"
    return PodView(
        name=str(meta.get("name")),
        ip=status.get("podIP"),
        ready=is_ready and not meta.get("deletionTimestamp"),
        created=_seconds(meta.get("creationTimestamp")) or 0.0,
        ready_since=_seconds(ready.get("lastTransitionTime")) if is_ready else None,
        deleting=bool(meta.get("deletionTimestamp")),
        serves=naming.serves_requests(meta.get("labels") or {}),
    )


class StartupTimes:
    """Pod creation to Ready, as measured on one deployment's pods (the last `keep`)."""

    def __init__(self, keep: int = 20) -> None:
        self.keep = keep
        self._seen: dict[str, float] = {}

    def observe(self, pods: Iterable[PodView]) -> None:
        for pod in pods:
            if pod.ready and pod.ready_since is not None and pod.name not in self._seen:
                # A pod restarted in place keeps its creation time: only a plausible first start counts.
                duration = pod.ready_since - pod.created
                if duration >= 0:
                    self._seen[pod.name] = duration
        while len(self._seen) > self.keep:
            self._seen.pop(next(iter(self._seen)))

    @property
    def median(self) -> float | None:
        return statistics.median(self._seen.values()) if self._seen else None


def replica_state(
    spec_replicas: int,
    pods: Iterable[PodView],
    now: float,
    time_to_ready: float | None,
    max_running: int | None = None,
) -> ReplicaState:
    """Ready, starting and stuck pods of the deployment (pods being deleted are none of them);
    `max_running` is the most requests one pod runs at once (spec.runtime.maxNumSeqs)."""
    alive = [p for p in pods if not p.deleting]
    horizon = STUCK_FACTOR * (time_to_ready or DEFAULT_TIME_TO_READY)
    ready = sum(1 for p in alive if p.ready)
    waiting = [p for p in alive if not p.ready]
    stuck = sum(1 for p in waiting if now - p.created > horizon)
    return ReplicaState(
        current=spec_replicas,
        ready=ready,
        starting=len(waiting) - stuck,
        stuck=stuck,
        time_to_ready_seconds=time_to_ready,
        max_running=max_running,
    )


def deletion_costs(pods: Iterable[PodView], metrics: Mapping[str, PodMetrics]) -> dict[str, int]:
    """`pod-deletion-cost` per ready pod: the ReplicaSet deletes the lowest first, so the emptiest
    pod (fewest requests in flight, then least cached prefix) goes, and the drain loses nothing.
    A pod without metrics is unknown, not idle: it gets the highest cost."""
    costs: dict[str, int] = {}
    known = [m for m in metrics.values()]
    ceiling = int(max((m.in_flight for m in known), default=0) * 1000) + 1000
    for pod in pods:
        if not pod.ready:
            continue
        sample = metrics.get(pod.name)
        if sample is None:
            costs[pod.name] = ceiling
            continue
        cache = sample.gauges.get("kv_usage", 0.0)
        costs[pod.name] = int(sample.in_flight * 1000 + cache * 100)
    return costs
