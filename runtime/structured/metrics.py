"""Structured output's Prometheus families, built from a stats snapshot at scrape time (the server's
collector yields them once a request has asked for a grammar)."""

from __future__ import annotations

from collections.abc import Iterator
from itertools import accumulate

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric

from kvasir.observability import metric_names as m
from kvasir.runtime.structured.stats import HistogramSnapshot, StructuredStatsSnapshot


def structured_metrics(labels: list[str], stats: StructuredStatsSnapshot) -> Iterator[Metric]:
    """Requests by kind and outcome, compile and mask times, under the collector's `labels`."""
    requests = CounterMetricFamily(
        m.STRUCTURED_REQUESTS.name, m.STRUCTURED_REQUESTS.help, labels=["model_name", "kind", "outcome"]
    )
    for (kind, outcome), count in sorted(stats.requests.items()):
        requests.add_metric([*labels, kind, outcome], float(count))
    yield requests
    yield _histogram(m.STRUCTURED_COMPILE_SECONDS, labels, stats.compile_seconds)
    yield _histogram(m.STRUCTURED_MASK_SECONDS, labels, stats.mask_seconds)


def _histogram(declared: m.Metric, labels: list[str], snapshot: HistogramSnapshot) -> HistogramMetricFamily:
    family = HistogramMetricFamily(declared.name, declared.help, labels=["model_name"])
    bounds = [*(f"{bound:g}" for bound in snapshot.buckets), "+Inf"]
    cumulative = list(accumulate(snapshot.counts))
    family.add_metric(labels, list(zip(bounds, map(float, cumulative), strict=True)), snapshot.total)
    return family
