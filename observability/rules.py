"""Prometheus rules for Kvasir: recording rules for the SLIs over the SRE workbook's windows,
multiwindow multi-burn-rate alerts on each SLO, and warnings for saturation and missing metrics.

SLIs, per deployment (namespace, service):
- availability: requests the server turned away (queue full, loading, draining) among all ended;
- TTFT: first tokens later than the threshold (a histogram bucket bound) among all first tokens;
- ITL: gaps between tokens longer than the threshold among all gaps.

Alerts (SRE workbook, "multiwindow, multi-burn-rate"): page when the budget burns 14.4x over 1 h
and 5 min, or 6x over 6 h and 30 min; ticket at 3x over 1 d and 2 h, or 1x over 3 d and 6 h; only
where the deployment has traffic enough for a ratio to mean something (`min_requests_per_second`
over the long window).

Router alerts (scale from zero, `kvasir router`): held requests that time out, a full hold queue,
and requests held for long with no replica turning ready. The runtime exports no count of failed
LoRA adapter loads (a failed load is an error answer to its load request, or a server that does
not start), so no alert watches them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvasir.observability import promql as q

# (severity, burn rate, long window, short window): the workbook's table.
BURN_RATES = (
    ("page", 14.4, "1h", "5m"),
    ("page", 6.0, "6h", "30m"),
    ("ticket", 3.0, "1d", "2h"),
    ("ticket", 1.0, "3d", "6h"),
)


@dataclass(frozen=True)
class Slo:
    """The objectives the alerts defend; thresholds are bucket bounds as the exposition spells them."""

    availability: float = 0.999
    ttft_threshold: str = "1.0"
    ttft_objective: float = 0.99
    itl_threshold: str = "0.1"
    itl_objective: float = 0.99
    min_requests_per_second: float = 1 / 60  # an hour with fewer than 60 requests pages no one
    kv_saturation: float = 0.9
    queue_waiting: int = 10
    preemptions_per_second: float = 1.0
    held_for: str = "10m"  # requests held this long without a pause: no replica turns ready


@dataclass(frozen=True)
class _Sli:
    key: str  # recording-rule infix
    alert: str  # alert-name infix
    what: str
    objective: float

    def record(self, window: str) -> str:
        return f"kvasir:{self.key}:ratio_rate{window}"


def slis(slo: Slo) -> list[_Sli]:
    return [
        _Sli("request_errors", "Availability", "requests turned away", slo.availability),
        _Sli("ttft_slow", "TTFT", f"first tokens slower than {slo.ttft_threshold}s", slo.ttft_objective),
        _Sli("itl_slow", "ITL", f"inter-token gaps longer than {slo.itl_threshold}s", slo.itl_objective),
    ]


def recording_rules(slo: Slo) -> list[dict[str, Any]]:
    rules: list[dict[str, Any]] = []
    for window in q.SLO_WINDOWS:
        rules += [
            {"record": f"kvasir:requests:rate{window}", "expr": q.requests_rate(window)},
            {"record": f"kvasir:request_errors:ratio_rate{window}", "expr": q.error_ratio(window)},
            {"record": f"kvasir:ttft_slow:ratio_rate{window}", "expr": q.slow_ratio(q.TTFT, slo.ttft_threshold, window)},
            {"record": f"kvasir:itl_slow:ratio_rate{window}", "expr": q.slow_ratio(q.ITL, slo.itl_threshold, window)},
        ]  # fmt: skip
    by = f"by ({q.DEPLOYMENT})"
    rules += [
        {"record": "kvasir:requests_waiting:sum", "expr": f"sum {by} ({q.WAITING})"},
        {"record": "kvasir:requests_running:sum", "expr": f"sum {by} ({q.RUNNING})"},
        {"record": "kvasir:kv_cache_usage:avg", "expr": f"avg {by} ({q.KV_USAGE})"},
        {"record": "kvasir:kv_cache_usage:max", "expr": f"max {by} ({q.KV_USAGE})"},
        {"record": "kvasir:preemptions:rate5m", "expr": f"sum {by} (rate({q.PREEMPTIONS}[5m]))"},
    ]
    return rules


def burn_alerts(slo: Slo) -> list[dict[str, Any]]:
    alerts = []
    for sli in slis(slo):
        budget = 1 - sli.objective
        for severity, pairs in (("page", BURN_RATES[:2]), ("ticket", BURN_RATES[2:])):
            terms = [
                f"({sli.record(long)} > {rate * budget:.6g} and {sli.record(short)} > {rate * budget:.6g})"
                for _, rate, long, short in pairs
            ]
            guard_window = pairs[0][2]
            expr = (
                f"({' or '.join(terms)})\n"
                f"and on ({q.DEPLOYMENT}) kvasir:requests:rate{guard_window} >= {slo.min_requests_per_second:.6g}"
            )
            burn = " or ".join(f"{rate:g}x over {long} and {short}" for _, rate, long, short in pairs)
            alerts.append(
                {
                    "alert": f"Kvasir{sli.alert}ErrorBudgetBurn",
                    "expr": expr,
                    "labels": {"severity": severity, "slo": sli.key},
                    "annotations": {
                        "summary": f"{{{{ $labels.namespace }}}}/{{{{ $labels.service }}}} burns its {sli.alert} error budget",
                        "description": (
                            f"{sli.what} exceed the {sli.objective:.4g} objective's budget ({burn}); "
                            f"over the long window the ratio is {{{{ $value | humanizePercentage }}}}."
                        ),
                    },
                }
            )
    return alerts


def warning_alerts(slo: Slo) -> list[dict[str, Any]]:
    def alert(name: str, expr: str, duration: str, summary: str, description: str) -> dict[str, Any]:
        return {
            "alert": name,
            "expr": expr,
            "for": duration,
            "labels": {"severity": "warning"},
            "annotations": {"summary": summary, "description": description},
        }

    where = "{{ $labels.namespace }}/{{ $labels.service }}"
    return [
        alert(
            "KvasirKVCacheSaturated",
            f"kvasir:kv_cache_usage:avg > {slo.kv_saturation:g}",
            "15m",
            f"{where}: KV cache above {slo.kv_saturation:.0%} for 15 minutes",
            "Requests queue or are preempted; raise maxReplicas, or the GPU memory utilization.",
        ),
        alert(
            "KvasirQueueGrowing",
            f"kvasir:requests_waiting:sum > {slo.queue_waiting} and deriv(kvasir:requests_waiting:sum[10m]) > 0",
            "10m",
            f"{where}: the queue keeps growing",
            "More requests arrive than the replicas finish; check the autoscaler's status and maxReplicas.",
        ),
        alert(
            "KvasirPreemptionStorm",
            f"kvasir:preemptions:rate5m > {slo.preemptions_per_second:g}",
            "10m",
            f"{where}: {{{{ $value | humanize }}}} preemptions/s",
            "Running requests lose their KV cache and recompute: the cache is too small for the batch.",
        ),
        alert(
            "KvasirRuntimeMetricsAbsent",
            f"absent({q.RUNNING})",
            "15m",
            "No Kvasir runtime metrics at all",
            "No pod's /metrics reaches Prometheus: check the ServiceMonitor (spec.monitoring.enabled) "
            "and Prometheus's serviceMonitorSelector. Turn this alert off (prometheusRule.absentAlerts) "
            "where no LLMDeployment runs.",
        ),
        alert(
            "KvasirOperatorAbsent",
            f"absent({q.OPERATOR_LEADER})",
            "10m",
            "No Kvasir operator metrics",
            "The operator is down or not scraped: LLMDeployments are not reconciled or autoscaled.",
        ),
        alert(
            "KvasirOperatorNoLeader",
            f"max({q.OPERATOR_LEADER}) < 1",
            "5m",
            "No Kvasir operator replica holds the leader lease",
            "Nothing reconciles or autoscales; check the operator's logs and the Lease.",
        ),
    ]


def router_alerts(slo: Slo) -> list[dict[str, Any]]:
    """Scale from zero: what a client waiting for a cold start ran into."""
    by = f"sum by ({q.DEPLOYMENT})"
    where = "{{ $labels.namespace }}/{{ $labels.service }}"
    wake = (
        "Check `kubectl describe llmd {{ $labels.service }} -n {{ $labels.namespace }}` (conditions "
        "ScaledToZero and ColdStartExceedsSLO, Events), the model pods (Pending for want of GPUs, "
        "image pulls, a model that fails to load), and the router's log (a wake refused: the "
        "router's Role must allow get and patch on its llmdeployments/scale)."
    )

    def outcome(name: str, held: str, summary: str, description: str) -> dict[str, Any]:
        return {
            "alert": name,
            "expr": f'{by} (rate({q.ROUTER_HELD}{{outcome="{held}"}}[5m])) > 0',
            "labels": {"severity": "warning"},
            "annotations": {"summary": summary, "description": description},
        }

    return [
        outcome(
            "KvasirRouterHoldTimeouts",
            "timed_out",
            f"{where}: held requests time out ({{{{ $value | humanize }}}}/s)",
            "The router held requests while no replica was ready and answered them 503 (hold_timeout) "
            "after scaleToZero.holdSeconds: the cold start is longer than the hold, or the deployment "
            f"was never woken. {wake} The Kvasir / Autoscaling dashboard's cold start by phase shows "
            "how long the pods take; raise holdSeconds above it, or keep minReplicas 1.",
        ),
        outcome(
            "KvasirRouterHoldQueueFull",
            "rejected_full",
            f"{where}: the router's hold queue is full ({{{{ $value | humanize }}}} requests/s refused)",
            "More requests arrived while no replica was ready than scaleToZero.maxHeld, and the router "
            "answered the rest 503 (hold_queue_full) at once. Raise maxHeld (their bodies count in the "
            "router's --max-buffered-request-bytes), shorten the cold start, or keep minReplicas 1 for "
            f"traffic that bursts at zero. {wake}",
        ),
        {
            "alert": "KvasirRouterHoldingWithoutReplica",
            "expr": f"max by ({q.DEPLOYMENT}) ({q.ROUTER_HELD_NOW}) > 0",
            "for": slo.held_for,
            "labels": {"severity": "warning"},
            "annotations": {
                "summary": f"{where}: requests held for {slo.held_for} with no replica ready",
                "description": f"A router pod holds {{{{ $value }}}} requests now and has held some at every "
                f"evaluation for {slo.held_for}: no replica turned ready in that time. {wake}",
            },
        },
    ]


def rule_groups(slo: Slo = Slo()) -> dict[str, Any]:
    """The `groups:` document promtool and Prometheus load (the PrometheusRule's spec)."""
    return {
        "groups": [
            {"name": "kvasir.slis", "rules": recording_rules(slo)},
            {"name": "kvasir.slo-alerts", "rules": burn_alerts(slo)},
            {"name": "kvasir.warnings", "rules": warning_alerts(slo)},
            {"name": "kvasir.router", "rules": router_alerts(slo)},
        ]
    }
