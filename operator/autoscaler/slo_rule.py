"""The SLO rule (rule 0 of decide()): with `spec.autoscaling.slo`, the fewest replicas that keep
each observed latency percentile inside the objective with a margin, the load-independent part of
latency (its floor) set aside; KV usage, the queue and preemptions lead. docs/autoscaling.md
explains each step."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from kvasir.operator.autoscaler import learned
from kvasir.operator.autoscaler.policy import Policy, Slo
from kvasir.operator.autoscaler.signals import Signals
from kvasir.operator.autoscaler.targets import DEFAULT_TIME_TO_READY, kv_recommendation, tracked

if TYPE_CHECKING:
    from kvasir.operator.autoscaler.decide import History, ReplicaState

# The observed percentile is held between SLO_ROOM and SLO_AIM of the part of the objective that
# replicas can change (the margin absorbs a window's noise and the minute a new replica takes to
# matter); the leading signals act once latency has used LEAD_FLOOR of the objective.
SLO_AIM = 0.9
SLO_ROOM = 0.5
LEAD_FLOOR = 0.5


@dataclass(frozen=True)
class Pressure:
    """One SLO latency as decide() reads it: observed percentile / objective."""

    index: int  # 0: TTFT, 1: time per output token (its slot in History.pressures)
    value: float
    text: str
    # The part no replica count removes, where the window shows it: TTFT less its queueing (a
    # long prompt's prefill takes as long on any number of replicas). None: learned (learned.py).
    floor: float | None = None


def slo_pressures(signals: Signals, slo: Slo) -> list[Pressure]:
    """Observed percentile / objective for TTFT and time per output token, where the window has
    enough requests to read them."""
    percentile = f"p{slo.attainment * 100:g}"
    found = []
    if slo.ttft_seconds is not None:
        ttft = signals.ttft_quantile(slo.attainment)
        if ttft is not None:
            text = f"TTFT {percentile} {ttft:.2f}s (SLO {slo.ttft_seconds:g}s)"
            queued = signals.queue_time_quantile(slo.attainment)
            floor = None if queued is None else max(ttft - queued, 0.0) / slo.ttft_seconds
            found.append(Pressure(0, ttft / slo.ttft_seconds, text, floor))
    if slo.itl_seconds is not None:
        tpot = signals.tpot_quantile(slo.attainment)
        if tpot is not None:
            text = f"time per token {percentile} {tpot * 1e3:.0f} ms (SLO {slo.itl_seconds * 1e3:g} ms)"
            found.append(Pressure(1, tpot / slo.itl_seconds, text))
    return found


def smoothed(now: float, history: History, pressures: list[Pressure]) -> list[Pressure]:
    """This tick's pressures as the median of the last few ticks' (learned.remember_point)."""
    out = []
    for pressure in pressures:
        points = history.pressures[pressure.index]
        if points and points[-1][0] == now:
            floor = points[-1][5]
            pressure = replace(pressure, value=points[-1][2], floor=None if floor < 0 else floor)
        out.append(pressure)
    return out


def by_slo(
    now: float,
    signals: Signals,
    history: History,
    policy: Policy,
    replicas: ReplicaState,
    pressures: list[Pressure],
    reasons: list[str],
) -> int | None:
    """Rule 0: the fewest replicas that keep each observed percentile inside the SLO's margin;
    None when no latency of the SLO can be moved by the replica count (then the targets decide).

    Each latency = a floor that no replica count removes (a long prompt's prefill; the bucket a
    coarse histogram rounds to) + a part that scales with the load per replica: on N' replicas
    its pressure p (observed / objective) becomes floor + (p - floor) x N / N'. The margin is
    taken on the part replicas can change: aim = floor + SLO_AIM x (1 - floor), room likewise."""
    serving = signals.reporting_replicas
    ups: list[int] = []
    downs: list[int] = []
    for pressure in pressures:
        value, text = pressure.value, pressure.text
        learned_floor = pressure.floor
        if learned_floor is None:
            learned_floor = learned.latency_floor(history.pressures[pressure.index])
        floor = min(learned_floor or 0.0, value)
        if floor > SLO_AIM:
            # It does not fall with the load per replica: more replicas would not help.
            reasons.append(f"{text}: {value:.2f} of the SLO, {floor:.2f} of it at any load")
            continue
        aim = floor + SLO_AIM * (1 - floor)
        room = floor + SLO_ROOM * (1 - floor)

        def needed(target: float, value: float = value, floor: float = floor) -> int:
            return max(1, math.ceil(serving * max(value - floor, 0.0) / (target - floor) - 1e-9))

        if value > aim:
            # At most half as many again (past the knee, latency overstates the load: a queue
            # grows with time, not with the load), and one at a time until the floor is known (a
            # floor taken for load would be scaled out at any cost).
            most = math.ceil(1.5 * serving) if learned_floor is not None else serving + 1
            ups.append(min(most, max(serving + 1, needed(aim))))
            reasons.append(f"{text}: {value:.2f} of the SLO, above {aim:.2f} -> {ups[-1]}")
        elif value < room:
            downs.append(min(serving, needed(room)))
            reasons.append(f"{text}: {value:.2f} of the SLO, room below {room:.2f} -> {downs[-1]}")
        else:
            downs.append(serving)
            reasons.append(f"{text}: {value:.2f} of the SLO, within {room:.2f}..{aim:.2f}")
    if not ups and not downs:
        return None
    wanted = max(ups) if ups else max(downs)
    if not ups:
        kv = signals.kv_usage_mean
        if kv is not None:  # never below what the cache holds at its target
            wanted = max(wanted, math.ceil(serving * kv / policy.target_kv_cache_usage - 1e-9))
    highest = max(p.value for p in pressures)
    if highest >= LEAD_FLOOR:
        # Leading signals: where latency is going before the window's percentile shows it. Each
        # asks for what its own target tracking asks, at least one more, at most half again (a
        # queue keeps growing while new replicas load: tracked in full it overshoots, as the
        # HPA on queue length does).
        queue = signals.queue_per_replica or 0.0
        by_kv = kv_recommendation(signals, history, policy, replicas, []) or 0
        by_queue = tracked(serving, queue, policy.target_queue_per_replica, policy.tolerance)
        leads = []
        if queue >= policy.target_queue_per_replica > 0:
            leads.append((by_queue, f"queue {queue:.1f}/replica"))
        if (signals.kv_usage_max or 0.0) >= policy.target_kv_cache_usage or by_kv > serving:
            leads.append((by_kv, f"KV usage {signals.kv_usage_max or 0.0:.2f}"))
        if (signals.preemption_rate or 0.0) > 0:
            leads.append((serving + 1, "preemptions"))
        lead = min(max((count for count, _ in leads), default=0), math.ceil(1.5 * serving))
        if leads and max(lead, serving + 1) > wanted:
            wanted = max(lead, serving + 1)
            names = ", ".join(name for _, name in leads)
            reasons.append(f"leading: {names} with latency at {highest:.2f} of the SLO -> {wanted}")
    if wanted > serving:
        # The new replicas must start, then fill a window, before their effect shows: what was
        # asked then must show before more is asked (the panic rule's step still applies).
        settle = (replicas.time_to_ready_seconds or DEFAULT_TIME_TO_READY) + policy.metrics_window_seconds
        if history.last_scale_up is not None and now - history.last_scale_up <= settle:
            wanted = min(wanted, replicas.current)
            reasons.append(f"the last scale-up has not shown in the window yet ({settle:.0f}s)")
    return wanted


def remember(points: learned.Points, now: float, pressure: Pressure | None, at_rest: bool) -> learned.Points:
    if pressure is None:
        return learned.remember_point(points, now, None, None, at_rest)
    return learned.remember_point(points, now, pressure.value, pressure.floor, at_rest)
