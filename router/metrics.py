"""The router's own /metrics: decisions by reason, retries, and per-backend load and errors.

Per-backend gauges are read from the pool at scrape time (a backend that left has no series). The
page is open (no key), so a backend is labelled by its index (`backend="0"`, in the order backends
first appeared; the router logs each index with its address at info level), never by its address."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from kvasir.observability import metric_names as m
from kvasir.router.backends import BackendPool

DECISION_REASONS = ("prefix", "load", "unknown_metrics", "unreachable")
RETRY_REASONS = ("status_429", "status_503", "connect", "bad_response", "timeout")
# Per-backend failures: connect (no connection, or closed before any answer), refused (429/503),
# bad_response (not valid HTTP: garbage, a bad status line, oversized headers), timeout (no answer
# within --first-byte-timeout), stream_broken (the backend went away mid-answer).
ERROR_KINDS = ("connect", "refused", "bad_response", "timeout", "stream_broken")
# How a held request's wait ended (router/hold.py).
HOLD_OUTCOMES = ("released", "timed_out", "rejected_full", "client_gone", "draining")


class _PoolCollector(Collector):
    def __init__(self, pool: BackendPool) -> None:
        self._pool = pool

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        families = {
            declared: GaugeMetricFamily(declared.name, declared.help, labels=["backend"])
            for declared in (
                m.ROUTER_BACKEND_IN_FLIGHT,
                m.ROUTER_BACKEND_WAITING,
                m.ROUTER_BACKEND_KV_USAGE,
                m.ROUTER_BACKEND_METRICS_KNOWN,
            )
        }
        for backend in self._pool.backends.values():
            label = [backend.label]
            families[m.ROUTER_BACKEND_IN_FLIGHT].add_metric(label, backend.in_flight)
            families[m.ROUTER_BACKEND_METRICS_KNOWN].add_metric(label, 1.0 if backend.metrics_known else 0.0)
            if backend.waiting is not None:  # unknown stays absent, never 0
                families[m.ROUTER_BACKEND_WAITING].add_metric(label, backend.waiting)
            if backend.kv_usage is not None:
                families[m.ROUTER_BACKEND_KV_USAGE].add_metric(label, backend.kv_usage)
        yield from families.values()


class RouterMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, pool: BackendPool) -> None:
        self.registry = registry = CollectorRegistry()
        ProcessCollector(registry=registry)
        registry.register(_PoolCollector(pool))
        decisions = Counter(m.ROUTER_DECISIONS.name, m.ROUTER_DECISIONS.help, ["reason"], registry=registry)
        self._decisions = {reason: decisions.labels(reason) for reason in DECISION_REASONS}
        retries = Counter(m.ROUTER_RETRIES.name, m.ROUTER_RETRIES.help, ["reason"], registry=registry)
        self._retries = {reason: retries.labels(reason) for reason in RETRY_REASONS}
        self._requests = Counter(
            m.ROUTER_BACKEND_REQUESTS.name, m.ROUTER_BACKEND_REQUESTS.help, ["backend"], registry=registry
        )
        self._errors = Counter(
            m.ROUTER_BACKEND_ERRORS.name, m.ROUTER_BACKEND_ERRORS.help, ["backend", "kind"], registry=registry
        )
        self._held_now = Gauge(m.ROUTER_HELD_REQUESTS.name, m.ROUTER_HELD_REQUESTS.help, registry=registry)
        held = Counter(m.ROUTER_HELD.name, m.ROUTER_HELD.help, ["outcome"], registry=registry)
        self._held = {outcome: held.labels(outcome) for outcome in HOLD_OUTCOMES}
        self._activations = Counter(m.ROUTER_ACTIVATIONS.name, m.ROUTER_ACTIVATIONS.help, registry=registry)

    def decided(self, reason: str) -> None:
        self._decisions[reason].inc()

    def retried(self, reason: str) -> None:
        self._retries[reason].inc()

    def sent(self, backend: str) -> None:
        """One request sent to the backend labelled `backend` (its index, never its address)."""
        self._requests.labels(backend).inc()

    def error(self, backend: str, kind: str) -> None:
        """One failure of the backend labelled `backend`; `kind` one of ERROR_KINDS."""
        self._errors.labels(backend, kind).inc()

    def holding(self, count: int) -> None:
        """`count` requests are held now."""
        self._held_now.set(count)

    def hold_ended(self, outcome: str) -> None:
        """One held request's wait ended; `outcome` one of HOLD_OUTCOMES."""
        self._held[outcome].inc()

    def activated(self) -> None:
        """The router scaled its LLMDeployment from zero."""
        self._activations.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
