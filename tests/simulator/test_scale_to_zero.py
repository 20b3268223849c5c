"""`kvasir simulate` with minReplicas 0: requests that find no ready replica wait in the router's
hold queue (bounded by holdSeconds and maxHeld; past either they fail and are counted), the first
one wakes a replica at once, ready after the cold start. On a sparse trace (about 20 requests an
hour for three hours) zero costs at most 30% of the GPU-hours of minReplicas 1, and the TTFT P99
is the cold start plus the short time to serve."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import yaml

from kvasir.operator.autoscaler.decide import Policy
from kvasir.simulator.cluster import ClusterConfig, simulate
from kvasir.simulator.compare import compare, never_worse_than_static
from kvasir.simulator.config import parse_config
from kvasir.simulator.policies import make_policy
from kvasir.simulator.profile import ReplicaProfile, StepModel
from kvasir.simulator.trace import TraceRequest, generate

REPO = Path(__file__).resolve().parents[2]
COLD_START = 30.0
SMALL = ReplicaProfile(
    name="small",
    description="a small replica for tests",
    step=StepModel(base_s=0.01, per_token_s=0.0001, per_kv_token_s=0.000002, per_seq_s=0.0005),
    num_kv_blocks=200,
    block_size=16,
    max_num_seqs=16,
    max_num_batched_tokens=512,
    max_model_len=1024,
    cold_start_s=COLD_START,
)
SPARSE = generate("poisson", duration=3 * 3600, rate=20 / 3600, seed=7)  # about 20 an hour
WINDOWS = {"interval_seconds": 5, "scale_down_stabilization_seconds": 0, "scale_down_period_seconds": 0}


def _run(min_replicas: int, trace: list[TraceRequest] = SPARSE, **zero: int) -> tuple[object, ClusterConfig]:
    policy = Policy(min_replicas=min_replicas, max_replicas=2, idle_seconds=20, **WINDOWS, **zero)  # type: ignore[arg-type]
    config = ClusterConfig(
        SMALL,
        min_replicas=min_replicas,
        max_replicas=2,
        interval_s=5,
        hold_s=policy.hold_seconds,
        max_held=policy.max_held,
    )
    return simulate(trace, config, make_policy("kvasir", policy, parse_config({}).baselines)), config


def test_zero_costs_under_30_percent_of_one_replica_on_a_sparse_trace() -> None:
    assert 45 <= len(SPARSE) <= 75  # 20 an hour on average, drawn
    zero, _ = _run(0)
    one, _ = _run(1)
    assert zero.failed == 0 and len(zero.finished) == len(SPARSE)  # type: ignore[attr-defined]
    assert zero.activations >= 0.5 * len(SPARSE)  # type: ignore[attr-defined]  # most requests wake it
    ratio = zero.gpu_hours / one.gpu_hours  # type: ignore[attr-defined]
    print(
        f"zero: {zero.gpu_hours:.3f} GPU-hours, one: {one.gpu_hours:.3f} ({ratio:.0%}); TTFT p99 {zero.ttft_quantile(0.99):.2f} s; {zero.activations} activations"
    )  # type: ignore[attr-defined]
    assert ratio <= 0.30, ratio
    # TTFT P99: the cold start (held at the router) plus a short time to serve.
    p99 = zero.ttft_quantile(0.99)  # type: ignore[attr-defined]
    assert COLD_START <= p99 <= COLD_START + 1.0, p99
    assert one.ttft_quantile(0.99) < 1.0  # type: ignore[attr-defined]
    summary = zero.summary()  # type: ignore[attr-defined]
    assert summary["failed_requests"] == 0 and summary["activations"] == zero.activations  # type: ignore[attr-defined]


def test_the_hold_is_bounded_in_time_and_in_requests() -> None:
    burst = [TraceRequest(10.0 + i * 0.01, 50, 10) for i in range(8)]
    # Eight requests at zero, at most five held: three fail at once, five wait for the cold start.
    bounded, _ = _run(0, burst, max_held=5)
    assert (bounded.failed, len(bounded.finished), bounded.activations) == (3, 5, 1)  # type: ignore[attr-defined]
    # The three found the hold full: rejected at once (the queue-full answer), not timed out.
    assert (len(bounded.rejected), len(bounded.timed_out)) == (3, 0)  # type: ignore[attr-defined]
    # A failed request meets no objective: 5 served of 8 is at most 5/8 attained.
    assert bounded.slo_attainment <= 5 / 8  # type: ignore[attr-defined]
    # A hold shorter than the cold start: every request fails, and the replica still wakes.
    short, _ = _run(0, burst, hold_seconds=10)
    assert (short.failed, len(short.finished), short.activations) == (8, 0, 1)  # type: ignore[attr-defined]
    assert (len(short.rejected), len(short.timed_out)) == (0, 8)  # type: ignore[attr-defined]
    summary = short.summary()  # type: ignore[attr-defined]
    assert (summary["timed_out_requests"], summary["slo_attainment"], summary["slo_breach_minutes"]) == (
        8,
        0.0,
        1,
    )


def test_minimum_one_is_untouched_by_the_zero_settings() -> None:
    trace = generate("poisson", duration=1800, rate=0.05, seed=3)
    one, config = _run(1, trace)
    again = simulate(
        trace,
        replace(config, hold_s=1.0, max_held=0),
        make_policy("kvasir", Policy(min_replicas=1, max_replicas=2, **WINDOWS), parse_config({}).baselines),  # type: ignore[arg-type]
    )
    assert one.summary() == again.summary()  # type: ignore[attr-defined]
    assert one.failed == 0 and one.activations == 0  # type: ignore[attr-defined]


def test_the_docs_zero_example_meets_the_goal_never_worse_than_static() -> None:
    """docs/simulator.md's "Scale to zero" example, as it is shown (examples/sim-zero.yaml and the
    `kvasir trace` line): its SLO is one that zero can keep (a TTFT objective above the cold start
    plus the time to serve), so Kvasir meets it, and at no more than 1.05x the cheapest policy that
    does. The cheapest is the queue target, which has no idle time at all: it asks for zero at the
    first tick that shows no queue, the woken request still draining. With the example's 1 s
    default objective no policy that reaches zero met the SLO (Kvasir 0.236), and with a 60 s idle
    time and 5 s ticks Kvasir spent 2.15x the queue target's GPU-hours."""
    example = yaml.safe_load((REPO / "examples" / "sim-zero.yaml").read_text())
    config = parse_config(example)
    assert config.slo.ttft_s > config.cold_start_s + 1.0
    trace = generate("poisson", duration=10800, rate=0.005556, seed=7)  # the docs' 72 requests
    results = compare(trace, config, ["kvasir", "static", "queue"])
    summaries = {name: result.summary() for name, result in results.items()}
    assert never_worse_than_static(summaries) == [], summaries
    kvasir = summaries["kvasir"]
    assert kvasir["meets_slo"] and kvasir["failed_requests"] == 0
    assert kvasir["gpu_hours"] <= 0.3 * summaries["static"]["gpu_hours"]  # part 5's claim, here too
    assert config.cold_start_s <= kvasir["ttft_p99_s"] <= config.cold_start_s + 1.0
