"""The declared metrics are what the exporters export: every family of the runtime's and the
operator's /metrics is declared in `metric_names` with the same kind and help, and every declared
family is exported (so the dashboards, rules and autoscaler, which read the declaration, read
series that exist)."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvasir.observability import metric_names as m
from kvasir.operator.metrics import OperatorMetrics
from kvasir.runtime.engine.llm_engine import EngineStats
from kvasir.runtime.outputs import WeightsReport
from kvasir.runtime.server.metrics import ServerMetrics
from kvasir.runtime.spec_decode.stats import SpecDecodeStats


def _families(text: str) -> dict[str, tuple[str, str]]:
    return {
        family.name: (family.type, family.documentation)
        for family in text_string_to_metric_families(text)
        # prometheus-client's `_created` timestamps of unlabelled metrics parse as families of their own.
        if family.name.startswith("kvasir_") and not family.name.endswith("_created")
    }


def _declared(metrics: tuple[m.Metric, ...]) -> dict[str, tuple[str, str]]:
    return {metric.name: (metric.kind, metric.help) for metric in metrics}


def test_the_runtime_exports_exactly_the_declared_metrics() -> None:
    spec = SpecDecodeStats()
    stats = EngineStats(1, 2, 0.5, 3, 4, 5, spec_decode=spec)
    weights = WeightsReport("gguf", {"gguf Q4_1 (cpu)": 3}, 1000)
    exported = _families(ServerMetrics("m", lambda: stats, lambda: weights).render().decode())
    assert exported == _declared(m.RUNTIME + m.SPEC_DECODE + m.WEIGHTS)


def test_the_operator_exports_exactly_the_declared_metrics() -> None:
    exported = _families(generate_latest(OperatorMetrics().registry).decode())
    assert exported == _declared(m.OPERATOR)


def test_counters_are_read_with_their_total_suffix() -> None:
    assert m.FINISHED.series == "kvasir_requests_finished_total"
    assert m.TTFT.series == m.TTFT.name
