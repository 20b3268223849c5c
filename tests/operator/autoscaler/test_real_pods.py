"""The autoscaler against real runtime processes (`kvasir serve` on a tiny model, each on its own
loopback address): the collector reads what the pods really report, survives a pod killed in the
middle of a tick, and in a closed loop (the operator on kmock, tests/operator/kubelet.py standing
in for the kubelet) replicas rise under load, fall after the stabilization window once the load
stops, and no request fails while pods drain."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvasir.operator.autoscaler.pods import PodView
from kvasir.operator.autoscaler.sources import PodScraper

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]


def _load(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(
        # The shared helpers (kubelet.py, apiserver.py) sit in tests/operator/, one folder up.
        f"kvasir_tests_{name}",
        pathlib.Path(__file__).parents[1] / f"{name}.py",
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


kubelet_module = _load("kubelet")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint) -> Path:
    return tiny_checkpoint("llama")


@contextlib.contextmanager
def serve(checkpoint: Path, ip: str, port: int, *args: str) -> Iterator[subprocess.Popen[bytes]]:
    command = [
        sys.executable, "-m", "kvasir.cli", "serve", "--model", str(checkpoint), "--served-model-name", "tiny",
        "--host", ip, "--port", str(port), "--device", "cpu", *args,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONSAFEPATH": "1", "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=10)


async def _wait_ready(session: aiohttp.ClientSession, url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(aiohttp.ClientError, OSError, asyncio.TimeoutError):
            async with session.get(f"{url}/ready") as response:
                if response.status == 200:
                    return
        await asyncio.sleep(0.2)
    raise AssertionError(f"{url} never became ready")


async def _complete(session: aiohttp.ClientSession, url: str, max_tokens: int) -> dict[str, Any]:
    body = {
        "model": "tiny",
        "prompt": "hello " * 8,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
    }
    async with session.post(f"{url}/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
        return dict(await response.json())


async def test_the_collector_reads_what_real_pods_report(checkpoint: Path) -> None:
    port = _free_port()
    ips = ["127.0.1.101", "127.0.1.102"]
    with (
        serve(checkpoint, ips[0], port, "--max-num-seqs", "2"),
        serve(checkpoint, ips[1], port, "--max-num-seqs", "2") as doomed,
    ):
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            for ip in ips:
                await _wait_ready(session, f"http://{ip}:{port}")
            pods = [PodView(f"pod-{i}", ip, True, 0.0, 1.0, False) for i, ip in enumerate(ips)]
            scraper = PodScraper(timeout=2.0, port=port)
            # Load: 6 requests on a pod that runs 2 at a time, so some wait.
            load = [
                asyncio.ensure_future(_complete(session, f"http://{ips[0]}:{port}", 120)) for _ in range(6)
            ]
            seen_waiting = seen_running = 0.0
            while not all(task.done() for task in load):
                metrics = await scraper.collect("ns", "demo", pods)
                seen_waiting = max(seen_waiting, metrics["pod-0"].gauges["waiting"])
                seen_running = max(seen_running, metrics["pod-0"].gauges["running"])
                await asyncio.sleep(0.05)
            answers = await asyncio.gather(*load)
            assert seen_running == 2 and seen_waiting >= 1
            metrics = await scraper.collect("ns", "demo", pods)
            busy = metrics["pod-0"]
            # Counters equal what the requests themselves report.
            assert busy.counters["generation_tokens"] == sum(a["usage"]["completion_tokens"] for a in answers)
            assert busy.counters["prompt_tokens"] == sum(a["usage"]["prompt_tokens"] for a in answers)
            assert busy.histograms["ttft"].count == 6
            assert busy.histograms["itl"].count == 6 * 119  # one gap between each two tokens
            assert busy.gauges["running"] == 0 and 0 <= busy.gauges["kv_usage"] <= 1
            assert metrics["pod-1"].counters.get("generation_tokens", 0) == 0
            # A pod killed in the middle of a tick: the other is still read, within the timeout.
            failures: list[str] = []
            scraper.on_failure = lambda pod, why: failures.append(pod)
            doomed.send_signal(signal.SIGKILL)
            started = time.monotonic()
            metrics = await scraper.collect("ns", "demo", pods)
            assert time.monotonic() - started < 3
            assert set(metrics) == {"pod-0"} and failures == ["pod-1"]
            await scraper.close()


async def test_closed_loop_scales_up_under_load_and_down_without_losing_requests(
    cluster, start_operator, kt, checkpoint: Path
) -> None:
    port = _free_port()
    await start_operator(metrics_port=port, autoscaler_poll_seconds=0.2, scrape_timeout_seconds=1.0)
    kubelet = kubelet_module.Kubelet(
        cluster, kt, checkpoint, port, serve_args=("--max-num-seqs", "2", "--drain-timeout", "30")
    )
    balancer = kubelet_module.Balancer(kubelet)
    policy = {
        "minReplicas": 1,
        "maxReplicas": 3,
        "targets": {"queuePerReplica": 1, "kvCacheUsage": 0.9},
        "windows": {"intervalSeconds": 1, "metricsSeconds": 10, "scaleDownSeconds": 4},
        "behavior": {"scaleDownPeriodSeconds": 2},
    }
    kubelet.start()
    results: list[int] = []
    stop = asyncio.Event()

    async def client(session: aiohttp.ClientSession) -> None:
        while not stop.is_set():
            url = balancer.pick()
            if url is None:
                await asyncio.sleep(0.1)
                continue
            try:
                body = {"model": "tiny", "prompt": "hi " * 8, "max_tokens": 60, "ignore_eos": True}
                async with session.post(f"{url}/v1/completions", json=body) as response:
                    await response.read()
                    results.append(response.status)
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
                results.append(0)

    try:
        await cluster.create(kt.LLMD, kt.llmd("demo", replicas=1, autoscaling=policy))
        await cluster.wait(lambda: kubelet.serving, timeout=90, what="the first pod ready")
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            clients = [asyncio.ensure_future(client(session)) for _ in range(6)]
            await cluster.wait(
                lambda: cluster.get(kt.LLMD, "demo")["spec"]["replicas"] >= 2, timeout=60, what="a scale-up"
            )
            await cluster.wait(lambda: len(kubelet.serving) >= 2, timeout=90, what="two pods serving")
            peak = cluster.get(kt.LLMD, "demo")["spec"]["replicas"]
            stop.set()
            await asyncio.gather(*clients)
            # On a loaded 2-core machine a pod's /metrics can miss the 1 s scrape timeout, and a
            # deployment with a pod unheard from never scales down (by design): allow time for that.
            try:
                await cluster.wait(
                    lambda: cluster.get(kt.LLMD, "demo")["spec"]["replicas"] < peak,
                    timeout=150,
                    what="a scale-down",
                )
            except AssertionError as error:
                reason = cluster.get(kt.LLMD, "demo").get("status", {}).get("autoscaling", {}).get("reason")
                raise AssertionError(f"{error}; the autoscaler's last reason: {reason}") from None
            await cluster.wait(lambda: len(kubelet.pods) < peak, timeout=90, what="a pod drained and gone")
        status = cluster.get(kt.LLMD, "demo")["status"]["autoscaling"]
        assert [d["to"] > d["from"] for d in status["lastDecisions"]][:1] == [True]
        assert results and set(results) == {200}, {s: results.count(s) for s in set(results)}
    finally:
        stop.set()
        await kubelet.stop()
