"""The SLO as decide() reads it: each latency's pressure (the observed percentile / the
objective), its floor (the part no replica count removes), and how much more load per replica it
would take before reaching the aim. The SLO rule (slo_rule.py) sizes replicas from these; decide()
learns from them (learned.py, headroom.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from kvasir.operator.autoscaler import headroom, learned
from kvasir.operator.autoscaler.policy import Slo
from kvasir.operator.autoscaler.signals import Signals
from kvasir.operator.autoscaler.state import History

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


def floor_of(history: History, pressure: Pressure) -> tuple[float | None, float]:
    """(the floor as measured or learned, None where neither; the floor taken, at most the
    pressure itself)."""
    learned_floor = pressure.floor
    if learned_floor is None:
        learned_floor = learned.latency_floor(history.pressures[pressure.index])
    return learned_floor, min(learned_floor or 0.0, pressure.value)


def latency_limit(history: History, pressures: list[Pressure], signals: Signals) -> float:
    """The arrivals per second per replica at which latency would reach its aim, by the rule's
    own projection (latency_reach) from this tick's load: where it comes before the knee,
    latency is the replica's limit and the rules above size for it, not the knee."""
    serving = signals.reporting_replicas
    if not serving or signals.request_rate is None:
        return math.inf
    reach = latency_reach(history, pressures)
    return math.inf if math.isinf(reach) else reach * signals.request_rate / serving


def stretch(history: History, pressures: list[Pressure]) -> float:
    """How much more load per replica this tick's latencies would take before the first reaches
    its aim (latency_reach), at least 1 and at most headroom.MAX_STRETCH (a projection far beyond
    what was seen is a guess). Read from the tick's own (raw) percentiles: the smoothed ones lag
    a load that just rose."""
    return max(1.0, min(headroom.MAX_STRETCH, latency_reach(history, pressures)))


def latency_reach(history: History, pressures: list[Pressure]) -> float:
    """How much more load per replica these latencies would take before the first reaches its
    aim, by the rule's own projection (the part above the floor grows with the load): 0 where one
    is at its aim already (load or floor alike), infinite where none grows with the load."""
    reach = math.inf
    for pressure in pressures:
        _, floor = floor_of(history, pressure)
        aim = floor + SLO_AIM * (1 - floor)
        if pressure.value >= min(aim, SLO_AIM):
            return 0.0
        if pressure.value > floor:
            reach = min(reach, (aim - floor) / (pressure.value - floor))
    return reach


def remember(points: learned.Points, now: float, pressure: Pressure | None, at_rest: bool) -> learned.Points:
    if pressure is None:
        return learned.remember_point(points, now, None, None, at_rest)
    return learned.remember_point(points, now, pressure.value, pressure.floor, at_rest)
