"""Idleness for scale to zero (`minReplicas: 0`): how long an LLMDeployment has seen no request,
counted at Kvasir's router (requests held, routed or in flight there) and at the pods (requests
running or waiting, and requests finished since the last tick). Pure: readings in, a clock out.

The clock is conservative, so that only a settled, readable quiet ever lets the last replica go:
- any sign of a request restarts it (a gauge above zero, or any counter that moved, either way:
  a restarted process resets its counters, and that is no proof of quiet);
- an unreadable source restarts it (a ready pod or router pod that did not answer is not idle);
- a wake from zero restarts it, so a woken deployment keeps its replica for a whole idle time
  (the hysteresis: a request every half idle time keeps it at one)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kvasir.observability import metric_names as m
from kvasir.operator.autoscaler.metrics import PodMetrics

# The router's series read here (router/metrics.py exposes them; router_load.py scrapes them).
ROUTER_HELD = m.ROUTER_HELD_REQUESTS.name  # gauge: requests held now, waiting for a replica
ROUTER_IN_FLIGHT = m.ROUTER_BACKEND_IN_FLIGHT.name  # gauge, per backend: requests being proxied
ROUTER_ROUTED = f"{m.ROUTER_DECISIONS.name}_total"  # counter: one per routed request


@dataclass(frozen=True)
class RouterLoad:
    """One router pod's reading: requests held and in flight now, and requests routed so far."""

    held: float
    in_flight: float
    routed: float


@dataclass(frozen=True)
class Reading:
    """One tick's view of the requests. `known` is False when a ready pod or a router pod did not
    answer; `totals` are the counters by source (`pod/NAME`, `router/NAME`)."""

    known: bool
    busy: float  # requests held, in flight, running or waiting now (all sources)
    held: float  # of which held at the router (no replica to send them to)
    totals: Mapping[str, float] = field(default_factory=dict)


def reading(
    pods: Mapping[str, PodMetrics],
    ready_pods: list[str],
    routers: Mapping[str, RouterLoad],
    ready_routers: list[str],
) -> Reading:
    """The tick's reading from the scraped model pods and router pods (absent ones failed)."""
    known = all(pod in pods for pod in ready_pods) and all(r in routers for r in ready_routers)
    known = known and bool(ready_routers)  # no router readable: requests may be waiting unseen
    busy = 0.0
    totals: dict[str, float] = {}
    for pod, metrics in pods.items():
        busy += metrics.gauges.get("running", 0.0) + metrics.gauges.get("waiting", 0.0)
        totals[f"pod/{pod}"] = metrics.counters.get("prompt_tokens", 0.0)
    held = sum(load.held for load in routers.values())
    for router, load in routers.items():
        busy += load.held + load.in_flight
        totals[f"router/{router}"] = load.routed
    return Reading(known, busy, held, totals)


@dataclass(frozen=True)
class IdleClock:
    """Since when the deployment has been idle (`quiet_since`), from the readings of its ticks."""

    quiet_since: float
    totals: Mapping[str, float] = field(default_factory=dict)
    replicas: int = 0  # spec.replicas at the last tick: a 0 -> n change is a wake

    @staticmethod
    def starting_at(now: float, replicas: int) -> IdleClock:
        """After an operator restart nothing is known: a whole idle time must pass."""
        return IdleClock(now, {}, replicas)

    def observe(self, now: float, read: Reading, replicas: int) -> IdleClock:
        """The clock after this tick's reading, with `replicas` the deployment's count now."""
        woke = self.replicas == 0 and replicas > 0
        active = not read.known or read.busy > 0 or woke or dict(read.totals) != dict(self.totals)
        return IdleClock(now if active else self.quiet_since, dict(read.totals), replicas)

    def idle_seconds(self, now: float) -> float:
        return max(0.0, now - self.quiet_since)


@dataclass(frozen=True)
class Idleness:
    """What decide() needs to go to zero or come back: seconds without a request (None: unknown,
    never zero) and requests held at the router now (a wake when at zero)."""

    seconds: float | None
    held: float = 0.0
