"""Autoscaling policies compared in the simulator, on the same traces: Kvasir's, static for the
peak, a concurrency target (Knative/KServe KPA), KV usage alone (AIBrix-like), queue alone, llm-d
WVA's saturation rule, and Kvasir's without the latency-ratio signal. For each trace: SLO attainment
(DistServe's: TTFT and mean time per output token within the SLO for 99% of requests), GPU-hours,
and which policy meets the SLO with the fewest GPU-hours. Plots go to docs/img/autoscaling-*.png.

The replicas are the `cpu-embedded` profile, the one calibrated against the real engine
(benchmarks/simulator_fidelity.py), with a GPU pod's cold start (120 s: image cached, model load,
warm-up) and an SLO that profile can meet (TTFT 2.5 s, 250 ms per output token); a replica serves
about 1 request/s of these traces (prompts ~128 tokens, outputs ~64). `--profile h100-llama3-8b`
runs the roofline H100 profile instead (set --scale: it serves about 50x more per replica).

    python benchmarks/autoscaling_policies.py [--traces poisson,ramp,...] [--scale 1.0] [--plots docs/img]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import print_header, print_table

from kvasir.simulator.compare import compare, plot, results_json
from kvasir.simulator.config import parse_config
from kvasir.simulator.policies import POLICY_NAMES
from kvasir.simulator.trace import Lengths, generate

REPO = Path(__file__).resolve().parents[1]

# (duration s, base or mean requests/s) per shape for the cpu-embedded profile; --scale multiplies
# the rate. Sized so that the load crosses several replicas' worth and back.
TRACES = {
    "poisson": (3600, 4.0),
    "ramp": (3600, 1.5),
    "flash-crowd": (3600, 0.8),
    "bursts": (3600, 1.5),
    "diurnal": (86400, 3.0),
    "long-prompts": (3600, 2.0),
}
LENGTHS = Lengths(prompt_median=128, output_median=64, max_prompt=1024, max_output=256)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--traces", default=",".join(TRACES))
    parser.add_argument("--policies", default=",".join(POLICY_NAMES))
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every trace's rate")
    parser.add_argument("--max-replicas", type=int, default=32)
    parser.add_argument("--plots", default=str(REPO / "docs" / "img"))
    parser.add_argument("--output", help="write all results as JSON")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", default="cpu-embedded")
    args = parser.parse_args()
    print_header(f"autoscaling policies in the simulator ({args.profile} profile)")
    cpu = args.profile == "cpu-embedded"
    config = parse_config(
        {
            # Kvasir's latency target at 0.7 x the SLO's time per output token (docs/autoscaling.md).
            "autoscaling": {
                "minReplicas": 1,
                "maxReplicas": args.max_replicas,
                "targets": {"interTokenLatencySeconds": round(0.7 * (0.25 if cpu else 0.1), 4)},
            },
            "profile": args.profile,
            "coldStartSeconds": 120,
            "slo": {"ttftSeconds": 2.5, "itlSeconds": 0.25} if cpu else {},
            # Each baseline's knob set as its users would for this replica: the concurrency one
            # replica sustains at the SLO, KV 0.8 (AIBrix's default), 2 waiting per replica.
            "baselines": {"concurrencyTarget": 8, "kvTarget": 0.8, "queueTarget": 2} if cpu else {},
        }
    )
    print(
        f"SLO: TTFT <= {config.slo.ttft_s}s and time per output token <= {config.slo.itl_s}s for "
        f"{config.slo.attainment:.0%} of requests; cold start {config.cold_start_s:.0f}s"
    )
    policies = args.policies.split(",")
    everything = {}
    for kind in args.traces.split(","):
        duration, rate = TRACES[kind]
        trace = generate(
            kind,
            duration=duration,
            rate=rate * args.scale,
            seed=args.seed,
            lengths=LENGTHS if cpu else Lengths(),
        )
        started = time.perf_counter()
        results = compare(trace, config, policies)
        elapsed = time.perf_counter() - started
        report = results_json(results, config)
        everything[kind] = report
        rows = []
        meeting = {n: s for n, s in report["policies"].items() if s["meets_slo"]}
        best = min(meeting, key=lambda n: meeting[n]["gpu_hours"]) if meeting else None
        for name, s in report["policies"].items():
            rows.append(
                [name, s["slo_attainment"], "yes" if s["meets_slo"] else "no", s["gpu_hours"], s["ttft_p99_s"],
                 s["itl_p99_s"], s["max_replicas"], s["scale_events"], "<-" if name == best else ""]
            )  # fmt: skip
        print(f"### {kind}: {len(trace)} requests over {duration / 3600:g} h (simulated in {elapsed:.0f} s)")
        print_table(
            [
                "policy",
                "SLO attainment",
                "meets",
                "GPU-hours",
                "TTFT p99 s",
                "ITL p99 s",
                "max replicas",
                "scale events",
                "fewest GPU-h meeting SLO",
            ],
            rows,
        )
        if "static" in report["policies"] and "kvasir" in report["policies"]:
            saving = 1 - report["policies"]["kvasir"]["gpu_hours"] / report["policies"]["static"]["gpu_hours"]
            print(f"kvasir vs static peak provisioning: {saving:.0%} fewer GPU-hours")
        if args.plots:
            path = plot(
                results, f"{kind} ({len(trace)} requests)", Path(args.plots) / f"autoscaling-{kind}.png"
            )
            print(f"plot: {path.relative_to(REPO) if path.is_relative_to(REPO) else path}")
        print()
    if args.output:
        Path(args.output).write_text(json.dumps(everything, indent=2) + "\n")


if __name__ == "__main__":
    main()
