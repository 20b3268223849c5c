"""How fast `kvasir simulate` is: a 24-hour diurnal trace under Kvasir's autoscaler with up to 32
replicas, timed on this machine (goal: under 15 minutes on 2 cores). Prints the wall time, the
requests and replica-hours simulated, and the engine steps that ran through the real scheduler
versus those applied by the exact steady-decode fast-forward.

    python benchmarks/simulator_speed.py [--profile cpu-embedded] [--rate 4]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import print_header

from kvasir.simulator.cluster import simulate
from kvasir.simulator.config import parse_config
from kvasir.simulator.policies import make_policy
from kvasir.simulator.replica import SimReplica
from kvasir.simulator.trace import Lengths, generate


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--profile", default="cpu-embedded")
    parser.add_argument("--rate", type=float, default=0.35, help="mean requests per second over the day")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--max-replicas", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print_header("simulator speed: a 24 h diurnal trace, up to 32 replicas")
    lengths = Lengths(
        prompt_median=args.prompt_tokens, output_median=args.output_tokens, max_prompt=1024, max_output=256
    )
    trace = generate("diurnal", duration=86400, rate=args.rate, seed=args.seed, lengths=lengths)
    config = parse_config(
        {
            "autoscaling": {"minReplicas": 1, "maxReplicas": args.max_replicas},
            "profile": args.profile,
            "slo": {"timeToFirstTokenSeconds": 5.0, "interTokenLatencySeconds": 0.5},
        }
    )
    steps = {"real": 0, "fast-forwarded": 0}
    original_step, original_ff = SimReplica._step, SimReplica._fast_forward

    def counted_step(self: SimReplica) -> bool:
        steps["real"] += 1
        return original_step(self)

    def counted_ff(self: SimReplica, n: int) -> None:
        steps["fast-forwarded"] += n
        original_ff(self, n)

    SimReplica._step = counted_step  # type: ignore[method-assign]
    SimReplica._fast_forward = counted_ff  # type: ignore[method-assign]
    started = time.perf_counter()
    result = simulate(trace, config.cluster, make_policy("kvasir", config.policy, config.baselines))
    elapsed = time.perf_counter() - started
    summary = result.summary()
    print(
        f"profile {config.profile.name}; {len(trace)} requests over 24 h (mean {args.rate}/s, peak 5x the trough)"
    )
    print(
        f"wall time: {elapsed:.1f} s ({elapsed / 60:.1f} min), {len(trace) / elapsed:.0f} requests/s simulated"
    )
    print(
        f"replicas: max {summary['max_replicas']}, {summary['gpu_hours']:.1f} replica-hours, {summary['scale_events']} scale events"
    )
    total = steps["real"] + steps["fast-forwarded"]
    print(
        f"engine steps: {total:,} simulated, {steps['real']:,} through the real scheduler, {steps['fast-forwarded']:,} fast-forwarded ({steps['fast-forwarded'] / max(total, 1):.0%})"
    )
    print(
        f"SLO attainment {summary['slo_attainment']:.4f}, TTFT p99 {summary['ttft_p99_s']} s, ITL p99 {summary['itl_p99_s']} s"
    )


if __name__ == "__main__":
    main()
