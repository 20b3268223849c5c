"""The error budget and the headroom (budget.py, headroom.py): latency above the aim scales up
only while the budget burns; a fast burn is sized from the arrivals at the learned capacity; a
scale-down never goes below what the arrivals' envelope needs. Each rule of decide() they add
is tested here against hand-computed figures."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from kvasir.observability.metric_names import QUEUE_BUCKETS, TPOT_BUCKETS, TTFT_BUCKETS
from kvasir.operator.autoscaler import budget, headroom
from kvasir.operator.autoscaler.decide import History, ReplicaState, decide
from kvasir.operator.autoscaler.metrics import Histogram, PodMetrics
from kvasir.operator.autoscaler.policy import Policy, Slo
from kvasir.operator.autoscaler.signals import MetricsWindow, Scrape, Signals, histogram_count_above

SLO = Slo(ttft_seconds=1.0, itl_seconds=0.1, attainment=0.99)
POLICY = Policy(max_replicas=40, slo_ttft_seconds=1.0, slo_itl_seconds=0.1, slo_attainment=0.99)


def histogram(values: list[float], bounds: tuple[float, ...]) -> Histogram:
    cumulative = {b: float(sum(1 for v in values if v <= b)) for b in bounds}
    cumulative[math.inf] = float(len(values))
    return Histogram(cumulative)


def signals(
    replicas: int = 10,
    *,
    tpot: list[float] | None = None,
    rate: float | None = 5.0,
    waiting: float = 0.0,
    kv: float = 0.3,
) -> Signals:
    """200 requests at 50 ms per token unless `tpot` says otherwise; TTFT 0.1 s for all."""
    values = tpot if tpot is not None else [0.05] * 200
    return Signals(
        ready_replicas=replicas,
        reporting_replicas=replicas,
        kv_usage_mean=kv,
        kv_usage_max=kv,
        waiting=waiting,
        running=4.0 * replicas,
        preemption_rate=0.0,
        generation_tokens_rate=100.0 * replicas,
        itl_ratio=2.0,
        ttft_ratio=None,
        ttft_histogram=histogram([0.1] * len(values), TTFT_BUCKETS),
        tpot_histogram=histogram(values, TPOT_BUCKETS),
        request_rate=rate,
    )


def state(current: int = 10) -> ReplicaState:
    return ReplicaState(current=current, ready=current, time_to_ready_seconds=30.0)


def run(history: History, ticks: list[tuple[float, Signals]], current: int = 10) -> History:
    for now, tick in ticks:
        history = decide(now, tick, history, POLICY, state(current)).history
    return history


# ---- the burn ---------------------------------------------------------------------------------


def test_requests_over_an_objective_are_counted_from_the_buckets() -> None:
    buckets = histogram([0.05] * 90 + [0.2] * 10, TPOT_BUCKETS).buckets
    assert histogram_count_above(0.1, buckets) == 10  # 0.1 is a bucket bound: exact
    assert histogram_count_above(0.3, buckets) == 0
    # Within a bucket, linearly (as histogram_quantile reads it): 0.1875 is half of (0.175, 0.2].
    assert histogram_count_above(0.1875, buckets) == pytest.approx(5.0)
    # TTFT and time per token add up: a request that misses both counts twice.
    tick = signals(tpot=[0.05] * 190 + [0.2] * 10)
    tick = replace(tick, ttft_histogram=histogram([0.1] * 195 + [2.0] * 5, TTFT_BUCKETS))
    assert budget.missed(tick, SLO) == ((5.0, 10.0), 200.0)


def test_the_burn_is_the_share_missed_over_the_share_allowed_in_two_windows() -> None:
    burns: budget.Burns = ()
    for t in range(0, 600, 15):
        burns = budget.remember(burns, float(t), ((0.0, 1.0), 200.0))  # 0.5%: half the budget
    burns = budget.remember(burns, 600.0, ((4.0, 6.0), 200.0))  # 5% in the last window
    short, long = budget.burn_rates(burns, 600.0, 0.99) or (0, 0)
    assert short == pytest.approx(5.0)
    assert long == pytest.approx((39 * 1 + 10) / (40 * 200) / 0.01)  # the 600 s window: 0.61
    # The time per token's misses alone (the TTFT's left out).
    assert budget.burn_rates(burns, 600.0, 0.99, (1,)) == pytest.approx((3.0, (39 + 6) / (40 * 200) / 0.01))
    assert budget.burning((short, long)).startswith("error budget burning 5.0x")  # fast: alone
    assert budget.burning((2.0, 0.6)) == ""  # a slow burn must last
    assert budget.burning((2.0, 1.2)) != ""
    assert budget.burn_rates(burns, 615.0, 0.99) is None  # no reading this tick


def test_latency_above_the_aim_scales_up_only_while_the_budget_burns() -> None:
    calm = [(t * 15.0, signals()) for t in range(12)]
    history = run(History.starting_at(0.0, 10), calm)
    # 2% of requests at 200 ms: the P99 is far above the aim, the last window burns 2x, the
    # last ten minutes 0.3x: one long prompt's neighbours, not a load to scale for.
    spike = signals(tpot=[0.05] * 196 + [0.2] * 4)
    d = decide(180, spike, history, POLICY, state())
    d = decide(195, spike, d.history, POLICY, state())
    assert d.replicas == 10 and "the error budget is not burning" in d.reason, d.reason
    # The same 2% for ten minutes: a sustained burn. The capacity is known (5/s served inside
    # the SLO by 10) and the arrivals are within it: latency adds a tenth at a time.
    slow = run(history, [(180 + t * 15.0, spike) for t in range(40)])
    d = decide(780, spike, slow, POLICY, state())
    assert d.replicas == 11 and "error budget burning 2.0x" in d.reason, d.reason
    # Without a known capacity (no arrival rate reported), a quarter more at most.
    blind = [(t, replace(tick, request_rate=None)) for t, tick in calm]
    slow = run(
        run(History.starting_at(0.0, 10), blind),
        [(180 + t * 15.0, replace(spike, request_rate=None)) for t in range(40)],
    )
    d = decide(780, replace(spike, request_rate=None), slow, POLICY, state())
    assert 11 < d.replicas <= 13 and "error budget burning 2.0x" in d.reason, d.reason
    # 5% in one window: a fast burn acts alone; with the arrivals within the known capacity,
    # a tenth more.
    fast = signals(tpot=[0.05] * 190 + [0.2] * 10)
    d = decide(180, fast, history, POLICY, state())
    d = decide(195, fast, d.history, POLICY, state())
    assert d.replicas == 11 and "error budget burning 5.0x" in d.reason, d.reason
    # 12%: a jump (over budget.JUMP_BURN), up to half again whatever the capacity says.
    jump = signals(tpot=[0.05] * 176 + [0.2] * 24)
    d = decide(180, jump, history, POLICY, state())
    d = decide(195, jump, d.history, POLICY, state())
    assert 13 < d.replicas <= 15 and "error budget burning 12.0x" in d.reason, d.reason


def test_requests_over_a_latency_replicas_cannot_move_do_not_add_replicas_for_the_other() -> None:
    # 2% of requests take 3 s to their first token with no queueing (prompts whose prefill alone
    # is three times the objective), and the time per token's P99 (93 ms) is above its aim with
    # 0.5% of requests over 100 ms: its own budget is not burning.
    tpot = [0.05] * 196 + [0.095] * 3 + [0.2]
    tick = replace(
        signals(tpot=tpot),
        ttft_histogram=histogram([0.1] * 196 + [3.0] * 4, TTFT_BUCKETS),
        queue_time_histogram=histogram([0.005] * 200, QUEUE_BUCKETS),
    )
    assert budget.missed(tick, SLO) == ((4.0, 1.0), 200.0)
    d = decide(15.0, tick, History.starting_at(0.0, 10), POLICY, state())
    assert d.recommendation == 10, d.reason
    assert "of it at any load" in d.reason  # TTFT: its floor is past the aim, left out
    assert "above 0.90, but the error budget is not burning (0.5x, 0.5x over 600s)" in d.reason, d.reason
    # The same TTFT misses spent queueing: replicas move them, the budget burns 2.5x.
    queued = replace(tick, queue_time_histogram=histogram([0.005] * 196 + [2.9] * 4, QUEUE_BUCKETS))
    d = decide(15.0, queued, History.starting_at(0.0, 10), POLICY, state())
    assert d.replicas > 10 and "error budget burning 2.5x" in d.reason, d.reason


# ---- the headroom -----------------------------------------------------------------------------


def low(rate: float, window: float = 60.0) -> float:
    """A window's rate taken two Poisson standard deviations low, as the capacity reads it."""
    return rate - 2 * math.sqrt(rate / window)


def test_capacity_is_the_most_a_replica_served_inside_the_slo_stretched_by_its_room() -> None:
    demand: headroom.Demand = ()
    for t in range(7):
        demand = headroom.remember(demand, t * 15.0, 4.0, 10, 1.0, 60.0)
    assert headroom.capacity(demand) is None  # too few good ticks
    demand = headroom.remember(demand, 105.0, 6.0, 10, 1.2, 60.0)  # latency room for 20% more
    demand = headroom.remember(demand, 120.0, 20.0, 10, 0.0, 60.0)  # a tick that missed: never counted
    capacity = low(6.0) / 10 * 1.2
    assert headroom.capacity(demand) == pytest.approx(capacity)
    count, why = headroom.replicas_for_rate(demand, 9.0, 60.0) or (0, "")
    assert count == math.ceil(low(9.0) / capacity) == 13 and "arrivals 9.00/s (at least 8.23)" in why
    assert headroom.replicas_for_rate(demand, 4.0, 60.0) == (
        6,
        "arrivals 4.00/s (at least 3.48) at 0.644/s per replica -> 6",
    )


def test_steady_arrivals_hold_their_trend_bursts_their_peak_level_shifts_their_level() -> None:
    steady: headroom.Demand = ()
    rising: headroom.Demand = ()
    bursty: headroom.Demand = ()
    shifted: headroom.Demand = ()
    for i in range(80):
        t = i * 15.0
        wiggle = 0.2 if i % 2 else -0.2  # within a 60 s window's Poisson noise at 4/s (sd 0.26)
        steady = headroom.remember(steady, t, 4.0 + wiggle, 10, 1.0, 60.0)
        rising = headroom.remember(rising, t, 2.0 + t / 600.0, 10, 1.0, 60.0)  # +0.1/s a minute
        bursty = headroom.remember(bursty, t, 7.5 if i % 40 < 4 else 1.5, 10, 1.0, 60.0)  # 45 s bursts
        shifted = headroom.remember(shifted, t, 8.0 if 10 <= i < 60 else 0.8, 10, 1.0, 60.0)  # a crowd
    now = 79 * 15.0
    reaction = 82.0  # a tick, a 7 s cold start and a 60 s window
    assert headroom.envelope(steady, now, 60.0, reaction) == pytest.approx(4.0, abs=0.05)
    assert headroom.envelope(rising, now, 60.0, reaction) == pytest.approx(2.0 + now / 600.0)
    assert headroom.rising(rising, now) == pytest.approx(1 / 600.0)
    assert headroom.rising(steady, now) == 0.0
    # A burst shorter than two reactions is held long after it; a crowd of 12 minutes is not.
    assert headroom.envelope(bursty, now, 60.0, reaction) == 7.5
    assert headroom.envelope(shifted, now, 60.0, reaction) < 2.0


def test_a_scale_down_never_goes_below_what_the_arrivals_envelope_needs() -> None:
    # Bursts of 7.5/s every ten minutes, met by 10 replicas (0.75/s each, at the aim: no room
    # to credit); between them 1.5/s and latency at its floor: the SLO rule alone would go to 1.
    history = History.starting_at(0.0, 10)
    for i in range(80):
        burst = i % 40 < 4
        tick = signals(rate=7.5 if burst else 1.5, tpot=[0.09 if burst else 0.03] * 200)
        history = decide(i * 15.0, tick, history, POLICY, state()).history
    quiet = signals(rate=1.5, tpot=[0.03] * 200)
    d = decide(1400.0, quiet, history, POLICY, state())
    assert "headroom: a recent burst's peak 7.50/s" in d.reason, d.reason
    assert d.recommendation == 10, d.reason
    # A floor only: it never adds a replica by itself.
    fewer = replace(quiet, ready_replicas=6, reporting_replicas=6)
    d = decide(1400.0, fewer, history, POLICY, ReplicaState(current=6, ready=6, time_to_ready_seconds=30.0))
    assert d.replicas <= 6


def test_a_fast_burn_is_sized_from_the_arrivals_even_before_the_last_scale_up_shows() -> None:
    calm = [(t * 15.0, signals(rate=4.0, tpot=[0.09] * 200)) for t in range(12)]
    history = run(History.starting_at(0.0, 10), calm)  # 0.4/s per replica, at the aim: no room
    history = replace(history, last_scale_up=170.0)
    crowd = signals(rate=12.0, tpot=[0.05] * 100 + [0.3] * 100, waiting=30.0)
    d = decide(180, crowd, history, POLICY, state())
    d = decide(195, crowd, d.history, POLICY, state())
    # 12/s (at least 11.1) at 0.348/s per replica (4/s, at least 3.48, on 10): 32; the
    # scale-up step allows 10 more at once: 20.
    capacity = low(4.0) / 10
    need = math.ceil(low(12.0) / capacity)
    assert f"arrivals 12.00/s (at least 11.11) at {capacity:.3g}/s per replica -> {need}" in d.reason, (
        d.reason
    )
    assert d.replicas == 20 and d.recommendation == need == 32


def test_the_arrival_rate_is_served_requests_plus_the_queue_growth_over_the_window() -> None:
    window = MetricsWindow(60, min_samples=1)

    def pod(served: int, waiting: float) -> PodMetrics:
        return PodMetrics(
            gauges={"waiting": waiting},
            histograms={"ttft": Histogram({0.5: float(served), math.inf: float(served)})},
        )

    window.add(Scrape(0.0, {"a": pod(0, 0.0)}))
    window.add(Scrape(15.0, {"a": pod(30, 5.0), "b": pod(0, 0.0)}))
    window.add(Scrape(30.0, {"a": pod(60, 5.0), "b": pod(15, 0.0)}))
    # a: 60 served + 5 queued; b, new: 15 served since it came: 80 requests over the 30 s window
    # (2/s, then 3/s once b came). Not b at its own rate next to a's over 30 s (65/30 + 15/15 =
    # 3.17/s, above even the last 15 s' 3/s): that reads a scale-up as a load that rose.
    assert window.signals(["a", "b"]).request_rate == pytest.approx(80 / 30)


def test_no_scale_down_while_arrivals_rise_unless_the_budget_is_unspent() -> None:
    # Arrivals rising by 0.1/s a minute (2 -> 3/s), a replica known to serve 1/s inside the SLO
    # (so the arrivals' need, 3, binds nothing), latency with room (P99 30 ms) but 1% of requests
    # at 200 ms for ten minutes: the budget is spent as fast as it may be, none to spare.
    tpot = [0.03] * 198 + [0.2] * 2
    demand: headroom.Demand = tuple(
        (i * 15.0, 2.0 + i * 0.025, 2.0, 1.0, 2.0) for i in range(40)
    )  # 2/s on 2 replicas
    burns: budget.Burns = tuple((i * 15.0, (0.0, 2.0), 200.0) for i in range(40))
    history = replace(History.starting_at(0.0, 10), demand=demand, burns=burns)
    d = decide(600.0, signals(rate=3.0, tpot=tpot), history, POLICY, state())
    assert d.replicas == 10 and "arrivals rising (+0.10/s a minute): no scale-down" in d.reason, d.reason
    # The same without the rise: latency's room decides (within the scale-down step).
    flat = tuple((t, 3.0, serving, stretch, low) for t, _, serving, stretch, low in demand)
    d = decide(600.0, signals(rate=3.0, tpot=tpot), replace(history, demand=flat), POLICY, state())
    assert d.replicas < 10 and "arrivals rising" not in d.reason, d.reason


def test_with_the_budget_unspent_the_arrivals_decide_the_way_down() -> None:
    # 6/s served by 10 with latency at its floor (P99 30 ms: room for a quarter more each), for
    # five minutes; then 3/s with the P99 at 85 ms, in its band: latency alone holds 10.
    history = History.starting_at(0.0, 10)
    for i in range(20):
        history = decide(i * 15.0, signals(rate=6.0, tpot=[0.03] * 200), history, POLICY, state()).history
    for i in range(20, 30):
        history = decide(i * 15.0, signals(rate=3.0, tpot=[0.085] * 200), history, POLICY, state()).history
    d = decide(450.0, signals(rate=3.0, tpot=[0.085] * 200), history, POLICY, state())
    # The most served inside the SLO, credited with its room (up to MAX_STRETCH more).
    capacity = low(6.0) / 10 * headroom.MAX_STRETCH
    assert d.recommendation == math.ceil(3.0 / capacity) == 6, d.reason
    assert "error budget unspent (0.0x over 600s): arrivals to be ready for 3.00/s" in d.reason
    # With 2% of the requests over the objective in the last window: none to spare.
    missing = signals(rate=3.0, tpot=[0.085] * 196 + [0.2] * 4)
    d = decide(450.0, missing, history, POLICY, state())
    assert d.recommendation == 10 and "error budget unspent" not in d.reason, d.reason


def test_a_level_load_with_room_probes_one_replica_below_the_learned_capacity() -> None:
    # 6/s served by 10 with the time per token's P99 at its aim (85 ms, read as the 75-100 ms
    # bucket's top: no room to credit), then 4/s for five minutes with every latency far below
    # its aim and no request missing.
    busy, quiet = signals(rate=6.0, tpot=[0.085] * 200), signals(rate=4.0, tpot=[0.03] * 200)
    history = run(History.starting_at(0.0, 10), [(i * 15.0, busy if i < 20 else quiet) for i in range(40)])
    d = decide(600.0, signals(rate=4.0, tpot=[0.03] * 200), history, POLICY, state())
    capacity = headroom.capacity(d.history.demand) or 0.0
    assert capacity == pytest.approx(low(6.0) / 10)
    need = math.ceil(4.0 / capacity)  # 8: what the capacity seen so far says 4/s needs
    assert d.recommendation == need - 1 == 7, d.reason
    assert f"per replica -> {need}, probing one below" in d.reason, d.reason
    # The time per token at its aim again (the median of three ticks): no probe, the capacity's
    # count holds.
    busy = signals(rate=4.0, tpot=[0.085] * 200)
    d = decide(630.0, busy, run(history, [(600.0, busy), (615.0, busy)]), POLICY, state())
    assert d.recommendation == need and "probing" not in d.reason, d.reason


def test_while_arrivals_fall_the_whole_budget_may_be_spent_on_the_way_down() -> None:
    # Arrivals falling from 8 to 3/s over ten minutes on 10 replicas known to serve 0.6/s each;
    # the time per token's P99 at the objective (85 ms in the 75-100 ms bucket) with the budget
    # not burning: latency alone holds 10. 0.8% of the requests over the objective for ten
    # minutes: more than half the budget spent, not all.
    tpot = [0.085] * 199 + [0.2]
    demand: headroom.Demand = tuple((i * 15.0, 8.0 - i * 0.125, 10.0, 1.0, 6.0) for i in range(40))
    burns: budget.Burns = tuple((i * 15.0, (0.0, 1.6), 200.0) for i in range(40))
    history = replace(History.starting_at(0.0, 10), demand=demand, burns=burns)
    d = decide(600.0, signals(rate=3.0, tpot=tpot), history, POLICY, state())
    # The trend now is 3/s: at 0.6/s per replica, 5 replicas.
    assert d.recommendation == 5, d.reason
    assert "arrivals falling (-0.50/s a minute), error budget unspent (0.8x over 600s)" in d.reason, d.reason
    # The same spend with the arrivals level at 3/s: the budget's second half is not spent on
    # a scale-down, latency holds the count.
    flat = tuple((t, 3.0, serving, stretch, low) for t, _, serving, stretch, low in demand)
    d = decide(600.0, signals(rate=3.0, tpot=tpot), replace(history, demand=flat), POLICY, state())
    assert d.recommendation == 10 and "error budget unspent" not in d.reason, d.reason


def test_the_stretch_is_the_room_to_the_aim_at_most_a_quarter() -> None:
    from kvasir.operator.autoscaler.pressure import Pressure, stretch

    empty = History()
    # Floor 0.3 (TTFT less its queueing), at 0.5: (0.93 - 0.3) / (0.5 - 0.3) = 3.15, capped.
    assert stretch(empty, [Pressure(0, 0.5, "", floor=0.3)]) == headroom.MAX_STRETCH == 1.1
    # At 0.88 of the objective: (0.93 - 0.3) / (0.88 - 0.3) = 1.086.
    assert stretch(empty, [Pressure(0, 0.88, "", floor=0.3)]) == pytest.approx(0.63 / 0.58)
    # At the aim, or a floor near the objective (no replica count moves it): no room.
    assert stretch(empty, [Pressure(0, 0.95, "", floor=0.3)]) == 1.0
    assert stretch(empty, [Pressure(0, 0.92, "", floor=0.92)]) == 1.0
    # The tighter latency decides.
    both = [Pressure(0, 0.5, "", floor=0.3), Pressure(1, 0.88, "", floor=0.3)]
    assert stretch(empty, both) == pytest.approx(0.63 / 0.58)


def test_rising_arrivals_are_met_a_cold_start_ahead() -> None:
    # Arrivals rising by 0.32/s a minute reach 4.2/s on 2 replicas with latency at 0.6 of the
    # objective (past half: the leading signals act), inside the SLO: this tick says a replica
    # serves (4.2/s, at least 3.67) / 2 with a tenth more room (MAX_STRETCH). In the 75 s a new
    # pod takes to serve (a tick, its 30 s cold start, half a window) 4.6/s arrive (at least
    # 4.05): 3 replicas, asked for now, before the budget burns.
    demand: headroom.Demand = tuple((i * 15.0, 1.0 + 0.08 * i, 2.0, 1.0, 1.0) for i in range(40))
    history = replace(History.starting_at(0.0, 2), demand=demand)
    two = ReplicaState(current=2, ready=2, time_to_ready_seconds=30.0)
    d = decide(600.0, signals(2, rate=4.2, tpot=[0.06] * 200), history, POLICY, two)
    capacity = low(4.2) / 2 * headroom.MAX_STRETCH
    assert math.ceil(low(4.2 + 0.08 / 15 * 75) / capacity) == 3
    assert d.replicas == 3 and "arrivals rising (+0.32/s a minute), in 75s: arrivals 4.60/s" in d.reason, (
        d.reason
    )
    # Steady at 4.2/s, the same replicas are enough until latency or the budget says otherwise;
    # rising with latency at 0.3 of the objective, nothing is predicted yet.
    flat = tuple((t, 4.2, serving, stretch, low) for t, _, serving, stretch, low in demand)
    d = decide(600.0, signals(2, rate=4.2, tpot=[0.06] * 200), replace(history, demand=flat), POLICY, two)
    assert d.replicas <= 2, d.reason
    d = decide(600.0, signals(2, rate=4.2, tpot=[0.03] * 200), history, POLICY, two)
    assert d.replicas <= 2 and "arrivals rising (+0.32/s a minute), in" not in d.reason, d.reason


def test_a_scale_down_removes_at_most_its_pods_or_with_an_slo_its_percentage() -> None:
    """max(scaleDownMaxPods, scaleDownMaxPercent of the replicas, rounded down) per step while
    the SLO's budget is read; scaleDownMaxPods alone without it."""
    idle = signals(20, kv=0.01, tpot=[0.01] * 200)
    for percent, pods, expected in ((50, 1, 10), (25, 1, 15), (0, 1, 19), (10, 3, 17)):
        policy = replace(POLICY, scale_down_max_percent=percent, scale_down_max_pods=pods)
        d = decide(0, idle, History(), policy, state(20))
        assert (d.replicas, d.kind) == (expected, "scale_down"), (percent, pods, d.reason)
    no_slo = replace(POLICY, slo_ttft_seconds=None, slo_itl_seconds=None)
    d = decide(0, idle, History(), no_slo, state(20))
    assert (d.replicas, d.kind) == (19, "scale_down"), d.reason
