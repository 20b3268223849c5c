"""The simulator: traces, the simulated replica (the real scheduler and KV cache; fast-forward
exactly equal to stepping), the cluster loop with the autoscaler, baselines, and the CLI."""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from kvasir.operator.autoscaler.decide import Policy, ReplicaState
from kvasir.operator.autoscaler.signals import Signals
from kvasir.simulator.cluster import ClusterConfig, simulate
from kvasir.simulator.compare import peak_window, static_for_peak
from kvasir.simulator.config import parse_config
from kvasir.simulator.latency import LogHistogram
from kvasir.simulator.policies import Hpa, KnativeKpa, Static, Wva, make_policy
from kvasir.simulator.profile import ReplicaProfile, StepModel, load_profile, shipped_profiles
from kvasir.simulator.replica import Finished, SimReplica
from kvasir.simulator.trace import (
    KINDS,
    Lengths,
    TraceError,
    TraceRequest,
    generate,
    read_trace,
    write_trace,
)

SMALL = ReplicaProfile(
    name="small",
    description="a small replica for tests",
    step=StepModel(base_s=0.01, per_token_s=0.0001, per_kv_token_s=0.000002, per_seq_s=0.0005),
    num_kv_blocks=200,
    block_size=16,
    max_num_seqs=16,
    max_num_batched_tokens=512,
    max_model_len=1024,
    cold_start_s=30.0,
)


# The same replica with a measured token curve (a CPU profile's shape: batch 2 costs 1.6x batch 1).
SMALL_CURVE = replace(
    SMALL,
    step=StepModel(0.0, 0.0002, 0.000002, 0.0, token_curve=((1, 0.05), (2, 0.08), (16, 0.1), (256, 0.3))),
)


def _replay(
    trace: list[TraceRequest], *, fast_forward: bool, profile: ReplicaProfile = SMALL
) -> tuple[list[Finished], SimReplica]:
    done: list[Finished] = []
    replica = SimReplica("r", profile, created=0, ready_at=0, on_finish=done.append, itl=LogHistogram())
    if not fast_forward:
        replica._steady_steps = lambda until: 0  # type: ignore[method-assign]
    for index, request in enumerate(trace):
        replica.advance(request.arrival_time)
        replica.submit(index, request, request.arrival_time)
    replica.advance(float("inf"))
    return sorted(done, key=lambda f: f.index), replica


@pytest.mark.parametrize("profile", [SMALL, SMALL_CURVE], ids=["formula", "token-curve"])
def test_fast_forward_equals_stepping_one_by_one(profile: ReplicaProfile) -> None:
    """Steady decode applied in bulk gives the same tokens, times and blocks as the real scheduler
    stepped one step at a time, preemptions and prefix hits included."""
    trace = generate("bursts", duration=120, rate=0.5, seed=3, prefix_groups=2, prefix_tokens=64)
    trace = [
        replace(r, prompt_tokens=min(r.prompt_tokens, 300), output_tokens=min(r.output_tokens, 300))
        for r in trace
    ]
    stepped, slow = _replay(trace, fast_forward=False, profile=profile)
    bulk, fast = _replay(trace, fast_forward=True, profile=profile)
    assert len(stepped) == len(trace) == len(bulk)
    for a, b in zip(stepped, bulk, strict=True):
        assert a.output_tokens == b.output_tokens
        assert a.ttft == pytest.approx(b.ttft, rel=1e-9, abs=1e-9)
        assert a.tpot == pytest.approx(b.tpot, rel=1e-9, abs=1e-9)
    assert fast.steps == slow.steps and fast.generation_tokens == slow.generation_tokens
    assert fast.scheduler.num_preemptions_total == slow.scheduler.num_preemptions_total
    assert slow.scheduler.num_preemptions_total > 0  # the scenario exercised preemption
    for replica in (fast, slow):
        replica.kv.check_integrity()
        assert replica.kv.usage == 0  # every block free after every request finished


def test_replica_metrics_are_what_the_autoscaler_reads() -> None:
    trace = [TraceRequest(0.0, 100, 50), TraceRequest(0.0, 100, 50)]
    _, replica = _replay(trace, fast_forward=True)
    metrics = replica.metrics()
    assert metrics.counters["generation_tokens"] == 100
    assert metrics.histograms["ttft"].count == 2
    assert metrics.histograms["itl"].count == 2 * 49
    assert metrics.histograms["tpot"].count == 2  # one per request, as the runtime's histogram
    assert metrics.gauges == {"running": 0.0, "waiting": 0.0, "kv_usage": 0.0, "time_to_ready": 0.0}


def test_traces_round_trip_and_bad_lines_name_the_field(tmp_path: Path) -> None:
    trace = generate("poisson", duration=60, rate=2, seed=1, prefix_groups=3, prefix_tokens=32)
    path = tmp_path / "t.jsonl"
    with path.open("w") as out:
        write_trace(trace, out)
    again = read_trace(path).requests
    assert [(r.prompt_tokens, r.prefix_group) for r in again] == [
        (r.prompt_tokens, r.prefix_group) for r in trace
    ]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"arrival_time": 0, "prompt_tokens": 5, "output_tokens": 3}\n{"arrival_time": 1, "prompt_tokens": 5}\n'
    )
    with pytest.raises(TraceError, match="line 2: missing 'output_tokens'"):
        read_trace(bad)
    bad.write_text('{"arrival_time": 1, "prompt_tokens": 0, "output_tokens": 3}\n')
    with pytest.raises(TraceError, match="line 1"):
        read_trace(bad)


def test_generated_shapes() -> None:
    def rate(trace: list[TraceRequest], start: float, end: float) -> float:
        return sum(1 for r in trace if start <= r.arrival_time < end) / (end - start)

    duration = 4000.0
    ramp = generate("ramp", duration=duration, rate=2, seed=0)
    assert rate(ramp, 0, 1000) == pytest.approx(2, rel=0.2) and rate(ramp, 3000, 4000) == pytest.approx(
        8, rel=0.2
    )
    crowd = generate("flash-crowd", duration=duration, rate=2, seed=0)
    start = duration / 3
    assert rate(crowd, start + 60, start + 600) == pytest.approx(20, rel=0.2)
    day = generate("diurnal", duration=86400, rate=1, seed=0)
    assert rate(day, 15.5 * 3600, 16.5 * 3600) / rate(day, 3.5 * 3600, 4.5 * 3600) == pytest.approx(
        5, rel=0.25
    )
    shift = generate("long-prompts", duration=duration, rate=2, seed=0)
    early = [r.prompt_tokens for r in shift if r.arrival_time < duration / 2]
    late = [r.prompt_tokens for r in shift if r.arrival_time >= duration / 2]
    assert sorted(late)[len(late) // 2] > 5 * sorted(early)[len(early) // 2]
    assert rate(shift, 0, 2000) == pytest.approx(rate(shift, 2000, 4000), rel=0.2)
    two = generate("two-peak", duration=7200, rate=3, seed=0)
    assert rate(two, 0, 600) == pytest.approx(3, rel=0.25)  # night
    assert rate(two, 0.3 * 7200 - 150, 0.3 * 7200 + 150) == pytest.approx(58, rel=0.15)  # a 20x peak
    assert rate(two, 0.7 * 7200 - 150, 0.7 * 7200 + 150) == pytest.approx(58, rel=0.15)  # and again
    assert rate(two, 0.5 * 7200 - 150, 0.5 * 7200 + 150) < 0.3 * 58  # the trough between them
    assert set(KINDS) == {"poisson", "ramp", "flash-crowd", "bursts", "diurnal", "long-prompts", "two-peak"}


def test_the_cluster_scales_with_the_load_and_counts_gpu_hours() -> None:
    config = ClusterConfig(SMALL, min_replicas=1, max_replicas=8, interval_s=15, cold_start_s=30)
    trace = generate("ramp", duration=1800, rate=0.5, seed=2)
    policy = make_policy("kvasir", Policy(min_replicas=1, max_replicas=8), parse_config({}).baselines)
    result = simulate(trace, config, policy)
    assert len(result.finished) == len(trace)
    assert result.max_replicas > 1 and result.scale_events >= 1
    assert result.ticks[-1].desired > result.ticks[0].desired
    # Each tick keeps the policy's reason for its decision (read back by --tick-reasons).
    scaled_up = next(t for a, t in itertools.pairwise(result.ticks) if t.desired > a.desired)
    assert scaled_up.reason and "->" in scaled_up.reason, scaled_up.reason
    fixed = simulate(trace, config, Static(2), initial_replicas=2)
    assert {t.reason for t in fixed.ticks} == {"static at 2"}
    assert fixed.gpu_hours == pytest.approx(2 * 1800 / 3600, rel=0.02)
    assert fixed.scale_events == 0


def test_static_for_the_peak_meets_the_slo() -> None:
    config = parse_config({"autoscaling": {"minReplicas": 1, "maxReplicas": 6}})
    config = replace(config, profile=SMALL, cold_start_s=30)
    trace = generate("flash-crowd", duration=1800, rate=0.3, seed=4)
    window = peak_window(trace)
    assert window and window[0].arrival_time == 0 and window[-1].arrival_time <= 600
    n = static_for_peak(trace, config)
    assert 1 <= n <= 6
    result = simulate(window, config.cluster, Static(n), initial_replicas=n)
    assert result.slo_attainment >= config.slo.attainment or n == 6


def _signals(replicas: int, kv: float, waiting: float = 0.0, running: float = 4.0) -> Signals:
    return Signals(replicas, replicas, kv, kv, waiting, running * replicas, 0.0, 1.0, None, None)


def test_baseline_policies_follow_their_rules() -> None:
    state = ReplicaState(current=2, ready=2)
    assert Hpa("kv", "kv", 0.8, (1, 10)).decide(0, _signals(2, 1.0), state).replicas == 3
    assert Hpa("queue", "queue", 4, (1, 10)).decide(0, _signals(2, 0.5, waiting=16), state).replicas == 4
    kpa = KnativeKpa(target=8, bounds=(1, 10))
    assert kpa.decide(0, _signals(2, 0.5, waiting=20, running=8), state).replicas == 5  # panic: 36 / 8
    wva = Wva((1, 10))
    assert wva.decide(0, _signals(2, 0.85), state).replicas == 3
    assert wva.decide(30, _signals(2, 0.85), state).replicas == 2  # one change a minute
    assert wva.decide(100, _signals(2, 0.2), state).replicas == 1


def test_a_measured_token_curve_interpolates_and_extends() -> None:
    model = SMALL_CURVE.step
    assert model.compute_time(1) == model.compute_time(0) == 0.05  # below the first point: flat
    assert model.compute_time(9) == pytest.approx(0.09)  # halfway from 2 to 16
    assert model.compute_time(356) == pytest.approx(0.3 + 100 * 0.0002)  # past the end: per_token
    assert model.step_time(2, 1000, 2) == pytest.approx(0.08 + 1000 * 0.000002)
    again = ReplicaProfile.from_json(json.loads(json.dumps(SMALL_CURVE.to_json())))
    assert again.step == model  # JSON lists come back as the same curve
    with pytest.raises(ValueError, match="must increase"):
        StepModel(0.0, 0.0, 0.0, 0.0, token_curve=((4, 0.1), (2, 0.2)))


def test_profiles_ship_and_load() -> None:
    assert {"h100-llama3-8b", "cpu-embedded"} <= set(shipped_profiles())
    h100 = load_profile("h100-llama3-8b")
    decode = h100.step.step_time(64, 64 * 1000, 64)
    assert 0.005 < decode < 0.02  # weights-bound decode of an 8B model on an H100
    with pytest.raises(ValueError, match="no profile"):
        load_profile("tpu-v9")


def test_config_defaults_and_errors() -> None:
    config = parse_config(None)
    assert (config.autoscaling.min_replicas, config.autoscaling.max_replicas) == (1, 8)
    assert config.slo.ttft_s == 1.0 and config.profile.name == "h100-llama3-8b"
    with pytest.raises(ValueError, match="unknown key"):
        parse_config({"autoscale": {}})
    with pytest.raises(ValueError, match=r"autoscaling\.minReplicas"):
        parse_config({"autoscaling": {"minReplicas": 5, "maxReplicas": 2}})


def test_the_cli_generates_and_compares(tmp_path: Path) -> None:
    trace, results, config = tmp_path / "t.jsonl", tmp_path / "r.json", tmp_path / "sim.yaml"
    config.write_text(
        "autoscaling: {minReplicas: 1, maxReplicas: 4}\nprofile: cpu-embedded\nslo: {timeToFirstTokenSeconds: 5, interTokenLatencySeconds: 0.5}\n"
    )
    env = {"PYTHONSAFEPATH": "1"}
    run = [sys.executable, "-m", "kvasir.cli"]
    subprocess.run(
        [*run, "trace", "poisson", "--duration", "120", "--rate", "0.2", "-o", str(trace)],
        check=True,
        env=env,
        capture_output=True,
    )
    done = subprocess.run(
        [
            *run,
            "simulate",
            "--trace",
            str(trace),
            "--config",
            str(config),
            "--policies",
            "kvasir,static,wva",
            "--output",
            str(results),
        ],
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(results.read_text())
    assert set(report["policies"]) == {"kvasir", "static", "wva"}
    for summary in report["policies"].values():
        assert {
            "slo_attainment",
            "ttft_p50_s",
            "ttft_p99_s",
            "itl_p50_s",
            "itl_p99_s",
            "gpu_hours",
            "scale_events",
            "max_replicas",
        } <= set(summary)
    bad = subprocess.run(
        [*run, "simulate", "--trace", str(trace), "--policies", "magic"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "unknown policy magic" in bad.stderr


def test_log_histogram_quantiles() -> None:
    histogram = LogHistogram()
    histogram.add_linear(0.010, 0.0001, 100, weight=2)  # 10.0 .. 19.9 ms, 200 observations
    assert histogram.count == 200
    assert histogram.quantile(0.5) == pytest.approx(0.015, rel=0.02)
    assert histogram.quantile(0.99) == pytest.approx(0.0199, rel=0.02)


def test_skipping_a_cluster_at_rest_equals_ticking_through_it() -> None:
    """A long idle gap (a night, a far-future line) is skipped once the cluster is at rest; the
    outcome is the one ticking through every interval gives, scale-downs in the gap included."""
    config = parse_config({"profile": "cpu-embedded", "autoscaling": {"minReplicas": 1, "maxReplicas": 6}})
    busy = generate("poisson", duration=300, rate=1, seed=5, lengths=Lengths(128, 64))
    trace = [*busy, *(replace(r, arrival_time=r.arrival_time + 6 * 3600) for r in busy)]
    for name in ("kvasir", "kv", "concurrency"):
        policy = make_policy(name, config.policy, config.baselines)
        skipped = simulate(trace, config.cluster, policy, initial_replicas=3)
        policy = make_policy(name, config.policy, config.baselines)
        stepped = simulate(trace, replace(config.cluster, rest_s=math.inf), policy, initial_replicas=3)
        assert len(skipped.ticks) < len(stepped.ticks) / 2, name  # most of the gap was skipped
        assert skipped.summary() == stepped.summary(), name
        assert skipped.finished == stepped.finished, name
        by_time = {t.time: t for t in stepped.ticks}
        assert all(t == by_time[t.time] for t in skipped.ticks), name
        # The gap saw the scale-down to the minimum, at the same tick either way.
        assert min(t.desired for t in stepped.ticks) == 1
