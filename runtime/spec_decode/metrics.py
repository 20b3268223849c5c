"""Speculative decoding's Prometheus families, built from a stats snapshot at scrape time.

The server's collector yields these (only when speculation is on), as vLLM's spec_decode_* family.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, Metric

from kvasir.observability import metric_names as m
from kvasir.runtime.spec_decode.stats import SpecDecodeStats


def spec_decode_metrics(labels: list[str], spec: SpecDecodeStats) -> Iterator[Metric]:
    """The counters of `spec` under the collector's `labels` (the model name)."""
    for declared, value in (
        (m.SPEC_DRAFTS, spec.num_drafts),
        (m.SPEC_DRAFT_TOKENS, spec.num_draft_tokens),
        (m.SPEC_ACCEPTED_TOKENS, spec.num_accepted_tokens),
    ):
        metric = CounterMetricFamily(declared.name, declared.help, labels=["model_name"])
        metric.add_metric(labels, float(value))
        yield metric
    per_position = CounterMetricFamily(
        m.SPEC_ACCEPTED_PER_POSITION.name,
        m.SPEC_ACCEPTED_PER_POSITION.help,
        labels=["model_name", "position"],
    )
    for position, count in enumerate(spec.accepted_per_position):
        per_position.add_metric([*labels, str(position)], float(count))
    yield per_position
