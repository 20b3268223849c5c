"""The `predictive` baseline (a planner as Dynamo's SLA planner is one): replicas for the larger of
the arrivals now and those forecast a cold start ahead, at a capacity per replica profiled at the
SLO before the run, re-planned once an adjustment interval."""

from __future__ import annotations

import pytest

from kvasir.operator.autoscaler.decide import HOLD, SCALE_DOWN, SCALE_UP, Policy, ReplicaState
from kvasir.operator.autoscaler.signals import Signals
from kvasir.simulator import compare as compare_module
from kvasir.simulator.cluster import simulate
from kvasir.simulator.compare import _poisson, capacity_at_slo, compare
from kvasir.simulator.config import parse_config
from kvasir.simulator.policies import ADJUSTMENT_SECONDS, Baselines, Predictive, forecast, make_policy
from kvasir.simulator.trace import generate

CONFIG = parse_config(
    {
        "autoscaling": {"minReplicas": 1, "maxReplicas": 8},
        "profile": "cpu-embedded",
        "slo": {"timeToFirstTokenSeconds": 2.5, "interTokenLatencySeconds": 0.25},
    }
)


def _signals(rate: float) -> Signals:
    return Signals(
        ready_replicas=1,
        reporting_replicas=1,
        kv_usage_mean=None,
        kv_usage_max=None,
        waiting=None,
        running=None,
        preemption_rate=None,
        generation_tokens_rate=None,
        itl_ratio=None,
        ttft_ratio=None,
        request_rate=rate,
    )


def test_the_forecast_is_the_line_through_the_arrivals() -> None:
    rising = [(0.0, 1.0), (60.0, 2.0), (120.0, 3.0)]
    assert forecast(rising, 240.0) == pytest.approx(5.0)
    assert forecast([(5.0, 4.0)], 100.0) == 4.0  # one point: no trend


def test_replicas_for_the_arrivals_now_or_a_cold_start_ahead() -> None:
    planner = Predictive(capacity=2.0, bounds=(1, 10))
    state = ReplicaState(current=1, ready=1, time_to_ready_seconds=120.0)
    # Rising by 1/s a minute: 3/s now, 5/s when a replica started now serves -> 3 replicas.
    decision = None
    for minute, rate in enumerate([1.0, 2.0, 3.0]):
        decision = planner.decide(60.0 * minute, _signals(rate), state)
    assert decision is not None and decision.kind == SCALE_UP
    assert decision.replicas == 3 and "5.00/s forecast in 120s" in decision.reason
    # Within the adjustment interval it holds, whatever the load.
    held = planner.decide(120.0 + ADJUSTMENT_SECONDS / 2, _signals(30.0), ReplicaState(current=3, ready=3))
    assert held.kind == HOLD and held.replicas == 3
    # A fall is followed at once: a replica removed now is gone now, and the line falls too.
    later = Predictive(capacity=2.0, bounds=(1, 10))
    for t, rate in [(0.0, 6.0), (100.0, 6.0), (200.0, 1.0), (300.0, 1.0), (400.0, 1.0), (500.0, 1.0)]:
        down = later.decide(t, _signals(rate), ReplicaState(current=3, ready=3, time_to_ready_seconds=60.0))
    assert down.kind == SCALE_DOWN and down.replicas == 1


def test_predictive_needs_its_capacity() -> None:
    with pytest.raises(ValueError, match="capacity"):
        make_policy("predictive", Policy(min_replicas=1, max_replicas=4), Baselines())


@pytest.fixture
def short_profile(monkeypatch: pytest.MonkeyPatch) -> None:
    """Profile on 60 requests over 30 s, not 600 over 120 s: the method, not its precision (each
    replay of the profile is CPU time in CI)."""
    monkeypatch.setattr(compare_module, "PROFILE_REQUESTS", 60)
    monkeypatch.setattr(compare_module, "PROFILE_SECONDS", 30.0)


@pytest.mark.usefixtures("short_profile")
def test_the_capacity_is_profiled_at_the_slo() -> None:
    trace = generate("poisson", duration=600, rate=1.0, seed=3)
    capacity = capacity_at_slo(trace, CONFIG)

    def attainment(rate: float) -> float:
        one = make_policy("static", CONFIG.policy, Baselines(), 1)
        return simulate(_poisson(trace, rate), CONFIG.cluster, one, initial_replicas=1).slo_attainment

    assert attainment(capacity) >= CONFIG.slo.attainment
    assert attainment(2 * capacity) < CONFIG.slo.attainment


def test_compare_profiles_the_trace_for_predictive(monkeypatch: pytest.MonkeyPatch) -> None:
    """compare() hands predictive the capacity profiled on the trace it replays (the profile
    itself is the test above; here a fixed one, to keep the replay short)."""
    profiled: list[int] = []

    def capacity(trace: list[object], config: object) -> float:
        profiled.append(len(trace))
        return 0.4

    monkeypatch.setattr(compare_module, "capacity_at_slo", capacity)
    trace = generate("ramp", duration=600, rate=0.5, seed=2)
    result = compare(trace, CONFIG, ["predictive"])["predictive"]
    assert profiled == [len(trace)]
    assert result.max_replicas > 1  # the ramp asked for more than the warm start
    assert any("at 0.4/s per replica" in tick.reason for tick in result.ticks)
