"""The autoscaler inside the running operator (real kopf loop, kmock API server): it reads the
ready pods' /metrics (served here by small HTTP servers, one per pod IP on loopback), decides,
writes the scale subresource, posts Events, sets pod-deletion-cost before a scale-down, writes
status.autoscaling only when it changes, and survives slow pods."""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.asyncio


def autoscaled(kt: Any, **extra: Any) -> dict[str, Any]:
    policy = {
        "minReplicas": 1,
        "maxReplicas": 4,
        "windows": {"intervalSeconds": 1, "scaleDownSeconds": 0, "metricsSeconds": 10},
        "behavior": {"scaleDownPeriodSeconds": 0},
    }
    policy.update(extra)
    return kt.llmd("demo", replicas=1, autoscaling=policy)


def _replicas(cluster: Any, kt: Any) -> int:
    return int(cluster.get(kt.LLMD, "demo")["spec"]["replicas"])


def _events(cluster: Any, kt: Any, reason: str) -> list[dict[str, Any]]:
    return [
        r.data
        for r in cluster.requests(agent="kvasir-operator")
        if r.method == "POST" and r.resource == kt.EVENTS and (r.data or {}).get("reason") == reason
    ]


async def _start(cluster, start_operator, kt, port: int) -> Any:
    return await start_operator(metrics_port=port, autoscaler_poll_seconds=0.1, scrape_timeout_seconds=0.5)


async def test_the_autoscaler_follows_the_kv_cache(cluster, start_operator, kt, fake_pods) -> None:
    port, pods = fake_pods
    handle = await _start(cluster, start_operator, kt, port)
    await cluster.create(kt.PODS, kt.pod_object("demo-0", pods["demo-0"].ip))
    pods["demo-0"].text = kt.exposition(kv=1.0, waiting=2)
    await cluster.create(kt.LLMD, autoscaled(kt))
    await cluster.wait(lambda: _replicas(cluster, kt) >= 2, what="a scale-up")
    event = (await cluster.wait(lambda: _events(cluster, kt, "ScaledUp"), what="a ScaledUp event"))[0]
    assert event["involvedObject"]["name"] == "demo" and "KV usage 1.00" in event["message"]
    parent = await cluster.wait(
        lambda: (
            (cluster.get(kt.LLMD, "demo").get("status") or {}).get("autoscaling", {}).get("kind")
            == "scale_up"
            and cluster.get(kt.LLMD, "demo")
        ),
        what="status.autoscaling",
    )
    status = parent["status"]
    assert status["kvCacheUsagePercent"] == 100 and status["queueDepth"] == 2
    assert status["autoscaling"]["signals"]["kvCacheUsage"] == 1.0
    assert status["autoscaling"]["lastDecisions"][-1]["from"] == 1
    # The Deployment follows the scale subresource through the reconciler.
    await cluster.wait(
        lambda: cluster.get(kt.DEPLOYMENTS, "demo")["spec"]["replicas"] == _replicas(cluster, kt),
        what="the Deployment",
    )
    assert handle.metrics.registry.get_sample_value(
        "kvasir_operator_autoscaler_decisions_total", {"namespace": kt.NS, "name": "demo", "kind": "scale_up"}
    )
    ready = {"namespace": kt.NS, "name": "demo", "state": "ready"}
    assert handle.metrics.registry.get_sample_value("kvasir_operator_autoscaler_replicas", ready) == 1

    # The new pods are ready and the load is gone: it scales down, the emptiest pod first.
    for name in ("demo-1", "demo-2"):
        await cluster.create(kt.PODS, kt.pod_object(name, pods[name].ip))
    scaled = _replicas(cluster, kt)
    pods["demo-0"].text = kt.exposition(kv=0.05, running=3)
    pods["demo-1"].text = kt.exposition(kv=0.01, running=0)
    pods["demo-2"].text = kt.exposition(kv=0.05, running=2)
    await cluster.wait(lambda: _replicas(cluster, kt) < scaled, what="a scale-down")
    costs = {
        name: int(
            cluster.get(kt.PODS, name)["metadata"]["annotations"][
                "controller.kubernetes.io/pod-deletion-cost"
            ]
        )
        for name in ("demo-0", "demo-1", "demo-2")
    }
    assert costs["demo-1"] < costs["demo-2"] < costs["demo-0"]
    await cluster.wait(lambda: _events(cluster, kt, "ScaledDown"), what="a ScaledDown event")


async def test_status_is_written_only_when_it_changes(cluster, start_operator, kt, fake_pods) -> None:
    port, pods = fake_pods
    handle = await _start(cluster, start_operator, kt, port)
    await cluster.create(kt.PODS, kt.pod_object("demo-0", pods["demo-0"].ip))
    pods["demo-0"].text = kt.exposition(kv=0.8)
    await cluster.create(kt.LLMD, autoscaled(kt))

    def ticks() -> float:
        return (
            handle.metrics.registry.get_sample_value(
                "kvasir_operator_autoscaler_decisions_total",
                {"namespace": kt.NS, "name": "demo", "kind": "hold"},
            )
            or 0.0
        )

    def autoscaler_writes() -> int:
        return len(
            [
                r
                for r in cluster.writes(kt.LLMD)
                if r.subresource == "status" and "autoscaling" in (r.data or {}).get("status", {})
            ]
        )

    await cluster.wait(
        lambda: autoscaler_writes() >= 1 and ticks() >= 1, what="the first decision and status"
    )
    before, seen = autoscaler_writes(), ticks()
    await cluster.wait(lambda: ticks() >= seen + 4, what="four more decisions")
    assert autoscaler_writes() == before  # the same signals: nothing new to write
    pods["demo-0"].text = kt.exposition(kv=0.75)  # a real change (KV 80% -> 75%) is written
    await cluster.wait(lambda: autoscaler_writes() == before + 1, what="the changed status")
    assert cluster.get(kt.LLMD, "demo")["status"]["kvCacheUsagePercent"] == 75
    assert _replicas(cluster, kt) == 1


async def test_a_slow_pod_is_unknown_and_blocks_only_scale_down(
    cluster, start_operator, kt, fake_pods
) -> None:
    port, pods = fake_pods
    handle = await _start(cluster, start_operator, kt, port)
    for name in ("demo-0", "demo-1", "demo-2"):
        await cluster.create(kt.PODS, kt.pod_object(name, pods[name].ip))
        pods[name].text = kt.exposition(kv=0.02)
    pods["demo-2"].delay = 5.0  # far beyond the 0.5 s scrape timeout
    llmd = autoscaled(kt)
    llmd["spec"]["replicas"] = 3
    await cluster.create(kt.LLMD, llmd)

    def autoscaling() -> dict[str, Any]:
        return (cluster.get(kt.LLMD, "demo").get("status") or {}).get("autoscaling") or {}

    await cluster.wait(
        lambda: "metrics missing from 1 of 3" in autoscaling().get("reason", ""), what="a blocked scale-down"
    )
    assert _replicas(cluster, kt) == 3  # idle, but never scaled down on partial metrics
    assert autoscaling()["signals"]["reportingReplicas"] == 2
    assert handle.metrics.registry.get_sample_value(
        "kvasir_operator_autoscaler_scrape_failures_total", {"namespace": kt.NS, "name": "demo"}
    )
    # The pods that answer can still ask for more: the silent one keeps its own replica.
    for name in ("demo-0", "demo-1"):
        pods[name].text = kt.exposition(kv=1.0, waiting=3)
    await cluster.wait(lambda: _replicas(cluster, kt) >= 4, what="a scale-up despite the silent pod")


async def test_scale_to_zero_needs_the_router(crd, kt) -> None:
    manifest = autoscaled(kt, minReplicas=0)
    assert any("minReplicas 0 needs routing.mode kvasir" in e for e in kt.validate_cr(crd, manifest))
    manifest["spec"]["routing"] = {"mode": "kvasir"}
    assert kt.validate_cr(crd, manifest) == []
