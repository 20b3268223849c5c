"""decide(): the replica count for one LLMDeployment, a pure function of (signals, history,
policy, replica states) returning (replicas, reason). The same function runs in the operator and
in `kvasir simulate`.

The rules, in the order they apply:

0. With an SLO (`spec.autoscaling.slo`) and enough requests in the window to read it, the SLO is
   the target (slo_rule.py): the observed TTFT and time-per-output-token percentiles (the SLO's
   attainment, e.g. P99) are kept between SLO_ROOM and SLO_AIM of the objective, projecting the
   load-dependent part of latency (above the deployment's learned latency floor) onto the
   replica count. A percentile above the aim adds replicas only while the error budget burns
   (budget.py: more requests over an objective than 1 - attainment allows, in the last window
   and over ten minutes, or three times that in the last window). The arrivals (headroom.py)
   give the deployment's learned capacity (requests/s one replica served inside the SLO): a
   burn with more arrivals than that capacity covers is sized from the arrivals at once; a
   scale-down never goes below what a recurring burst's peak needs, nor happens while arrivals
   rise; with most of the budget unspent the arrivals' need decides the way down. Each replica's
   knee (knee.py: where its running batch, predicted from how it grew with the load, reaches
   --max-num-seqs or the KV target) keeps the arrivals a cold start ahead below it at any
   latency, and bounds every scale-down. KV usage, the
   queue, preemptions and the tail are leading signals once latency has used LEAD_FLOOR of its
   budget. Without an SLO, or without enough requests, rule 1 decides.
1. Target tracking on KV-cache usage and on waiting requests per replica; the larger recommendation
   wins. A signal within the tolerance band (default ±10%) of its target recommends no change.
   Pods that did not report count as unknown: they keep their own replica, and they forbid scaling
   down (missing, partial or stale metrics never shrink a deployment).
2. The latency tail (off unless `latencyRatio` is set): a P99/P50 ratio (inter-token latency or
   TTFT) above both `latencyRatio` and 1.5 times the deployment's own ratio at rest (learned) means saturation only together with a
   full cache, a real queue or preemptions, and then adds a replica. A ratio that is high at every
   load is the workload's shape (mixed lengths), not saturation, and changes nothing.
3. Prediction over the time-to-ready horizon: while the KV demand grows (a trend clear of the
   noise), scale up for the demand expected when a new pod would be ready (the pods' measured
   start time), capped at twice the current.
4. Capacity on the way: recommendations are computed from the pods that serve now and compared
   with the replica count already asked for, so pods still loading a model count as capacity and
   a slow load never causes a runaway scale-up.
5. Panic: a queue of `panicThreshold` x its target per replica acts at once (no scale-up window,
   a doubled step) and forbids scaling down until it has been gone for `panicHoldSeconds`.
6. Up fast, down slowly: scale-ups limited to max(4 pods, 100%) per decision; scale-downs take the
   highest recommendation of the stabilization window (default 300 s; longer while scale-up
   episodes recur at a steady interval, so a recurring peak finds its capacity; one reaction
   while the arrivals fall with the SLO's error budget unspent, _falling_window), at most
   max(scaleDownMaxPods, scaleDownMaxPercent) per period, and only if the load would still fit
   the smaller count (llm-d's rule).
7. Bounds: minReplicas..maxReplicas, always.
8. Zero (minReplicas 0, idle.py): the rules above run with a floor of one replica; the last one
   goes only after `scaleToZero.idleSeconds` with no request at the router or the pods, read on
   every source (never on missing metrics), and never from more than one replica in one step. At
   zero, requests held at the router bring one replica back (the router asks for it too).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from kvasir.operator.autoscaler import budget, headroom, knee, learned, pressure, slo_rule
from kvasir.operator.autoscaler.idle import Idleness
from kvasir.operator.autoscaler.policy import Policy
from kvasir.operator.autoscaler.signals import Signals
from kvasir.operator.autoscaler.state import DEFAULT_TIME_TO_READY, DecisionRecord, History, ReplicaState
from kvasir.operator.autoscaler.targets import by_targets

# The state types (state.py), DEFAULT_TIME_TO_READY and Policy are re-exported: the operator's
# loop, pods.py and the simulator take them from here.
__all__ = [
    "BLOCKED", "DEFAULT_TIME_TO_READY", "HOLD", "NO_METRICS", "SCALE_DOWN", "SCALE_UP", "STABILIZING",
    "Decision", "DecisionRecord", "History", "Policy", "ReplicaState", "decide",
]  # fmt: skip


# Decision kinds: a small set, for the operator's metrics and Events (the reason has the details).
SCALE_UP, SCALE_DOWN, HOLD, STABILIZING, BLOCKED, NO_METRICS = (
    "scale_up",
    "scale_down",
    "hold",
    "stabilizing",
    "blocked",
    "no_metrics",
)


@dataclass(frozen=True)
class Decision:
    replicas: int
    reason: str
    kind: str  # one of the kinds above
    recommendation: int  # what the signals alone ask for, before windows, limits and bounds
    panic: bool
    history: History = field(repr=False, default_factory=History)


def _clamp(value: int, policy: Policy) -> int:
    return max(policy.min_replicas, min(policy.max_replicas, value))


def _recommend(
    now: float, signals: Signals, history: History, policy: Policy, replicas: ReplicaState
) -> tuple[int, list[str]]:
    """(recommended replicas, reasons) from the signals alone."""
    serving = signals.reporting_replicas
    unknown = signals.ready_replicas - serving
    reasons: list[str] = []
    slo = policy.slo
    pressures = [] if slo is None else pressure.smoothed(now, history, pressure.slo_pressures(signals, slo))
    by_slo = (
        slo_rule.by_slo(now, signals, history, policy, replicas, pressures, reasons) if pressures else None
    )
    recommendation = by_slo if by_slo is not None else by_targets(signals, history, policy, replicas, reasons)
    ratio = signals.latency_ratio
    if policy.use_latency_ratio and policy.target_latency_ratio is not None and ratio is not None:
        threshold = learned.tail_threshold(history.ratios, policy.target_latency_ratio)
        if ratio > threshold:
            busy = (
                (signals.kv_usage_max or 0.0) >= policy.target_kv_cache_usage
                # A real queue (a quarter of the target per replica), not one request caught waiting.
                or (signals.queue_per_replica or 0.0) >= 0.25 * policy.target_queue_per_replica
                or (signals.preemption_rate or 0.0) > 0
            )
            calm = (
                by_slo is not None and max(p.value for p in pressures) < pressure.LEAD_FLOOR
            )  # room to spare
            if busy and not calm:
                recommendation = max(recommendation, serving + 1)
                reasons.append(
                    f"P99/P50 latency {ratio:.1f} > {threshold:.3g} while saturated -> {recommendation}"
                )
            elif not busy:
                reasons.append(f"P99/P50 latency {ratio:.1f} with an idle cache and no queue: not saturation")
    return recommendation + unknown, reasons


def decide(
    now: float,
    signals: Signals | None,
    history: History,
    policy: Policy,
    replicas: ReplicaState,
    idle: Idleness | None = None,
) -> Decision:
    """The replica count to ask for now, why, and the history to pass to the next call. `idle`
    (minReplicas 0 only): how long no request was seen, and requests held at the router."""
    if policy.min_replicas > 0:
        return _decide(now, signals, history, policy, replicas)
    return _decide_with_zero(now, signals, history, policy, replicas, idle or Idleness(None))


def _decide_with_zero(
    now: float,
    signals: Signals | None,
    history: History,
    policy: Policy,
    replicas: ReplicaState,
    idle: Idleness,
) -> Decision:
    """Rule 8: one replica is the floor of every other rule; zero is reached only from one, idle."""
    current = replicas.current
    floor = replace(policy, min_replicas=1)
    if current == 0:
        if idle.held > 0:
            why = f"activation: {idle.held:.0f} requests held at the router"
            return _finish(now, 1, why, SCALE_UP, 0, False, history, floor, 1)
        return Decision(0, "scaled to zero: no requests", HOLD, 0, False, history)
    decision = _decide(now, signals, history, floor, replicas)
    if decision.replicas > 1 or current > 1:
        return decision
    wait = policy.idle_seconds
    if idle.seconds is None or idle.seconds < wait:
        return decision
    if signals is not None and not signals.complete:
        return decision  # a ready pod that did not report may be serving
    why = f"no requests for {idle.seconds:.0f}s (scaleToZero.idleSeconds {wait}): scaling to zero"
    return _finish(now, 0, why, SCALE_DOWN, current, decision.panic, decision.history, policy, 0)


def _decide(
    now: float, signals: Signals | None, history: History, policy: Policy, replicas: ReplicaState
) -> Decision:
    """Rules 0 to 7, within minReplicas..maxReplicas."""
    current = replicas.current
    if signals is None or signals.reporting_replicas == 0:
        target = _clamp(current, policy)
        reason = "no metrics from any ready pod: holding" if target == current else "bounds"
        return _finish(now, target, reason, NO_METRICS, current, False, history, policy, current)

    history = _learn(now, signals, _remember_load(now, signals, history, replicas), policy)
    recommendation, reasons = _recommend(now, signals, history, policy, replicas)
    history = _panic(now, signals, history, policy)
    panicking = history.panic_until is not None

    # While peaks recur, the scale-down window outlasts their interval (learned.hold_seconds);
    # while the arrivals fall inside the SLO, it is one reaction (_falling_window).
    down_window = learned.hold_seconds(history.episodes, now, policy.scale_down_stabilization_seconds)
    down_window = _falling_window(now, history, policy, replicas, down_window)
    window = max(down_window, policy.scale_up_stabilization_seconds)
    recent = (*((t, r) for t, r in history.recommendations if t > now - window), (now, recommendation))
    history = replace(history, recommendations=recent)

    # Pods stuck loading are not capacity: what the signals ask for comes on top of them.
    effective = current - replicas.stuck
    if recommendation > effective:
        up_window = 0.0 if panicking else policy.scale_up_stabilization_seconds
        wanted = min(r for t, r in recent if t > now - up_window or t == now) + replicas.stuck
        if wanted <= current:
            why = f"scale-up stabilizing: the lowest recommendation in {up_window:.0f}s is {wanted}"
            return _finish(
                now, current, why, STABILIZING, current, panicking, history, policy, recommendation
            )
        step = max(policy.scale_up_max_pods, math.ceil(current * policy.scale_up_max_percent / 100))
        if panicking:
            step *= 2
        target = _clamp(min(wanted, current + step), policy)
        why = ("panic: " if panicking else "") + "; ".join(reasons)
        return _finish(now, target, why, SCALE_UP, current, panicking, history, policy, recommendation)

    if recommendation < current:
        highest = max(r for t, r in recent if t > now - down_window or t == now)
        blocked = _scale_down_blocker(
            now, signals, history, policy, replicas, panicking, highest, down_window
        )
        if blocked:
            blocked = f"{blocked} ({'; '.join(reasons)})" if reasons else blocked
            kind = STABILIZING if blocked.startswith("scale-down stabilizing") else BLOCKED
            if blocked.startswith("waiting for"):
                kind = HOLD
            return _finish(
                now,
                _clamp(current, policy),
                blocked,
                kind,
                current,
                panicking,
                history,
                policy,
                recommendation,
            )
        target = _clamp(max(highest, current - _scale_down_step(now, history, policy, current)), policy)
        return _finish(
            now, target, "; ".join(reasons), SCALE_DOWN, current, panicking, history, policy, recommendation
        )

    why = "within tolerance of the targets: " + "; ".join(reasons)
    return _finish(
        now, _clamp(current, policy), why, HOLD, current, panicking, history, policy, recommendation
    )


def _falling_window(
    now: float, history: History, policy: Policy, replicas: ReplicaState, window: float
) -> float:
    """The scale-down window while the arrivals fall (over the last two reactions, clear of the
    noise) with the SLO's error budget unspent: one reaction (the next tick, a cold start, a
    metrics window), not `window`. The window guards a count read from noisy signals against
    flapping; on the way down from a peak the arrivals are the demand itself, the budget is the
    feedback (a count taken too low burns it, and the replicas come back), and a window held
    past the reaction keeps the peak's replicas through the fall (the two-peak day). A window
    lengthened because peaks recur (learned.hold_seconds) is kept."""
    slo = policy.slo
    if slo is None or window > policy.scale_down_stabilization_seconds:
        return window
    reaction = slo_rule.reaction_seconds(policy, replicas)
    rates = budget.burn_rates(history.burns, now, slo.attainment)
    if rates is None or not slo_rule.spare(rates, falling=True):
        return window
    if headroom.falling(history.demand, now, 2 * reaction) <= 0:
        return window
    return min(window, reaction)


def _remember_load(now: float, signals: Signals, history: History, replicas: ReplicaState) -> History:
    """The KV demand (usage x serving replicas) of the last 1.5 time-to-ready, for rule 3's trend.
    It is measured only on a settled, unsaturated deployment: a full cache hides demand (so adding
    replicas would look like growth), and so does a count still changing."""
    horizon = replicas.time_to_ready_seconds or DEFAULT_TIME_TO_READY
    load = tuple((t, v) for t, v in history.load if t >= now - 1.5 * horizon)
    settled = replicas.ready == replicas.current and signals.complete
    if signals.kv_usage_mean is not None and (signals.kv_usage_max or 0.0) < 0.95 and settled:
        load = (*load, (now, signals.kv_usage_mean * signals.reporting_replicas))
    elif not settled:
        load = ()
    return replace(history, load=load)


def _panic(now: float, signals: Signals, history: History, policy: Policy) -> History:
    """Rule 5: a queue of panicThreshold x its target per replica starts (or extends) a panic
    that lasts panicHoldSeconds; `panic_until` is None once it is over."""
    queue = signals.queue_per_replica or 0.0
    panic_now = (
        policy.target_queue_per_replica > 0
        and queue >= policy.panic_threshold * policy.target_queue_per_replica
    )
    panic_until = now + policy.panic_hold_seconds if panic_now else history.panic_until
    panicking = panic_until is not None and now < panic_until
    return replace(history, panic_until=panic_until if panicking else None)


def _learn(now: float, signals: Signals, history: History, policy: Policy) -> History:
    """The readings of this tick that the baselines learn from (learned.py)."""
    slo = policy.slo
    found = {p.index: p for p in ([] if slo is None else pressure.slo_pressures(signals, slo))}
    # The tail at rest: no queue, the cache below its target, nothing preempted.
    at_rest = (
        signals.complete
        and (signals.waiting or 0.0) == 0
        and (signals.kv_usage_max or 0.0) < policy.target_kv_cache_usage
        and (signals.preemption_rate or 0.0) == 0
    )
    ttft, tpot = history.pressures
    history = replace(
        history,
        ratios=learned.remember(history.ratios, now, signals.latency_ratio if at_rest else None),
        pressures=(
            pressure.remember(ttft, now, found.get(0), at_rest),
            pressure.remember(tpot, now, found.get(1), at_rest),
        ),
    )
    if slo is None:
        return history
    burns = budget.remember(history.burns, now, budget.missed(signals, slo))
    rates = budget.burn_rates(burns, now, slo.attainment)
    # A tick that met the SLO (the budget not burning, no queue building): its arrivals per
    # replica are a rate one replica is known to serve, and, by how far its latencies are below
    # the aim, a little more (pressure.stretch).
    good = (
        signals.complete
        and rates is not None
        and rates[0] <= 1.0
        and (signals.queue_per_replica or 0.0) < max(1.0, 0.25 * policy.target_queue_per_replica)
    )
    demand = headroom.remember(
        history.demand,
        now,
        signals.request_rate,
        signals.reporting_replicas,
        pressure.stretch(history, list(found.values())) if good else 0.0,
        signals.window_seconds or policy.metrics_window_seconds,
    )
    # Little's law holds for a batch that can still grow: a queued tick's batch is capped.
    unqueued = signals.complete and (signals.queue_per_replica or 0.0) < 1.0
    readings = knee.remember(
        history.running,
        now,
        signals.request_rate if unqueued else None,
        signals.running,
        signals.kv_usage_mean,
        signals.reporting_replicas,
    )
    return replace(history, burns=burns, demand=demand, running=readings)


def _scale_down_blocker(
    now: float,
    signals: Signals,
    history: History,
    policy: Policy,
    replicas: ReplicaState,
    panicking: bool,
    highest: int,
    window: float | None = None,
) -> str:
    """Why scaling down must wait ('' when it may go ahead)."""
    current = replicas.current
    if not signals.complete:
        missing = signals.ready_replicas - signals.reporting_replicas
        return f"metrics missing from {missing} of {signals.ready_replicas} ready pods: no scale-down"
    if replicas.ready < current:
        return (
            f"waiting for {current - replicas.ready} starting replicas (capacity on the way): no scale-down"
        )
    if panicking:
        return "panic mode: no scale-down"
    if highest >= current:
        seconds = policy.scale_down_stabilization_seconds if window is None else window
        held = " (peaks recur: capacity held)" if seconds > policy.scale_down_stabilization_seconds else ""
        if seconds < policy.scale_down_stabilization_seconds:
            held = " (arrivals falling inside the SLO: one reaction)"
        return f"scale-down stabilizing: the highest recommendation in {seconds:.0f}s is {highest}{held}"
    if (
        history.last_scale_down is not None
        and now - history.last_scale_down < policy.scale_down_period_seconds
    ):
        return f"scale-down rate: one step per {policy.scale_down_period_seconds:.0f}s"
    # llm-d's rule: the load of N replicas must fit the smaller count without crossing a target
    # (implied by the recommendations today; kept so that no future rule can shrink past it).
    smaller = max(highest, current - _scale_down_step(now, history, policy, current), 1)
    kv = signals.kv_usage_mean or 0.0
    projected_kv = kv * current / smaller
    projected_queue = (signals.waiting or 0.0) / smaller
    if projected_kv > policy.target_kv_cache_usage * (1 + policy.tolerance) or (
        policy.target_queue_per_replica > 0 and projected_queue > policy.target_queue_per_replica
    ):
        return f"the load would not fit {smaller} replicas (KV {projected_kv:.2f}): no scale-down"
    if policy.target_itl_seconds is not None and signals.itl_mean is not None:
        projected_itl = signals.itl_mean * current / smaller  # latency grows with load per replica
        if projected_itl > policy.target_itl_seconds * (1 + policy.tolerance):
            return f"the load would not fit {smaller} replicas (mean ITL {projected_itl * 1e3:.0f} ms): no scale-down"
    return ""


def _scale_down_step(now: float, history: History, policy: Policy, current: int) -> int:
    """The most pods one scale-down removes: scaleDownMaxPods, or scaleDownMaxPercent of the
    replicas where that is more (a deployment scaled far out comes back in minutes, not in one
    pod a minute) while an SLO guards the way down (its error budget read this tick: a burn
    brings replicas back). The targets alone do not see a compute-bound replica's saturation;
    without the SLO's reading the slow step is their margin."""
    guarded = bool(history.burns) and history.burns[-1][0] == now
    if not guarded:
        return policy.scale_down_max_pods
    return max(policy.scale_down_max_pods, current * policy.scale_down_max_percent // 100)


def _finish(
    now: float,
    target: int,
    reason: str,
    kind: str,
    current: int,
    panicking: bool,
    history: History,
    policy: Policy,
    recommendation: int,
) -> Decision:
    if target != current:
        changed = DecisionRecord(now, current, target, reason)
        history = replace(
            history,
            decisions=(*history.decisions, changed)[-10:],
            last_scale_up=now if target > current else history.last_scale_up,
            episodes=(
                learned.new_episode(history.episodes, now, policy.scale_down_stabilization_seconds)
                if target > current
                else history.episodes
            ),
            last_scale_down=now if target < current else history.last_scale_down,
        )
    if (
        target != current
        and target in (policy.min_replicas, policy.max_replicas)
        and recommendation != target
    ):
        reason = f"{reason} (bounded to {target})"
    if target > current:
        kind = SCALE_UP
    elif target < current:
        kind = SCALE_DOWN
    return Decision(target, reason, kind, recommendation, panicking, history)
