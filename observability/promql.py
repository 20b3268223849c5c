"""The PromQL pieces the dashboards and the rules share, over the series of the metrics that
`metric_names` declares once, so a renamed metric changes the dashboards with it."""

from __future__ import annotations

from kvasir.observability import metric_names as m

# The series PromQL reads (metric_names declares every metric once). The runtime's carry
# namespace, service and pod from the scrape; the operator's (one leader) carry the LLMDeployment's
# namespace and name (the chart's monitor keeps them with honorLabels).
RUNNING = m.RUNNING.series
WAITING = m.WAITING.series
KV_USAGE = m.KV_USAGE.series
CPU_THREADS = m.CPU_THREADS.series
PREEMPTIONS = m.PREEMPTIONS.series
PREFIX_QUERIES = m.PREFIX_QUERIES.series
PREFIX_HITS = m.PREFIX_HITS.series
TTFT = m.TTFT.series
ITL = m.ITL.series
E2E = m.E2E.series
QUEUE_TIME = m.QUEUE_TIME.series
PROMPT_TOKENS = m.PROMPT_TOKENS.series
GENERATION_TOKENS = m.GENERATION_TOKENS.series
FINISHED = m.FINISHED.series
REJECTED = m.REJECTED.series
TIME_TO_READY = m.TIME_TO_READY.series
OPERATOR_LEADER = m.LEADER.series
DESIRED = m.DESIRED.series
REPLICAS = m.REPLICAS.series
SIGNAL = m.SIGNAL.series
TARGET = m.TARGET.series
DECISIONS = m.DECISIONS.series
SCRAPE_FAILURES = m.SCRAPE_FAILURES.series
LORA_INFO = m.LORA_INFO.series
LORA_REQUESTS = m.LORA_REQUESTS.series
LORA_LOAD = m.LORA_LOAD_SECONDS.series
# The router's (kvasir router; its pods carry namespace, service and pod as the runtime's do).
ROUTER_DECISIONS = m.ROUTER_DECISIONS.series
ROUTER_RETRIES = m.ROUTER_RETRIES.series
ROUTER_BACKEND_REQUESTS = m.ROUTER_BACKEND_REQUESTS.series
ROUTER_BACKEND_ERRORS = m.ROUTER_BACKEND_ERRORS.series
ROUTER_BACKEND_IN_FLIGHT = m.ROUTER_BACKEND_IN_FLIGHT.series
ROUTER_HELD_NOW = m.ROUTER_HELD_REQUESTS.series
ROUTER_HELD = m.ROUTER_HELD.series
ROUTER_ACTIVATIONS = m.ROUTER_ACTIVATIONS.series
RUNTIME_METRICS = tuple(metric.series for metric in (*m.RUNTIME, *m.LORA))
ROUTER_METRICS = tuple(metric.series for metric in m.ROUTER)

# A deployment is (namespace, service): the Prometheus Operator labels every target with the
# Service it was found through, and the operator names the Service after the LLMDeployment.
DEPLOYMENT = "namespace, service"
SLO_WINDOWS = ("5m", "30m", "1h", "2h", "6h", "1d", "3d")


def errors_rate(window: str, selector: str = "") -> str:
    """Requests the server turned away per second (queue full, loading, draining); 0, not nothing,
    while none was: a labelled counter has no series until its first increment."""
    by = f"sum by ({DEPLOYMENT})"
    return f"({by} (rate({REJECTED}{selector}[{window}])) or {by} (rate({FINISHED}{selector}[{window}])) * 0)"


def requests_rate(window: str, selector: str = "") -> str:
    """Requests ended per second: finished (any reason, one per choice) plus turned away."""
    return f"(sum by ({DEPLOYMENT}) (rate({FINISHED}{selector}[{window}])) + {errors_rate(window, selector)})"


def error_ratio(window: str, selector: str = "") -> str:
    """The availability SLI's bad fraction. A client that hangs up is not the server's error."""
    return f"{errors_rate(window, selector)} / {requests_rate(window, selector)}"


def slow_ratio(histogram: str, threshold: str, window: str, selector: str = "") -> str:
    """The latency SLI's bad fraction: observations above `threshold` (a bucket bound, as the
    exposition spells it: "1.0", "0.1")."""
    inner = selector[1:-1] + "," if selector else ""
    return (
        f'1 - sum by ({DEPLOYMENT}) (rate({histogram}_bucket{{{inner}le="{threshold}"}}[{window}]))'
        f" / sum by ({DEPLOYMENT}) (rate({histogram}_count{selector}[{window}]))"
    )
