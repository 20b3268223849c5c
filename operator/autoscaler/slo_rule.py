"""The SLO rule (rule 0 of decide()): with `spec.autoscaling.slo`, the fewest replicas that keep
each observed latency percentile inside the objective with a margin, the load-independent part of
latency (its floor) set aside; scale-ups on latency only while the error budget burns
(budget.py); the arrivals at the learned capacity size a load that rose and bound the way down
(headroom.py); each replica's knee keeps the arrivals a cold start ahead below it and bounds
the way down (knee.py); KV usage, the queue and preemptions lead. docs/autoscaling.md explains
each step."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from kvasir.operator.autoscaler import budget, headroom, knee, learned
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
# With the long window's burn at most this share of the budget, the arrivals decide scale-downs
# that latency, hovering in its band, would not make.
SPARE_BURN = 0.5


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
    slo = policy.slo
    floors = {p.index: _floor(history, p) for p in pressures}
    # The budget's burn counts every request over an objective (the way down spends it all);
    # what latency adds replicas for counts only the latencies replicas can move: requests over
    # TTFT where a prefill alone nears it (a long prompt) miss at any count.
    burn = None if slo is None else budget.burn_rates(history.burns, now, slo.attainment)
    movable = tuple(i for i in budget.BOTH if i not in floors or floors[i][1] <= SLO_AIM)
    movable_burn = None if slo is None else budget.burn_rates(history.burns, now, slo.attainment, movable)
    burning = budget.burning(movable_burn)
    known_capacity = headroom.capacity(history.demand) is not None
    # The arrivals' trend over the lookback (a day's rise or fall), and over the last two
    # reactions (a turn, the rise a reaction from now); where latency, not the knee, limits.
    growth = headroom.rising(history.demand, now)
    reaction = reaction_seconds(policy, replicas)
    turn = 2 * reaction
    recent_growth = headroom.rising(history.demand, now, turn)
    limit = latency_limit(history, pressures, signals)
    ups: list[int] = []
    downs: list[int] = []
    for pressure in pressures:
        value, text = pressure.value, pressure.text
        learned_floor, floor = floors[pressure.index]
        if floor > SLO_AIM:
            # It does not fall with the load per replica: more replicas would not help.
            reasons.append(f"{text}: {value:.2f} of the SLO, {floor:.2f} of it at any load")
            continue
        aim = floor + SLO_AIM * (1 - floor)
        room = floor + SLO_ROOM * (1 - floor)

        def needed(target: float, value: float = value, floor: float = floor) -> int:
            return max(1, math.ceil(serving * max(value - floor, 0.0) / (target - floor) - 1e-9))

        if value > aim and movable_burn is not None and not burning:
            # The percentile is over the aim but the requests over the objective are within the
            # budget (one long prompt in a window): no replica is added for it.
            downs.append(serving)
            reasons.append(
                f"{text}: {value:.2f} of the SLO, above {aim:.2f}, but the error budget is not "
                f"burning ({movable_burn[0]:.1f}x, {movable_burn[1]:.1f}x over {budget.BURN_SECONDS:.0f}s)"
            )
        elif value > aim:
            # At most half as many again on a fast burn (past the knee, latency overstates the
            # load: a queue grows with time, not with the load), a quarter on a slow one, and one
            # at a time until the floor is known (a floor taken for load would be scaled out at
            # any cost). Once the capacity is known, the arrivals size the large steps (below)
            # and latency adds a tenth at a time short of a jump (budget.JUMP_BURN): arrivals
            # within what the replicas were seen to serve are not a load that needs more.
            fast = movable_burn is None or movable_burn[0] > budget.FAST_BURN
            most = math.ceil((1.5 if fast else 1.25) * serving) if learned_floor is not None else serving + 1
            if known_capacity and (movable_burn is None or movable_burn[0] <= budget.JUMP_BURN):
                most = min(most, serving + max(1, math.ceil(0.1 * serving)))
            ups.append(min(most, max(serving + 1, needed(aim))))
            why = f" ({burning})" if burning else ""
            reasons.append(f"{text}: {value:.2f} of the SLO, above {aim:.2f}{why} -> {ups[-1]}")
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
        # Never below the replicas the arrivals' envelope needs at the learned capacity (bursts
        # that recur find their replicas); a floor only: it never adds a replica by itself.
        need = headroom.replicas_needed(history.demand, now, policy.metrics_window_seconds, reaction)
        if need is not None and wanted < serving and need[0] > wanted:
            # The capacity is a lower bound that grows only when replicas carry more than they
            # were seen to: with every latency showing room and most of the budget unspent, a
            # level load (not a burst's peak held) may go one replica below it, a probe the
            # budget watches (a burn brings the replica back; a good tick teaches a higher
            # capacity).
            probe = not need[2] and burn is not None and spare(burn) and max(downs) < serving
            wanted = min(need[0] - (1 if probe else 0), serving)
            reasons.append(f"headroom: {need[1]}" + (", probing one below" if probe else ""))
        # No scale-down while arrivals rise (it would only have to be undone), unless the last
        # two reactions show them falling: a 20-minute line through a hump still rises minutes
        # after its top.
        held = 0.0 if headroom.falling(history.demand, now, turn) > 0 else growth
        if wanted < serving and held > 0:
            wanted = serving
            reasons.append(f"arrivals rising ({held * 60:+.2f}/s a minute): no scale-down")
        fall = headroom.falling(history.demand, now)  # over the lookback: a day's fall, not a turn
        if need is not None and wanted >= serving > need[0] and burn is not None and spare(burn, fall > 0):
            # A percentile that hovers in its band (a tail set by the workload, not the load)
            # holds no count by itself: with most of the budget unspent, or all of it while the
            # arrivals fall (the window's latency is that of a load already gone), the arrivals'
            # need at the learned capacity (their trend now) decides the way down (a burn
            # brings the replicas back).
            why = f"arrivals falling ({-fall * 60:+.2f}/s a minute), " if fall > 0 else ""
            wanted = need[0]
            reasons.append(
                f"{why}error budget unspent ({burn[1]:.1f}x over {budget.BURN_SECONDS:.0f}s): {need[1]}"
            )
        # Never so few that today's arrivals would take a replica near its knee (knee.py).
        below = knee.replicas_below_knee(
            history.running,
            replicas.max_running,
            policy.target_kv_cache_usage,
            signals.request_rate or 0.0,
            limit,
        )
        if below is not None and wanted < serving and below[0] > wanted:
            wanted = min(below[0], serving)
            reasons.append(f"the knee: {below[1]}")
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
    by_rate = 0
    highest = max(p.value for p in pressures)
    if (movable_burn is not None and movable_burn[0] > 1.0) or highest >= LEAD_FLOOR:
        # More arrive than the replicas were ever seen to serve inside the SLO (a load that rose),
        # and requests miss faster than the budget allows or latency has used half of it: the
        # replicas today's arrivals need at the learned capacity, at once. Latency would get
        # there in steps, each waiting for the last to show; the arrival rate is the demand
        # itself, read from the requests, not from their wait. While a backlog drains, latency
        # overstates the load (requests queued on the old replicas wait however many new ones
        # come): past today's count, the arrivals decide.
        for_rate = headroom.replicas_for_rate(
            history.demand, signals.request_rate, signals.window_seconds or policy.metrics_window_seconds
        )
        if for_rate is not None and for_rate[0] > serving:
            by_rate, wanted = for_rate[0], for_rate[0]
            reasons.append(f"arrivals beyond the known capacity: {for_rate[1]}")
    # When a pod started now serves: after a tick, its cold start and half a window (the window's
    # rate lags the arrivals by half a window).
    cold_start = replicas.time_to_ready_seconds or DEFAULT_TIME_TO_READY
    horizon = policy.interval_seconds + cold_start + policy.metrics_window_seconds / 2
    if growth > 0 and signals.request_rate is not None and highest >= LEAD_FLOOR:
        # The predicted load over the cold start: while arrivals rise (a trend clear of the
        # noise), the replicas they will need when a pod started now is ready (the window's rate
        # lags it by half a window), at the learned capacity. A replica's latency is flat until
        # its knee and then a wall; with a long cold start, waiting for it to show is too late.
        # Only once latency has used half its objective, as the other leading signals: the
        # capacity is what replicas were seen to serve, and a replica never pushed has been seen
        # to serve little.
        ahead = headroom.replicas_for_rate(
            history.demand,
            signals.request_rate + growth * horizon,
            signals.window_seconds or policy.metrics_window_seconds,
        )
        if ahead is not None and ahead[0] > max(wanted, serving):
            by_rate = wanted = ahead[0]
            reasons.append(f"arrivals rising ({growth * 60:+.2f}/s a minute), in {horizon:.0f}s: {ahead[1]}")
    if signals.request_rate is not None:
        # The knee ahead (knee.py): the arrivals expected when a pod started now can serve (their
        # trend over the last two reactions, where it stands clear of the noise, a tick, the cold
        # start and half a window ahead) kept below each replica's knee. Unlike the learned
        # capacity, the knee is where the batch would reach its limit, predicted from how it grew
        # with the load so far, so it acts at any latency: a replica's latency is flat until the
        # knee and a wall after it, and with a long cold start the wall would come before the
        # replica. The trend is the present one: a 20-minute line averages a valley's fall with
        # the rise after it (and reads no growth on a day's second peak), while the rise that
        # matters is the one a reaction from now.
        below = knee.replicas_below_knee(
            history.running,
            replicas.max_running,
            policy.target_kv_cache_usage,
            signals.request_rate + recent_growth * horizon,
            limit,
        )
        if below is not None and below[0] > max(wanted, serving):
            by_rate = wanted = below[0]
            reasons.append(f"the knee, {horizon:.0f}s ahead: {below[1]}")
    if wanted > serving:
        # The new replicas must start, then fill a window, before their effect shows: what was
        # asked then must show before more is asked (the panic rule's step still applies; the
        # arrivals' count does not wait: it is read from the demand, not from latency).
        settle = reaction - policy.interval_seconds
        if history.last_scale_up is not None and now - history.last_scale_up <= settle:
            wanted = min(wanted, max(replicas.current, by_rate))
            if wanted != by_rate:
                reasons.append(f"the last scale-up has not shown in the window yet ({settle:.0f}s)")
    return wanted


def _floor(history: History, pressure: Pressure) -> tuple[float | None, float]:
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


def spare(burn: tuple[float, float], falling: bool = False) -> bool:
    """The error budget unspent enough for the arrivals to decide the way down: the last window
    within it, and the long one at most SPARE_BURN of it (within it while arrivals fall)."""
    return burn[0] <= 1.0 and burn[1] <= (1.0 if falling else SPARE_BURN)


def reaction_seconds(policy: Policy, replicas: ReplicaState) -> float:
    """How long a scale-up takes to show: the next tick, the cold start, then a metrics window."""
    cold_start = replicas.time_to_ready_seconds or DEFAULT_TIME_TO_READY
    return policy.interval_seconds + cold_start + policy.metrics_window_seconds


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
        _, floor = _floor(history, pressure)
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
