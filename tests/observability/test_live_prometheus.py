"""A real Prometheus on loopback scrapes a running Kvasir server (under a short load, some of it
turned away) and the operator's metrics endpoint; then every query of every dashboard panel
returns data, every recording rule produces series, and every runtime metric the dashboards and
rules name is one the server exports."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
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
from kvasir.runtime.server.app import build_app
from kvasir.runtime.server.config import ServerConfig
from tests.external_tools import REPO, tool
from tests.observability.test_dashboards import boards, substitute
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


@contextmanager
def prometheus(tmp_path: Path, runtime: str, operator: str) -> Iterator[str]:
    """Prometheus scraping both every second, evaluating the shipped rules every second."""
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [
            {
                "job_name": "kvasir-runtime",
                # The labels the Prometheus Operator gives a pod found through the LLMDeployment's Service.
                "static_configs": [
                    {
                        "targets": [runtime],
                        "labels": {"namespace": "team-a", "service": "demo", "pod": "demo-0"},
                    }
                ],
            },
            {
                "job_name": "kvasir-operator",
                "honor_labels": True,  # as the chart's ServiceMonitor: the LLMDeployment's namespace wins
                "static_configs": [
                    {
                        "targets": [operator],
                        "labels": {"namespace": "kvasir-system", "pod": "kvasir-operator-0"},
                    }
                ],
            },
        ],
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


def _load(base: str) -> list[int]:
    def one(index: int) -> int:
        body = {"model": MODEL, "prompt": f"request {index} " * 6, "max_tokens": 12, "ignore_eos": True}
        return httpx.post(f"{base}/v1/completions", json=body, timeout=60).status_code

    codes = []
    for workers, count in ((3, 16), (16, 24)):  # steady traffic, then a burst past the queue limit
        with ThreadPoolExecutor(workers) as pool:
            codes += list(pool.map(one, range(count)))
    return codes


def test_every_panel_and_rule_has_data(tiny_checkpoint: Any, tmp_path: Path) -> None:
    engine = tiny_engine_config(tiny_checkpoint("llama"), max_num_seqs=2)
    app = build_app(engine, ServerConfig(max_queue_len=2))
    metrics = OperatorMetrics()
    with serve(app) as server, operator_endpoint(metrics) as operator_port:
        runtime = server.url.removeprefix("http://")
        with prometheus(tmp_path, runtime, f"127.0.0.1:{operator_port}") as url:
            before = parse_metrics(httpx.get(f"{server.url}/metrics").text)
            codes = _load(server.url)
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
            records = [r["record"] for g in rule_groups()["groups"] for r in g["rules"] if "record" in r]
            missing = [record for record in records if not eventually_data(url, record)]
            assert not missing, f"recording rules without series: {missing}"
            assert len(DASHBOARDS) == len(boards())
