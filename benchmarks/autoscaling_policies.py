"""Autoscaling policies compared in the simulator, on the same traces: Kvasir's, static for the
peak, a concurrency target (Knative/KServe KPA), KV usage alone (AIBrix-like), queue alone, llm-d
WVA's saturation rule, a predictive planner (as Dynamo's SLA planner: a forecast over the cold
start over a capacity per replica profiled at the SLO), and Kvasir's ablations (without the latency-ratio signal; without the SLO
as a target, i.e. the CRD's defaults alone). For each trace: SLO attainment (DistServe's: TTFT and
mean time per output token within the SLO for 99% of requests), GPU-hours relative to the cheapest
policy that meets the SLO, scale events per trace-hour, and whether Kvasir holds the goal (meets
the SLO at <= 1.05x the cheapest that does; on diurnal days >= 30% fewer GPU-hours than static;
<= 20 scale events per trace-hour).

Two suites, one per shipped profile:
- `cpu-embedded` (calibrated against the real engine, benchmarks/simulator_fidelity.py) with its
  measured cold start, an SLO that profile can meet (TTFT 2.5 s, 250 ms per output token);
- `h100-llama3-8b` (the roofline profile) with a GPU pod's 90 s cold start and the held-out
  day's SLO (TTFT 1 s, 100 ms per output token), on five shorter traces (20 min to 1 h: a replica of this profile serves tens of requests a second, every step of every replica
  goes through the real scheduler, and the suite has to run on a shared 2-core machine).
Each has the shipped trace shapes plus mixed lengths (log-normal with a long tail) and a two-peak
working day. Kvasir runs with the CRD's defaults and the SLO as `spec.autoscaling.slo`.

    python benchmarks/autoscaling_policies.py [--profiles cpu-embedded,h100-llama3-8b]
        [--traces poisson,...] [--policies ...] [--jobs 16] [--output results.json] [--plots docs/img]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import print_header, print_table

from kvasir.simulator.cluster import Result, simulate
from kvasir.simulator.compare import capacity_at_slo, static_for_peak, warm_start
from kvasir.simulator.config import SimConfig, parse_config
from kvasir.simulator.policies import POLICY_NAMES, make_policy
from kvasir.simulator.trace import Lengths, TraceRequest, generate

REPO = Path(__file__).resolve().parents[1]
GPU_HOURS_SLACK = 1.05  # the goal: Kvasir within 5% of the cheapest policy that meets the SLO
DIURNAL_SAVING = 0.30
EVENTS_PER_HOUR = 20
MIN_REPLICAS = 1


@dataclass(frozen=True)
class TraceSpec:
    kind: str  # a generator shape (kvasir.simulator.trace)
    duration: float  # seconds
    rate: float  # base or mean requests/s
    lengths: Lengths
    what: str


CPU_SHORT = Lengths(prompt_median=128, output_median=64, max_prompt=1024, max_output=256)
# Mixed: a heavy tail (sigma 1), prompts up to 8x the median; the longest prefill (512 tokens,
# 1.7 s on this profile) still fits the 2.5 s TTFT objective, so the SLO can be met.
CPU_MIXED = Lengths(prompt_median=64, output_median=32, sigma=1.0, max_prompt=512, max_output=384)
GPU_CHAT = Lengths()
# The held-out day's lengths: prompts near 400 with a tail to 4,000, outputs near 150 with a tail
# to 2,000.
GPU_MIXED = Lengths(prompt_median=400, output_median=150, sigma=1.0, max_prompt=4000, max_output=2000)

SUITES: dict[str, dict[str, Any]] = {
    "cpu-embedded": {
        "slo": {"timeToFirstTokenSeconds": 2.5, "interTokenLatencySeconds": 0.25},
        # Each baseline's knob as its users would set it for this replica: the concurrency one
        # replica sustains at the SLO, KV 0.8 (AIBrix's default), 2 waiting per replica.
        "baselines": {"concurrencyTarget": 8, "kvTarget": 0.8, "queueTarget": 2},
        "traces": {
            "poisson": TraceSpec("poisson", 3600, 4.0, CPU_SHORT, "4/s, 1 h"),
            "ramp": TraceSpec("ramp", 3600, 1.5, CPU_SHORT, "1.5 -> 6/s in 4 steps, 1 h"),
            "flash-crowd": TraceSpec("flash-crowd", 3600, 0.8, CPU_SHORT, "10x in 30 s, 1 h"),
            "bursts": TraceSpec("bursts", 3600, 1.5, CPU_SHORT, "5x for 60 s every 10 min, 1 h"),
            "diurnal": TraceSpec("diurnal", 6 * 3600, 3.0, CPU_SHORT, "a day in 6 h, mean 3/s"),
            "long-prompts": TraceSpec("long-prompts", 3600, 2.0, CPU_SHORT, "8x prompts from mid-trace, 1 h"),
            "mixed-length": TraceSpec("poisson", 3600, 2.5, CPU_MIXED, "2.5/s, heavy-tailed lengths, 1 h"),
            "two-peak": TraceSpec("two-peak", 7200, 0.3, CPU_MIXED, "0.3 -> 6/s twice, mixed lengths, 2 h"),
        },
    },
    "h100-llama3-8b": {
        "slo": {"timeToFirstTokenSeconds": 1.0, "interTokenLatencySeconds": 0.1},
        "baselines": {},  # the defaults: concurrency 32, KV 0.8, 4 waiting
        "traces": {
            "bursts": TraceSpec("bursts", 1800, 6.0, GPU_CHAT, "6 -> 30/s for 60 s every 10 min, 30 min"),
            "diurnal": TraceSpec("diurnal", 3600, 8.0, GPU_CHAT, "a day in 1 h, mean 8/s"),
            # The same day at five times the load: three replicas at its peak, so that a saving
            # over static exists (one replica serves the day above).
            "busy-day": TraceSpec("diurnal", 3600, 40.0, GPU_CHAT, "a day in 1 h, mean 40/s"),
            "mixed-length": TraceSpec("poisson", 1200, 12.0, GPU_MIXED, "12/s, heavy-tailed lengths, 20 min"),
            "two-peak": TraceSpec("two-peak", 3600, 1.5, GPU_MIXED, "1.5 -> 30/s twice, mixed lengths, 1 h"),
        },
    },
}


# Held out: the trace a capacity planner ran against the autoscaler before its SLO rule (a
# two-hour two-peak day, 3 to 60 requests/s, mixed lengths, h100-llama3-8b, SLO TTFT 1 s and
# 100 ms per output token at 99%, CRD defaults otherwise). No rule was tuned on it: it is run
# only with --held-out, after the design is settled, and reported on its own.
HELD_OUT = {
    "profile": "h100-llama3-8b",
    "trace": TraceSpec("two-peak", 7200, 3.0, GPU_MIXED, "3 -> 60/s twice, mixed lengths, 2 h"),
}


def config_for(profile: str, max_replicas: int) -> SimConfig:
    suite = SUITES[profile]
    return parse_config(
        {
            "autoscaling": {"minReplicas": MIN_REPLICAS, "maxReplicas": max_replicas},
            "profile": profile,
            "slo": suite["slo"],
            "baselines": suite["baselines"],
        }
    )


def trace_spec(profile: str, name: str) -> TraceSpec:
    if name == "held-out":
        spec: TraceSpec = HELD_OUT["trace"]
        return spec
    spec = SUITES[profile]["traces"][name]
    return spec


def trace_for(profile: str, name: str, seed: int) -> list[TraceRequest]:
    spec = trace_spec(profile, name)
    return generate(spec.kind, duration=spec.duration, rate=spec.rate, seed=seed, lengths=spec.lengths)


def run_one(job: tuple[str, str, str, int, int, bool]) -> tuple[str, str, str, dict[str, Any], float]:
    """One (profile, trace, policy): its summary and the seconds it took to simulate."""
    profile, name, policy, max_replicas, seed, tick_reasons = job
    started = time.perf_counter()
    config = config_for(profile, max_replicas)
    trace = trace_for(profile, name, seed)
    result = _replay(trace, config, policy)
    summary = result.summary()
    summary["hours"] = trace_spec(profile, name).duration / 3600
    summary["ticks"] = [(t.time, t.desired) for t in result.ticks][:: max(1, len(result.ticks) // 2000)]
    if tick_reasons:
        # Every tick, for reading why a policy held the count it did (large: one line a tick).
        summary["tick_reasons"] = [
            (t.time, t.arrivals_per_s, t.ready, t.desired, t.queue, t.reason) for t in result.ticks
        ]
    return profile, name, policy, summary, time.perf_counter() - started


def _replay(trace: list[TraceRequest], config: SimConfig, policy: str) -> Result:
    static = static_for_peak(trace, config) if policy == "static" else None
    capacity = capacity_at_slo(trace, config) if policy == "predictive" else None
    autoscaler = make_policy(policy, config.policy, config.baselines, static, capacity)
    start = static if static is not None else warm_start(trace, config)
    return simulate(trace, config.cluster, autoscaler, initial_replicas=start)


def judge(policies: dict[str, dict[str, Any]], diurnal: bool) -> tuple[str | None, list[str]]:
    """The cheapest policy meeting the SLO, and the goal's verdicts for Kvasir on this trace."""
    meeting = {n: s for n, s in policies.items() if s["meets_slo"]}
    cheapest = min(meeting, key=lambda n: meeting[n]["gpu_hours"]) if meeting else None
    verdicts = []
    kvasir = policies.get("kvasir")
    if kvasir is None:
        return cheapest, verdicts
    if cheapest is None:
        verdicts.append("no policy meets the SLO")
    elif not kvasir["meets_slo"]:
        verdicts.append("MISSED: Kvasir misses the SLO")
    else:
        ratio = kvasir["gpu_hours"] / meeting[cheapest]["gpu_hours"]
        ok = ratio <= GPU_HOURS_SLACK
        verdicts.append(
            f"{'met' if ok else 'MISSED'}: {ratio:.2f}x the cheapest meeting the SLO ({cheapest})"
        )
    if diurnal and "static" in policies and policies["static"]["max_replicas"] <= MIN_REPLICAS:
        # Static peak provisioning is already minReplicas: no count an autoscaler may run is lower.
        verdicts.append(f"no saving possible: static runs minReplicas ({MIN_REPLICAS})")
    elif diurnal and "static" in policies:
        saving = 1 - kvasir["gpu_hours"] / policies["static"]["gpu_hours"]
        ok = saving >= DIURNAL_SAVING and kvasir["meets_slo"]
        verdicts.append(f"{'met' if ok else 'MISSED'}: {saving:.1%} fewer GPU-hours than static")
    if not kvasir["meets_slo"] and "static" in policies:
        cheaper = kvasir["gpu_hours"] <= policies["static"]["gpu_hours"]
        verdicts.append(f"{'no more' if cheaper else 'MORE'} GPU-hours than static")
    per_hour = kvasir["scale_events"] / max(kvasir["hours"], 1e-9)
    verdicts.append(f"{'met' if per_hour <= EVENTS_PER_HOUR else 'MISSED'}: {per_hour:.1f} scale events/h")
    return cheapest, verdicts


def report(results: dict[str, dict[str, dict[str, dict[str, Any]]]], plots: str | None) -> None:
    for profile, traces in results.items():
        suite = SUITES[profile]
        slo = suite["slo"]
        print(
            f"## {profile}: SLO TTFT <= {slo['timeToFirstTokenSeconds']} s and time per output token <= "
            f"{slo['interTokenLatencySeconds']} s for 99% of requests; cold start {config_for(profile, 1).cold_start_s:g} s"
        )
        for name, policies in traces.items():
            spec = trace_spec(profile, name)
            cheapest, verdicts = judge(policies, spec.kind == "diurnal")
            base = policies[cheapest]["gpu_hours"] if cheapest else None
            rows = []
            for policy, s in policies.items():
                relative = f"{s['gpu_hours'] / base:.2f}x" if base else "-"
                per_hour = f"{s['scale_events'] / spec.duration * 3600:.1f}"
                rows.append(
                    [policy, s["slo_attainment"], "yes" if s["meets_slo"] else "no", s["gpu_hours"], relative,
                     s["ttft_p99_s"], s["max_replicas"], s["scale_events"], per_hour,
                     "<-" if policy == cheapest else ""]
                )  # fmt: skip
            requests = next(iter(policies.values()))["requests"]
            print(f"### {profile} / {name} ({spec.what}; {requests} requests)")
            print_table(
                ["policy", "SLO attainment", "meets", "GPU-hours", "vs cheapest meeting", "TTFT p99 s",
                 "max replicas", "scale events", "events / h", "cheapest meeting"],
                rows,
            )  # fmt: skip
            print("goal: " + "; ".join(verdicts))
            if plots:
                _plot(policies, f"{profile} / {name}", Path(plots) / f"autoscaling-{profile}-{name}.png")
            print()


def _plot(policies: dict[str, dict[str, Any]], title: str, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    figure, axes = plt.subplots(figsize=(10, 4))
    for policy, s in policies.items():
        axes.step(
            [t / 3600 for t, _ in s["ticks"]], [r for _, r in s["ticks"]], where="post", label=policy, lw=1
        )
    axes.set_title(title)
    axes.set_xlabel("hours")
    axes.set_ylabel("replicas")
    axes.legend(loc="upper left", ncol=5, fontsize=7)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=80)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--profiles", default=",".join(SUITES))
    parser.add_argument("--traces", default=None, help="default: every trace of the suite")
    parser.add_argument("--policies", default=",".join(POLICY_NAMES))
    parser.add_argument("--max-replicas", type=int, default=32)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="simulations in parallel")
    parser.add_argument("--plots", default=None, help="a folder for replica plots (needs matplotlib)")
    parser.add_argument("--output", help="write all results as JSON")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--held-out",
        action="store_true",
        help="run only the held-out trace (a capacity planner's two-peak day on the H100)",
    )
    parser.add_argument("--log", help="append each finished simulation to this JSON-lines file")
    parser.add_argument(
        "--tick-reasons",
        action="store_true",
        help="add every tick's (time, arrivals/s, ready, desired, queue, reason) to --output",
    )
    parser.add_argument("--report", help="only print the tables of a --log file (of this or an earlier run)")
    args = parser.parse_args()
    if args.report:
        logged: dict[str, dict[str, dict[str, dict[str, Any]]]] = {}
        for line in Path(args.report).read_text().splitlines():
            item = json.loads(line)
            logged.setdefault(item["profile"], {}).setdefault(item["trace"], {})[item["policy"]] = item[
                "summary"
            ]
        policies = [
            q for q in args.policies.split(",") if any(q in t for p in logged.values() for t in p.values())
        ]
        report(
            {
                p: {n: {q: t[q] for q in policies if q in t} for n, t in logged[p].items()}
                for p in SUITES
                if p in logged
            },
            args.plots,
        )
        return
    print_header("autoscaling policies in the simulator")
    jobs = []
    profiles = [HELD_OUT["profile"]] if args.held_out else args.profiles.split(",")
    for profile in profiles:
        names = (
            ["held-out"]
            if args.held_out
            else args.traces.split(",")
            if args.traces
            else list(SUITES[profile]["traces"])
        )
        for name in names:
            for policy in args.policies.split(","):
                jobs.append((profile, name, policy, args.max_replicas, args.seed, args.tick_reasons))
    results: dict[str, dict[str, dict[str, dict[str, Any]]]] = {}
    started = time.perf_counter()
    # The longest traces first, so that the pool's last minutes are not one long job alone.
    jobs.sort(key=lambda job: -trace_spec(job[0], job[1]).duration * trace_spec(job[0], job[1]).rate)
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        for profile, name, policy, summary, seconds in pool.map(run_one, jobs):
            results.setdefault(profile, {}).setdefault(name, {})[policy] = summary
            print(f"  {profile} / {name} / {policy}: {seconds:.0f} s", file=sys.stderr, flush=True)
            if args.log:
                with open(args.log, "a") as log:
                    item = {"profile": profile, "trace": name, "policy": policy, "seconds": seconds}
                    log.write(json.dumps({**item, "summary": summary}) + "\n")
    # Each table in the order of the arguments.
    ordered = {
        p: {n: {q: results[p][n][q] for q in args.policies.split(",")} for n in results[p]} for p in profiles
    }
    report(ordered, args.plots)
    print(f"simulated in {time.perf_counter() - started:.0f} s with {args.jobs} processes")
    if args.output:
        Path(args.output).write_text(json.dumps(ordered, indent=1) + "\n")


if __name__ == "__main__":
    main()
