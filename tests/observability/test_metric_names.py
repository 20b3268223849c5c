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
from kvasir.runtime.structured.stats import StructuredStats


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
    structured = StructuredStats()
    structured.count("json", "compiled")
    structured.observe_compile(0.01)
    structured.observe_mask(0.00004, 3)
    stats = EngineStats(1, 2, 0.5, 3, 4, 5, spec_decode=spec, structured=structured.snapshot())
    weights = WeightsReport("gguf", {"gguf Q4_1 (cpu)": 3}, 1000)
    exported = _families(ServerMetrics("m", lambda: stats, lambda: weights).render().decode())
    assert exported == _declared(m.RUNTIME + m.SPEC_DECODE + m.STRUCTURED + m.WEIGHTS + m.LORA)


def test_structured_output_histograms_count_every_observation() -> None:
    structured = StructuredStats()
    structured.count("regex", "invalid")
    structured.observe_mask(0.00004, 3)
    structured.observe_mask(0.002, 1)
    stats = EngineStats(1, 2, 0.5, 3, 4, 5, structured=structured.snapshot())
    text = ServerMetrics("m", lambda: stats, lambda: None).render().decode()
    samples = {
        (sample.name, sample.labels.get("le"), sample.labels.get("outcome")): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    assert samples[("kvasir_structured_output_mask_seconds_bucket", "5e-05", None)] == 3
    assert samples[("kvasir_structured_output_mask_seconds_bucket", "+Inf", None)] == 4
    assert samples[("kvasir_structured_output_requests_total", None, "invalid")] == 1


def test_the_operator_exports_exactly_the_declared_metrics() -> None:
    exported = _families(generate_latest(OperatorMetrics().registry).decode())
    assert exported == _declared(m.OPERATOR)


def test_counters_are_read_with_their_total_suffix() -> None:
    assert m.FINISHED.series == "kvasir_requests_finished_total"
    assert m.TTFT.series == m.TTFT.name
