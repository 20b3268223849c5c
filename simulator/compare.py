"""Run one trace under several policies and report them side by side (RESULTS.json, plots)."""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvasir.simulator.cluster import Result, nearest_rank, simulate
from kvasir.simulator.config import SimConfig
from kvasir.simulator.policies import Static, make_policy
from kvasir.simulator.routing import make_routing
from kvasir.simulator.trace import TraceRequest

PEAK_WINDOW_S = 600.0


def peak_window(trace: Sequence[TraceRequest], seconds: float = PEAK_WINDOW_S) -> list[TraceRequest]:
    """The `seconds` of the trace with the most tokens to process, shifted to start at 0."""
    if not trace or trace[-1].arrival_time <= seconds:
        return list(trace)
    best, best_load, load, left = 0, -1.0, 0.0, 0
    for r in trace:
        load += r.prompt_tokens + r.output_tokens
        while trace[left].arrival_time < r.arrival_time - seconds:
            load -= trace[left].prompt_tokens + trace[left].output_tokens
            left += 1
        if load > best_load:
            best, best_load = left, load
    start = trace[best].arrival_time
    return [
        replace(r, arrival_time=r.arrival_time - start)
        for r in trace[best:]
        if r.arrival_time - start <= seconds
    ]


def static_for_peak(trace: Sequence[TraceRequest], config: SimConfig) -> int:
    """The fewest fixed replicas that meet the SLO over the trace's busiest window."""
    return replicas_for(peak_window(trace), config)


def warm_start(trace: Sequence[TraceRequest], config: SimConfig) -> int:
    """What an autoscaled deployment runs when the trace begins: the fewest replicas that meet the
    SLO over its first 10 minutes (a deployment that has been serving before, not one scaled to
    its minimum facing the trace's load cold)."""
    return max(
        config.autoscaling.min_replicas,
        replicas_for([r for r in trace if r.arrival_time <= PEAK_WINDOW_S], config),
    )


def replicas_for(window: Sequence[TraceRequest], config: SimConfig) -> int:
    """The fewest fixed replicas that meet the SLO over `window` (at most maxReplicas)."""
    window = list(window)
    cluster = config.cluster
    # At least one: a fixed count of zero serves nothing (minReplicas 0 is the autoscaler's floor).
    low, high = max(1, config.autoscaling.min_replicas), config.autoscaling.max_replicas

    def meets(n: int) -> bool:
        result = simulate(window, cluster, Static(n), initial_replicas=n)
        return result.slo_attainment >= config.slo.attainment

    if not meets(high):
        return high
    while low < high:
        middle = (low + high) // 2
        if meets(middle):
            high = middle
        else:
            low = middle + 1
    return low


# The predictive planner's capacity profile: one replica under Poisson arrivals for this long and
# at least this many requests (a 99% objective judged on a few dozen requests is one request's
# luck), at rates bisected to within PROFILE_PRECISION of each other (Dynamo profiles a replica
# before deploying it).
PROFILE_SECONDS = 120.0
PROFILE_REQUESTS = 600
PROFILE_PRECISION = 0.05
PROFILE_SEED = 1


def capacity_at_slo(trace: Sequence[TraceRequest], config: SimConfig) -> float:
    """Requests/s one replica serves at the SLO: the highest rate of Poisson arrivals, with the
    trace's own prompt and output lengths, whose replay on one fixed replica meets the SLO. It
    knows the workload's lengths, not its arrivals: a capacity profile, not an oracle."""
    lengths = list(trace)

    def meets(rate: float) -> bool:
        result = simulate(_poisson(lengths, rate), config.cluster, Static(1), initial_replicas=1)
        return result.slo_attainment >= config.slo.attainment

    # Up in steps of half again (an overloaded replay is the slow one: its queue only grows), then
    # bisect.
    low, high = 0.0, 1.0
    while meets(high) and high < 1e4:
        low, high = high, 1.5 * high
    while high - low > PROFILE_PRECISION * high:
        middle = (low + high) / 2
        low, high = (middle, high) if meets(middle) else (low, middle)
    return max(low, PROFILE_PRECISION * high)


def _poisson(lengths: Sequence[TraceRequest], rate: float) -> list[TraceRequest]:
    """Poisson arrivals at `rate` for PROFILE_SECONDS (at least PROFILE_REQUESTS), their lengths taken in turn from `lengths`
    (spread over the whole trace, so that a trace whose lengths change is profiled on all of them)."""
    draw = random.Random(PROFILE_SEED)
    count = max(PROFILE_REQUESTS, round(rate * PROFILE_SECONDS))
    stride = max(1, len(lengths) // count)
    out, now = [], 0.0
    for i in range(count):
        now += draw.expovariate(rate)
        out.append(replace(lengths[(i * stride) % len(lengths)], arrival_time=now))
    return out


# Progress of one policy's replay: (policy, simulated seconds, requests routed so far).
Progress = Callable[[str, float, int], None]


def compare(
    trace: Sequence[TraceRequest],
    config: SimConfig,
    policies: Sequence[str],
    on_progress: Progress | None = None,
    routing: str = "round-robin",
) -> dict[str, Result]:
    """Each policy on the same trace; autoscaled ones start warm (`warm_start`), static at its count.
    `routing` spreads requests over the replicas (`kvasir.simulator.routing.ROUTINGS`)."""
    results: dict[str, Result] = {}
    initial = warm_start(trace, config) if any(name != "static" for name in policies) else None
    for name in policies:
        if on_progress is not None:
            on_progress(name, 0.0, 0)  # shown while static is sized, before its replay ticks
        static_replicas = static_for_peak(trace, config) if name == "static" else None
        capacity = capacity_at_slo(trace, config) if name == "predictive" else None
        autoscaler = make_policy(name, config.policy, config.baselines, static_replicas, capacity)
        start = static_replicas if static_replicas is not None else initial
        on_tick = None if on_progress is None else functools.partial(on_progress, name)
        spread = make_routing(routing, block_size=config.profile.block_size)
        results[name] = simulate(
            list(trace), config.cluster, autoscaler, initial_replicas=start, on_tick=on_tick, routing=spread
        )
    return results


# Kvasir's GPU-hours may be at most this many times the cheapest policy's that meets the SLO
# (or static's, where none does).
GPU_HOURS_SLACK = 1.05


def never_worse_than_static(summaries: dict[str, dict[str, Any]], kvasir: str = "kvasir") -> list[str]:
    """What breaks Kvasir's goal on one trace, from each policy's summary (Result.summary());
    [] when it holds: Kvasir meets the SLO with GPU-hours at most static's and at most
    GPU_HOURS_SLACK times the cheapest policy's that meets it; where no policy meets it, at most
    GPU_HOURS_SLACK times static's. Needs `kvasir` and `static` among the summaries."""
    ours, static = summaries[kvasir], summaries["static"]
    meeting = {name: s["gpu_hours"] for name, s in summaries.items() if s["meets_slo"]}
    if not meeting:
        if ours["gpu_hours"] > GPU_HOURS_SLACK * static["gpu_hours"]:
            return [
                f"no policy meets the SLO and {ours['gpu_hours']} GPU-hours > {GPU_HOURS_SLACK}x static's"
            ]
        return []
    broken = []
    if ours["gpu_hours"] > static["gpu_hours"]:
        broken.append(f"{ours['gpu_hours']} GPU-hours, static {static['gpu_hours']}")
    if not ours["meets_slo"]:
        broken.append(f"misses the SLO ({ours['slo_attainment']}) where {', '.join(sorted(meeting))} meet it")
        return broken
    cheapest = min(meeting, key=lambda name: meeting[name])
    if ours["gpu_hours"] > GPU_HOURS_SLACK * meeting[cheapest]:
        ratio = ours["gpu_hours"] / meeting[cheapest]
        broken.append(
            f"{ratio:.2f}x the cheapest meeting the SLO ({cheapest}, {meeting[cheapest]} GPU-hours)"
        )
    return broken


def results_json(results: dict[str, Result], config: SimConfig) -> dict[str, Any]:
    return {
        "slo": {
            "timeToFirstTokenSeconds": config.slo.ttft_s,
            "interTokenLatencySeconds": config.slo.itl_s,
            "attainment": config.slo.attainment,
        },
        "profile": config.profile.name,
        "policies": {name: result.summary() for name, result in results.items()},
    }


def _per_minute_ttft_p99(result: Result) -> tuple[list[float], list[float]]:
    buckets: dict[int, list[float]] = {}
    for f in result.finished:
        buckets.setdefault(int(f.arrival // 60), []).append(f.ttft)
    minutes = sorted(buckets)
    return [m / 60.0 for m in minutes], [nearest_rank(buckets[m], 0.99) for m in minutes]


def plot(results: dict[str, Result], title: str, path: Path) -> Path:
    """Load, replicas and TTFT p99 over time, every policy on the same axes (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError("--plots needs matplotlib (pip install matplotlib)") from exc
    figure, (load, replicas, latency) = plt.subplots(3, 1, figsize=(11, 9), sharex=True)
    first = next(iter(results.values()))
    load.plot(
        [t.time / 3600 for t in first.ticks], [t.arrivals_per_s for t in first.ticks], color="black", lw=0.8
    )
    load.set_ylabel("requests/s")
    load.set_title(title)
    for name, result in results.items():
        replicas.step(
            [t.time / 3600 for t in result.ticks],
            [t.desired for t in result.ticks],
            where="post",
            label=name,
            lw=1,
        )
        hours, p99 = _per_minute_ttft_p99(result)
        latency.plot(hours, p99, label=name, lw=0.8)
    replicas.set_ylabel("replicas")
    replicas.legend(loc="upper left", ncol=4, fontsize=8)
    latency.set_ylabel("TTFT p99 per minute (s)")
    latency.set_yscale("log")
    latency.set_xlabel("hours")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=90)
    plt.close(figure)
    return path
