"""Target tracking (rule 1 of decide()): each signal against its per-replica target, as the HPA
tracks a metric, with the KV demand looked at one cold start ahead while it grows. Without an SLO
these decide; with one, they lead (slo_rule.py) and decide only when the SLO cannot be read."""

from __future__ import annotations

import math

from kvasir.operator.autoscaler.learned import trend
from kvasir.operator.autoscaler.policy import Policy
from kvasir.operator.autoscaler.signals import Signals
from kvasir.operator.autoscaler.state import DEFAULT_TIME_TO_READY, History, ReplicaState


def tracked(current: int, value: float, target: float, tolerance: float) -> int:
    """Target tracking for one signal: `current` replicas at `value` per replica."""
    if target <= 0:
        return current + 1 if value > 0 else current
    ratio = value / target
    if abs(ratio - 1.0) <= tolerance:
        return current
    return max(0, math.ceil(current * ratio - 1e-9))


def kv_recommendation(
    signals: Signals, history: History, policy: Policy, replicas: ReplicaState, reasons: list[str]
) -> int | None:
    """KV-cache target tracking, looking one start-up time ahead while the demand grows."""
    serving = signals.reporting_replicas
    kv = signals.kv_usage_mean
    if kv is None:
        return None
    by_kv = tracked(serving, kv, policy.target_kv_cache_usage, policy.tolerance)
    horizon = replicas.time_to_ready_seconds or DEFAULT_TIME_TO_READY
    growth = trend(history.load) * horizon if policy.use_prediction and serving else 0.0
    if growth > policy.tolerance * policy.target_kv_cache_usage * serving:
        # The demand (KV usage times replicas) is continuous across scale events; per replica
        # it is what a new pod would find when it is ready, one start time from now.
        demand = kv * serving
        predicted = min(demand + growth, 2.0 * demand) / serving
        ahead = tracked(serving, predicted, policy.target_kv_cache_usage, policy.tolerance)
        if ahead > by_kv:
            reasons.append(f"KV usage {kv:.2f} rising: {predicted:.2f} expected in {horizon:.0f}s")
            by_kv = ahead
    reasons.append(f"KV usage {kv:.2f} (target {policy.target_kv_cache_usage:.2f}) -> {by_kv}")
    return by_kv


def by_targets(
    signals: Signals, history: History, policy: Policy, replicas: ReplicaState, reasons: list[str]
) -> int:
    """Rule 1: the largest of the per-signal target-tracking recommendations."""
    serving = signals.reporting_replicas
    candidates: list[int] = []
    by_kv = kv_recommendation(signals, history, policy, replicas, reasons)
    if by_kv is not None:
        candidates.append(by_kv)
    queue = signals.queue_per_replica
    if queue is not None:
        by_queue = tracked(serving, queue, policy.target_queue_per_replica, policy.tolerance)
        if signals.waiting == 0:
            by_queue = 0  # an empty queue asks for nothing; the cache decides
        candidates.append(by_queue)
        reasons.append(
            f"queue {queue:.1f}/replica (target {policy.target_queue_per_replica:g}) -> {by_queue}"
        )
    itl = signals.itl_mean
    if policy.target_itl_seconds is not None and itl is not None:
        # Latency is not linear in replicas, but it falls as load per replica does: tracked like
        # a load, it converges from either side, and the tolerance band keeps it from hunting.
        by_latency = tracked(serving, itl, policy.target_itl_seconds, policy.tolerance)
        candidates.append(by_latency)
        reasons.append(
            f"mean ITL {itl * 1e3:.0f} ms (target {policy.target_itl_seconds * 1e3:.0f} ms) -> {by_latency}"
        )
    return max(candidates) if candidates else serving
