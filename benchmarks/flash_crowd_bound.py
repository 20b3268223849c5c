"""The best any reactive autoscaler could do on the suite's flash crowd, measured in the simulator.

A reactive policy learns of the crowd at the first tick whose scrapes show it. This benchmark
gives one every advantage a reactive policy could have: it knows the crowd's size and that it
will last, and at the Kth tick after the crowd's onset (K = 1: the first tick that shows it, 15 s
in) it jumps straight to N replicas and keeps them to the end (no scale-down, so its GPU-hours
are an upper bound of such a policy's). Against it: Kvasir's own decide() and the static count
provisioned for the peak (the oracle that knows the crowd in advance). If the SLO is met only
with K = 1 and N well past what the crowd needs, no rule reading the pods can meet it: at the
first tick the pods have shown 15 s of a crowd still rising (a third of the way to its height).

    python benchmarks/flash_crowd_bound.py [--seed 0] [--routing round-robin,least-loaded]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import print_header, print_table
from autoscaling_policies import config_for, trace_for, trace_spec

from kvasir.operator.autoscaler.decide import HOLD, SCALE_UP, Decision, ReplicaState
from kvasir.operator.autoscaler.signals import Signals
from kvasir.simulator.cluster import simulate
from kvasir.simulator.compare import static_for_peak, warm_start
from kvasir.simulator.policies import Static, make_policy
from kvasir.simulator.routing import make_routing

PROFILE = "cpu-embedded"


class JumpAfterOnset:
    """Hold `start` replicas, then from the first tick at or after `at` hold `replicas`."""

    def __init__(self, start: int, at: float, replicas: int) -> None:
        self.name = f"jump at {at:.0f}s to {replicas}"
        self.start, self.at, self.replicas = start, at, replicas

    def decide(self, now: float, signals: Signals | None, replicas: ReplicaState) -> Decision:
        target = self.replicas if now >= self.at else self.start
        kind = SCALE_UP if target > replicas.current else HOLD
        return Decision(target, self.name, kind, target, False)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--routing", default="round-robin,least-loaded")
    parser.add_argument("--ticks", default="1,2,3", help="K: react at the Kth tick after the onset")
    args = parser.parse_args()

    config = config_for(PROFILE, 32)
    spec = trace_spec(PROFILE, "flash-crowd")
    trace = trace_for(PROFILE, "flash-crowd", args.seed)
    onset = spec.duration / 3  # kvasir.simulator.trace's flash crowd starts a third of the way in
    interval = config.autoscaling.interval_seconds
    start = warm_start(trace, config)
    static = static_for_peak(trace, config)
    budget = int(len(trace) * (1 - config.slo.attainment))
    print_header(
        f"flash crowd bound: {PROFILE}, {spec.what}, seed {args.seed}; {len(trace)} requests, "
        f"{budget} may miss; warm start {start}, static for the peak {static}; "
        f"cold start {config.cold_start_s:g} s, a tick every {interval:g} s"
    )
    for routing in args.routing.split(","):
        rows = []
        runs = [("static (knows the peak)", Static(static), static), ("kvasir", None, start)]
        for k in (int(k) for k in args.ticks.split(",")):
            first = (onset // interval + k) * interval  # the Kth tick after the onset
            for n in (static, round(1.5 * static), 2 * static):
                runs.append(
                    (f"tick {k} ({first - onset:.0f} s in) -> {n}", JumpAfterOnset(start, first, n), start)
                )
        for name, autoscaler, initial in runs:
            if autoscaler is None:
                autoscaler = make_policy("kvasir", config.policy, config.baselines, None)
            result = simulate(
                trace, config.cluster, autoscaler, initial_replicas=initial, routing=make_routing(routing)
            )
            misses = round((1 - result.slo_attainment) * len(trace))
            meets = "yes" if result.slo_attainment >= config.slo.attainment else "no"
            rows.append((name, result.slo_attainment, meets, misses, result.gpu_hours))
        print(f"routing: {routing}")
        print_table(["policy", "SLO attainment", "meets", "requests missed", "GPU-hours"], rows)


if __name__ == "__main__":
    main()
