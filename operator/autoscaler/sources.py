"""Where the autoscaler reads the pods' metrics: each ready pod's /metrics directly (the default),
or a Prometheus server that already scrapes them (`kvasir operator --prometheus-url`).

Scrapes run concurrently, each bounded by a short timeout: a slow or failing pod is reported as
missing (unknown, never idle) and never delays the others or another LLMDeployment's tick."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

import aiohttp

from kvasir.operator import naming
from kvasir.operator.autoscaler.metrics import (
    COUNTERS,
    GAUGES,
    HISTOGRAMS,
    ONLY,
    Histogram,
    PodMetrics,
    parse_metrics,
)
from kvasir.operator.autoscaler.pods import PodView

# The /metrics of a runtime pod is a few tens of kB; anything far larger is not a runtime.
MAX_EXPOSITION_BYTES = 4 << 20

FailureHook = Callable[[str, str], None]  # (pod name, why)


class MetricsSource(Protocol):
    async def collect(self, namespace: str, name: str, pods: list[PodView]) -> dict[str, PodMetrics]:
        """Metrics of the given (ready) pods of one LLMDeployment; pods that failed are absent."""
        ...

    async def close(self) -> None: ...


async def fetch_exposition(
    session: aiohttp.ClientSession, pod: PodView, port: int, on_failure: FailureHook
) -> str | None:
    """GET http://POD_IP:PORT/metrics as text; None (and `on_failure` told why) when it fails."""
    if not pod.ip:
        on_failure(pod.name, "no IP")
        return None
    host = f"[{pod.ip}]" if ":" in pod.ip else pod.ip
    try:
        async with session.get(f"http://{host}:{port}{naming.METRICS_PATH}") as response:
            if response.status != 200:
                on_failure(pod.name, f"HTTP {response.status}")
                return None
            body = await response.content.read(MAX_EXPOSITION_BYTES + 1)
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        on_failure(pod.name, type(exc).__name__)
        return None
    if len(body) > MAX_EXPOSITION_BYTES:
        on_failure(pod.name, "exposition too large")
        return None
    return body.decode("utf-8", errors="replace")


class PodScraper:
    """GET http://POD_IP:PORT/metrics of every pod at once, each within `timeout` seconds."""

    def __init__(
        self, *, timeout: float = 2.0, port: int = naming.RUNTIME_PORT, on_failure: FailureHook | None = None
    ) -> None:
        self.timeout = timeout
        self.port = port
        self.on_failure = on_failure or (lambda pod, why: None)
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout))
        return self._session

    async def _scrape(self, pod: PodView) -> PodMetrics | None:
        text = await fetch_exposition(self._client(), pod, self.port, self.on_failure)
        if text is None:
            return None
        try:
            return parse_metrics(text)
        except ValueError:
            self.on_failure(pod.name, "not a Prometheus exposition")
            return None

    async def collect(self, namespace: str, name: str, pods: list[PodView]) -> dict[str, PodMetrics]:
        results = await asyncio.gather(*(self._scrape(pod) for pod in pods))
        return {pod.name: metrics for pod, metrics in zip(pods, results, strict=True) if metrics is not None}

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


_SERIES = {
    **{f"{n}": ("gauge", s) for s, names in GAUGES.items() for n in names},
    **{f"{n}_total": ("counter", s) for s, names in COUNTERS.items() for n in names},
    **{f"{n}_bucket": ("histogram", s) for s, names in HISTOGRAMS.items() for n in names},
}


def metrics_from_series(series: Iterable[Mapping[str, Any]]) -> dict[str, PodMetrics]:
    """Per-pod metrics from a Prometheus instant-query result (`data.result`), by the `pod` label."""
    pods: dict[str, PodMetrics] = {}
    for item in series:
        labels = item.get("metric") or {}
        known = _SERIES.get(labels.get("__name__", ""))
        pod = labels.get("pod")
        if known is None or not pod:
            continue
        try:
            value = float(item["value"][1])
        except (KeyError, IndexError, TypeError, ValueError):
            continue
        kind, signal = known
        only = ONLY.get(signal)
        if only is not None and labels.get(only[0]) != only[1]:
            continue
        metrics = pods.setdefault(pod, PodMetrics())
        if kind == "gauge":
            metrics.gauges[signal] = metrics.gauges.get(signal, 0.0) + value
        elif kind == "counter":
            metrics.counters[signal] = metrics.counters.get(signal, 0.0) + value
        elif "le" in labels:
            histogram = metrics.histograms.setdefault(signal, Histogram())
            bound = math.inf if labels["le"] in ("+Inf", "Inf") else float(labels["le"])
            histogram.buckets[bound] = histogram.buckets.get(bound, 0.0) + value
    return pods


class PrometheusSource:
    """The same raw series, read from Prometheus: one instant query per tick and deployment.

    It expects the pods' series to carry `namespace` and `pod` labels, as a ServiceMonitor or
    PodMonitor (or the usual Kubernetes scrape configs) give them."""

    def __init__(self, url: str, *, timeout: float = 5.0, on_failure: FailureHook | None = None) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.on_failure = on_failure or (lambda pod, why: None)
        self._session: aiohttp.ClientSession | None = None

    def query(self, namespace: str, pods: list[PodView]) -> str:
        names = "|".join(sorted(_SERIES))
        pod_names = "|".join(p.name for p in pods)
        return f'{{__name__=~"{names}",namespace="{namespace}",pod=~"{pod_names}"}}'

    async def collect(self, namespace: str, name: str, pods: list[PodView]) -> dict[str, PodMetrics]:
        if not pods:
            return {}
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout))
        try:
            async with self._session.get(
                f"{self.url}/api/v1/query", params={"query": self.query(namespace, pods)}
            ) as response:
                payload = await response.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as exc:
            for pod in pods:
                self.on_failure(pod.name, f"prometheus: {type(exc).__name__}")
            return {}
        if not isinstance(payload, dict) or payload.get("status") != "success":
            for pod in pods:
                self.on_failure(pod.name, "prometheus: query failed")
            return {}
        found = metrics_from_series((payload.get("data") or {}).get("result") or [])
        wanted = {p.name for p in pods}
        return {pod: metrics for pod, metrics in found.items() if pod in wanted}

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
