"""A real Prometheus on loopback scrapes a running Kvasir server (with LoRA adapters, under a short
load, some of it turned away), the operator's metrics endpoint and three real `kvasir router`s;
then every query of every dashboard panel returns data, every recording rule produces series, the
router's hold alerts fire, and every runtime metric the dashboards and rules name is one the
server exports.

The routers stage what the router panels show, as pods of the deployment's router:
- demo-router-0 (`--deployment`, against a stand-in API server at zero replicas): a held request
  wakes the deployment (an activation) and is released to the server once its pod is Ready;
- idle-router-0, the router of another deployment, "idle", at zero replicas (`--backends` that
  never answer, --max-held-requests 1, a short --hold-timeout): one request held until it times
  out, one refused at once because the hold queue is full; the dashboards' deployment variable must
  offer it although it has no runtime pod;
- demo-router-1 (`--backends`: the server twice, by two names): the load goes through it, so it
  routes, and a 429 from one name is retried on the other.
Of the hold outcomes, client_gone and draining are not staged: their series exist (zero), and the
router's own tests stage both (tests/router/test_hold.py)."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import yaml

from kvasir.observability import promql
from kvasir.observability.dashboards import DASHBOARDS, panel_queries
from kvasir.observability.rules import rule_groups
from kvasir.operator.autoscaler.decide import History, Policy, ReplicaState, decide
from kvasir.operator.autoscaler.loop import Autoscaler
from kvasir.operator.autoscaler.metrics import parse_metrics
from kvasir.operator.autoscaler.signals import MetricsWindow, Scrape
from kvasir.operator.metrics import OperatorMetrics, start_http
from kvasir.router.config import RouterConfig
from kvasir.router.server import RouterApp
from kvasir.runtime.lora.modules import LoRAModule
from kvasir.runtime.server.app import build_app
from kvasir.runtime.server.config import ServerConfig
from tests.external_tools import REPO, tool
from tests.lora_adapters import make_peft_adapter
from tests.observability.test_dashboards import boards, substitute, variable_queries
from tests.router.fake_api import FakeApi
from tests.router.stub_backend import Served, serve_app
from tests.router.test_activation import _router as waking_router
from tests.runtime.server.harness import MODEL, serve, tiny_engine_config

pytestmark = pytest.mark.slow
RULES = REPO / "charts" / "kvasir" / "files" / "prometheus-rules.yaml"
DEADLINE = 60.0


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextmanager
def operator_endpoint(metrics: OperatorMetrics) -> Iterator[int]:
    """The operator's real /metrics server, on its own event loop thread."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    port = _free_port()
    runner = asyncio.run_coroutine_threadsafe(
        start_http(metrics, lambda: (True, "ok"), "127.0.0.1", port), loop
    ).result(30)
    try:
        yield port
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


# (job, target, labels, honor_labels): what Prometheus scrapes.
Target = tuple[str, str, dict[str, str], bool]


@contextmanager
def prometheus(tmp_path: Path, targets: list[Target]) -> Iterator[str]:
    """Prometheus scraping every target every second, evaluating the shipped rules every second."""
    jobs: dict[str, dict[str, Any]] = {}
    for job, target, labels, honor in targets:
        scrape = jobs.setdefault(job, {"job_name": job, "honor_labels": honor, "static_configs": []})
        scrape["static_configs"].append({"targets": [target], "labels": labels})
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": list(jobs.values()),
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = _free_port()
    process = subprocess.Popen(
        [
            tool("prometheus"), f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + DEADLINE
        while True:
            assert process.poll() is None, process.stderr.read().decode() if process.stderr else ""
            try:
                if httpx.get(f"{url}/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "Prometheus did not become ready"
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        process.wait(30)


def query(url: str, expr: str) -> list[dict[str, Any]]:
    answer = httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=10).json()
    assert answer["status"] == "success", f"{expr}: {answer}"
    result: list[dict[str, Any]] = answer["data"]["result"]
    return result


def eventually_data(url: str, expr: str) -> list[dict[str, Any]]:
    deadline = time.monotonic() + DEADLINE
    while True:
        result = query(url, expr)
        if result or time.monotonic() > deadline:
            return result
        time.sleep(0.5)


def _wait(condition: Callable[[], object], what: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not reached in time"
        time.sleep(0.05)


def _completion(base: str, model: str = MODEL) -> httpx.Response:
    return httpx.post(
        f"{base}/v1/completions", json={"model": model, "prompt": "hello", "max_tokens": 4}, timeout=DEADLINE
    )


def _wake_from_zero(router: RouterApp, url: str, api: FakeApi) -> None:
    """A request at zero replicas is held, wakes the deployment, and is served once its pod is Ready."""
    with ThreadPoolExecutor(1) as threads:
        held = threads.submit(_completion, url)
        _wait(lambda: api.replicas == 1, "the router's wake")
        assert router.hold is not None and len(router.hold) == 1 and not held.done()
        api.pods_start.set()
        assert held.result(DEADLINE).status_code == 200


def _time_out_and_fill(router: RouterApp, url: str) -> None:
    """With room for one held request: one held until --hold-timeout, a second refused at once. A
    first request that timed out before the second arrived (a slow machine) is tried again."""
    assert router.hold is not None
    codes: set[str] = set()
    deadline = time.monotonic() + DEADLINE
    with ThreadPoolExecutor(1) as threads:
        while codes != {"hold_timeout", "hold_queue_full"}:
            assert time.monotonic() < deadline, codes
            first = threads.submit(_completion, url)

            def held_or_done(first: Future[httpx.Response] = first) -> bool:
                return len(router.hold or ()) == 1 or first.done()

            _wait(held_or_done, "a held request")
            second = _completion(url)
            for answer in (second, first.result(DEADLINE)):
                assert answer.status_code == 503, answer.text
                codes.add(answer.json()["error"]["code"])


def _load(base: str) -> list[int]:
    def one(index: int) -> int:
        model = (MODEL, "support", "late")[index % 3]
        body = {"model": model, "prompt": f"request {index} " * 6, "max_tokens": 12, "ignore_eos": True}
        return httpx.post(f"{base}/v1/completions", json=body, timeout=60).status_code

    codes = []
    for workers, count in ((3, 16), (16, 24)):  # steady traffic, then a burst past the queue limit
        with ThreadPoolExecutor(workers) as pool:
            codes += list(pool.map(one, range(count)))
    return codes


# What the staging above must have made happen, as Prometheus saw it (not merely zero series). A
# counter whose labels appear with its first increment (errors per backend, requests per adapter)
# is read by its value: its first sample may already hold every increment.
STAGED = (
    "sum(increase(kvasir_router_activations_total[10m])) > 0",
    'sum(increase(kvasir_router_held_total{outcome="released"}[10m])) > 0',
    'sum(increase(kvasir_router_held_total{outcome="timed_out"}[10m])) > 0',
    'sum(increase(kvasir_router_held_total{outcome="rejected_full"}[10m])) > 0',
    "sum(increase(kvasir_router_decisions_total[10m])) > 0",
    'sum(increase(kvasir_router_retries_total{reason="status_429"}[10m])) > 0',
    'sum(kvasir_router_backend_errors_total{kind="refused"}) > 0',
    'count(kvasir_lora_requests_total{lora_name=~"support|late"} > 0) == 2',
    "sum(increase(kvasir_lora_load_seconds_count[1h])) > 0",
    "histogram_quantile(0.99, sum by (le) (increase(kvasir_lora_load_seconds_bucket[1h]))) >= 0",  # not NaN
    'ALERTS{alertname="KvasirRouterHoldTimeouts", alertstate="firing", service="idle"}',
    'ALERTS{alertname="KvasirRouterHoldQueueFull", alertstate="firing", service="idle"}',
)


def test_every_panel_and_rule_has_data(tiny_checkpoint: Any, tmp_path: Path) -> None:
    checkpoint = tiny_checkpoint("llama")
    adapters = tmp_path / "adapters"
    for seed, name in enumerate(("support", "late")):
        make_peft_adapter(checkpoint, adapters / name, rank=4, seed=seed)
    engine = tiny_engine_config(checkpoint, max_num_seqs=2, enable_lora=True, max_loras=2, max_lora_rank=8)
    server_config = ServerConfig(
        max_queue_len=2,
        lora_modules=(LoRAModule("support", str(adapters / "support")),),  # loaded at start-up
        lora_root=str(adapters),  # "late" is loaded at run time, while Prometheus watches
    )
    app = build_app(engine, server_config)
    metrics = OperatorMetrics()
    api = FakeApi(replicas=0)
    with ExitStack() as stack:
        server = stack.enter_context(serve(app))
        operator_port = stack.enter_context(operator_endpoint(metrics))
        runtime = server.url.removeprefix("http://")
        runtime_port = int(runtime.rsplit(":", 1)[1])
        kube = stack.enter_context(serve_app(api))
        # `kvasir router --deployment demo`, its pods and scale read from the stand-in API server.
        waking = waking_router(kube.url, runtime_port, tmp_path)
        holding = RouterApp(
            RouterConfig(
                backends=(f"http://127.0.0.1:{_free_port()}",), hold_timeout=2.0, max_held_requests=1
            )
        )
        routing = RouterApp(
            RouterConfig(backends=(server.url, f"http://localhost:{runtime_port}"), scrape_interval=0.2)
        )
        routers: list[Served] = [
            stack.enter_context(serve_app(router, lifespan="on", kill=False))
            for router in (waking, holding, routing)
        ]
        pod = {"namespace": "team-a", "service": "demo"}
        router_pods = [
            {**pod, "pod": "demo-router-0"},
            {**pod, "service": "idle", "pod": "idle-router-0"},
            {**pod, "pod": "demo-router-1"},
        ]
        targets: list[Target] = [
            # The labels the Prometheus Operator gives a pod found through the LLMDeployment's Service
            # (or the chart's PodMonitors).
            ("kvasir-runtime", runtime, {**pod, "pod": "demo-0"}, False),
            # As the chart's ServiceMonitor: honorLabels, the LLMDeployment's namespace wins.
            ("kvasir-operator", f"127.0.0.1:{operator_port}", {"namespace": "kvasir-system", "pod": "kvasir-operator-0"}, True),
        ] + [
            ("kvasir-router", router.url.removeprefix("http://"), labels, False)
            for router, labels in zip(routers, router_pods, strict=True)
        ]  # fmt: skip
        url = stack.enter_context(prometheus(tmp_path, targets))
        # Every target scraped once, so that each staged increment is one Prometheus sees happen.
        _wait(lambda: len(query(url, "up == 1")) == len(targets), "every target scraped")

        before = parse_metrics(httpx.get(f"{server.url}/metrics").text)
        _wake_from_zero(waking, routers[0].url, api)
        _time_out_and_fill(holding, routers[1].url)
        late = {"lora_name": "late", "lora_path": str(adapters / "late")}
        loaded = httpx.post(f"{server.url}/v1/load_lora_adapter", json=late, timeout=DEADLINE)
        assert loaded.status_code == 200, loaded.text
        codes = _load(routers[2].url)
        assert codes.count(200) >= 10 and 429 in codes, codes  # served, and some turned away (queue full)
        text = httpx.get(f"{server.url}/metrics").text
        # The autoscaler's real chain on what the server said: window, signals, decide, record.
        window = MetricsWindow(60, min_samples=5)
        window.add(Scrape(0.0, {"demo-0": before}))
        window.add(Scrape(30.0, {"demo-0": parse_metrics(text)}))
        signals = window.signals(["demo-0"])
        assert signals.latency_ratio is not None
        policy = Policy(
            min_replicas=1,
            max_replicas=4,
            target_itl_seconds=0.05,
            target_latency_ratio=5.0,
            slo_ttft_seconds=1.0,
            slo_itl_seconds=0.1,
        )
        state = ReplicaState(current=1, ready=1)
        decision = decide(30.0, signals, History.starting_at(0.0, 1), policy, state)
        recorder: Any = SimpleNamespace(metrics=metrics)
        Autoscaler._record(recorder, "team-a", "demo", decision, signals, policy, state)

        for name in promql.RUNTIME_METRICS:
            assert f"\n{name}" in text or text.startswith(name) or f"\n{name}_bucket" in text, (
                f"{name} not exported"
            )
        empty = []
        for board in boards().values():
            for title, expr in panel_queries(board):
                if not eventually_data(url, substitute(expr)):
                    empty.append(f"{board['title']} / {title}: {expr}")
        assert not empty, "panels without data:\n" + "\n".join(empty)
        offered = {}
        for name, board in boards().items():
            for variable, expr in variable_queries(board):
                values = eventually_data(url, substitute(expr))
                assert values, f"{board['title']}: the variable {variable} offers nothing"
                offered[(name, variable)] = {
                    value for result in values for value in result["metric"].values()
                }
        # A deployment at zero has only its router's series: the router's dashboard offers it.
        assert offered[("kvasir-routing", "deployment")] == {"demo", "idle"}
        assert offered[("kvasir-saturation", "deployment")] == {"demo"}
        not_seen = [expr for expr in STAGED if not eventually_data(url, expr)]
        assert not not_seen, f"staged but not seen by Prometheus: {not_seen}"
        records = [r["record"] for g in rule_groups()["groups"] for r in g["rules"] if "record" in r]
        missing = [record for record in records if not eventually_data(url, record)]
        assert not missing, f"recording rules without series: {missing}"
        assert len(DASHBOARDS) == len(boards())
