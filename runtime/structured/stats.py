"""Structured-output counters for /metrics: requests by kind and outcome, and the time grammars
take to compile and their token masks to fill. Written by the compiler (server threads) and the
model runner (the engine's step); read by a snapshot at scrape time."""

from __future__ import annotations

import bisect
import threading
from collections import Counter
from dataclasses import dataclass

from kvasir.observability import metric_names as m


@dataclass(frozen=True)
class HistogramSnapshot:
    buckets: tuple[float, ...]
    counts: tuple[int, ...]  # per bucket (not cumulative), the last one for +Inf
    total: float

    @property
    def count(self) -> int:
        return sum(self.counts)


@dataclass(frozen=True)
class StructuredStatsSnapshot:
    requests: dict[tuple[str, str], int]  # (kind, outcome) -> requests
    compile_seconds: HistogramSnapshot
    mask_seconds: HistogramSnapshot


class _Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value

    def snapshot(self) -> HistogramSnapshot:
        return HistogramSnapshot(self.buckets, tuple(self.counts), self.total)


class StructuredStats:
    """Thread-safe counters; `snapshot()` copies them for a scrape."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: Counter[tuple[str, str]] = Counter()
        self._compile = _Histogram(m.STRUCTURED_COMPILE_SECONDS.buckets)
        self._mask = _Histogram(m.STRUCTURED_MASK_SECONDS.buckets)

    def count(self, kind: str, outcome: str) -> None:
        with self._lock:
            self._requests[(kind, outcome)] += 1

    def observe_compile(self, seconds: float) -> None:
        with self._lock:
            self._compile.observe(seconds)

    def observe_mask(self, seconds_per_sequence: float, sequences: int) -> None:
        with self._lock:
            for _ in range(sequences):
                self._mask.observe(seconds_per_sequence)

    def snapshot(self) -> StructuredStatsSnapshot:
        with self._lock:
            return StructuredStatsSnapshot(
                dict(self._requests), self._compile.snapshot(), self._mask.snapshot()
            )
