"""Autoscaling policies the simulator compares: Kvasir's own `decide()` (and its ablations: without
the latency-ratio signal, and without the SLO as a target), and the policies users run today, each as its published rule:

- `static`: a fixed count, provisioned for the trace's peak at the SLO (found by the simulator);
- `concurrency`: Knative/KServe KPA: in-flight requests per replica against a target, a 60 s
  stable window, a 6 s panic window at 2x, no scale-down while panicking;
- `kv`: KV-cache usage alone, with the HPA's algorithm (AIBrix's KV-usage scaler is of this kind);
- `queue`: waiting requests per replica alone, with the HPA's algorithm;
- `wva`: llm-d's workload variant autoscaler's saturation rule: add a replica when any replica's
  KV usage reaches 0.8 or its queue 5, remove one when the load would fit, at most one change a
  minute;
- `predictive`: a planner as NVIDIA Dynamo's SLA planner is one: a forecast of the arrivals one
  cold start ahead, divided by a per-replica capacity at the SLO profiled before the run
  (compare.capacity_at_slo).

Each takes the same signals (the same scrapes, at the same interval) and returns a Decision."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, replace
from typing import Protocol

from kvasir.operator.autoscaler.decide import (
    HOLD,
    NO_METRICS,
    SCALE_DOWN,
    SCALE_UP,
    Decision,
    History,
    Policy,
    ReplicaState,
    decide,
)
from kvasir.operator.autoscaler.idle import Idleness
from kvasir.operator.autoscaler.signals import Signals


class Autoscaler(Protocol):
    name: str

    def decide(
        self, now: float, signals: Signals | None, replicas: ReplicaState, idle: Idleness | None = None
    ) -> Decision:
        """`idle`: for scale to zero (minReplicas 0), read by Kvasir's decide() alone."""
        ...


def _decision(target: int, current: int, reason: str) -> Decision:
    kind = SCALE_UP if target > current else SCALE_DOWN if target < current else HOLD
    return Decision(target, reason, kind, target, False)


class Kvasir:
    """Kvasir's decide(); `use_latency_ratio=False` is the ablation."""

    def __init__(self, policy: Policy, name: str = "kvasir") -> None:
        self.name = name
        self.policy = policy
        self.history: History | None = None

    def decide(
        self, now: float, signals: Signals | None, replicas: ReplicaState, idle: Idleness | None = None
    ) -> Decision:
        if self.history is None:
            self.history = History.starting_at(now, replicas.current)
        decision = decide(now, signals, self.history, self.policy, replicas, idle)
        self.history = decision.history
        return decision


@dataclass
class Static:
    replicas: int
    name: str = "static"

    def decide(
        self, now: float, signals: Signals | None, replicas: ReplicaState, idle: Idleness | None = None
    ) -> Decision:
        return _decision(self.replicas, replicas.current, f"static at {self.replicas}")


class Hpa:
    """The HPA's algorithm on one per-replica metric: ceil(current x value / target) outside a
    10% tolerance, up at most max(4 pods, 100%) per decision, down to the highest recommendation
    of the last 300 s."""

    def __init__(self, name: str, metric: str, target: float, bounds: tuple[int, int]) -> None:
        self.name = name
        self.metric = metric
        self.target = target
        self.bounds = bounds
        self._recent: deque[tuple[float, int]] = deque()

    def _value(self, signals: Signals) -> float | None:
        if self.metric == "kv":
            return signals.kv_usage_mean
        return signals.queue_per_replica

    def decide(
        self, now: float, signals: Signals | None, replicas: ReplicaState, idle: Idleness | None = None
    ) -> Decision:
        current = replicas.current
        value = None if signals is None else self._value(signals)
        if signals is None or value is None or signals.reporting_replicas == 0:
            return Decision(current, "no metrics", NO_METRICS, current, False)
        ratio = value / self.target if self.target else 0.0
        serving = signals.reporting_replicas
        wanted = serving if abs(ratio - 1) <= 0.1 else math.ceil(serving * ratio - 1e-9)
        wanted += signals.ready_replicas - serving
        self._recent.append((now, wanted))
        while self._recent and self._recent[0][0] < now - 300:
            self._recent.popleft()
        if wanted > current:
            target = min(wanted, current + max(4, current))
        else:
            target = min(current, max(r for _, r in self._recent))
        target = max(self.bounds[0], min(self.bounds[1], target))
        return _decision(target, current, f"{self.metric} {value:.2f} (target {self.target:g}) -> {wanted}")


class KnativeKpa:
    """Knative's KPA on concurrency (requests running or waiting per replica)."""

    def __init__(self, target: float, bounds: tuple[int, int], name: str = "concurrency") -> None:
        self.name = name
        self.target = target
        self.bounds = bounds
        self._samples: deque[tuple[float, float]] = deque()
        self._panic_until = -math.inf

    def decide(
        self, now: float, signals: Signals | None, replicas: ReplicaState, idle: Idleness | None = None
    ) -> Decision:
        current = replicas.current
        if signals is None or signals.running is None or signals.reporting_replicas == 0:
            return Decision(current, "no metrics", NO_METRICS, current, False)
        concurrency = (signals.running or 0.0) + (signals.waiting or 0.0)
        concurrency *= signals.ready_replicas / signals.reporting_replicas
        self._samples.append((now, concurrency))
        while self._samples and self._samples[0][0] < now - 60:
            self._samples.popleft()
        stable = sum(v for _, v in self._samples) / len(self._samples)
        stable_want = math.ceil(stable / self.target)
        panic_want = math.ceil(concurrency / self.target)  # the 6 s window: the latest sample
        if panic_want >= 2 * max(current, 1):
            self._panic_until = now + 60
        panicking = now < self._panic_until
        target = max(panic_want, current) if panicking else stable_want
        target = max(self.bounds[0], min(self.bounds[1], target))
        return _decision(target, current, f"concurrency {concurrency:.1f} (target {self.target:g}/replica)")


class Wva:
    """llm-d WVA's saturation rule: +1 when saturated, -1 when the load fits N-1, one change/min."""

    def __init__(self, bounds: tuple[int, int], name: str = "wva") -> None:
        self.name = name
        self.bounds = bounds
        self._last_change = -math.inf

    def decide(
        self, now: float, signals: Signals | None, replicas: ReplicaState, idle: Idleness | None = None
    ) -> Decision:
        current = replicas.current
        if signals is None or signals.reporting_replicas == 0:
            return Decision(current, "no metrics", NO_METRICS, current, False)
        if now - self._last_change < 60 or replicas.ready < current:
            return Decision(current, "waiting", HOLD, current, False)
        kv_max = signals.kv_usage_max or 0.0
        queue = signals.queue_per_replica or 0.0
        target = current
        if kv_max >= 0.8 or queue >= 5:
            target = current + 1
        elif current > 1 and (signals.kv_usage_mean or 0.0) * current / (current - 1) < 0.8 and queue == 0:
            target = current - 1
        target = max(self.bounds[0], min(self.bounds[1], target))
        if target != current:
            self._last_change = now
        return _decision(target, current, f"KV max {kv_max:.2f}, queue {queue:.1f}/replica")


# The predictive planner re-plans at most this often (Dynamo's planner acts once an adjustment
# interval; between two, a window's noise would move the count every tick).
ADJUSTMENT_SECONDS = 60.0
# Its load predictor fits a line through this much of the arrivals: long enough that one
# window's noise does not tilt it, short enough to follow a rise that began minutes ago.
PREDICTOR_SECONDS = 300.0


class Predictive:
    """A planner: replicas = ceil(arrivals / capacity), for the arrivals now (a replica removed
    now is gone now) and for those forecast when a replica started now serves (a cold start
    ahead: the least-squares line through the last PREDICTOR_SECONDS of arrivals), whichever
    needs more. `capacity`: requests/s one replica serves at the SLO, profiled before the run as
    Dynamo's pre-deployment profiling does. No correction factor from observed latency: the
    capacity is taken as profiled."""

    def __init__(self, capacity: float, bounds: tuple[int, int], name: str = "predictive") -> None:
        self.name = name
        self.capacity = capacity
        self.bounds = bounds
        self._rates: deque[tuple[float, float]] = deque()
        self._last_change = -math.inf

    def decide(
        self, now: float, signals: Signals | None, replicas: ReplicaState, idle: Idleness | None = None
    ) -> Decision:
        current = replicas.current
        rate = None if signals is None else signals.request_rate
        if rate is None:
            return Decision(current, "no metrics", NO_METRICS, current, False)
        self._rates.append((now, rate))
        while self._rates[0][0] < now - PREDICTOR_SECONDS:
            self._rates.popleft()
        if now - self._last_change < ADJUSTMENT_SECONDS:
            return Decision(current, "within the adjustment interval", HOLD, current, False)
        horizon = replicas.time_to_ready_seconds or 0.0
        ahead = max(0.0, forecast(list(self._rates), now + horizon))
        needed = math.ceil(max(rate, ahead) / self.capacity - 1e-9)
        target = max(self.bounds[0], min(self.bounds[1], needed))
        if target != current:
            self._last_change = now
        why = (
            f"arrivals {rate:.2f}/s, {ahead:.2f}/s forecast in {horizon:.0f}s, "
            f"at {self.capacity:.3g}/s per replica -> {needed}"
        )
        return _decision(target, current, why)


def forecast(rates: list[tuple[float, float]], at: float) -> float:
    """The least-squares line through (time, rate) points, read at `at` (the last rate when the
    points span no time)."""
    times = [t for t, _ in rates]
    mean_t = sum(times) / len(times)
    mean_r = sum(r for _, r in rates) / len(rates)
    spread = sum((t - mean_t) ** 2 for t in times)
    if spread <= 0:
        return rates[-1][1]
    slope = sum((t - mean_t) * (r - mean_r) for t, r in rates) / spread
    return mean_r + slope * (at - mean_t)


POLICY_NAMES = (
    "kvasir", "static", "concurrency", "kv", "queue", "wva", "predictive", "kvasir-ratio", "kvasir-no-ratio",
    "kvasir-no-slo",
)  # fmt: skip
# The tail rule's threshold when the ablation turns it on (the value it had as a default).
RATIO_ON = 5.0


@dataclass(frozen=True)
class Baselines:
    """The baselines' own targets (SIM.yaml `baselines:`)."""

    concurrency_target: float = 32.0  # in-flight requests per replica (KPA)
    kv_target: float = 0.8
    queue_target: float = 4.0


def make_policy(
    name: str,
    policy: Policy,
    baselines: Baselines,
    static_replicas: int | None = None,
    capacity: float | None = None,
) -> Autoscaler:
    """`static_replicas`: static's count; `capacity`: predictive's requests/s per replica at the
    SLO (both found by replaying the trace: compare.static_for_peak, compare.capacity_at_slo)."""
    bounds = (policy.min_replicas, policy.max_replicas)
    if name == "kvasir":
        return Kvasir(policy)
    if name == "kvasir-ratio":  # targets.latencyRatio set: the tail rule on
        return Kvasir(replace(policy, target_latency_ratio=RATIO_ON, use_latency_ratio=True), name)
    if name == "kvasir-no-ratio":
        return Kvasir(replace(policy, use_latency_ratio=False), name)
    if name == "kvasir-no-slo":  # spec.autoscaling without an slo: the targets alone
        return Kvasir(replace(policy, slo_ttft_seconds=None, slo_itl_seconds=None), name)
    if name == "static":
        if static_replicas is None:
            raise ValueError("static needs its replica count")
        return Static(static_replicas)
    if name == "concurrency":
        return KnativeKpa(baselines.concurrency_target, bounds)
    if name == "kv":
        return Hpa("kv", "kv", baselines.kv_target, bounds)
    if name == "queue":
        return Hpa("queue", "queue", baselines.queue_target, bounds)
    if name == "wva":
        return Wva(bounds)
    if name == "predictive":
        if capacity is None or capacity <= 0:
            raise ValueError("predictive needs a positive capacity per replica")
        return Predictive(capacity, bounds)
    raise ValueError(f"unknown policy {name!r}; one of {', '.join(POLICY_NAMES)}")
