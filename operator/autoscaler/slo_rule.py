"""The SLO rule (rule 0 of decide()): with `spec.autoscaling.slo`, the fewest replicas that hold
the SLO, read as a planner reads it (docs/autoscaling.md):

- latency (`latency_step`): each observed percentile kept between SLO_ROOM and SLO_AIM of the
  part of its objective that replicas can change (pressure.py); above the aim only while the
  error budget burns (budget.py: the budget is the feedback);
- the way down (`way_down`): never below what the cache, the arrivals at the learned capacity
  (headroom.py) and each replica's knee (knee.py) need, never while arrivals rise; with the
  budget unspent, the arrivals decide it;
- the way up, once latency has used LEAD_FLOOR of the SLO: the leading signals
  (`leading_signals`), the arrivals beyond the learned capacity (`beyond_capacity`), their
  forecast one cold start ahead (`forecast`), and the knee that far ahead at any latency
  (`knee_ahead`); neither forecast asks for a burst served inside the SLO on today's count and,
  by the last hour's precedent, over before a new replica would serve (`burst_passes`);
- `settle`: what a scale-up asked must show in the window before latency asks again.

Each step is a function of `Tick`, the readings every step shares, computed once."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvasir.operator.autoscaler import budget, headroom, knee
from kvasir.operator.autoscaler.policy import Policy
from kvasir.operator.autoscaler.pressure import (
    LEAD_FLOOR,
    SLO_AIM,
    SLO_ROOM,
    Pressure,
    floor_of,
    latency_limit,
)
from kvasir.operator.autoscaler.signals import Signals
from kvasir.operator.autoscaler.state import DEFAULT_TIME_TO_READY, History, ReplicaState
from kvasir.operator.autoscaler.targets import kv_recommendation, tracked

# With the long window's burn at most this share of the budget, the arrivals decide scale-downs
# that latency, hovering in its band, would not make.
SPARE_BURN = 0.5


@dataclass(frozen=True)
class Tick:
    """What every step of the rule reads this tick, computed once (`read`)."""

    now: float
    signals: Signals
    history: History
    policy: Policy
    replicas: ReplicaState
    pressures: list[Pressure]
    serving: int
    floors: dict[int, tuple[float | None, float]]  # per latency: floor_of()
    # The budget's burn counts every request over an objective (the way down spends it all);
    # `movable_burn` only the latencies replicas can move: requests over TTFT where a prefill
    # alone nears it (a long prompt) miss at any count. (last window, ten minutes) / the budget.
    burn: tuple[float, float] | None
    movable_burn: tuple[float, float] | None
    growth: float  # the arrivals' trend over the lookback (a day's rise), per second per second
    recent_growth: float  # their trend over the last two reactions (a turn, the rise ahead)
    reaction: float  # seconds for a scale-up to show (reaction_seconds)
    horizon: float  # seconds until a pod started now serves, as the window's rate sees it
    limit: float  # arrivals/s per replica at which latency reaches its aim (pressure.py)
    highest: float  # the highest pressure

    @property
    def rate_window(self) -> float:
        return self.signals.window_seconds or self.policy.metrics_window_seconds


def read(
    now: float,
    signals: Signals,
    history: History,
    policy: Policy,
    replicas: ReplicaState,
    pressures: list[Pressure],
) -> Tick:
    slo = policy.slo
    floors = {p.index: floor_of(history, p) for p in pressures}
    movable = tuple(i for i in budget.BOTH if i not in floors or floors[i][1] <= SLO_AIM)
    reaction = reaction_seconds(policy, replicas)
    # When a pod started now serves: after a tick, its cold start and half a window (the
    # window's rate lags the arrivals by half a window).
    cold_start = replicas.time_to_ready_seconds or DEFAULT_TIME_TO_READY
    return Tick(
        now=now,
        signals=signals,
        history=history,
        policy=policy,
        replicas=replicas,
        pressures=pressures,
        serving=signals.reporting_replicas,
        floors=floors,
        burn=None if slo is None else budget.burn_rates(history.burns, now, slo.attainment),
        movable_burn=(
            None if slo is None else budget.burn_rates(history.burns, now, slo.attainment, movable)
        ),
        growth=headroom.rising(history.demand, now),
        recent_growth=headroom.rising(history.demand, now, 2 * reaction),
        reaction=reaction,
        horizon=policy.interval_seconds + cold_start + policy.metrics_window_seconds / 2,
        limit=latency_limit(history, pressures, signals),
        highest=max((p.value for p in pressures), default=0.0),
    )


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
    `reasons` gets one line per step that spoke."""
    tick = read(now, signals, history, policy, replicas, pressures)
    asks = [ask for p in pressures if (ask := latency_step(tick, p, reasons)) is not None]
    if not asks:
        return None
    ups = [count for up, count in asks if up]
    wanted = max(ups) if ups else way_down(tick, max(count for _, count in asks), reasons)
    wanted = leading_signals(tick, wanted, reasons)
    by_rate = 0  # the last count read from the arrivals: settle() never holds it back
    for from_arrivals in (beyond_capacity, forecast, knee_ahead):
        count = from_arrivals(tick, wanted, reasons)
        if count is not None:
            by_rate = wanted = count
    return settle(tick, wanted, by_rate, reasons)


def latency_step(tick: Tick, pressure: Pressure, reasons: list[str]) -> tuple[bool, int] | None:
    """One latency's ask: (True, more replicas) above the aim while the budget burns, else
    (False, the fewest that keep it below the room, at most today's); None when it does not fall
    with the load per replica (a floor above the aim). Each latency = a floor + a part that scales
    with the load per replica: on N' replicas its pressure p becomes floor + (p - floor) x N / N',
    and the margin is taken on that part. The shape it is for: `long-prompts`, where a prefill's
    time is a floor no replica count removes, and one long prompt in a window is not a load."""
    value, text = pressure.value, pressure.text
    learned_floor, floor = tick.floors[pressure.index]
    if floor > SLO_AIM:
        reasons.append(f"{text}: {value:.2f} of the SLO, {floor:.2f} of it at any load")
        return None
    aim = floor + SLO_AIM * (1 - floor)
    room = floor + SLO_ROOM * (1 - floor)

    def needed(target: float) -> int:
        return max(1, math.ceil(tick.serving * max(value - floor, 0.0) / (target - floor) - 1e-9))

    burning = budget.burning(tick.movable_burn)
    if value > aim and tick.movable_burn is not None and not burning:
        # The requests over the objective are within the budget: no replica is added for it.
        reasons.append(
            f"{text}: {value:.2f} of the SLO, above {aim:.2f}, but the error budget is not "
            f"burning ({tick.movable_burn[0]:.1f}x, {tick.movable_burn[1]:.1f}x over {budget.BURN_SECONDS:.0f}s)"
        )
        return False, tick.serving
    if value > aim:
        count = latency_up(tick, learned_floor, needed(aim))
        why = f" ({burning})" if burning else ""
        reasons.append(f"{text}: {value:.2f} of the SLO, above {aim:.2f}{why} -> {count}")
        return True, count
    if value < room:
        count = min(tick.serving, needed(room))
        reasons.append(f"{text}: {value:.2f} of the SLO, room below {room:.2f} -> {count}")
        return False, count
    reasons.append(f"{text}: {value:.2f} of the SLO, within {room:.2f}..{aim:.2f}")
    return False, tick.serving


def latency_up(tick: Tick, learned_floor: float | None, to_aim: int) -> int:
    """A burning latency's step up, toward `to_aim` (its projection to the aim) but bounded: at
    most half as many again on a fast burn (past the knee, latency overstates the load: a queue
    grows with time, not with the load), a quarter on a slow one, and one at a time until the
    floor is known (a floor taken for load would be scaled out at any cost). Once the capacity
    is known, the arrivals size the large steps (beyond_capacity) and latency adds a tenth at a
    time short of a jump (budget.JUMP_BURN): arrivals within what the replicas were seen to serve
    are not a load that needs more."""
    serving, burn = tick.serving, tick.movable_burn
    fast = burn is None or burn[0] > budget.FAST_BURN
    most = math.ceil((1.5 if fast else 1.25) * serving) if learned_floor is not None else serving + 1
    if headroom.capacity(tick.history.demand) is not None and (burn is None or burn[0] <= budget.JUMP_BURN):
        most = min(most, serving + max(1, math.ceil(0.1 * serving)))
    return min(most, max(serving + 1, to_aim))


def way_down(tick: Tick, by_latency: int, reasons: list[str]) -> int:
    """With no latency over its aim, the fewest replicas the latencies allow (`by_latency`),
    bounded by what the demand needs, in order: the cache, the arrivals at the learned capacity,
    no fall while they rise, the budget's say, the knee."""
    wanted = by_latency
    kv = tick.signals.kv_usage_mean
    if kv is not None:  # never below what the cache holds at its target
        wanted = max(wanted, math.ceil(tick.serving * kv / tick.policy.target_kv_cache_usage - 1e-9))
    need = headroom.replicas_needed(
        tick.history.demand, tick.now, tick.policy.metrics_window_seconds, tick.reaction
    )
    wanted = arrivals_floor(tick, wanted, need, by_latency, reasons)
    wanted = hold_while_rising(tick, wanted, reasons)
    wanted = unspent_budget(tick, wanted, need, reasons)
    return knee_floor(tick, wanted, reasons)


def arrivals_floor(
    tick: Tick, wanted: int, need: tuple[int, str, bool] | None, by_latency: int, reasons: list[str]
) -> int:
    """Never below the replicas the arrivals' envelope needs at the learned capacity
    (headroom.replicas_needed), a floor only: it never adds a replica by itself. The shape it is
    for: `bursts`: a burst shorter than a cold start plus a window is over before new replicas serve
    it, so recurring bursts must find their replicas still there. The capacity is a lower bound
    that grows only when replicas carry more than they were seen to: with every latency showing
    room and most of the budget unspent, a level load (not a burst's peak held) may go one
    replica below it, a probe the budget watches (a burn brings the replica back; a good tick
    teaches a higher capacity)."""
    serving = tick.serving
    if need is None or wanted >= serving or need[0] <= wanted:
        return wanted
    probe = not need[2] and tick.burn is not None and spare(tick.burn) and by_latency < serving
    reasons.append(f"headroom: {need[1]}" + (", probing one below" if probe else ""))
    return min(need[0] - (1 if probe else 0), serving)


def hold_while_rising(tick: Tick, wanted: int, reasons: list[str]) -> int:
    """No scale-down while arrivals rise (it would only have to be undone), unless the last two
    reactions show them falling. The shape it is for: a day (`diurnal`), where a 20-minute line
    through a hump still rises minutes after its top."""
    falling_now = headroom.falling(tick.history.demand, tick.now, 2 * tick.reaction) > 0
    held = 0.0 if falling_now else tick.growth
    if wanted < tick.serving and held > 0:
        reasons.append(f"arrivals rising ({held * 60:+.2f}/s a minute): no scale-down")
        return tick.serving
    return wanted


def unspent_budget(tick: Tick, wanted: int, need: tuple[int, str, bool] | None, reasons: list[str]) -> int:
    """A percentile that hovers in its band (a tail set by the workload, not the load) holds no
    count by itself: with most of the budget unspent, or all of it while the arrivals fall over
    the lookback (the window's latency is that of a load already gone), the arrivals' need at the
    learned capacity decides the way down; a burn brings the replicas back. This is the error
    budget as feedback, for a level load or a falling one, where latency alone would hold a
    peak's replicas."""
    fall = headroom.falling(tick.history.demand, tick.now)
    burn = tick.burn
    if need is None or burn is None or not (wanted >= tick.serving > need[0]) or not spare(burn, fall > 0):
        return wanted
    why = f"arrivals falling ({-fall * 60:+.2f}/s a minute), " if fall > 0 else ""
    reasons.append(f"{why}error budget unspent ({burn[1]:.1f}x over {budget.BURN_SECONDS:.0f}s): {need[1]}")
    return need[0]


def knee_floor(tick: Tick, wanted: int, reasons: list[str]) -> int:
    """Never so few that today's arrivals would take a replica near its knee (knee.py), where
    its batch reaches --max-num-seqs or the KV target and latency turns into a queue."""
    below = knee.replicas_below_knee(
        tick.history.running,
        tick.replicas.max_running,
        tick.policy.target_kv_cache_usage,
        tick.signals.request_rate or 0.0,
        tick.limit,
    )
    if below is not None and wanted < tick.serving and below[0] > wanted:
        reasons.append(f"the knee: {below[1]}")
        return min(below[0], tick.serving)
    return wanted


def leading_signals(tick: Tick, wanted: int, reasons: list[str]) -> int:
    """Once latency has used LEAD_FLOOR of the SLO: where it is going before the window's
    percentile shows it. Each signal (queue, KV usage, preemptions) asks for what its own target
    tracking asks, at least one more, at most half again: a queue keeps growing while new
    replicas load, and tracked in full it overshoots, as the HPA on queue length does."""
    if tick.highest < LEAD_FLOOR:
        return wanted
    signals, policy, serving = tick.signals, tick.policy, tick.serving
    queue = signals.queue_per_replica or 0.0
    by_kv = kv_recommendation(signals, tick.history, policy, tick.replicas, []) or 0
    by_queue = tracked(serving, queue, policy.target_queue_per_replica, policy.tolerance)
    leads = []
    if queue >= policy.target_queue_per_replica > 0:
        leads.append((by_queue, f"queue {queue:.1f}/replica"))
    if (signals.kv_usage_max or 0.0) >= policy.target_kv_cache_usage or by_kv > serving:
        leads.append((by_kv, f"KV usage {signals.kv_usage_max or 0.0:.2f}"))
    if (signals.preemption_rate or 0.0) > 0:
        leads.append((serving + 1, "preemptions"))
    lead = min(max((count for count, _ in leads), default=0), math.ceil(1.5 * serving))
    if not leads or max(lead, serving + 1) <= wanted:
        return wanted
    wanted = max(lead, serving + 1)
    names = ", ".join(name for _, name in leads)
    reasons.append(f"leading: {names} with latency at {tick.highest:.2f} of the SLO -> {wanted}")
    return wanted


def beyond_capacity(tick: Tick, wanted: int, reasons: list[str]) -> int | None:
    """The replicas today's arrivals need at the learned capacity, at once, when more arrive than
    the replicas were ever seen to serve inside the SLO and the budget burns or latency has used
    LEAD_FLOOR of it. Latency would get there in steps, each waiting for the last to show; the
    arrival rate is the demand itself. While a backlog drains latency overstates the load, so
    past today's count the arrivals decide (the count may be below `wanted`). The shape it is
    for: a load that rose past anything served (`ramp`'s steps, `flash-crowd`)."""
    burn = tick.movable_burn
    if not ((burn is not None and burn[0] > 1.0) or tick.highest >= LEAD_FLOOR):
        return None
    for_rate = headroom.replicas_for_rate(tick.history.demand, tick.signals.request_rate, tick.rate_window)
    if for_rate is None or for_rate[0] <= tick.serving:
        return None
    reasons.append(f"arrivals beyond the known capacity: {for_rate[1]}")
    return for_rate[0]


def forecast(tick: Tick, wanted: int, reasons: list[str]) -> int | None:
    """The forecast over the cold start: while arrivals rise (a trend clear of the noise), the
    replicas they will need when a pod started now serves, at the learned capacity. Only once
    latency has used LEAD_FLOOR of the SLO: a replica never pushed has been seen to serve little.
    The shape it is for: a day's morning (`diurnal`); latency is flat until the knee, and with a
    long cold start waiting for it to show is too late."""
    rate = tick.signals.request_rate
    if not (tick.growth > 0 and rate is not None and tick.highest >= LEAD_FLOOR):
        return None
    ahead = headroom.replicas_for_rate(
        tick.history.demand, rate + tick.growth * tick.horizon, tick.rate_window
    )
    if ahead is None or ahead[0] <= max(wanted, tick.serving) or burst_passes(tick, reasons):
        return None
    reasons.append(
        f"arrivals rising ({tick.growth * 60:+.2f}/s a minute), in {tick.horizon:.0f}s: {ahead[1]}"
    )
    return ahead[0]


def knee_ahead(tick: Tick, wanted: int, reasons: list[str]) -> int | None:
    """The arrivals expected when a pod started now serves (their trend over the last two
    reactions) kept below each replica's knee, at any latency: the knee is predicted from how
    the batch grew with the load, not learned from what was served. The trend is the present
    one: a 20-minute line averages a valley's fall with the rise after it and reads no growth on
    `two-peak`'s second peak, while the rise that matters is the one a reaction from now."""
    rate = tick.signals.request_rate
    if rate is None:
        return None
    below = knee.replicas_below_knee(
        tick.history.running,
        tick.replicas.max_running,
        tick.policy.target_kv_cache_usage,
        rate + tick.recent_growth * tick.horizon,
        tick.limit,
    )
    if below is None or below[0] <= max(wanted, tick.serving) or burst_passes(tick, reasons):
        return None
    reasons.append(f"the knee, {tick.horizon:.0f}s ahead: {below[1]}")
    return below[0]


def burst_passes(tick: Tick, reasons: list[str]) -> bool:
    """The guard on the two forecasts (`forecast`, `knee_ahead`): a burst served inside the SLO on
    today's count (the budget unspent, the arrivals within the learned capacity of today's
    replicas) and, by the precedent of the last hour's bursts, over before a pod started now
    would serve (headroom.passing_burst), asks for nothing: the replica would serve the valley
    after it, and the scale-down window would keep it there. The shape it is for: `bursts`
    (60 s at 5x every 10 minutes, against a 90 s cold start). A burst that outlasts its
    precedents, or burns the budget, is scaled for by latency and the arrivals as any load."""
    rate = tick.signals.request_rate
    if rate is None or tick.burn is None or not spare(tick.burn):
        return False
    within = headroom.replicas_for_rate(tick.history.demand, rate, tick.rate_window)
    if within is None or within[0] > tick.serving:
        return False
    why = headroom.passing_burst(
        tick.history.demand, tick.now, rate, tick.serving, tick.horizon, tick.rate_window
    )
    if why is not None:
        reasons.append(f"{why}: no replica for it")
    return why is not None


def settle(tick: Tick, wanted: int, by_rate: int, reasons: list[str]) -> int:
    """New replicas must start, then fill a window, before their effect shows: what was asked
    then must show before latency asks for more. The count read from the arrivals (`by_rate`)
    does not wait: it is read from the demand, not from latency."""
    if wanted <= tick.serving:
        return wanted
    settling = tick.reaction - tick.policy.interval_seconds
    last_up = tick.history.last_scale_up
    if last_up is None or tick.now - last_up > settling:
        return wanted
    wanted = min(wanted, max(tick.replicas.current, by_rate))
    if wanted != by_rate:
        reasons.append(f"the last scale-up has not shown in the window yet ({settling:.0f}s)")
    return wanted


def spare(burn: tuple[float, float], falling: bool = False) -> bool:
    """The error budget unspent enough for the arrivals to decide the way down: the last window
    within it, and the long one at most SPARE_BURN of it (within it while arrivals fall)."""
    return burn[0] <= 1.0 and burn[1] <= (1.0 if falling else SPARE_BURN)


def reaction_seconds(policy: Policy, replicas: ReplicaState) -> float:
    """How long a scale-up takes to show: the next tick, the cold start, then a metrics window."""
    cold_start = replicas.time_to_ready_seconds or DEFAULT_TIME_TO_READY
    return policy.interval_seconds + cold_start + policy.metrics_window_seconds
