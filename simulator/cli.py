"""`kvasir simulate` (replay a trace under autoscaling policies) and `kvasir trace` (generate one)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from kvasir.simulator.policies import POLICY_NAMES
from kvasir.simulator.trace import KINDS


def register(subparsers: Any) -> None:
    simulate = subparsers.add_parser(
        "simulate",
        help="replay a load trace against simulated replicas under autoscaling policies",
        description="Replay TRACE.jsonl against simulated replicas (Kvasir's real scheduler and KV cache "
        "manager with a fitted step-time model) under each policy, and compare SLO attainment and GPU-hours.",
    )
    simulate.add_argument(
        "--trace", required=True, help="JSONL trace: arrival_time, prompt_tokens, output_tokens"
    )
    simulate.add_argument(
        "--config", help="SIM.yaml (autoscaling, profile, coldStartSeconds, slo, baselines)"
    )
    simulate.add_argument(
        "--policies",
        default="kvasir,static",
        help=f"comma-separated, from {','.join(POLICY_NAMES)} (default: kvasir,static)",
    )
    simulate.add_argument("--output", help="write RESULTS.json here (default: print it)")
    simulate.add_argument(
        "--plots", help="write a PNG of load, replicas and TTFT p99 over time into this folder"
    )
    simulate.set_defaults(handler=_simulate)

    trace = subparsers.add_parser(
        "trace",
        help="generate a load trace for `kvasir simulate`",
        description="Write a JSONL trace of one of the shipped shapes.",
    )
    trace.add_argument("kind", choices=KINDS)
    trace.add_argument("--duration", type=float, default=3600.0, help="seconds (default: 3600)")
    trace.add_argument(
        "--rate", type=float, default=10.0, help="base (or mean) requests per second (default: 10)"
    )
    trace.add_argument("--prompt-tokens", type=int, default=512, help="median prompt length (default: 512)")
    trace.add_argument("--output-tokens", type=int, default=256, help="median output length (default: 256)")
    trace.add_argument("--prefix-groups", type=int, default=0, help="shared system prompts (default: none)")
    trace.add_argument("--prefix-tokens", type=int, default=0, help="their length in tokens")
    trace.add_argument("--seed", type=int, default=0)
    trace.add_argument("--output", "-o", required=True, help="the JSONL file to write ('-': stdout)")
    trace.set_defaults(handler=_trace)


def _simulate(args: argparse.Namespace) -> int:
    from kvasir.simulator.compare import compare, plot, results_json
    from kvasir.simulator.config import load_config
    from kvasir.simulator.trace import TraceError, read_trace

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICY_NAMES]
    if unknown or not policies:
        print(
            f"kvasir simulate: unknown policy {', '.join(unknown) or '(none)'}; one of {', '.join(POLICY_NAMES)}",
            file=sys.stderr,
        )
        return 2
    try:
        config = load_config(args.config)
        trace = read_trace(args.trace)
    except (OSError, ValueError, TraceError) as exc:
        print(f"kvasir simulate: {exc}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    results = compare(trace, config, policies)
    elapsed = time.perf_counter() - started
    report = results_json(results, config)
    report["trace"] = {"path": str(args.trace), "requests": len(trace), "seconds": trace[-1].arrival_time}
    report["wall_seconds"] = round(elapsed, 1)
    text = json.dumps(report, indent=2)
    if args.output:
        Path(args.output).write_text(text + "\n")
    else:
        print(text)
    for name, summary in report["policies"].items():
        print(
            f"{name:>16}: SLO {summary['slo_attainment']:.4f} {'met' if summary['meets_slo'] else 'missed':6}"
            f" GPU-h {summary['gpu_hours']:8.2f}  TTFT p99 {summary['ttft_p99_s']:.3f}s"
            f"  max {summary['max_replicas']:3d} replicas, {summary['scale_events']} scale events",
            file=sys.stderr,
        )
    if args.plots:
        try:
            path = plot(results, Path(args.trace).stem, Path(args.plots) / f"{Path(args.trace).stem}.png")
        except RuntimeError as exc:
            print(f"kvasir simulate: {exc}", file=sys.stderr)
            return 2
        print(f"wrote {path}", file=sys.stderr)
    return 0


def _trace(args: argparse.Namespace) -> int:
    from kvasir.simulator.trace import Lengths, generate, write_trace

    if args.duration <= 0 or args.rate <= 0:
        print("kvasir trace: --duration and --rate must be positive", file=sys.stderr)
        return 2
    requests = generate(
        args.kind,
        duration=args.duration,
        rate=args.rate,
        seed=args.seed,
        lengths=Lengths(prompt_median=args.prompt_tokens, output_median=args.output_tokens),
        prefix_groups=args.prefix_groups,
        prefix_tokens=args.prefix_tokens,
    )
    if args.output == "-":
        write_trace(requests, sys.stdout)
    else:
        with open(args.output, "w", encoding="utf-8") as out:
            write_trace(requests, out)
    print(f"{len(requests)} requests over {args.duration:.0f}s", file=sys.stderr)
    return 0
