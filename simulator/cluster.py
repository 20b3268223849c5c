"""The cluster simulation: a trace's requests routed round-robin over ready replicas (as a
Service does), the autoscaler ticking every `intervalSeconds` on scrapes of the ready replicas
(through the operator's own metrics window and signals), new replicas ready after the cold start,
removed replicas chosen by in-flight requests (pod-deletion-cost) and drained before they go.

Replicas are independent between two autoscaler ticks (round-robin routing does not look at
them), so a replica's clock is advanced only when it gets a request and at each tick. An idle
cluster at rest is not ticked through a long gap between two requests (a quiet night, or one
far-future line in a trace): see `ClusterConfig.rest_s`."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvasir.operator.autoscaler.decide import ReplicaState
from kvasir.operator.autoscaler.idle import IdleClock, Idleness, RouterLoad, reading
from kvasir.operator.autoscaler.signals import MetricsWindow, Scrape
from kvasir.simulator.latency import LogHistogram
from kvasir.simulator.policies import Autoscaler
from kvasir.simulator.profile import ReplicaProfile
from kvasir.simulator.replica import Finished, SimReplica
from kvasir.simulator.routing import Routing, make_routing
from kvasir.simulator.trace import TraceRequest


@dataclass(frozen=True)
class Slo:
    ttft_s: float = 1.0
    itl_s: float = 0.1  # the mean time per output token of one request (DistServe's TPOT)
    attainment: float = 0.99


@dataclass(frozen=True)
class ClusterConfig:
    profile: ReplicaProfile
    min_replicas: int
    max_replicas: int
    interval_s: float = 15.0
    metrics_window_s: float = 60.0
    cold_start_s: float | None = None  # None: the profile's
    slo: Slo = Slo()
    prefix_caching: bool = True
    # Idle (no request, nothing in flight, starting or draining, no scale change) for this long,
    # longer than any policy remembers, the cluster is at rest: every tick until the next request
    # would see the same signals and decide the same. Those ticks are skipped, all but the last
    # `rest_s`, which run as usual so that the metrics window and the policies' histories are
    # what stepping would have left (a test holds the two equal).
    rest_s: float = 1200.0
    # Scale to zero (min_replicas 0): Kvasir's router holds a request that finds no ready replica
    # for at most `hold_s`, and at most `max_held` at once; past either it fails (503).
    hold_s: float = 300.0
    max_held: int = 100

    @property
    def start_time(self) -> float:
        return self.profile.cold_start_s if self.cold_start_s is None else self.cold_start_s


@dataclass
class Tick:
    time: float
    arrivals_per_s: float
    desired: int
    ready: int
    kv_usage: float | None
    queue: float | None
    reason: str = ""  # the policy's reason for this tick's decision


@dataclass
class Result:
    policy: str
    finished: list[Finished]
    itl: LogHistogram
    gpu_hours: float
    scale_events: int
    max_replicas: int
    ticks: list[Tick] = field(default_factory=list)
    slo: Slo = Slo()
    routing: str = "round-robin"
    prefix_cache_queries: int = 0  # prompt tokens looked up in the replicas' prefix caches
    prefix_cache_hits: int = 0
    # Requests the router refused at zero, by arrival time: `rejected` found max_held requests
    # held already (503 at once, the queue-full answer); `timed_out` would have waited past
    # hold_s for a replica (503 after the hold).
    rejected: list[float] = field(default_factory=list)
    timed_out: list[float] = field(default_factory=list)
    activations: int = 0  # wakes from zero by a held request

    @property
    def failed(self) -> int:
        return len(self.rejected) + len(self.timed_out)

    @property
    def cached_token_fraction(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def slo_attainment(self) -> float:
        """The share of requests that met both objectives; a failed request met neither."""
        if not self.finished and not self.failed:
            return 0.0
        good = sum(1 for f in self.finished if f.ttft <= self.slo.ttft_s and f.tpot <= self.slo.itl_s)
        return good / (len(self.finished) + self.failed)

    def slo_breach_minutes(self) -> int:
        """Minutes of the trace (by arrival, from its first request) whose requests' SLO
        percentile (nearest rank at `attainment`) of TTFT or of time per output token missed its
        objective; a failed request counts as over both. Minutes without a request never breach."""
        minutes: dict[int, tuple[list[float], list[float]]] = {}
        for f in self.finished:
            ttfts, tpots = minutes.setdefault(int(f.arrival // 60), ([], []))
            ttfts.append(f.ttft)
            tpots.append(f.tpot)
        for arrival in (*self.rejected, *self.timed_out):
            ttfts, tpots = minutes.setdefault(int(arrival // 60), ([], []))
            ttfts.append(math.inf)
            tpots.append(math.inf)
        q = self.slo.attainment
        return sum(
            1
            for ttfts, tpots in minutes.values()
            if nearest_rank(ttfts, q) > self.slo.ttft_s or nearest_rank(tpots, q) > self.slo.itl_s
        )

    def ttft_quantile(self, q: float) -> float:
        return nearest_rank([f.ttft for f in self.finished], q) if self.finished else math.nan

    def summary(self) -> dict[str, Any]:
        return {
            "slo_attainment": round(self.slo_attainment, 5),
            "meets_slo": self.slo_attainment >= self.slo.attainment,
            "ttft_p50_s": round(self.ttft_quantile(0.5), 4),
            "ttft_p99_s": round(self.ttft_quantile(0.99), 4),
            "itl_p50_s": round(self.itl.quantile(0.5) or math.nan, 5),
            "itl_p99_s": round(self.itl.quantile(0.99) or math.nan, 5),
            "gpu_hours": round(self.gpu_hours, 3),
            "scale_events": self.scale_events,
            "max_replicas": self.max_replicas,
            "requests": len(self.finished),
            "routing": self.routing,
            "cached_token_fraction": round(self.cached_token_fraction, 4),
            "failed_requests": self.failed,
            "rejected_requests": len(self.rejected),
            "timed_out_requests": len(self.timed_out),
            "slo_breach_minutes": self.slo_breach_minutes(),
            "activations": self.activations,
        }


def simulate(
    trace: list[TraceRequest],
    config: ClusterConfig,
    autoscaler: Autoscaler,
    *,
    initial_replicas: int | None = None,
    on_tick: Callable[[float, int], None] | None = None,
    routing: Routing | None = None,
) -> Result:
    """Replay `trace` against replicas scaled by `autoscaler`; every request is served to the end.
    `on_tick(now, requests routed so far)` after each autoscaler tick (progress bars); `routing`
    spreads requests over ready replicas (default: round-robin, as a Service does)."""
    routing = routing or make_routing("round-robin")
    finished: list[Finished] = []
    itl = LogHistogram()
    profile = config.profile
    created = 0

    def new_replica(now: float, ready_at: float) -> SimReplica:
        nonlocal created
        created += 1
        return SimReplica(
            f"replica-{created}",
            profile,
            created=now,
            ready_at=ready_at,
            on_finish=finished.append,
            itl=itl,
            prefix_caching=config.prefix_caching,
        )

    start = initial_replicas if initial_replicas is not None else config.min_replicas
    replicas = [new_replica(0.0, 0.0) for _ in range(start)]  # warm at the start
    retired: list[SimReplica] = []
    desired = start
    window = MetricsWindow(config.metrics_window_s)
    horizon = trace[-1].arrival_time if trace else 0.0
    next_tick = config.interval_s
    arrivals_since_tick = 0
    scale_events = 0
    peak = start
    ticks: list[Tick] = []
    index = 0
    last_busy = 0.0  # the last tick that saw a request, a request in flight or a change
    # Scale to zero: the router's hold (when each held request gets its replica) and the idle clock.
    zero = config.min_replicas == 0
    held: list[float] = []
    rejected: list[float] = []
    timed_out: list[float] = []
    activations = 0
    idle_clock = IdleClock.starting_at(0.0, start)
    while index < len(trace) or next_tick <= horizon:
        arrival = trace[index].arrival_time if index < len(trace) else math.inf
        if next_tick - last_busy >= config.rest_s and arrival - next_tick > 2 * config.rest_s:
            skipped = math.floor((arrival - config.rest_s - next_tick) / config.interval_s)
            next_tick += skipped * config.interval_s
        if arrival < next_tick:
            serving = [r for r in replicas if r.ready_at <= arrival and not r.draining]
            if zero and not serving:
                # No ready replica: the router holds the request and, at zero, wakes one at once.
                if not any(not r.draining for r in replicas):
                    replicas.append(new_replica(arrival, arrival + config.start_time))
                    desired, activations, scale_events = max(desired, 1), activations + 1, scale_events + 1
                    peak = max(peak, len([r for r in replicas if not r.draining]))
                first = min((r for r in replicas if not r.draining), key=lambda r: r.ready_at)
                held = [t for t in held if t > arrival]
                if len(held) >= config.max_held:
                    rejected.append(arrival)  # 503 at once: the router's hold is full
                elif first.ready_at - arrival > config.hold_s:
                    timed_out.append(arrival)  # 503 once the hold runs out
                else:
                    held.append(first.ready_at)
                    first.submit(index, trace[index], arrival)  # its TTFT counts the hold
                index += 1
                arrivals_since_tick += 1
                continue
            if not serving:  # only while every replica is still starting: the earliest takes it
                serving = [min((r for r in replicas if not r.draining), key=lambda r: r.ready_at)]
            if routing.needs_state:
                for candidate in serving:
                    candidate.advance(arrival)
            replica = routing.choose(trace[index], serving)
            replica.advance(arrival)
            replica.submit(index, trace[index], max(arrival, replica.ready_at))
            index += 1
            arrivals_since_tick += 1
            continue
        now = next_tick
        next_tick += config.interval_s
        for replica in replicas:
            if replica.ready_at <= now:
                replica.advance(now)
        for replica in [r for r in replicas if r.draining and r.in_flight == 0]:
            replica.removed_at = max(now, replica.now if replica.now != math.inf else now)
            replicas.remove(replica)
            retired.append(replica)
            last_busy = now
        ready = [r for r in replicas if r.ready_at <= now and not r.draining]
        window.add(Scrape(now, {r.name: r.metrics() for r in ready}))
        signals = window.signals([r.name for r in ready]) if ready else None
        live = [r for r in replicas if not r.draining]
        state = ReplicaState(
            current=desired,
            ready=len(ready),
            starting=len(live) - len(ready),
            time_to_ready_seconds=config.start_time,
            max_running=profile.max_num_seqs,  # the replicas' --max-num-seqs, as the operator knows it
        )
        idle = None
        if zero:
            held = [t for t in held if t > now]
            router = {"router": RouterLoad(held=float(len(held)), in_flight=0.0, routed=float(index))}
            pods = {r.name: r.metrics() for r in ready}
            idle_clock = idle_clock.observe(now, reading(pods, list(pods), router, ["router"]), desired)
            idle = Idleness(idle_clock.idle_seconds(now), float(len(held)))
        decision = autoscaler.decide(now, signals, state, idle)
        target = decision.replicas
        changed = target != desired
        if changed:
            scale_events += 1
        if target > len(live):
            replicas += [new_replica(now, now + config.start_time) for _ in range(target - len(live))]
        elif target < len(live):
            # The ReplicaSet's order: pods not ready first, then the lowest deletion cost.
            ranked = sorted(live, key=lambda r: (r.ready_at <= now, r.in_flight))
            for replica in ranked[: len(live) - target]:
                replica.draining = True
                if replica.ready_at > now:  # never served: gone at once
                    replica.removed_at = now
                    replicas.remove(replica)
                    retired.append(replica)
        desired = target
        peak = max(peak, len([r for r in replicas if not r.draining]))
        ticks.append(
            Tick(
                now,
                arrivals_since_tick / config.interval_s,
                desired,
                len(ready),
                None if signals is None else signals.kv_usage_mean,
                None if signals is None else signals.queue_per_replica,
                decision.reason,
            )
        )
        if arrivals_since_tick or changed or len(live) != len(ready) or any(r.in_flight for r in replicas):
            last_busy = now  # a request, a change, replicas starting, or requests still in flight
        arrivals_since_tick = 0
        if on_tick is not None:
            on_tick(now, index)
    for replica in replicas:
        if replica.in_flight:
            replica.advance(math.inf)  # serve every request to its end
    end = max(horizon, next_tick - config.interval_s)
    gpu_seconds = 0.0
    for replica in [*retired, *replicas]:
        stop = replica.removed_at if replica.removed_at is not None else end
        gpu_seconds += max(0.0, min(stop, end) - replica.created) * profile.gpus
    everyone = [*retired, *replicas]
    return Result(
        getattr(autoscaler, "name", "policy"),
        finished,
        itl,
        gpu_seconds / 3600.0,
        scale_events,
        peak,
        ticks,
        config.slo,
        routing.name,
        sum(r.kv.prefix_cache_queries for r in everyone),
        sum(r.kv.prefix_cache_hits for r in everyone),
        rejected,
        timed_out,
        activations,
    )


def nearest_rank(values: list[float], q: float) -> float:
    """The q-quantile of `values` by nearest rank (the value at rank ceil(q x n))."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]
