"""Kvasir's goal, checked on every trace a user is shown: its GPU-hours at most static's, and at
most 1.05x the cheapest policy that meets the SLO while it meets it too (where no policy meets
it, at most 1.05x static's): `kvasir.simulator.compare.never_worse_than_static`.

Two sources of traces:
- the examples the docs show (`kvasir trace ...` then `kvasir simulate` with an examples/ SIM.yaml),
  each replayed here under every policy (`--examples`);
- the autoscaling suite's log (`benchmarks/autoscaling_policies.py --log FILE`; several files are
  merged, later lines win), judged as logged (`--suite-log FILE ...`).

    python benchmarks/never_worse_than_static.py --examples [--only headline,zero,routing]
    python benchmarks/never_worse_than_static.py --suite-log results.jsonl [more.jsonl]

Exit status 1 when the goal breaks anywhere. tests/simulator/test_never_worse_than_static.py checks
a fast subset in CI; this is the full sweep (the docs' headline example alone is about five minutes
of CPU for every policy)."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import print_header

from kvasir.simulator.compare import compare, never_worse_than_static
from kvasir.simulator.config import load_config
from kvasir.simulator.trace import Lengths, generate, read_trace, write_trace

REPO = Path(__file__).resolve().parents[1]
# Every policy the simulator compares, but Kvasir's ablations (kvasir-no-ratio equals kvasir by
# default; kvasir-ratio and kvasir-no-slo are other configurations of the same deployment).
POLICIES = ("kvasir", "static", "concurrency", "kv", "queue", "wva", "predictive")


@dataclass(frozen=True)
class Example:
    doc: str  # where the docs show it
    config: str  # its SIM.yaml, from the repository root
    kind: str
    duration: float
    rate: float
    seed: int = 0
    lengths: Lengths = field(default_factory=Lengths)
    prefix_groups: int = 0
    prefix_tokens: int = 0


# Each as the docs write its `kvasir trace` line (the CLI's defaults where it gives none).
EXAMPLES = {
    "headline": Example("docs/simulator.md (the first example)", "examples/sim.yaml", "bursts", 3600, 5.0),
    "zero": Example(
        "docs/simulator.md (Scale to zero)", "examples/sim-zero.yaml", "poisson", 10800, 0.005556, seed=7
    ),
    "routing": Example(
        "docs/benchmarks.md (Routing in the simulator; round-robin)",
        "examples/sim-routing.yaml",
        "poisson",
        300,
        40.0,
        seed=1,
        lengths=Lengths(prompt_median=4200, output_median=64),
        prefix_groups=128,
        prefix_tokens=4000,
    ),
}


def run_example(name: str) -> dict[str, dict[str, Any]]:
    example = EXAMPLES[name]
    trace = generate(
        example.kind,
        duration=example.duration,
        rate=example.rate,
        seed=example.seed,
        lengths=example.lengths,
        prefix_groups=example.prefix_groups,
        prefix_tokens=example.prefix_tokens,
    )
    # Through the file, as `kvasir trace -o` then `kvasir simulate --trace` take it (rounded as
    # written, replayed from the first request).
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trace.jsonl"
        with path.open("w") as out:
            write_trace(trace, out)
        requests = list(read_trace(path).requests)
    config = load_config(str(REPO / example.config))
    return {policy: result.summary() for policy, result in compare(requests, config, POLICIES).items()}


def suite_summaries(paths: list[str]) -> dict[str, dict[str, dict[str, Any]]]:
    """{"profile / trace": {policy: summary}} from autoscaling_policies.py --log files."""
    found: dict[str, dict[str, dict[str, Any]]] = {}
    for path in paths:
        for line in Path(path).read_text().splitlines():
            item = json.loads(line)
            found.setdefault(f"{item['profile']} / {item['trace']}", {})[item["policy"]] = item["summary"]
    return found


def verdict(name: str, summaries: dict[str, dict[str, Any]]) -> bool:
    """Print one trace's line per policy and the goal's verdict; True when it holds."""
    print(f"### {name}")
    for policy, s in summaries.items():
        meets = "met   " if s["meets_slo"] else "MISSED"
        print(f"  {policy:>12}: SLO {s['slo_attainment']:.4f} {meets} GPU-h {s['gpu_hours']:8.3f}")
    if "kvasir" not in summaries or "static" not in summaries:
        print("  goal: not judged (kvasir and static are both needed)")
        return True
    broken = never_worse_than_static(summaries)
    print("  goal: " + ("holds" if not broken else "BROKEN: " + "; ".join(broken)))
    return not broken


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--examples", action="store_true", help="replay the docs' examples under every policy"
    )
    parser.add_argument("--only", default=",".join(EXAMPLES), help=f"of {','.join(EXAMPLES)}")
    parser.add_argument("--suite-log", nargs="*", default=[], help="autoscaling_policies.py --log files")
    parser.add_argument("--output", help="write every summary as JSON")
    args = parser.parse_args()
    print_header("never worse than static")
    held, everything = True, {}
    if args.examples:
        for name in args.only.split(","):
            started = time.perf_counter()
            summaries = run_example(name)
            everything[name] = summaries
            held &= verdict(f"{name}: {EXAMPLES[name].doc}", summaries)
            print(f"  ({time.perf_counter() - started:.0f} s)", flush=True)
    for name, summaries in suite_summaries(args.suite_log).items():
        everything[name] = summaries
        held &= verdict(name, summaries)
    if args.output:
        Path(args.output).write_text(json.dumps(everything, indent=1) + "\n")
    sys.exit(0 if held else 1)


if __name__ == "__main__":
    main()
