"""The SLO as the autoscaler's input: `spec.autoscaling.slo` through the parser, the CRD (CEL) and
`kvasir render`; every rule decide() gained with it (SLO tracking with a margin and a latency
floor, leading signals, the tail ratio against a learned baseline, capacity held while peaks
recur, smoothing, no second scale-up on a stale window); the cold start the pods report."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import pytest

from kvasir.cli import main
from kvasir.observability.metric_names import QUEUE_BUCKETS, TPOT_BUCKETS, TTFT_BUCKETS
from kvasir.operator.api.source import SpecError
from kvasir.operator.autoscaler import learned
from kvasir.operator.autoscaler.decide import History, ReplicaState, _falling_window, decide
from kvasir.operator.autoscaler.loop import autoscaling_status, cold_start
from kvasir.operator.autoscaler.metrics import Histogram, parse_metrics
from kvasir.operator.autoscaler.policy import Policy, Slo, parse_policy
from kvasir.operator.autoscaler.signals import MetricsWindow, Scrape, Signals

SLO_POLICY = Policy(max_replicas=40, slo_ttft_seconds=1.0, slo_itl_seconds=0.1, slo_attainment=0.99)
NO_SLO = Policy(max_replicas=40, target_latency_ratio=5.0)  # the tail rule on (off by default)


def histogram(values: Iterable[float], bounds: tuple[float, ...]) -> Histogram:
    values = list(values)
    cumulative = {b: float(sum(1 for v in values if v <= b)) for b in bounds}
    cumulative[math.inf] = float(len(values))
    return Histogram(cumulative)


def signals(
    replicas: int = 10,
    *,
    ttft: float | None = None,
    queued: float | None = None,
    tpot: float | None = 0.05,
    kv: float = 0.3,
    waiting: float = 0.0,
    ratio: float = 2.0,
    n: int = 200,
) -> Signals:
    """Signals whose percentiles are (about) the given values: n requests at each value."""
    return Signals(
        ready_replicas=replicas,
        reporting_replicas=replicas,
        kv_usage_mean=kv,
        kv_usage_max=kv,
        waiting=waiting,
        running=4.0 * replicas,
        preemption_rate=0.0,
        generation_tokens_rate=100.0 * replicas,
        itl_ratio=ratio,
        ttft_ratio=None,
        ttft_histogram=None if ttft is None else histogram([ttft] * n, TTFT_BUCKETS),
        tpot_histogram=None if tpot is None else histogram([tpot] * n, TPOT_BUCKETS),
        queue_time_histogram=None if queued is None else histogram([queued] * n, QUEUE_BUCKETS),
    )


def state(current: int = 10, **kw: Any) -> ReplicaState:
    return ReplicaState(current=current, ready=current, **kw)


def settled(policy: Policy, calm: Signals, ticks: int = 12, interval: float = 15.0) -> History:
    """The history after `ticks` quiet ticks at `calm`: the floors and baselines are learned."""
    history = History.starting_at(0.0, calm.reporting_replicas)
    for tick in range(ticks):
        history = decide(tick * interval, calm, history, policy, state(calm.reporting_replicas)).history
    return history


# ---- the spec ---------------------------------------------------------------------------------


def test_the_slo_is_parsed_with_its_defaults() -> None:
    policy = parse_policy({"maxReplicas": 3, "slo": {"timeToFirstTokenSeconds": 1}})
    assert policy.slo == Slo(ttft_seconds=1.0, itl_seconds=None, attainment=0.99)
    assert parse_policy({"maxReplicas": 3}).slo is None  # no SLO: the targets alone
    both = parse_policy(
        {
            "maxReplicas": 3,
            "slo": {"timeToFirstTokenSeconds": 2, "interTokenLatencySeconds": 0.05, "attainment": 0.95},
        }
    )
    assert both.slo == Slo(2.0, 0.05, 0.95)


@pytest.mark.parametrize(
    ("slo", "message"),
    [
        ({}, "spec.autoscaling.slo: needs timeToFirstTokenSeconds or interTokenLatencySeconds"),
        ({"attainment": 0.9}, "spec.autoscaling.slo: needs timeToFirstTokenSeconds"),
        (
            {"timeToFirstTokenSeconds": 1, "attainment": 1},
            "spec.autoscaling.slo.attainment: must be between 0.5 and 0.9999, got 1",
        ),
        (
            {"interTokenLatencySeconds": "fast"},
            "spec.autoscaling.slo.interTokenLatencySeconds: must be a number",
        ),
        (
            {"timeToFirstTokenSeconds": 0},
            "spec.autoscaling.slo.timeToFirstTokenSeconds: must be between 0.001",
        ),
        ([], "spec.autoscaling.slo: must be an object"),
    ],
)
def test_a_bad_slo_names_its_field(slo: Any, message: str) -> None:
    with pytest.raises(SpecError) as refused:
        parse_policy({"maxReplicas": 3, "slo": slo})
    assert str(refused.value).startswith(message), str(refused.value)


def _with_slo(kt: Any, slo: Any) -> dict[str, Any]:
    return {
        **kt.llmd("demo"),
        "spec": {"model": {"source": "hf://org/name"}, "autoscaling": {"maxReplicas": 4, "slo": slo}},
    }


def test_the_crd_takes_the_slo_and_its_cel_rules_refuse_what_the_parser_does(crd, kt) -> None:
    assert kt.crd_semantics.crd_errors(crd) == []  # as kube-apiserver 1.36 checks a CRD
    good = _with_slo(kt, {"timeToFirstTokenSeconds": 1.5, "interTokenLatencySeconds": 0.08})
    assert kt.validate_cr(crd, good) == []
    defaulted = kt.apply_defaults(kt.crd_schema(crd), good)
    assert defaulted["spec"]["autoscaling"]["slo"]["attainment"] == 0.99
    # No slo: nothing is defaulted into existence (an SLO nobody gave is not an SLO).
    plain = {
        **kt.llmd("demo"),
        "spec": {"model": {"source": "hf://org/name"}, "autoscaling": {"maxReplicas": 4}},
    }
    assert "slo" not in kt.apply_defaults(kt.crd_schema(crd), plain)["spec"]["autoscaling"]
    for slo, message in [
        ({}, "autoscaling.slo needs timeToFirstTokenSeconds or interTokenLatencySeconds"),
        (
            {"timeToFirstTokenSeconds": 1, "attainment": 1},
            "autoscaling.slo.attainment must be between 0.5 and 0.9999",
        ),
        (
            {"interTokenLatencySeconds": 0},
            "autoscaling.slo.interTokenLatencySeconds must be between 0.0001 and 60",
        ),
    ]:
        errors = kt.validate_cr(crd, _with_slo(kt, slo))
        assert any(message in error for error in errors), errors


def test_render_takes_the_slo_and_names_a_bad_one(tmp_path, capsys) -> None:
    head = "apiVersion: inference.kvasir.dev/v1alpha1\nkind: LLMDeployment\nmetadata: {name: demo}\n"
    good = tmp_path / "good.yaml"
    good.write_text(
        head + "spec:\n  model: {source: hf://org/name}\n  autoscaling:\n    maxReplicas: 4\n"
        "    slo: {timeToFirstTokenSeconds: 1.0, interTokenLatencySeconds: 0.1, attainment: 0.99}\n"
    )
    assert main(["render", "-f", str(good)]) == 0
    assert "kind: Deployment" in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        head
        + "spec:\n  model: {source: hf://org/name}\n  autoscaling:\n    maxReplicas: 4\n    slo: {attainment: 0.9}\n"
    )
    assert main(["render", "-f", str(bad)]) == 2
    assert "spec.autoscaling.slo: needs timeToFirstTokenSeconds" in capsys.readouterr().err


def test_the_reference_lists_the_slo(kt) -> None:
    text = (kt.REPO / "docs" / "llmdeployment-reference.md").read_text()
    for key in ("slo.timeToFirstTokenSeconds", "slo.interTokenLatencySeconds", "slo.attainment"):
        assert f"`.spec.autoscaling.{key}`" in text


# ---- decide() with an SLO -------------------------------------------------------------------------


def test_latency_above_the_aim_scales_up_one_at_a_time_until_the_floor_is_known() -> None:
    slow = signals(10, tpot=0.12)  # 1.2 x the 100 ms objective
    d = decide(0, slow, History(), SLO_POLICY, state(10))
    assert d.replicas == 11 and "time per token p99" in d.reason and "above 0.90" in d.reason


def test_latency_above_the_aim_is_projected_on_the_part_above_the_floor() -> None:
    history = settled(SLO_POLICY, signals(10, tpot=0.03))  # at rest: a floor near 0.3
    floor = learned.latency_floor(history.pressures[1])
    assert floor == pytest.approx(0.3, abs=0.01)
    # Smoothed over three ticks: the first slow window alone is an outlier, the second is not.
    d = decide(180, signals(10, tpot=0.12), history, SLO_POLICY, state(10))
    assert d.replicas == 10
    d = decide(195, signals(10, tpot=0.12), d.history, SLO_POLICY, state(10))
    value = signals(10, tpot=0.12).tpot_quantile(0.99) / 0.1  # 1.25 (interpolated in its bucket)
    aim = floor + 0.9 * (1 - floor)
    # On N' replicas the pressure is floor + (value - floor) x 10 / N', at most the aim: 16; but
    # one step adds at most half again (past the knee latency overstates the load): 15.
    assert math.ceil(10 * (value - floor) / (aim - floor)) == 16
    assert d.recommendation == 15, d.reason
    # 95 ms is above the aim but every request meets the objective: the error budget is not
    # burning, and no replica is added for it (test_budget.py has the burn's own rules).
    d = decide(180, signals(10, tpot=0.095), history, SLO_POLICY, state(10))
    d = decide(195, signals(10, tpot=0.095), d.history, SLO_POLICY, state(10))
    assert d.recommendation == 10 and "the error budget is not burning" in d.reason, d.reason


def test_room_below_the_slo_scales_down_but_never_below_the_cache() -> None:
    history = settled(SLO_POLICY, signals(10, tpot=0.03, ttft=0.1, queued=0.0))
    d = decide(1000, signals(10, tpot=0.03, ttft=0.1, queued=0.0, kv=0.5), history, SLO_POLICY, state(10))
    # Latency is at its floor, so latency alone would go to 1; the cache at 0.5 x 10 needs 7 at 0.8.
    assert d.recommendation == 7, d.reason


def test_ttft_that_is_prefill_not_waiting_does_not_scale() -> None:
    """A long prompt's prefill takes as long on any number of replicas: TTFT 1.2 s with 0.05 s of
    queueing is all floor, and the time per token decides."""
    d = decide(0, signals(10, ttft=1.2, queued=0.05, tpot=0.08), History(), SLO_POLICY, state(10))
    assert d.replicas == 10 and "at any load" in d.reason
    waiting = signals(10, ttft=1.2, queued=1.0, tpot=0.08)  # the same TTFT, most of it queueing
    assert decide(0, waiting, History(), SLO_POLICY, state(10)).replicas > 10


def test_leading_signals_add_one_replica_once_latency_has_used_half_its_budget() -> None:
    history = settled(SLO_POLICY, signals(10, tpot=0.06))
    queued = signals(10, tpot=0.06, waiting=50.0)  # 5 waiting per replica, target 4
    d = decide(1000, queued, history, SLO_POLICY, state(10))
    assert d.recommendation == 13 and "leading: queue 5.0/replica" in d.reason  # ceil(10 x 5 / 4)
    flood = signals(10, tpot=0.06, waiting=510.0)  # 51 per replica: tracked, 128; at most half again
    assert decide(1000, flood, history, SLO_POLICY, state(10)).recommendation == 15
    history = settled(SLO_POLICY, signals(10, tpot=0.03))
    early = signals(10, tpot=0.03, waiting=50.0)  # latency at 0.3 of the SLO: the queue is harmless yet
    assert "leading" not in decide(1000, early, history, SLO_POLICY, state(10)).reason


def test_one_slow_window_does_not_scale_up_its_median_does() -> None:
    history = settled(SLO_POLICY, signals(10, tpot=0.08))
    d = decide(180, signals(10, tpot=0.3), history, SLO_POLICY, state(10))
    assert d.replicas == 10  # median of (0.8, 0.8, 3.0): one outlier
    d = decide(195, signals(10, tpot=0.3), d.history, SLO_POLICY, state(10))
    assert d.replicas > 10


def test_no_second_scale_up_on_latency_before_the_window_shows_the_first() -> None:
    history = replace(settled(SLO_POLICY, signals(10, tpot=0.03)), last_scale_up=990.0)
    slow = signals(10, tpot=0.2)
    d = decide(1000, slow, history, SLO_POLICY, state(10))
    d = decide(1015, slow, d.history, SLO_POLICY, state(10))
    assert d.replicas == 10 and "has not shown in the window yet (180s)" in d.reason
    # A queue explosion waits too: the replicas asked for are on their way.
    flood = decide(1030, signals(10, tpot=0.2, waiting=100), d.history, SLO_POLICY, state(10))
    assert flood.replicas == 10 and flood.panic
    later = decide(1200, signals(10, tpot=0.2, waiting=100), flood.history, SLO_POLICY, state(10))
    assert later.replicas > 10


def test_without_enough_requests_the_targets_decide() -> None:
    quiet = signals(4, ttft=None, tpot=None, queued=None, kv=1.0)
    d = decide(0, quiet, History(), SLO_POLICY, state(4))
    assert d.replicas == 5 and "KV usage 1.00 (target 0.80)" in d.reason


# ---- the tail, relative to the deployment's own ----------------------------------------------------


def test_a_tail_ratio_high_at_every_load_is_the_workload() -> None:
    """Mixed lengths: P99/P50 of 8 at rest. With a real queue, 8 is no rise; 13 is."""
    history = settled(NO_SLO, signals(4, ratio=8.0, kv=0.75))
    same = signals(4, ratio=8.0, kv=0.75, waiting=4.0)  # one waiting per replica: a real queue
    d = decide(1000, same, history, NO_SLO, state(4))
    assert d.replicas == 4, d.reason
    risen = signals(4, ratio=13.0, kv=0.75, waiting=4.0)
    d = decide(1000, risen, history, NO_SLO, state(4))
    assert d.replicas == 5 and "P99/P50 latency 13.0 > 12 while saturated" in d.reason


def test_the_tail_baseline_is_learned_at_rest_only() -> None:
    readings: learned.Readings = ()
    for t in range(10):
        readings = learned.remember(readings, t * 15.0, 3.0)
    assert learned.tail_baseline(readings) == 3.0
    assert learned.tail_threshold(readings, 5.0) == 5.0  # 1.5 x 3 is below latencyRatio
    assert learned.tail_threshold((), 5.0) == 5.0  # nothing learned yet
    busy = signals(4, ratio=20.0, waiting=8.0)
    history = decide(0, busy, History(), NO_SLO, state(4)).history
    assert history.ratios == ()  # a queue: not at rest, not a baseline reading


def test_the_latency_floor_is_never_learned_under_load() -> None:
    points: learned.Points = ()
    for t in range(10):
        points = learned.remember_point(points, t * 15.0, 1.5, None, at_rest=False)
    assert learned.latency_floor(points) is None  # overload is never taken for a floor
    for t in range(10, 20):
        points = learned.remember_point(points, t * 15.0, 0.4, None, at_rest=True)
    assert learned.latency_floor(points) == 0.4


# ---- headroom while peaks recur -----------------------------------------------------------------


def test_capacity_is_held_while_peaks_recur_at_a_steady_interval() -> None:
    assert learned.hold_seconds((0.0, 600.0, 1200.0), 1300.0, 300.0) == 750.0  # 1.25 x 600
    assert learned.hold_seconds((0.0, 600.0), 700.0, 300.0) == 300.0  # one gap is no pattern
    assert learned.hold_seconds((0.0, 200.0, 900.0), 1000.0, 300.0) == 300.0  # irregular: noise
    assert learned.hold_seconds((0.0, 600.0, 1200.0), 2500.0, 300.0) == 300.0  # the pattern stopped
    assert learned.hold_seconds((0.0, 4000.0, 8000.0), 8100.0, 300.0) == learned.MAX_HOLD_SECONDS
    # A scale-up within the stabilization window of the last one is the same episode.
    assert learned.new_episode((100.0,), 200.0, 300.0) == (100.0,)
    assert learned.new_episode((100.0,), 700.0, 300.0) == (100.0, 700.0)


def test_decide_keeps_the_peak_through_the_recurrence_window() -> None:
    calm = signals(4, kv=0.2, ttft=None, tpot=None, queued=None)
    history = replace(History.starting_at(0.0, 8), episodes=(0.0, 600.0, 1200.0))
    history = replace(history, recommendations=((1250.0, 8),))
    d = decide(1600, calm, history, NO_SLO, ReplicaState(current=8, ready=8))
    assert d.replicas == 8 and "peaks recur: capacity held" in d.reason
    d = decide(1600, calm, replace(history, episodes=()), NO_SLO, ReplicaState(current=8, ready=8))
    assert d.replicas == 7  # without the pattern, the 300 s window has passed


def test_a_scale_up_records_an_episode() -> None:
    d = decide(0, signals(2, kv=1.0, ttft=None, tpot=None, queued=None), History(), NO_SLO, state(2))
    assert d.replicas > 2 and d.history.episodes == (0.0,)


# ---- cold start, as the pods report it ------------------------------------------------------------


def test_the_pods_time_to_ready_is_read_from_its_total_phase_only() -> None:
    text = (
        "# TYPE kvasir_time_to_ready_seconds gauge\n"
        'kvasir_time_to_ready_seconds{model_name="m",phase="process"} 2.0\n'
        'kvasir_time_to_ready_seconds{model_name="m",phase="engine"} 30.0\n'
        'kvasir_time_to_ready_seconds{model_name="m",phase="total"} 41.5\n'
    )
    assert parse_metrics(text).gauges["time_to_ready"] == 41.5
    window = MetricsWindow(60)
    pods = {
        name: parse_metrics(text.replace("41.5", value))
        for name, value in (("a", "40"), ("b", "50"), ("c", "90"))
    }
    window.add(Scrape(0.0, pods))
    assert window.signals(["a", "b", "c"]).time_to_ready == 50.0  # the median


def test_the_cold_start_planned_on_is_the_larger_measurement() -> None:
    reported = replace(signals(2), time_to_ready=70.0)
    assert cold_start(40.0, reported) == 70.0  # the servers know more than the pods' timestamps
    assert cold_start(120.0, reported) == 120.0  # scheduling and the image pull come on top
    assert cold_start(None, reported) == 70.0 and cold_start(30.0, None) == 30.0
    assert cold_start(None, signals(2)) is None


def test_status_shows_the_slo_percentiles_and_the_servers_cold_start() -> None:
    observed = replace(signals(2, ttft=1.0, tpot=0.05), time_to_ready=42.04)
    decision = decide(0, observed, History(), SLO_POLICY, state(2))
    status = autoscaling_status(decision, observed, 60.0, None, SLO_POLICY.slo)["autoscaling"]
    assert status["serverTimeToReadySeconds"] == 42.0 and status["timeToReadySeconds"] == 60.0
    assert status["signals"]["ttftPercentileSeconds"] == pytest.approx(1.0, abs=0.01)
    assert status["signals"]["timePerTokenPercentileSeconds"] == pytest.approx(0.05, abs=0.006)
    assert (
        "ttftPercentileSeconds"
        not in autoscaling_status(decision, observed, 60.0, None)["autoscaling"]["signals"]
    )


def test_the_scale_down_window_is_one_reaction_while_arrivals_fall_inside_the_slo() -> None:
    """decide._falling_window: with the arrivals falling over the last two reactions and the
    error budget unspent, the scale-down window is one reaction (tick, cold start, window), not
    scaleDownSeconds; rising arrivals, a burning budget, no SLO, or a window lengthened because
    peaks recur keep it."""
    now, cold = 3600.0, 90.0
    replicas = ReplicaState(current=3, ready=3, time_to_ready_seconds=cold)
    reaction = SLO_POLICY.interval_seconds + cold + SLO_POLICY.metrics_window_seconds
    ticks = [now - 15.0 * i for i in range(40)][::-1]

    def history(step: float, over: float) -> History:
        # arrivals moving by `step`/s a tick from 60/s; `over` requests of 100 over an objective
        demand = tuple((t, 60.0 + step * i, 3.0, 1.0, 60.0 + step * i) for i, t in enumerate(ticks))
        burns = tuple((t, (over, 0.0), 100.0) for t in ticks)
        return History(demand=demand, burns=burns)

    window = float(SLO_POLICY.scale_down_stabilization_seconds)
    assert _falling_window(now, history(-0.5, 0.0), SLO_POLICY, replicas, window) == reaction
    assert _falling_window(now, history(+0.5, 0.0), SLO_POLICY, replicas, window) == window  # rising
    assert _falling_window(now, history(-0.5, 5.0), SLO_POLICY, replicas, window) == window  # burning
    assert _falling_window(now, history(-0.5, 0.0), NO_SLO, replicas, window) == window  # no SLO
    recurring = 2 * window  # learned.hold_seconds: peaks recur, their capacity is held
    assert _falling_window(now, history(-0.5, 0.0), SLO_POLICY, replicas, recurring) == recurring
