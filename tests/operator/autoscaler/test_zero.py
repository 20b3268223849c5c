"""Scale to zero, pure: the idle clock (idle.py) and decide()'s rule 8, on timelines written out
tick by tick, and the router's /metrics as the operator reads them (router_load.py)."""

from __future__ import annotations

from dataclasses import replace

from kvasir.operator.autoscaler.decide import SCALE_DOWN, SCALE_UP, History, Policy, ReplicaState, decide
from kvasir.operator.autoscaler.idle import IdleClock, Idleness, RouterLoad, reading
from kvasir.operator.autoscaler.loop import autoscaling_status
from kvasir.operator.autoscaler.metrics import PodMetrics
from kvasir.operator.autoscaler.router_load import parse_router_load
from kvasir.operator.autoscaler.signals import Signals

ZERO = Policy(max_replicas=3, min_replicas=0, idle_seconds=100, scale_down_stabilization_seconds=0)


def quiet_signals() -> Signals:
    return Signals(
        ready_replicas=1,
        reporting_replicas=1,
        kv_usage_mean=0.0,
        kv_usage_max=0.0,
        waiting=0.0,
        running=0.0,
        preemption_rate=0.0,
        generation_tokens_rate=0.0,
        itl_ratio=None,
        ttft_ratio=None,
    )


def pod(running: float = 0.0, prompt_tokens: float = 0.0) -> PodMetrics:
    return PodMetrics(gauges={"running": running, "waiting": 0.0}, counters={"prompt_tokens": prompt_tokens})


def router(held: float = 0.0, routed: float = 0.0) -> dict[str, RouterLoad]:
    return {"router-0": RouterLoad(held=held, in_flight=0.0, routed=routed)}


def test_the_clock_restarts_on_any_request_unknown_source_or_wake() -> None:
    clock = IdleClock.starting_at(0.0, 1)
    quiet = reading({"p": pod()}, ["p"], router(), ["router-0"])
    clock = clock.observe(10.0, quiet, 1)  # first reading: totals new, so active
    clock = clock.observe(20.0, quiet, 1)
    assert clock.idle_seconds(20.0) == 10.0
    # A request finished between two ticks: only its counter shows it.
    clock = clock.observe(30.0, reading({"p": pod(prompt_tokens=12)}, ["p"], router(), ["router-0"]), 1)
    assert clock.idle_seconds(30.0) == 0.0
    clock = clock.observe(40.0, reading({"p": pod(prompt_tokens=12)}, ["p"], router(), ["router-0"]), 1)
    assert clock.idle_seconds(40.0) == 10.0
    # A ready pod that did not answer, or no router readable: unknown, never idle.
    silent = reading({}, ["p"], router(), ["router-0"])
    assert not silent.known
    assert clock.observe(50.0, silent, 1).idle_seconds(50.0) == 0.0
    assert not reading({"p": pod()}, ["p"], {}, []).known
    # At zero, then woken: the replica gets a whole idle time from the wake.
    at_zero = IdleClock(0.0, {"router/router-0": 0.0}, 0)
    empty = reading({}, [], router(), ["router-0"])
    assert at_zero.observe(500.0, empty, 0).idle_seconds(500.0) == 500.0
    assert at_zero.observe(500.0, empty, 1).idle_seconds(500.0) == 0.0


def _run(arrivals: set[int], until: int, step: int = 10) -> list[tuple[int, int]]:
    """decide() every `step` seconds on one replica with requests routed at `arrivals` (seconds):
    the (time, replicas) of every change."""
    clock, history, replicas, routed = IdleClock.starting_at(0.0, 1), History(), 1, 0.0
    changes = []
    for now in range(step, until + 1, step):
        routed += sum(1 for t in arrivals if now - step < t <= now)
        read = reading(
            {"p": pod()} if replicas else {}, ["p"] if replicas else [], router(routed=routed), ["router-0"]
        )
        clock = clock.observe(float(now), read, replicas)
        idle = Idleness(clock.idle_seconds(float(now)), read.held)
        signals = quiet_signals() if replicas else None
        decision = decide(float(now), signals, history, ZERO, ReplicaState(replicas, replicas), idle)
        history = decision.history
        if decision.replicas != replicas:
            changes.append((now, decision.replicas))
            replicas = decision.replicas
    return changes


def test_zero_after_the_idle_time_and_never_while_requests_come_every_half_idle_time() -> None:
    assert _run(set(), 300) == [(110, 0)]  # the first tick (10 s) sees new counters, then 100 s of quiet
    every_half = set(range(5, 1000, 50))  # one request every half idle time
    assert _run(every_half, 1000) == []


def test_zero_holds_at_zero_and_held_requests_wake_it() -> None:
    at_zero = ReplicaState(0, 0)
    stay = decide(0.0, None, History(), ZERO, at_zero, Idleness(5.0, held=0))
    assert (stay.replicas, stay.kind) == (0, "hold")
    wake = decide(0.0, None, History(), ZERO, at_zero, Idleness(0.0, held=3))
    assert (wake.replicas, wake.kind) == (1, SCALE_UP)
    assert "3 requests held" in wake.reason


def test_zero_never_on_missing_metrics_nor_from_more_than_one_replica() -> None:
    one = ReplicaState(1, 1)
    idle = Idleness(1000.0)
    assert decide(0.0, quiet_signals(), History(), ZERO, one, idle).kind == SCALE_DOWN
    assert decide(0.0, quiet_signals(), History(), ZERO, one, Idleness(None)).replicas == 1
    partial = replace(quiet_signals(), ready_replicas=2)
    assert decide(0.0, partial, History(), ZERO, ReplicaState(1, 2), idle).replicas >= 1
    two = replace(quiet_signals(), ready_replicas=2, reporting_replicas=2)
    assert decide(0.0, two, History(), ZERO, ReplicaState(2, 2), idle).replicas == 1  # one step at a time
    # minReplicas 1: the idleness is ignored, decide() is the one it always was.
    floor = Policy(max_replicas=3, min_replicas=1, scale_down_stabilization_seconds=0)
    assert decide(0.0, quiet_signals(), History(), floor, one, idle).replicas == 1


def test_the_router_exposition_is_read_with_prometheus_parser() -> None:
    text = "\n".join(
        [
            "# TYPE kvasir_router_held_requests gauge",
            "kvasir_router_held_requests 2",
            "# TYPE kvasir_router_backend_in_flight gauge",
            'kvasir_router_backend_in_flight{backend="0"} 1',
            'kvasir_router_backend_in_flight{backend="1"} 3',
            "# TYPE kvasir_router_decisions counter",
            'kvasir_router_decisions_total{reason="prefix"} 5',
            'kvasir_router_decisions_total{reason="load"} 7',
            "",
        ]
    )
    assert parse_router_load(text) == RouterLoad(held=2.0, in_flight=4.0, routed=12.0)
    assert parse_router_load("") == RouterLoad(0.0, 0.0, 0.0)


def test_the_printer_columns_are_cleared_at_zero() -> None:
    at_zero = decide(0.0, None, History(), ZERO, ReplicaState(0, 0), Idleness(50.0))
    top = autoscaling_status(at_zero, None, 60.0, None)
    assert top["autoscaling"]["desiredReplicas"] == 0
    assert top["kvCacheUsagePercent"] is None and top["queueDepth"] is None  # null: no stale KV % or queue
    serving = decide(0.0, quiet_signals(), History(), ZERO, ReplicaState(1, 1), Idleness(5.0))
    assert autoscaling_status(serving, quiet_signals(), 60.0, None)["kvCacheUsagePercent"] == 0
