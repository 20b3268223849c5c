"""The SLO on the dashboards: for each latency of `spec.autoscaling.slo` the autoscaling dashboard
plots the observed percentile next to the objective (the operator exports both, and exports
them for exactly these signal names), and the runtime's cold start by phase."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

from kvasir.observability import metric_names as m
from kvasir.observability.dashboards import SLO_SIGNALS, panel_queries
from kvasir.operator.autoscaler.decide import History, ReplicaState, decide
from kvasir.operator.autoscaler.loop import Autoscaler
from kvasir.operator.autoscaler.metrics import Histogram
from kvasir.operator.autoscaler.policy import Policy
from kvasir.operator.autoscaler.signals import Signals
from kvasir.operator.metrics import OperatorMetrics
from tests.external_tools import REPO


def _autoscaling_board() -> dict[str, Any]:
    return json.loads((REPO / "dashboards" / "kvasir-autoscaling.json").read_text())


def test_each_slo_latency_has_a_panel_with_the_observed_percentile_and_the_objective() -> None:
    queries = panel_queries(_autoscaling_board())
    for signal, title in SLO_SIGNALS:
        mine = [expr for panel, expr in queries if panel == title]
        assert any(m.SIGNAL.series in e and f'signal="{signal}"' in e for e in mine), mine
        assert any(m.TARGET.series in e and f'signal="{signal}"' in e for e in mine), mine


def test_the_cold_start_panel_reads_the_runtimes_metric() -> None:
    queries = [expr for panel, expr in panel_queries(_autoscaling_board()) if panel == "Cold start by phase"]
    assert queries and all(m.TIME_TO_READY.series in expr for expr in queries)


def _series(metrics: OperatorMetrics) -> dict[tuple[str, str], float]:
    out = {}
    for family in metrics.registry.collect():
        for sample in family.samples:
            if "signal" in sample.labels:
                out[(sample.name, sample.labels["signal"])] = sample.value
    return out


def test_the_operator_exports_the_slo_percentiles_the_panels_read() -> None:
    ttft = Histogram({0.5: 0.0, 1.0: 100.0, float("inf"): 100.0})
    tpot = Histogram({0.05: 0.0, 0.1: 100.0, float("inf"): 100.0})
    signals = Signals(2, 2, 0.3, 0.3, 0.0, 4.0, 0.0, 50.0, 2.0, 2.0, ttft_histogram=ttft, tpot_histogram=tpot)
    policy = Policy(max_replicas=4, slo_ttft_seconds=1.5, slo_itl_seconds=0.2)
    state = ReplicaState(current=2, ready=2)
    decision = decide(0.0, signals, History(), policy, state)
    metrics = OperatorMetrics()
    Autoscaler._record(SimpleNamespace(metrics=metrics), "ns", "demo", decision, signals, policy, state)  # type: ignore[arg-type]
    exported = _series(metrics)
    assert exported[(m.TARGET.name, "ttft_slo_percentile_seconds")] == 1.5
    assert exported[(m.TARGET.name, "tpot_slo_percentile_seconds")] == 0.2
    assert 0.5 < exported[(m.SIGNAL.name, "ttft_slo_percentile_seconds")] <= 1.0
    assert 0.05 < exported[(m.SIGNAL.name, "tpot_slo_percentile_seconds")] <= 0.1
    # Without an SLO, no objective is exported (the panel shows nothing rather than a made-up one).
    plain = OperatorMetrics()
    recorder: Any = SimpleNamespace(metrics=plain)
    Autoscaler._record(recorder, "ns", "demo", decision, signals, Policy(max_replicas=4), state)
    assert (m.TARGET.name, "ttft_slo_percentile_seconds") not in _series(plain)
