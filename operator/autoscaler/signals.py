"""The autoscaler's signals over a sliding window of scrapes, as Prometheus would compute them.

Gauges (KV-cache usage, running and waiting requests) are read from the latest scrape; rates
(preemptions, tokens) and latency quantiles come from counter and histogram deltas between the
oldest and newest scrape of each pod in the window, summed across pods, exactly as
`histogram_quantile(q, sum(rate(x_bucket[w])) by (le))` would. A counter that went down (a
restarted pod) counts from zero, like Prometheus' `rate()`. A quantile needs a minimum number of
observations in the window, or it is unknown (a ratio of two noisy quantiles means nothing)."""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from kvasir.operator.autoscaler.metrics import Histogram, PodMetrics


@dataclass(frozen=True)
class Signals:
    """What the pods said over the window; None means unknown (no pod reported it)."""

    ready_replicas: int  # pods that are Ready
    reporting_replicas: int  # Ready pods whose latest scrape succeeded
    kv_usage_mean: float | None
    kv_usage_max: float | None
    waiting: float | None  # total over the reporting pods
    running: float | None
    preemption_rate: float | None  # per second, summed
    generation_tokens_rate: float | None  # output tokens per second, summed
    itl_ratio: float | None  # P99 / P50 of inter-token latency over the window
    ttft_ratio: float | None  # P99 / P50 of time to first token
    itl_p99: float | None = None
    ttft_p99: float | None = None
    itl_mean: float | None = None  # mean inter-token latency over the window (from the buckets)
    window_seconds: float = 0.0
    # The window's histograms summed over the pods, for any percentile (an SLO's); None with fewer
    # observations than the window's minimum.
    ttft_histogram: Histogram | None = None
    tpot_histogram: Histogram | None = None  # per request: its mean time per output token
    queue_time_histogram: Histogram | None = None  # arrival to first scheduled
    time_to_ready: float | None = None  # the median of the pods' own start-up times (total)
    # Requests arriving per second over the window: those that got their first token in it plus
    # the growth of the queue, summed over the pods (what the pods were asked for, served or not).
    request_rate: float | None = None

    @property
    def complete(self) -> bool:
        """Every ready pod reported: no pod's state is unknown."""
        return self.ready_replicas > 0 and self.reporting_replicas == self.ready_replicas

    @property
    def queue_per_replica(self) -> float | None:
        if self.waiting is None or self.reporting_replicas == 0:
            return None
        return self.waiting / self.reporting_replicas

    def ttft_quantile(self, q: float) -> float | None:
        return None if self.ttft_histogram is None else histogram_quantile(q, self.ttft_histogram.buckets)

    def queue_time_quantile(self, q: float) -> float | None:
        histogram = self.queue_time_histogram
        return None if histogram is None else histogram_quantile(q, histogram.buckets)

    def tpot_quantile(self, q: float) -> float | None:
        return None if self.tpot_histogram is None else histogram_quantile(q, self.tpot_histogram.buckets)

    @property
    def latency_ratio(self) -> float | None:
        """The larger of the two tail-shape ratios that are known."""
        known = [r for r in (self.itl_ratio, self.ttft_ratio) if r is not None]
        return max(known) if known else None


def histogram_quantile(q: float, buckets: Mapping[float, float]) -> float | None:
    """Prometheus' histogram_quantile over cumulative `buckets` (linear within a bucket)."""
    bounds = sorted(buckets)
    if not bounds or bounds[-1] != math.inf:
        return None
    total = buckets[math.inf]
    if total <= 0:
        return None
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if bound == math.inf:
                return lower_bound  # the highest finite bound, as Prometheus answers
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return lower_bound


def histogram_count_above(threshold: float, buckets: Mapping[float, float]) -> float | None:
    """How many observations exceed `threshold`, from cumulative `buckets` (exact on a bucket
    bound, linear within a bucket, as histogram_quantile reads them)."""
    bounds = sorted(buckets)
    if not bounds or bounds[-1] != math.inf:
        return None
    total = buckets[math.inf]
    lower_bound, lower_count = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if threshold <= bound:
            if bound == math.inf:
                return total - lower_count  # above the highest finite bound: all of +Inf's
            share = (threshold - lower_bound) / (bound - lower_bound) if bound > lower_bound else 1.0
            return total - (lower_count + share * (count - lower_count))
        lower_bound, lower_count = bound, count
    return total - lower_count


def histogram_mean(buckets: Mapping[float, float]) -> float | None:
    """The mean of a histogram from its cumulative buckets alone (each observation at its bucket's
    midpoint; the +Inf bucket at the highest finite bound), for expositions read without `_sum`."""
    bounds = sorted(buckets)
    if not bounds or bounds[-1] != math.inf or buckets[math.inf] <= 0:
        return None
    total, weighted, lower_bound, lower_count = buckets[math.inf], 0.0, 0.0, 0.0
    for bound in bounds:
        count = buckets[bound] - lower_count
        point = lower_bound if bound == math.inf else (lower_bound + bound) / 2
        weighted += count * point
        lower_bound, lower_count = (lower_bound if bound == math.inf else bound), buckets[bound]
    return weighted / total


def _delta(new: float, old: float | None) -> float:
    return new if old is None or new < old else new - old


def _histogram_delta(new: Histogram, old: Histogram | None) -> Histogram:
    if old is None or new.count < old.count:
        return Histogram(dict(new.buckets))
    return Histogram({b: v - old.buckets.get(b, 0.0) for b, v in new.buckets.items()})


@dataclass(frozen=True)
class Scrape:
    """The pods' metrics at one tick (pods that failed to answer are absent)."""

    time: float
    pods: Mapping[str, PodMetrics]


class MetricsWindow:
    """The last `seconds` of scrapes of one deployment's pods."""

    def __init__(self, seconds: float, *, min_samples: int = 20) -> None:
        self.seconds = seconds
        self.min_samples = min_samples
        self._scrapes: deque[Scrape] = deque()

    def add(self, scrape: Scrape) -> None:
        self._scrapes.append(scrape)
        # Keep one scrape older than the window as the baseline of its deltas.
        while len(self._scrapes) > 2 and self._scrapes[1].time <= scrape.time - self.seconds:
            self._scrapes.popleft()

    def signals(self, ready_pods: Iterable[str]) -> Signals:
        """Signals for the Ready pods now; uses the latest scrape and the window's baseline per pod."""
        ready = list(ready_pods)
        latest = self._scrapes[-1] if self._scrapes else Scrape(0.0, {})
        reporting = [latest.pods[p] for p in ready if p in latest.pods]
        kv = [m.gauges["kv_usage"] for m in reporting if "kv_usage" in m.gauges]
        waiting = [m.gauges["waiting"] for m in reporting if "waiting" in m.gauges]
        running = [m.gauges["running"] for m in reporting if "running" in m.gauges]
        rates: dict[str, float] = {}
        histograms: dict[str, Histogram] = {}
        span = 0.0
        arrivals: float | None = None
        for pod in ready:
            if pod not in latest.pods:
                continue
            base = self._baseline(pod)
            if base is None:
                continue
            then, old = base
            span = max(span, latest.time - then)
            new = latest.pods[pod]
            for name, value in new.counters.items():
                rates[name] = rates.get(name, 0.0) + _delta(value, old.counters.get(name))
            for name, histogram in new.histograms.items():
                histograms.setdefault(name, Histogram()).add(
                    _histogram_delta(histogram, old.histograms.get(name))
                )
            if "ttft" in new.histograms and latest.time > then:
                # The pods' requests in the window over the window's span: a pod new to the window
                # took its requests from the others only since it came (counted at its own rate
                # over its short span, next to theirs over the whole window, a scale-up's first
                # window would read up to half again the true arrivals).
                served = _histogram_delta(new.histograms["ttft"], old.histograms.get("ttft")).count
                queued = new.gauges.get("waiting", 0.0) - old.gauges.get("waiting", 0.0)
                arrivals = (arrivals or 0.0) + max(0.0, served + queued)
        itl_ratio, itl_p99 = self._ratio(histograms.get("itl"))
        itl = histograms.get("itl")
        itl_mean = histogram_mean(itl.buckets) if itl is not None and itl.count >= self.min_samples else None
        ttft_ratio, ttft_p99 = self._ratio(histograms.get("ttft"))
        started = sorted(m.gauges["time_to_ready"] for m in reporting if "time_to_ready" in m.gauges)
        return Signals(
            ready_replicas=len(ready),
            reporting_replicas=len(reporting),
            kv_usage_mean=sum(kv) / len(kv) if kv else None,
            kv_usage_max=max(kv) if kv else None,
            waiting=sum(waiting) if waiting else None,
            running=sum(running) if running else None,
            preemption_rate=rates["preemptions"] / span if span and "preemptions" in rates else None,
            generation_tokens_rate=(
                rates["generation_tokens"] / span if span and "generation_tokens" in rates else None
            ),
            itl_ratio=itl_ratio,
            ttft_ratio=ttft_ratio,
            itl_p99=itl_p99,
            ttft_p99=ttft_p99,
            itl_mean=itl_mean,
            window_seconds=span,
            ttft_histogram=self._enough(histograms.get("ttft")),
            tpot_histogram=self._enough(histograms.get("tpot")),
            queue_time_histogram=self._enough(histograms.get("queue_time")),
            time_to_ready=statistics.median(started) if started else None,
            request_rate=arrivals / span if arrivals is not None and span > 0 else None,
        )

    def _enough(self, histogram: Histogram | None) -> Histogram | None:
        return histogram if histogram is not None and histogram.count >= self.min_samples else None

    def _baseline(self, pod: str) -> tuple[float, PodMetrics] | None:
        """The oldest scrape in the window (before the latest) in which the pod answered."""
        for scrape in list(self._scrapes)[:-1]:
            if pod in scrape.pods:
                return scrape.time, scrape.pods[pod]
        return None

    def _ratio(self, histogram: Histogram | None) -> tuple[float | None, float | None]:
        if histogram is None or histogram.count < self.min_samples:
            return None, None
        p50 = histogram_quantile(0.5, histogram.buckets)
        p99 = histogram_quantile(0.99, histogram.buckets)
        if p50 is None or p99 is None or p50 <= 0:
            return None, p99
        return p99 / p50, p99
