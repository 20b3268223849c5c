"""Where one replica's latency turns into a wall, in the simulator, and where the autoscaler's
line places it. One replica of a profile (static, no autoscaling) serves a steady Poisson load
at each rate for five minutes; for each, the SLO attainment, TTFT P99, and the mean running
batch, queue and arrivals its pods report (the signals the operator reads). The autoscaler's
knee (kvasir.operator.autoscaler.knee) is then fitted on the ticks without a queue, as it would
be on a deployment's own, and printed next to the highest
rate that met the SLO.

    python benchmarks/replica_knee.py [--profile h100-llama3-8b] [--lengths mixed]
        [--rates 5,10,15,20,25,27,30]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import print_header, print_table
from autoscaling_policies import CPU_SHORT, GPU_MIXED, config_for

from kvasir.operator.autoscaler import knee
from kvasir.operator.autoscaler.decide import Decision, ReplicaState
from kvasir.operator.autoscaler.signals import Signals
from kvasir.simulator.cluster import simulate
from kvasir.simulator.policies import Static
from kvasir.simulator.trace import generate

LENGTHS = {"mixed": GPU_MIXED, "short": CPU_SHORT}


class Recording(Static):
    """One replica, never scaled; keeps every tick's signals."""

    def __init__(self) -> None:
        super().__init__(1)
        self.seen: list[Signals] = []

    def decide(self, now: float, signals: Signals | None, replicas: ReplicaState) -> Decision:
        if signals is not None:
            self.seen.append(signals)
        return super().decide(now, signals, replicas)


def _mean(values: list[float | None]) -> float:
    known = [v for v in values if v is not None]
    return statistics.fmean(known) if known else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--profile", default="h100-llama3-8b")
    parser.add_argument("--lengths", default="mixed", choices=sorted(LENGTHS))
    parser.add_argument("--rates", default="5,10,15,20,25,27,30")
    parser.add_argument("--seconds", type=float, default=300.0)
    args = parser.parse_args()
    print_header(f"one replica of {args.profile} at steady load")
    config = config_for(args.profile, 1)
    rows: list[list[Any]] = []
    readings: knee.Readings = ()
    meeting = 0.0
    clock = 0.0
    for rate in (float(r) for r in args.rates.split(",")):
        trace = generate("poisson", duration=args.seconds, rate=rate, seed=1, lengths=LENGTHS[args.lengths])
        policy = Recording()
        summary = simulate(trace, config.cluster, policy, initial_replicas=1).summary()
        seen = policy.seen[4:]  # after the first window filled
        running = _mean([s.running for s in seen])
        waiting = _mean([s.waiting for s in seen])
        arrivals = _mean([s.request_rate for s in seen])
        kv = _mean([s.kv_usage_mean for s in seen])
        if summary["meets_slo"]:
            meeting = max(meeting, rate)
        for s in seen:  # as decide() keeps them: ticks without a queue
            clock += 15.0
            if (s.queue_per_replica or 0.0) < 1.0:
                readings = knee.remember(readings, clock, s.request_rate, s.running, s.kv_usage_mean, 1)
        rows.append(
            [rate, summary["slo_attainment"], summary["ttft_p99_s"], round(running, 1), round(waiting, 1),
             round(arrivals, 2), round(kv, 2)]
        )  # fmt: skip
    print_table(
        ["rate /s", "SLO attainment", "TTFT p99 s", "running", "waiting", "arrivals /s", "KV usage"], rows
    )
    profile = config.cluster.profile
    found = knee.knee_rate(readings, profile.max_num_seqs, config.policy.target_kv_cache_usage)
    print(f"\nhighest rate that met the SLO: {meeting:g}/s")
    if found is None:
        print("the autoscaler's line places no knee from these readings")
    else:
        print(f"the autoscaler's {found[1]}, from {len(readings)} unqueued ticks; it keeps arrivals at "
              f"{knee.KNEE_USE:g} of it: {knee.KNEE_USE * found[0]:.3g}/s per replica")  # fmt: skip


if __name__ == "__main__":
    main()
