"""The metric names and PromQL pieces the dashboards and the rules share: one place that names
what the runtime and the operator export, so a renamed metric breaks a test, not a dashboard."""

from __future__ import annotations

# The runtime (kvasir serve), per pod; labels added by the scrape: namespace, service, pod.
RUNNING = "kvasir_requests_running"
WAITING = "kvasir_requests_waiting"
KV_USAGE = "kvasir_kv_cache_usage_ratio"
PREEMPTIONS = "kvasir_preemptions_total"
PREFIX_QUERIES = "kvasir_prefix_cache_queries_total"
PREFIX_HITS = "kvasir_prefix_cache_hits_total"
TTFT = "kvasir_time_to_first_token_seconds"
ITL = "kvasir_inter_token_latency_seconds"
E2E = "kvasir_e2e_request_latency_seconds"
QUEUE_TIME = "kvasir_request_queue_time_seconds"
PROMPT_TOKENS = "kvasir_prompt_tokens_total"
GENERATION_TOKENS = "kvasir_generation_tokens_total"
FINISHED = "kvasir_requests_finished_total"
REJECTED = "kvasir_requests_rejected_total"

# The operator (one leader; its metrics carry the LLMDeployment's namespace and name: the chart's
# monitor keeps them with honorLabels).
OPERATOR_LEADER = "kvasir_operator_leader"
DESIRED = "kvasir_operator_autoscaler_desired_replicas"
REPLICAS = "kvasir_operator_autoscaler_replicas"
SIGNAL = "kvasir_operator_autoscaler_signal"
TARGET = "kvasir_operator_autoscaler_target"
DECISIONS = "kvasir_operator_autoscaler_decisions_total"
SCRAPE_FAILURES = "kvasir_operator_autoscaler_scrape_failures_total"

RUNTIME_METRICS = (
    RUNNING, WAITING, KV_USAGE, PREEMPTIONS, PREFIX_QUERIES, PREFIX_HITS, TTFT, ITL, E2E, QUEUE_TIME,
    PROMPT_TOKENS, GENERATION_TOKENS, FINISHED, REJECTED,
)  # fmt: skip

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
