"""Each replica's knee (knee.py) and the rules of decide() that use it: the line fitted on
running requests against arrivals per replica is checked against Little's law solved by hand for
a step time that grows with the batch; the knee ahead scales up at any latency; the knee bounds a
scale-down; a hump is not held as a burst."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from kvasir.operator.autoscaler import headroom, knee, pressure
from kvasir.operator.autoscaler.decide import History, ReplicaState, decide
from kvasir.operator.autoscaler.learned import MIN_READINGS
from kvasir.operator.autoscaler.signals import Signals

from .test_budget import POLICY, signals

# A replica whose step takes A + B x (running requests) seconds, each request running K steps.
A, B, K = 0.006, 0.0001, 250.0


def running(rate: float) -> float:
    """Little's law solved for the batch: R = x K (A + B R)  =>  R = x K A / (1 - x K B)."""
    return rate * K * A / (1 - rate * K * B)


def readings(rates: list[float], kv_per_request: float = 0.001) -> knee.Readings:
    return tuple((i * 15.0, x, running(x), kv_per_request * running(x)) for i, x in enumerate(rates))


# Loads seen from 4 to 24/s: the busiest batch, running(24) = 90, is past MIN_REACH of 256.
SEEN = [4.0, 6.0, 8.0, 10.0, 12.0, 14.0, 16.0, 18.0, 20.0, 22.0, 24.0]


def test_the_line_is_littles_law_with_a_step_that_grows_with_the_batch() -> None:
    # Exact readings: x / R = 1 / (K A) - (B / A) x, with no error to steepen the slope.
    line = knee.fit(readings(SEEN))
    assert line is not None
    alpha, beta = line
    assert alpha == pytest.approx(1 / (K * A)) and beta == pytest.approx(B / A)
    assert knee.running_at(alpha, beta, 20.0) == pytest.approx(running(20.0))
    assert knee.running_at(alpha, beta, 40.0) == math.inf  # past saturation (1 / (K B) = 40/s)


def test_the_knee_is_where_the_batch_reaches_its_first_limit() -> None:
    seen = readings(SEEN)
    # 256 running: x K A / (1 - x K B) = 256  =>  x = 256 / (K (A + 256 B)) = 32.4/s.
    rate, why = knee.knee_rate(seen, 256, 0.8) or (0.0, "")
    assert rate == pytest.approx(256 / (K * (A + 256 * B)))
    assert "256 running" in why
    # A KV cache that holds 0.8 / 0.01 = 80 requests binds first: 80 / (K (A + 80 B)) = 22.9/s.
    full = readings(SEEN, kv_per_request=0.01)
    rate, why = knee.knee_rate(full, 256, 0.8) or (0.0, "")
    assert rate == pytest.approx(80 / (K * (A + 80 * B)))
    assert "KV 0.8 at 80 running" in why
    # The replicas that keep 60/s at 0.85 of the 32.4/s knee: 3.
    count, _ = knee.replicas_below_knee(seen, 256, 0.8, 60.0) or (0, "")
    assert count == math.ceil(60.0 / (knee.KNEE_USE * 256 / (K * (A + 256 * B)))) == 3


def test_no_knee_from_too_few_readings_too_narrow_a_load_or_no_slope() -> None:
    assert knee.fit(readings([4.0, 6.0, 8.0, 10.0, 12.0, 14.0, 16.0])[: MIN_READINGS - 1]) is None
    assert knee.fit(readings([10.0, 11.0, 12.0, 13.0, 14.0, 10.0, 11.0, 12.0])) is None  # span < 1.5x
    # A batch proportional to the load (a step that does not grow): W is constant, no knee shows.
    flat = tuple((i * 15.0, x, 2.0 * x, 0.0) for i, x in enumerate([2.0, 4.0, 6.0, 8.0] * 2))
    assert knee.fit(flat) is None
    # Noise that hides the slope: no knee either (it would be placed anywhere).
    noisy = tuple(
        (i * 15.0, x, running(x) * (1.6 if i % 2 else 0.6), 0.0)
        for i, x in enumerate([2.0, 2.5, 3.0, 3.5, 2.0, 2.5, 3.0, 3.5])
    )
    assert knee.fit(noisy) is None


def test_an_uncertain_slope_places_the_knee_early() -> None:
    noisy = tuple((t, x, r * (1.03 if i % 2 else 0.97), kv) for i, (t, x, r, kv) in enumerate(readings(SEEN)))
    exact = knee.knee_rate(readings(SEEN), 256, 0.8)
    early = knee.knee_rate(noisy, 256, 0.8)
    assert exact is not None and early is not None and early[0] < exact[0]


def test_readings_are_kept_only_where_the_batch_is_readable() -> None:
    kept = knee.remember((), 0.0, 20.0, 40.0, 0.3, 2)
    assert kept == ((0.0, 10.0, 20.0, 0.3),)  # per replica
    assert knee.remember(kept, 15.0, None, 40.0, 0.3, 2) == kept  # a queued tick: the caller's None
    assert knee.remember(kept, 15.0, 20.0, 0.0, 0.3, 2) == kept  # nothing running
    assert knee.remember(kept, 4000.0, 20.0, 40.0, 0.3, 2) == ((4000.0, 10.0, 20.0, 0.3),)  # memory


def tick(replicas: int, rate: float) -> Signals:
    """The window of `replicas` serving `rate` arrivals, each batch as the replica above runs it,
    latency flat at 5 ms per token (0.05 of the objective: far from every latency rule)."""
    return replace(
        signals(replicas, rate=rate, tpot=[0.005] * 200), running=replicas * running(rate / replicas)
    )


def state(current: int, max_running: int | None = 256) -> ReplicaState:
    return ReplicaState(current=current, ready=current, time_to_ready_seconds=90.0, max_running=max_running)


def rising_to_25() -> tuple[History, float]:
    """One replica seen from 4 to 25/s (its batch growing as above, the arrivals rising by 0.12/s
    every 15 s), and the time of the next tick."""
    rates = [4.0 + 0.12 * i for i in range(176)]
    history = replace(
        History.starting_at(0.0, 1),
        running=readings(rates),
        demand=tuple((i * 15.0, x, 1.0, 0.0, x) for i, x in enumerate(rates)),
    )
    return history, 176 * 15.0


def test_the_knee_ahead_scales_up_at_any_latency() -> None:
    # One replica seen from 4 to 25/s, its batch growing as above, the arrivals rising by 0.12/s
    # every 15 s, latency flat. The knee is 32.4/s, 27.5/s at 0.85. At 25/s the arrivals a tick,
    # the 90 s cold start and half a window ahead (135 s) are about 26/s: one replica holds them;
    # at 27/s they are about 28/s: a second replica, asked for now, before latency shows it.
    history, now = rising_to_25()
    d = decide(now, tick(1, 25.0), history, POLICY, state(1))
    assert d.replicas == 1, d.reason
    d = decide(now, tick(1, 27.0), history, POLICY, state(1))
    assert d.replicas == 2 and "the knee, 135s ahead: 28." in d.reason, d.reason
    assert "below 0.85 of the knee 32.4/s per replica (256 running) -> 2" in d.reason, d.reason
    # Without the limit known (no --max-num-seqs, no KV usage) there is no knee: nothing ahead.
    no_kv = replace(history, running=tuple((t, x, r, 0.0) for t, x, r, _ in history.running))
    d = decide(now, tick(1, 27.0), no_kv, POLICY, state(1, max_running=None))
    assert "the knee" not in d.reason, d.reason


def test_a_scale_down_never_takes_the_replicas_past_their_knee() -> None:
    # 3 replicas at 20/s each with latency at its floor: the SLO rule alone would go to 1. The
    # knee (32.4/s, 27.5/s at 0.85; one replica was seen up to 24.7/s) needs ceil(60 / 27.5) = 3
    # for the 60/s that arrive.
    rates = [4.0 + 0.13 * i for i in range(160)]
    history = replace(History.starting_at(0.0, 3), running=readings(rates))
    d = decide(160 * 15.0, tick(3, 60.0), history, POLICY, state(3))
    assert d.recommendation == 3 and "the knee: 60.00/s below 0.85 of the knee" in d.reason, d.reason
    # At 40/s, two are enough.
    d = decide(160 * 15.0, tick(3, 40.0), history, POLICY, state(3))
    assert d.recommendation == 2, d.reason


def test_a_hump_is_not_held_as_a_burst() -> None:
    # A working day's hump (1.5 -> 30/s and back, about 8 minutes above half its height) is a
    # level the deployment scales for when it comes: after it, the current level. A 45 s burst
    # on the same base is held. Reaction: a tick, a 90 s cold start and a window.
    reaction = 165.0
    hump: headroom.Demand = ()
    burst: headroom.Demand = ()
    for i in range(80):
        t = i * 15.0
        hump = headroom.remember(hump, t, 1.5 + 28.5 * math.exp(-(((t - 500.0) / 290.0) ** 2)), 2, 1.0, 60.0)
        burst = headroom.remember(burst, t, 30.0 if 30 <= i < 33 else 1.5, 2, 1.0, 60.0)
    now = 79 * 15.0
    assert headroom.envelope(hump, now, 60.0, reaction) < 5.0
    assert headroom.envelope(burst, now, 60.0, reaction) == 30.0


def test_each_reading_counts_for_the_requests_it_saw(monkeypatch: pytest.MonkeyPatch) -> None:
    # At 2/s a replica runs 1, 2 or 3 requests (mean 2: x / R = 1.0); the mean of the readings'
    # x / R is 2 (1 + 1/2 + 1/3) / 3 = 1.22, biased high by the small counts. Weighted by R, the
    # line passes through the ratio of sums at that load (12 arrivals / 12 running = 1.0) and
    # through the heavy load's exact reading, 20/s with 100 running (0.2).
    light = [(i * 15.0, 2.0, float(r), 0.0) for i, r in enumerate([1, 2, 3, 1, 2, 3])]
    heavy = [(90.0 + i * 15.0, 20.0, 100.0, 0.0) for i in range(2)]
    monkeypatch.setattr(knee, "SLOPE_SIGMAS", 0.0)  # the fitted line itself, not steepened
    line = knee.fit((*light, *heavy))
    assert line is not None
    alpha, beta = line
    assert alpha - beta * 2.0 == pytest.approx(1.0)
    assert alpha - beta * 20.0 == pytest.approx(0.2)
    # The unweighted line would pass through 1.22 at 2/s: steeper, its knee earlier.
    plain_beta = (2 * (1 + 1 / 2 + 1 / 3) / 3 - 0.2) / 18.0
    plain_alpha = 0.2 + plain_beta * 20.0
    weighted_knee = alpha * 256 / (1 + beta * 256)
    assert plain_alpha * 256 / (1 + plain_beta * 256) < weighted_knee


def test_no_knee_until_a_batch_near_the_limit_was_seen() -> None:
    # Seen up to 18/s, the busiest batch is running(18) = 49: under MIN_REACH of 256 (64), so the
    # line places no knee there; a limit of 128 (reach 32) it does place.
    seen = readings([4.0, 6.0, 8.0, 10.0, 12.0, 14.0, 16.0, 18.0])
    assert max(r[2] for r in seen) < knee.MIN_REACH * 256
    assert knee.knee_rate(seen, 256, 0.8) is None
    rate, _ = knee.knee_rate(seen, 128, 0.8) or (0.0, "")
    assert rate == pytest.approx(128 / (K * (A + 128 * B)))


def test_the_knee_ahead_projects_the_present_rise() -> None:
    # Arrivals fell from 20 to 4.4/s over ten minutes, then rose by 0.5/s a tick for ten: the
    # lookback's 20-minute line averages the fall with the rise and reads no growth, while the
    # last two reactions (a tick, the 90 s cold start and a window, twice: 330 s) show the rise.
    rates = [20.0 - 0.4 * i for i in range(40)] + [4.0 + 0.5 * i for i in range(41)]
    demand = tuple((i * 15.0, x, 1.0, 0.0, x) for i, x in enumerate(rates))
    now = 80 * 15.0
    assert headroom.rising(demand, now) == 0.0
    assert headroom.rising(demand, now, 330.0) == pytest.approx(0.5 / 15.0)
    # The knee is 32.4/s (27.5/s at 0.85). At 24/s now, the arrivals 135 s ahead are
    # 24 + 0.5 / 15 x 135 = 28.5/s: a second replica, asked for now (24/s alone needs one).
    history = replace(
        History.starting_at(0.0, 1),
        running=readings([4.0 + 0.12 * i for i in range(176)]),
        demand=demand,
    )
    d = decide(now, tick(1, 24.0), history, POLICY, state(1))
    assert d.replicas == 2 and "the knee, 135s ahead: 28.50/s" in d.reason, d.reason


def test_a_rise_that_has_turned_holds_no_replicas() -> None:
    # Arrivals rose from 2 to 30/s over fifteen minutes, then fell for five, to 18/s now. The
    # 20-minute line still rises, but the last two reactions (330 s) clearly fall: three
    # replicas at 6/s each with latency at its floor may go down.
    rates = [2.0 + 0.47 * i for i in range(60)] + [30.0 - 0.6 * i for i in range(1, 21)]
    demand = tuple((i * 15.0, x, 3.0, 0.0, x) for i, x in enumerate(rates))
    now = 80 * 15.0
    assert headroom.rising(demand, now) > 0
    assert headroom.falling(demand, now, 330.0) == pytest.approx(0.6 / 15.0, rel=0.05)
    history = replace(History.starting_at(0.0, 3), demand=demand)
    d = decide(now, tick(3, 18.0), history, POLICY, state(3))
    assert d.recommendation < 3 and "arrivals rising" not in d.reason, d.reason
    # A rise that levels off (the same fifteen minutes, then five flat at 30/s) is not shown to
    # have turned: no scale-down yet.
    level = [2.0 + 0.47 * i for i in range(60)] + [30.0] * 20
    flat = replace(history, demand=tuple((i * 15.0, x, 3.0, 0.0, x) for i, x in enumerate(level)))
    assert headroom.falling(flat.demand, now, 330.0) == 0.0
    d = decide(now, tick(3, 30.0), flat, POLICY, state(3))
    assert d.recommendation == 3 and "arrivals rising" in d.reason, d.reason


def test_the_knee_gives_way_where_latency_reaches_its_aim_first() -> None:
    # The knee-ahead case above (27/s on one replica, a second asked for at flat latency), with
    # the time per token at 0.8 of its objective and no floor learned: by the rule's own
    # projection it reaches its aim (0.9) at 0.9 / 0.8 x 27 = 30.4/s per replica, before the
    # 32.4/s knee. Latency is this replica's limit (a CPU replica's case) and the knee asks
    # nothing; the latency rules size for it.
    history, now = rising_to_25()
    busy = replace(tick(1, 27.0), tpot_histogram=signals(1, tpot=[0.08] * 200).tpot_histogram)
    d = decide(now, busy, history, POLICY, state(1))
    assert "the knee" not in d.reason, d.reason
    assert pressure.latency_reach(history, pressure.slo_pressures(busy, POLICY.slo)) == pytest.approx(
        0.9 / 0.8, rel=0.05
    )
    # Flat latency: the knee acts (as in the test above).
    d = decide(now, tick(1, 27.0), history, POLICY, state(1))
    assert d.replicas == 2 and "the knee, 135s ahead" in d.reason, d.reason
