"""One pod's serving metrics, read from its Prometheus exposition: Kvasir's names or vLLM's.

Parsing is prometheus-client's (`text_string_to_metric_families`), never by hand. Each signal has
a Kvasir name and the vLLM names that mean the same (docs/serving.md has the table), so the
autoscaler scales vLLM pods too. Several series of one metric (one per `model_name`) are summed."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from kvasir.observability import metric_names as m

# Signal -> metric family names (prometheus-client strips `_total` from counter families).
GAUGES: Mapping[str, tuple[str, ...]] = {
    "running": (m.RUNNING.name, "vllm:num_requests_running"),
    "waiting": (m.WAITING.name, "vllm:num_requests_waiting"),
    # vLLM's "perc" is a fraction in 0..1 despite its name (1.0 means a full cache).
    "kv_usage": (m.KV_USAGE.name, "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    # The server's own start-up time (its `total` phase only): the cold start the autoscaler plans on.
    "time_to_ready": (m.TIME_TO_READY.name,),
}
# Series of a family that count, where only some do: (label, value).
ONLY: Mapping[str, tuple[str, str]] = {"time_to_ready": ("phase", "total")}
COUNTERS: Mapping[str, tuple[str, ...]] = {
    "preemptions": (m.PREEMPTIONS.name, "vllm:num_preemptions"),
    "generation_tokens": (m.GENERATION_TOKENS.name, "vllm:generation_tokens"),
    "prompt_tokens": (m.PROMPT_TOKENS.name, "vllm:prompt_tokens"),
    "prefix_cache_queries": (m.PREFIX_QUERIES.name, "vllm:prefix_cache_queries"),
    "prefix_cache_hits": (m.PREFIX_HITS.name, "vllm:prefix_cache_hits"),
}
HISTOGRAMS: Mapping[str, tuple[str, ...]] = {
    "ttft": (m.TTFT.name, "vllm:time_to_first_token_seconds"),
    "itl": (
        m.ITL.name,
        "vllm:inter_token_latency_seconds",
        "vllm:time_per_output_token_seconds",
    ),
    # Per request: the mean of its inter-token gaps (an ITL SLO's SLI).
    "tpot": (m.REQUEST_TPOT.name, "vllm:request_time_per_output_token_seconds"),
    # Arrival to first scheduled: the part of TTFT that more replicas shorten.
    "queue_time": (m.QUEUE_TIME.name, "vllm:request_queue_time_seconds"),
}

_BY_FAMILY = {
    **{name: ("gauge", signal) for signal, names in GAUGES.items() for name in names},
    **{name: ("counter", signal) for signal, names in COUNTERS.items() for name in names},
    **{name: ("histogram", signal) for signal, names in HISTOGRAMS.items() for name in names},
}


@dataclass
class Histogram:
    """Cumulative bucket counts by upper bound (`le`, +Inf included), as Prometheus exposes them."""

    buckets: dict[float, float] = field(default_factory=dict)

    @property
    def count(self) -> float:
        return self.buckets.get(math.inf, 0.0)

    def add(self, other: Histogram) -> None:
        for bound, value in other.buckets.items():
            self.buckets[bound] = self.buckets.get(bound, 0.0) + value


@dataclass
class PodMetrics:
    """What one scrape of one pod said; absent signals are missing from the dicts, never zero."""

    gauges: dict[str, float] = field(default_factory=dict)
    counters: dict[str, float] = field(default_factory=dict)
    histograms: dict[str, Histogram] = field(default_factory=dict)

    @property
    def in_flight(self) -> float:
        """Requests running or waiting: how much deleting this pod would cost."""
        return self.gauges.get("running", 0.0) + self.gauges.get("waiting", 0.0)


class MetricsFormatError(ValueError):
    """An exposition prometheus-client cannot parse."""


def parse_metrics(text: str) -> PodMetrics:
    """The signals in one pod's /metrics text; MetricsFormatError if it is not an exposition."""
    metrics = PodMetrics()
    try:
        families = list(text_string_to_metric_families(text))
    except (ValueError, TypeError, IndexError) as exc:
        raise MetricsFormatError(f"not a Prometheus exposition: {exc}") from None
    for family in families:
        known = _BY_FAMILY.get(family.name)
        if known is None:
            continue
        kind, signal = known
        if kind == "histogram":
            histogram = metrics.histograms.setdefault(signal, Histogram())
            for sample in family.samples:
                if sample.name.endswith("_bucket") and "le" in sample.labels:
                    bound = float(sample.labels["le"])
                    histogram.buckets[bound] = histogram.buckets.get(bound, 0.0) + float(sample.value)
            continue
        target = metrics.gauges if kind == "gauge" else metrics.counters
        only = ONLY.get(signal)
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            if only is not None and sample.labels.get(only[0]) != only[1]:
                continue
            target[signal] = target.get(signal, 0.0) + float(sample.value)
    return metrics
