"""Kvasir's Grafana dashboards, built with Grafana's foundation SDK: SLO overview, latency,
saturation, autoscaling, a per-pod drill-down, and the router (scale from zero, routing) with the
LoRA adapters. Every query filters on the template variables
`namespace`, `deployment` (the Service, named after the LLMDeployment) and, where it is per pod,
`pod`; the SLO thresholds are variables too, offered at the histograms' bucket bounds."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from grafana_foundation_sdk.builders import dashboard, heatmap, prometheus, stat, table, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import DataSourceRef, DataTransformerConfig, VariableRefresh
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

from kvasir.observability import promql as q

DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
SEL = '{namespace=~"$namespace", service=~"$deployment"}'
POD_SEL = '{namespace=~"$namespace", service=~"$deployment", pod=~"$pod"}'
# The operator's per-LLMDeployment series carry its namespace and name.
OP_SEL = '{namespace=~"$namespace", name=~"$deployment"}'
RATE = "$__rate_interval"
RANGE = "$__range"  # the dashboard's whole time range: for rare events (adapter loads)
BY = "by (namespace, service)"
TAGS = ["kvasir", "llm-inference"]

# A dashboard: (uid, title, description, builder function).
Query = tuple[str, str]  # (PromQL, legend)


def _target(expr: str, legend: str, *, heat: bool = False) -> prometheus.Dataquery:
    target = prometheus.Dataquery().expr(expr).legend_format(legend)
    if heat:
        target = target.format(PromQueryFormat.HEATMAP)
    return target


def series(
    title: str, unit: str, queries: Sequence[Query], description: str, *, width: int = 12
) -> timeseries.Panel:
    panel = timeseries.Panel().title(title).description(description).unit(unit).datasource(DATASOURCE)
    for expr, legend in queries:
        panel = panel.with_target(_target(expr, legend))
    return panel.height(8).span(width)


def single(title: str, unit: str, expr: str, description: str, *, width: int = 6) -> stat.Panel:
    return (
        stat.Panel()
        .title(title)
        .description(description)
        .unit(unit)
        .datasource(DATASOURCE)
        .with_target(_target(expr, ""))
        .height(5)
        .span(width)
    )


def instant_table(title: str, expr: str, columns: Sequence[str], description: str) -> table.Panel:
    """The labels of an info metric's series now, one row per series (`columns` in order)."""
    keep = {
        "excludeByName": {"Time": True, "Value": True},
        "indexByName": {c: i for i, c in enumerate(columns)},
    }
    return (
        table.Panel()
        .title(title)
        .description(description)
        .unit("none")
        .datasource(DATASOURCE)
        .with_target(_target(expr, "").instant().format(PromQueryFormat.TABLE))
        .with_transformation(DataTransformerConfig(id_val="organize", options=keep))
        .height(8)
        .span(12)
    )


def heat(title: str, histogram: str, description: str) -> heatmap.Panel:
    expr = f"sum by (le) (increase({histogram}_bucket{SEL}[{RATE}]))"
    return (
        heatmap.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .with_target(_target(expr, "{{le}}", heat=True))
        .calculate(False)
        .unit("s")
        .height(8)
        .span(12)
    )


def _quantiles(histogram: str, selector: str = SEL, by: str = "service") -> list[Query]:
    group = f"le, {by}" if by else "le"
    legend = f"{{{{{by}}}}} " if by else ""
    return [
        (
            f"histogram_quantile({quantile}, sum by ({group}) (rate({histogram}_bucket{selector}[{RATE}])))",
            f"{legend}p{round(quantile * 100)}",
        )
        for quantile in (0.5, 0.9, 0.99)
    ]


# The deployments a dashboard offers: those with runtime pods; on the router's dashboard also those
# with only router pods (a deployment at zero replicas has no runtime series).
WITH_PODS = q.RUNNING
WITH_PODS_OR_ROUTER = f'__name__=~"{q.RUNNING}|{q.ROUTER_HELD_NOW}"'


def _variables(board: dashboard.Dashboard, *, pod: bool, source: str = WITH_PODS) -> dashboard.Dashboard:
    board = board.with_variable(
        dashboard.DatasourceVariable("datasource").label("Data source").type("prometheus")
    )
    if source.startswith("__name__"):
        everything, in_namespace = f"{{{source}}}", f'{{{source}, namespace=~"$namespace"}}'
    else:
        everything, in_namespace = source, f'{source}{{namespace=~"$namespace"}}'
    queries = [
        ("namespace", "Namespace", f"label_values({everything}, namespace)"),
        ("deployment", "LLMDeployment", f"label_values({in_namespace}, service)"),
    ]
    if pod:
        queries.append(("pod", "Pod", f"label_values({q.RUNNING}{SEL}, pod)"))
    for name, label, query in queries:
        board = board.with_variable(
            dashboard.QueryVariable(name)
            .label(label)
            .datasource(DATASOURCE)
            .query(query)
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
            .multi(True)
            .include_all(True)
            .all_value(".*")
        )
    return board


def _board(
    uid: str, title: str, description: str, *, pod: bool = False, source: str = WITH_PODS
) -> dashboard.Dashboard:
    board = (
        dashboard.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags(TAGS)
        .refresh("30s")
        .time("now-3h", "now")
        .timezone("browser")
        .editable()
    )
    return _variables(board, pod=pod, source=source)


def slo_overview() -> dashboard.Dashboard:
    ttft_ok = f'sum {BY} (rate({q.TTFT}_bucket{{namespace=~"$namespace", service=~"$deployment", le="$ttft_slo"}}[{RATE}]))'
    itl_ok = f'sum {BY} (rate({q.ITL}_bucket{{namespace=~"$namespace", service=~"$deployment", le="$itl_slo"}}[{RATE}]))'
    ttft_all = f"sum {BY} (rate({q.TTFT}_count{SEL}[{RATE}]))"
    itl_all = f"sum {BY} (rate({q.ITL}_count{SEL}[{RATE}]))"
    errors = q.errors_rate(RATE, SEL)
    total = q.requests_rate(RATE, SEL)
    budget_30d = f"1 - ({q.errors_rate('30d', SEL)} / {q.requests_rate('30d', SEL)}) / (1 - $availability)"
    board = (
        _board("kvasir-slo", "Kvasir / SLO overview", "Attainment of the TTFT, ITL and availability objectives, error budget and burn rate, traffic.")
        .with_variable(dashboard.CustomVariable("ttft_slo").label("TTFT objective (s)").values("1.0,0.25,0.5,2.5"))
        .with_variable(dashboard.CustomVariable("itl_slo").label("ITL objective (s)").values("0.1,0.025,0.05"))
        .with_variable(dashboard.CustomVariable("availability").label("Availability objective").values("0.999,0.99,0.995,0.9995"))
        .with_row(dashboard.Row("Objectives"))
        .with_panel(single("TTFT attainment", "percentunit", f"{ttft_ok} / {ttft_all}", "Fraction of first tokens within the TTFT objective."))
        .with_panel(single("ITL attainment", "percentunit", f"{itl_ok} / {itl_all}", "Fraction of inter-token gaps within the ITL objective."))
        .with_panel(single("Availability", "percentunit", f"1 - {errors} / {total}", "Requests served among all that ended (turned-away requests count against it: queue full, loading, draining)."))
        .with_panel(single("Error budget left (30 d)", "percentunit", budget_30d, "Of the availability objective's 30-day budget, the share not yet spent."))
        .with_panel(series("Attainment over time", "percentunit", [(f"{ttft_ok} / {ttft_all}", "{{service}} TTFT"), (f"{itl_ok} / {itl_all}", "{{service}} ITL"), (f"1 - {errors} / {total}", "{{service}} availability")], "The three SLIs; the objectives are the variables above."))
        .with_panel(series("Burn rate (availability)", "none", [(f"({q.error_ratio(w, SEL)}) / (1 - $availability)", f"{{{{service}}}} {w}") for w in ("5m", "1h", "6h", "1d")], "How fast the budget burns: 1 spends it exactly over 30 days; the page alert fires at 14.4 (1 h and 5 min) or 6 (6 h and 30 min)."))
        .with_row(dashboard.Row("Traffic"))
        .with_panel(series("Requests / s", "reqps", [(f"sum {BY} (rate({q.FINISHED}{SEL}[{RATE}]))", "{{service}} finished"), (f"sum by (namespace, service, reason) (rate({q.REJECTED}{SEL}[{RATE}]))", "{{service}} rejected: {{reason}}")], "Requests finished (any reason) and turned away."))
        .with_panel(series("Tokens / s", "short", [(f"sum {BY} (rate({q.PROMPT_TOKENS}{SEL}[{RATE}]))", "{{service}} in (prompt)"), (f"sum {BY} (rate({q.GENERATION_TOKENS}{SEL}[{RATE}]))", "{{service}} out (generated)")], "Prompt tokens processed and tokens generated."))
    )  # fmt: skip
    return board


def latency() -> dashboard.Dashboard:
    ratio = (
        f"histogram_quantile(0.99, sum {BY.replace('by (', 'by (le, ')} (rate({q.ITL}_bucket{SEL}[{RATE}])))"
        f" / histogram_quantile(0.5, sum {BY.replace('by (', 'by (le, ')} (rate({q.ITL}_bucket{SEL}[{RATE}])))"
    )
    ttft_ratio = ratio.replace(q.ITL, q.TTFT)
    return (
        _board("kvasir-latency", "Kvasir / Latency", "TTFT, inter-token, end-to-end and queue latency quantiles, the tail-shape ratio the autoscaler reads, and heatmaps.")
        .with_row(dashboard.Row("Quantiles"))
        .with_panel(series("Time to first token", "s", _quantiles(q.TTFT), "From the request's arrival to its first token: tokenization, queueing and prefill."))
        .with_panel(series("Inter-token latency", "s", _quantiles(q.ITL), "Gaps between consecutive tokens of a stream."))
        .with_panel(series("End-to-end latency", "s", _quantiles(q.E2E), "From arrival to the last token."))
        .with_panel(series("Queue time", "s", _quantiles(q.QUEUE_TIME), "From arrival to the first scheduled step."))
        .with_row(dashboard.Row("Tail shape"))
        .with_panel(series("P99 / P50 ratio", "none", [(ratio, "{{service}} ITL"), (ttft_ratio, "{{service}} TTFT")], "A rising ratio with a busy cache means saturation (the autoscaler scales up on it); with an idle cache it means a few long prompts.", width=24))
        .with_row(dashboard.Row("Distributions"))
        .with_panel(heat("TTFT heatmap", q.TTFT, "First-token latency per bucket."))
        .with_panel(heat("ITL heatmap", q.ITL, "Inter-token gaps per bucket."))
    )  # fmt: skip


def saturation() -> dashboard.Dashboard:
    return (
        _board("kvasir-saturation", "Kvasir / Saturation", "KV cache, queue, running batch, preemptions and prefix-cache hits per deployment.")
        .with_row(dashboard.Row("KV cache"))
        .with_panel(series("KV-cache usage", "percentunit", [(f"avg {BY} ({q.KV_USAGE}{SEL})", "{{service}} mean"), (f"max {BY} ({q.KV_USAGE}{SEL})", "{{service}} max")], "Mean and max over the deployment's pods."))
        .with_panel(series("Prefix-cache hit rate", "percentunit", [(f"sum {BY} (rate({q.PREFIX_HITS}{SEL}[{RATE}])) / sum {BY} (rate({q.PREFIX_QUERIES}{SEL}[{RATE}]))", "{{service}}")], "Prompt tokens served from cached blocks among those looked up."))
        .with_row(dashboard.Row("Requests"))
        .with_panel(series("Waiting and running", "short", [(f"sum {BY} ({q.WAITING}{SEL})", "{{service}} waiting"), (f"sum {BY} ({q.RUNNING}{SEL})", "{{service}} running")], "Requests queued for admission and in the running batch."))
        .with_panel(series("Preemptions / s", "short", [(f"sum {BY} (rate({q.PREEMPTIONS}{SEL}[{RATE}]))", "{{service}}")], "Running requests evicted for want of KV blocks (they recompute later)."))
    )  # fmt: skip


# The SLO's latencies at its percentile, as the operator exports them next to the objective.
SLO_SIGNALS = (
    ("ttft_slo_percentile_seconds", "TTFT at the SLO percentile vs the SLO"),
    ("tpot_slo_percentile_seconds", "Time per output token at the SLO percentile vs the SLO"),
)


def autoscaling() -> dashboard.Dashboard:
    # (signal, unit): the operator exports each with its target (the ITL one when the target is set).
    signals = (
        ("kv_cache_usage", "percentunit"),
        ("queue_per_replica", "short"),
        ("latency_ratio", "none"),
        ("itl_mean_seconds", "s"),
    )
    board = (
        _board("kvasir-autoscaling", "Kvasir / Autoscaling", "What the operator's autoscaler sees and decides: replicas by state, decisions, each signal next to its target.")
        .with_row(dashboard.Row("Replicas"))
        .with_panel(series("Replicas", "short", [(f"{q.DESIRED}{OP_SEL}", "{{name}} desired"), (f'{q.REPLICAS}{{namespace=~"$namespace", name=~"$deployment", state=~"ready|starting|stuck"}}', "{{name}} {{state}}")], "Desired (what the autoscaler asks for), ready, starting (capacity on the way) and stuck pods."))
        .with_panel(series("Decisions / min", "short", [(f"sum by (name, kind) (rate({q.DECISIONS}{OP_SEL}[{RATE}])) * 60", "{{name}} {{kind}}")], "Each tick's decision by kind; the reasons are in the Events and status.autoscaling."))
        .with_row(dashboard.Row("Signals and targets"))
    )  # fmt: skip
    for signal, unit in signals:
        board = board.with_panel(
            series(
                signal.replace("_", " ").capitalize(),
                unit,
                [
                    (f'{q.SIGNAL}{{namespace=~"$namespace", name=~"$deployment", signal="{signal}"}}', "{{name}} signal"),
                    (f'{q.TARGET}{{namespace=~"$namespace", name=~"$deployment", signal="{signal}"}}', "{{name}} target"),
                ],
                f"The autoscaler's {signal.replace('_', ' ')} over its window, and the target it tracks.",
                width=6,
            )
        )  # fmt: skip
    for signal, title in SLO_SIGNALS:
        board = board.with_panel(
            series(
                title,
                "s",
                [
                    (f'{q.SIGNAL}{{namespace=~"$namespace", name=~"$deployment", signal="{signal}"}}', "{{name}} observed"),
                    (f'{q.TARGET}{{namespace=~"$namespace", name=~"$deployment", signal="{signal}"}}', "{{name}} SLO"),
                ],
                "With spec.autoscaling.slo: the percentile the SLO names (its attainment, e.g. P99) over the "
                "autoscaler's window, next to the objective. The autoscaler holds it between 0.5 and 0.9 of "
                "the part of the objective that replicas can change.",
            )
        )  # fmt: skip
    board = board.with_panel(
        series("Cold start by phase", "s", [(f"max by (service, phase) ({q.TIME_TO_READY}{SEL})", "{{service}} {{phase}}")], "How long the runtime pods took from process start to ready, by phase (process: imports; model_files: config and tokenizer; weights; kv_cache; kernel_warmup and cuda_graphs on a GPU; engine_setup: the rest of the engine; warmup: the first request). The autoscaler plans scale-ups on it.", width=24)
    )  # fmt: skip
    return board.with_panel(
        series("Scrape failures / s", "short", [(f"sum by (name) (rate({q.SCRAPE_FAILURES}{OP_SEL}[{RATE}]))", "{{name}}")], "Pod /metrics the autoscaler could not read: such pods count as unknown, never idle.", width=24)
    )  # fmt: skip


def pods() -> dashboard.Dashboard:
    by_pod = "by (pod)"
    return (
        _board("kvasir-pods", "Kvasir / Pods", "One deployment's pods side by side.", pod=True)
        .with_row(dashboard.Row("Per pod"))
        .with_panel(series("KV-cache usage", "percentunit", [(f"max {by_pod} ({q.KV_USAGE}{POD_SEL})", "{{pod}}")], "Per pod."))
        .with_panel(series("Waiting / running", "short", [(f"sum {by_pod} ({q.WAITING}{POD_SEL})", "{{pod}} waiting"), (f"sum {by_pod} ({q.RUNNING}{POD_SEL})", "{{pod}} running")], "Per pod."))
        .with_panel(series("TTFT p99", "s", [(f"histogram_quantile(0.99, sum by (le, pod) (rate({q.TTFT}_bucket{POD_SEL}[{RATE}])))", "{{pod}}")], "Per pod."))
        .with_panel(series("ITL p99", "s", [(f"histogram_quantile(0.99, sum by (le, pod) (rate({q.ITL}_bucket{POD_SEL}[{RATE}])))", "{{pod}}")], "Per pod."))
        .with_panel(series("Tokens out / s", "short", [(f"sum {by_pod} (rate({q.GENERATION_TOKENS}{POD_SEL}[{RATE}]))", "{{pod}}")], "Per pod."))
        .with_panel(series("Requests finished / s", "reqps", [(f"sum by (pod, finish_reason) (rate({q.FINISHED}{POD_SEL}[{RATE}]))", "{{pod}} {{finish_reason}}")], "Per pod and finish reason."))
        .with_panel(series("CPU threads", "short", [(f"max {by_pod} ({q.CPU_THREADS}{POD_SEL})", "{{pod}}")], "Per pod, on CPU: the threads its steps run on. With the default count a pod drops to one thread while that is clearly faster (a busy neighbour); 0 on a GPU."))
    )  # fmt: skip


def routing() -> dashboard.Dashboard:
    # A router replica numbers its backends itself ("0", "1", ... as it meets them), so a backend
    # is (router pod, index), never the index alone.
    per_backend = "by (pod, backend)"
    lora_columns = ["pod", "running_lora_adapters", "waiting_lora_adapters", "max_lora"]

    def load_quantile(quantile: float) -> str:
        return f"histogram_quantile({quantile}, sum by (le, service) (increase({q.LORA_LOAD}_bucket{SEL}[{RANGE}])))"

    return (
        _board("kvasir-routing", "Kvasir / Router and adapters", "Kvasir's router (spec.routing.mode kvasir): requests held while no replica is ready and the wakes from zero, routing decisions, retries and backend errors; and the LoRA adapters the runtime serves.", source=WITH_PODS_OR_ROUTER)
        .with_row(dashboard.Row("Scale from zero"))
        .with_panel(series("Held requests", "short", [(f"sum {BY} ({q.ROUTER_HELD_NOW}{SEL})", "{{service}} held")], "Requests the router holds now because no replica is ready (at zero, or every replica restarting). They wait up to --hold-timeout (scaleToZero.holdSeconds) for a first ready replica.", width=8))
        .with_panel(series("Hold outcomes / s", "reqps", [(f"sum by (namespace, service, outcome) (rate({q.ROUTER_HELD}{SEL}[{RATE}]))", "{{service}} {{outcome}}")], "How holds ended: released (sent to the first ready replica), timed_out (503 after the hold timeout), rejected_full (503 at once: maxHeld requests already held), client_gone, draining (the router shut down).", width=8))
        .with_panel(series("Wakes from zero / min", "short", [(f"sum {BY} (rate({q.ROUTER_ACTIVATIONS}{SEL}[{RATE}])) * 60", "{{service}}")], "The router's writes of replicas 1 to its LLMDeployment's scale at zero (each one a cold start). The operator also wakes a deployment whose router holds requests (in case the router's write was lost): a scale_up among the Autoscaling dashboard's decisions, 'activation' in its Events.", width=8))
        .with_row(dashboard.Row("Routing"))
        .with_panel(series("Routing decisions / s", "reqps", [(f"sum by (namespace, service, reason) (rate({q.ROUTER_DECISIONS}{SEL}[{RATE}]))", "{{service}} {{reason}}")], "Requests sent to a backend, by what chose it: prefix (prefix-cache affinity), load (queue and KV cache), unknown_metrics (no backend's load known), unreachable (only unreachable ones left)."))
        .with_panel(series("Retries and backend errors / s", "short", [(f"sum by (namespace, service, reason) (rate({q.ROUTER_RETRIES}{SEL}[{RATE}]))", "{{service}} retry: {{reason}}"), (f"sum by (namespace, service, kind) (rate({q.ROUTER_BACKEND_ERRORS}{SEL}[{RATE}]))", "{{service}} error: {{kind}}")], "Requests sent to another backend before any byte reached the client, by why; and failures of backends by kind (connect, refused: 429/503, bad_response, timeout, stream_broken). A refusal by the last backend tried reaches the client."))
        .with_panel(series("Requests per backend / s", "reqps", [(f"sum {per_backend} (rate({q.ROUTER_BACKEND_REQUESTS}{SEL}[{RATE}]))", "{{pod}} backend {{backend}}")], "Requests each router pod sent to each backend (backends are numbered per router pod; its log names each number's address once)."))
        .with_panel(series("In flight per backend", "short", [(f"sum {per_backend} ({q.ROUTER_BACKEND_IN_FLIGHT}{SEL})", "{{pod}} backend {{backend}}")], "Requests each router pod is proxying to each backend now."))
        .with_row(dashboard.Row("LoRA adapters"))
        .with_panel(instant_table("Adapters per pod now", f"max by ({', '.join(lora_columns)}) ({q.LORA_INFO}{SEL})", lora_columns, "Per runtime pod: the adapters with running and with waiting requests (comma-separated) and max_lora, the adapters one step can serve (--max-loras; 0 without --enable-lora). Waiting adapters while running ones fill max_lora: requests wait for a slot."))
        .with_panel(series("Requests per adapter / s", "reqps", [(f"sum by (namespace, service, lora_name) (rate({q.LORA_REQUESTS}{SEL}[{RATE}]))", "{{service}} {{lora_name}}")], "Requests admitted per adapter (only adapters loaded now have a series)."))
        .with_panel(single("Adapter loads (range)", "short", f"sum {BY} (increase({q.LORA_LOAD}_count{SEL}[{RANGE}]))", "Adapters loaded over the dashboard's time range: at start-up (--lora-modules) and at run time (/v1/load_lora_adapter, the operator's LoRA sync).", width=8))
        .with_panel(single("Adapter load time p50 (range)", "s", load_quantile(0.5), "Median time to load an adapter (read and check its files) over the dashboard's time range; empty when none loaded in it.", width=8))
        .with_panel(single("Adapter load time p99 (range)", "s", load_quantile(0.99), "The slowest loads over the dashboard's time range: a hub download or a slow volume shows here.", width=8))
    )  # fmt: skip


DASHBOARDS = {
    "kvasir-slo-overview": slo_overview,
    "kvasir-latency": latency,
    "kvasir-saturation": saturation,
    "kvasir-autoscaling": autoscaling,
    "kvasir-pods": pods,
    "kvasir-routing": routing,
}


def dashboard_json(name: str) -> str:
    """The dashboard as Grafana imports it (stable key order, so the committed files diff cleanly).

    Finished after the builder: panel ids numbered in order (the builder leaves every id 0), each
    target a refId (A, B, ...), no `"options": null` where a panel sets none."""
    board = json.loads(JSONEncoder().encode(DASHBOARDS[name]().build()))
    for number, panel in enumerate(board["panels"], start=1):
        panel["id"] = number
        for index, target in enumerate(panel.get("targets") or []):
            target["refId"] = chr(ord("A") + index)
        if panel.get("options", {}) is None:
            del panel["options"]
    return json.dumps(board, sort_keys=True, indent=2) + "\n"


def panel_queries(board: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of every panel of a dashboard's JSON."""
    found = []
    for panel in board.get("panels", []):
        for nested in [panel, *panel.get("panels", [])]:
            for target in nested.get("targets") or []:
                if target.get("expr"):
                    found.append((nested.get("title", ""), target["expr"]))
    return found
