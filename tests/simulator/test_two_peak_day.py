"""Kvasir on the CPU suite's two-peak day (benchmarks/autoscaling_policies.py, cpu-embedded /
two-peak: 0.3 -> 6 requests/s twice in two hours, heavy-tailed lengths) against the `predictive`
planner: it meets the SLO at no more than 1.05x the planner's GPU-hours.

Before the falling window (decide._falling_window) Kvasir met the SLO with 11.50 GPU-hours to the
planner's 10.06 (1.14x). Read tick by tick, 2.46 of its extra GPU-hours were ticks where the 300 s
scale-down window held a count the arrivals, falling after each peak, no longer needed (the
planner re-plans every minute on the arrivals); on the way up Kvasir was below the planner. With
the window at one reaction while the arrivals fall inside the error budget: 8.70 GPU-hours, 0.994
attainment, 33 scale events."""

from __future__ import annotations

from kvasir.simulator.compare import GPU_HOURS_SLACK, compare
from kvasir.simulator.config import parse_config
from kvasir.simulator.trace import Lengths, generate

# The suite's cpu-embedded configuration and two-peak trace (autoscaling_policies.py SUITES).
CONFIG = parse_config(
    {
        "autoscaling": {"minReplicas": 1, "maxReplicas": 32},
        "profile": "cpu-embedded",
        "slo": {"timeToFirstTokenSeconds": 2.5, "interTokenLatencySeconds": 0.25},
        "baselines": {"concurrencyTarget": 8, "kvTarget": 0.8, "queueTarget": 2},
    }
)
MIXED = Lengths(prompt_median=64, output_median=32, sigma=1.0, max_prompt=512, max_output=384)


def test_kvasir_is_within_5_percent_of_the_planner_on_the_two_peak_day() -> None:
    trace = generate("two-peak", duration=7200, rate=0.3, seed=0, lengths=MIXED)
    results = compare(trace, CONFIG, ["kvasir", "predictive"])
    kvasir, planner = (results[name].summary() for name in ("kvasir", "predictive"))
    assert kvasir["meets_slo"] and planner["meets_slo"], (kvasir, planner)
    assert kvasir["gpu_hours"] <= GPU_HOURS_SLACK * planner["gpu_hours"], (kvasir, planner)
    assert kvasir["scale_events"] <= 20 * 2  # the suite's bound: 20 an hour
    # The window was shortened on the way down, and only there.
    reasons = [tick.reason for tick in results["kvasir"].ticks]
    assert any("(arrivals falling inside the SLO: one reaction)" in r for r in reasons)
