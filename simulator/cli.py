"""`kvasir simulate` (replay a trace under autoscaling policies) and `kvasir trace` (generate one)."""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import math
import os
import sys
import time
from collections.abc import Callable
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
    simulate.add_argument(
        "--routing",
        default="round-robin",
        help="how requests spread over replicas, comma-separated to compare: round-robin, random, "
        "least-loaded, kvasir (the router's scorer; uses the trace's prefix_group) (default: round-robin)",
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
    trace.add_argument("--duration", type=_positive, default=3600.0, help="seconds (default: 3600)")
    trace.add_argument(
        "--rate", type=_positive, default=10.0, help="base (or mean) requests per second (default: 10)"
    )
    trace.add_argument(
        "--prompt-tokens", type=_count(1), default=512, help="median prompt length (default: 512)"
    )
    trace.add_argument(
        "--output-tokens", type=_count(1), default=256, help="median output length (default: 256)"
    )
    trace.add_argument(
        "--prefix-groups", type=_count(0), default=0, help="shared system prompts (default: none)"
    )
    trace.add_argument("--prefix-tokens", type=_count(0), default=0, help="their length in tokens")
    trace.add_argument("--seed", type=int, default=0)
    trace.add_argument("--output", "-o", required=True, help="the JSONL file to write ('-': stdout)")
    trace.set_defaults(handler=_trace)


def _simulate(args: argparse.Namespace) -> int:
    from kvasir.operator.yaml_input import InputError
    from kvasir.simulator.compare import compare, plot, results_json
    from kvasir.simulator.config import load_config
    from kvasir.simulator.trace import TraceError, read_trace

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICY_NAMES]
    if unknown or not policies:
        return _fail(f"unknown policy {', '.join(unknown) or '(none)'}; one of {', '.join(POLICY_NAMES)}")
    from kvasir.simulator.routing import ROUTINGS

    routings = [r.strip() for r in args.routing.split(",") if r.strip()]
    bad = [r for r in routings if r not in ROUTINGS]
    if bad or not routings:
        return _fail(f"unknown routing {', '.join(bad) or '(none)'}; one of {', '.join(ROUTINGS)}")
    # Everything that can be checked before a run of minutes or hours is checked first.
    problem = _output_problem(args)
    if problem:
        return _fail(problem)
    try:
        config = load_config(args.config)
    except (OSError, InputError, ValueError) as exc:
        return _fail(f"{args.config or 'SIM.yaml defaults'}: {getattr(exc, 'strerror', None) or exc}")
    try:
        loaded = read_trace(args.trace)
    except (OSError, TraceError) as exc:
        return _fail(f"{args.trace}: {getattr(exc, 'strerror', None) or exc}")
    trace = loaded.requests
    span = trace[-1].arrival_time
    print(f"{args.trace}: {len(trace)} requests over {_duration(span)}", file=sys.stderr)
    if loaded.gap > LONG_GAP_S:
        print(
            f"note: line {loaded.gap_line} arrives {_duration(loaded.gap)} after the request before it; the "
            "simulator skips the idle time, but the replicas kept through it count in GPU-hours",
            file=sys.stderr,
        )
    started = time.perf_counter()
    results = {}
    with _Bars(len(trace)) as bars:
        for routing in routings:
            progress = bars.update if len(routings) == 1 else functools.partial(_tagged, bars, routing)
            by_policy = compare(trace, config, policies, on_progress=progress, routing=routing)
            # One routing keeps the policies' own names; several are told apart as policy@routing.
            results.update(
                {name if len(routings) == 1 else f"{name}@{routing}": r for name, r in by_policy.items()}
            )
    elapsed = time.perf_counter() - started
    report = results_json(results, config)
    report["trace"] = {
        "path": str(args.trace),
        "requests": len(trace),
        "seconds": span,
        "start": loaded.start,
    }
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
            f"  max {summary['max_replicas']:3d} replicas, {summary['scale_events']} scale events"
            f", {summary['slo_breach_minutes']} SLO-breach minutes, {summary['failed_requests']} failed",
            file=sys.stderr,
        )
    if args.plots:
        path = plot(results, Path(args.trace).stem, Path(args.plots) / f"{Path(args.trace).stem}.png")
        print(f"wrote {path}", file=sys.stderr)
    return 0


# A gap between two requests longer than this is worth a word: a far-future line, or a day missing.
LONG_GAP_S = 6 * 3600.0


def _fail(message: str) -> int:
    print(f"kvasir simulate: {message}", file=sys.stderr)
    return 2


def _output_problem(args: argparse.Namespace) -> str | None:
    """Why --output or --plots cannot be written, found before the run instead of after it."""
    if args.plots:
        if importlib.util.find_spec("matplotlib") is None:
            return "--plots needs matplotlib: pip install matplotlib (or kvasir[bench])"
        try:
            Path(args.plots).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            return f"--plots {args.plots}: {exc.strerror or exc}"
    if args.output:
        target = Path(args.output)
        folder = target.parent
        if (
            not folder.is_dir()
            or not os.access(folder, os.W_OK)
            or (target.exists() and not os.access(target, os.W_OK))
        ):
            return f"--output {args.output}: cannot write there"
    return None


def _tagged(bars: _Bars, routing: str, name: str, now: float, routed: int) -> None:
    bars.update(f"{name}@{routing}", now, routed)


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


class _Bars:
    """One progress bar per policy on stderr, in requests routed (the work grows with them)."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.bar: Any = None
        self.name = ""

    def update(self, name: str, now: float, routed: int) -> None:
        from tqdm import tqdm

        if name != self.name:
            self.close()
            self.name = name
            self.bar = tqdm(
                total=self.total, desc=f"{name:>16}", unit="req", file=sys.stderr, mininterval=0.5
            )
        self.bar.update(routed - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.update(self.total - self.bar.n)
            self.bar.close()
            self.bar = None

    def __enter__(self) -> _Bars:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# The most requests `kvasir trace` writes (--rate x --duration; the peaks of a shape add more): a
# day at 100 requests per second is 8.6 million, about 700 MB of JSONL.
MAX_TRACE_REQUESTS = 10_000_000


def _positive(text: str) -> float:
    """A finite number above zero (NaN would never end the generator's loop)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text!r}")
    return value


def _count(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if not low <= value <= 10_000_000:
            raise argparse.ArgumentTypeError(f"must be between {low} and 10000000, got {value}")
        return value

    return parse


def _trace(args: argparse.Namespace) -> int:
    from kvasir.simulator.trace import Lengths, generate, write_trace

    if args.duration * args.rate > MAX_TRACE_REQUESTS:
        print(
            f"kvasir trace: --rate x --duration asks for {args.duration * args.rate:.3g} requests; "
            f"at most {MAX_TRACE_REQUESTS} are written",
            file=sys.stderr,
        )
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
        try:
            with open(args.output, "w", encoding="utf-8") as out:
                write_trace(requests, out)
        except OSError as exc:
            print(f"kvasir trace: {args.output}: {exc.strerror or exc}", file=sys.stderr)
            return 2
    print(f"{len(requests)} requests over {args.duration:.0f}s", file=sys.stderr)
    return 0
