"""The runtime's Prometheus metrics (docs/serving.md has the table), labelled by model name, plus the process metrics.

Gauges and the engine's cumulative counters (preemptions, prefix cache) are read from
`AsyncEngine.stats()` at scrape time, so the engine thread never touches Prometheus objects. The
per-request histograms and token counters are recorded by the server as each choice ends, from
the timing record its deltas built (`record_times`), whatever ended it. One choice of an `n > 1`
request counts as one request (each is one sequence in the engine); prompt tokens count once per
prompt, as `usage` does.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import suppress
from itertools import pairwise
from pathlib import Path

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from kvasir.observability import metric_names as m
from kvasir.runtime.engine.llm_engine import EngineStats
from kvasir.runtime.engine.outputs import RequestTimes
from kvasir.runtime.outputs import WeightsReport
from kvasir.runtime.spec_decode.metrics import spec_decode_metrics
from kvasir.runtime.structured.metrics import structured_metrics

FINISH_REASONS = ("stop", "length", "abort")
REJECT_REASONS = ("queue_full", "draining", "loading")


class _EngineCollector(Collector):
    """The engine's own gauges and counters, read from its latest stats snapshot at scrape time."""

    def __init__(
        self,
        model_name: str,
        stats: Callable[[], EngineStats | None],
        weights: Callable[[], WeightsReport | None],
    ) -> None:
        self._model_name = model_name
        self._stats = stats
        self._weights = weights

    def describe(self) -> list[Metric]:
        return []  # nothing to read before the engine exists; skips the registry's duplicate probe

    def collect(self) -> Iterator[Metric]:
        weights = self._weights()
        if weights is not None:
            yield from _weights_metrics(self._model_name, weights)
        stats = self._stats()
        if stats is None:
            return
        labels = [self._model_name]
        for declared, value in (
            (m.RUNNING, stats.num_running),
            (m.WAITING, stats.num_waiting),
            (m.KV_USAGE, stats.kv_cache_usage),
            (m.CPU_THREADS, stats.cpu_threads),
            (m.TENSOR_PARALLEL_SIZE, stats.tensor_parallel_size),
            (m.PREEMPTIONS, stats.num_preemptions),
            (m.PREFIX_QUERIES, stats.prefix_cache_queries),
            (m.PREFIX_HITS, stats.prefix_cache_hits),
        ):
            metric: GaugeMetricFamily | CounterMetricFamily
            if declared.kind == "gauge":
                metric = GaugeMetricFamily(declared.name, declared.help, labels=["model_name"])
            else:
                metric = CounterMetricFamily(declared.name, declared.help, labels=["model_name"])
            metric.add_metric(labels, float(value))
            yield metric
        if stats.spec_decode is not None:
            yield from spec_decode_metrics(labels, stats.spec_decode)
        if stats.structured is not None and stats.structured.requests:
            yield from structured_metrics(labels, stats.structured)
        yield from _endpoint_picker_metrics(labels, stats)


def _endpoint_picker_metrics(labels: list[str], stats: EngineStats) -> Iterator[Metric]:
    """The info series the Gateway API Inference Extension's endpoint picker reads, in vLLM's label
    format: the adapters with running and with waiting requests, comma-joined, and the adapter
    slots per step (both lists empty and max_lora "0" without --enable-lora; the picker still
    expects the series)."""
    lora = GaugeMetricFamily(
        m.LORA_INFO.name,
        m.LORA_INFO.help,
        labels=["model_name", "running_lora_adapters", "waiting_lora_adapters", "max_lora"],
    )
    running, waiting = ",".join(stats.running_loras), ",".join(stats.waiting_loras)
    lora.add_metric([*labels, running, waiting, str(stats.max_loras)], time.time())
    yield lora
    cache = GaugeMetricFamily(
        m.CACHE_CONFIG_INFO.name,
        m.CACHE_CONFIG_INFO.help,
        labels=["model_name", "block_size", "num_gpu_blocks"],
    )
    cache.add_metric([*labels, str(stats.block_size), str(stats.num_gpu_blocks)], 1.0)
    yield cache


def _weights_metrics(model_name: str, weights: WeightsReport) -> Iterator[Metric]:
    """What the weights were loaded as: layers per kernel, and their bytes (constant once loaded)."""
    method = weights.quantization or "none"
    layers = GaugeMetricFamily(
        m.WEIGHT_LAYERS.name, m.WEIGHT_LAYERS.help, labels=["model_name", "quantization", "kernel"]
    )
    for kernel, count in sorted(weights.kernels.items()):
        layers.add_metric([model_name, method, kernel], float(count))
    yield layers
    size = GaugeMetricFamily(m.WEIGHT_BYTES.name, m.WEIGHT_BYTES.help, labels=["model_name", "quantization"])
    size.add_metric([model_name, method], float(weights.weight_bytes))
    yield size


def process_start_time() -> float | None:
    """When this process started (Unix time), as Linux records it (`/proc/self/stat` field 22, in
    clock ticks after boot; the boot time from /proc/uptime, to 10 ms, not /proc/stat's whole
    seconds); None elsewhere."""
    try:
        fields = Path("/proc/self/stat").read_text().rpartition(")")[2].split()
        boot = time.time() - float(Path("/proc/uptime").read_text().split()[0])
        return boot + float(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


class ServerMetrics:
    """One registry per server (tests run several in one process); `render()` is the /metrics body."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(
        self,
        model_name: str,
        stats: Callable[[], EngineStats | None],
        weights: Callable[[], WeightsReport | None] = lambda: None,
    ) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)
        GCCollector(registry=registry)
        registry.register(_EngineCollector(model_name, stats, weights))
        label = ["model_name"]

        def histogram(declared: m.Metric) -> Histogram:
            return Histogram(declared.name, declared.help, label, buckets=declared.buckets, registry=registry)

        def counter(declared: m.Metric, labels: list[str]) -> Counter:
            return Counter(declared.name, declared.help, labels, registry=registry)

        self._ttft = histogram(m.TTFT).labels(model_name)
        self._itl = histogram(m.ITL).labels(model_name)
        self._tpot = histogram(m.REQUEST_TPOT).labels(model_name)
        self._time_to_ready = Gauge(
            m.TIME_TO_READY.name, m.TIME_TO_READY.help, [*label, "phase"], registry=registry
        )
        self._model_name = model_name
        self._e2e = histogram(m.E2E).labels(model_name)
        self._queue = histogram(m.QUEUE_TIME).labels(model_name)
        self._prompt_tokens = counter(m.PROMPT_TOKENS, label).labels(model_name)
        self._generation_tokens = counter(m.GENERATION_TOKENS, label).labels(model_name)
        finished = counter(m.FINISHED, [*label, "finish_reason"])
        self._finished = {reason: finished.labels(model_name, reason) for reason in FINISH_REASONS}
        rejected = counter(m.REJECTED, [*label, "reason"])
        self._rejected = {reason: rejected.labels(model_name, reason) for reason in REJECT_REASONS}
        self._lora_requests = counter(m.LORA_REQUESTS, [*label, "lora_name"])
        self._lora_load = histogram(m.LORA_LOAD_SECONDS).labels(model_name)

    def lora_request(self, name: str) -> None:
        """Count one admitted request of the adapter `name`."""
        self._lora_requests.labels(self._model_name, name).inc()

    def lora_loaded(self, seconds: float) -> None:
        self._lora_load.observe(seconds)

    def lora_unloaded(self, name: str) -> None:
        """Drop the adapter's request counter: only loaded adapters label a series."""
        with suppress(KeyError):
            self._lora_requests.remove(self._model_name, name)

    def add_prompt_tokens(self, count: int) -> None:
        self._prompt_tokens.inc(count)

    def add_generation_tokens(self, count: int) -> None:
        self._generation_tokens.inc(count)

    def rejected(self, reason: str) -> None:
        self._rejected[reason].inc()

    def finished(self, finish_reason: str, times: RequestTimes) -> None:
        """Record one ended choice (`times.finished` set) in each histogram of a phase it reached."""
        if times.finished is None:
            raise ValueError("a choice is recorded once it has ended: times.finished is not set")
        self._finished[finish_reason if finish_reason in self._finished else "abort"].inc()
        self._e2e.observe(max(times.finished - times.arrival, 0.0))
        if times.first_scheduled is not None:
            self._queue.observe(max(times.first_scheduled - times.arrival, 0.0))
        if times.first_token is not None:
            self._ttft.observe(max(times.first_token - times.arrival, 0.0))
        for earlier, later in pairwise(times.token_times):
            self._itl.observe(later - earlier)
        if len(times.token_times) >= 2:
            gaps = len(times.token_times) - 1
            self._tpot.observe(max(times.token_times[-1] - times.token_times[0], 0.0) / gaps)

    def ready_after(self, phases: dict[str, float]) -> None:
        """Record how long start-up took, by phase (seconds; `total` included)."""
        for phase, seconds in phases.items():
            self._time_to_ready.labels(self._model_name, phase).set(round(seconds, 3))

    def render(self) -> bytes:
        return generate_latest(self.registry)
