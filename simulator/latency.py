"""Percentiles of many weighted observations in constant memory: a log-spaced histogram with 1%
wide bins (so a percentile is exact to within 1%), filled one value or one linear run at a time."""

from __future__ import annotations

import math


class LogHistogram:
    """Values in (0, inf), binned at a relative resolution of `resolution` (1% by default)."""

    def __init__(self, resolution: float = 0.01) -> None:
        self._log_base = math.log1p(resolution)
        self._bins: dict[int, float] = {}
        self.count = 0.0

    def _bin(self, value: float) -> int:
        return math.floor(math.log(max(value, 1e-12)) / self._log_base)

    def add(self, value: float, weight: float = 1.0) -> None:
        key = self._bin(value)
        self._bins[key] = self._bins.get(key, 0.0) + weight
        self.count += weight

    def add_linear(self, start: float, step: float, n: int, weight: float) -> None:
        """`weight` observations of each of start, start + step, ..., start + (n-1) step."""
        if n <= 0:
            return
        if step <= 0 or n == 1:
            self.add(start, weight * n)
            return
        i = 0
        while i < n:
            key = self._bin(start + step * i)
            upper = math.exp((key + 1) * self._log_base)  # the bin's upper edge
            last = min(n - 1, max(i, math.ceil((upper - start) / step) - 1))
            self._bins[key] = self._bins.get(key, 0.0) + weight * (last - i + 1)
            i = last + 1
        self.count += weight * n

    def quantile(self, q: float) -> float | None:
        if self.count <= 0:
            return None
        rank = q * self.count
        seen = 0.0
        for key in sorted(self._bins):
            seen += self._bins[key]
            if seen >= rank:
                return math.exp((key + 0.5) * self._log_base)  # the bin's middle
        return math.exp((max(self._bins) + 0.5) * self._log_base)
