"""Scale to zero inside the running operator (real kopf loop, kmock API server): the router's
activation write on the scale subresource brings a Deployment replica back as soon as the event
is handled; the last replica goes after `scaleToZero.idleSeconds` without requests at the router
(its /metrics, served here on a loopback address) and at the pods; a request every tick keeps it;
the ScaledToZero condition follows; the router's Deployment and Role carry the hold and the wake."""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp import web

pytestmark = pytest.mark.asyncio

IDLE = 2  # seconds: a tiny idle time, so the tests wait on conditions, not on minutes


def router_pod(kt: Any, ip: str) -> dict[str, Any]:
    pod = kt.pod_object("demo-router-0", ip)
    pod["metadata"]["labels"] = {
        "app.kubernetes.io/name": "kvasir-router",
        "app.kubernetes.io/instance": "demo",
    }
    return pod


def router_exposition(held: int = 0, routed: int = 0) -> str:
    return "\n".join(
        [
            "# TYPE kvasir_router_held_requests gauge",
            f"kvasir_router_held_requests {held}",
            "# TYPE kvasir_router_decisions counter",
            f'kvasir_router_decisions_total{{reason="load"}} {routed}',
            "",
        ]
    )


def zero(kt: Any, replicas: int) -> dict[str, Any]:
    policy = {
        "minReplicas": 0,
        "maxReplicas": 2,
        "windows": {"intervalSeconds": 1, "scaleDownSeconds": 0, "metricsSeconds": 10},
        "behavior": {"scaleDownPeriodSeconds": 0},
        "scaleToZero": {"idleSeconds": IDLE, "holdSeconds": 120, "maxHeld": 7},
    }
    return kt.llmd("demo", replicas=replicas, autoscaling=policy, routing={"mode": "kvasir"})


def _replicas(cluster: Any, kt: Any, resource: str) -> int | None:
    obj = cluster.get(resource, "demo")
    return None if obj is None else int(obj["spec"].get("replicas", 1))


def _condition(cluster: Any, kt: Any, kind: str) -> dict[str, Any]:
    conditions = (cluster.get(kt.LLMD, "demo").get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == kind), {})


def _scale_writes(cluster: Any, kt: Any) -> list[Any]:
    return [r for r in cluster.writes(kt.LLMD) if r.subresource == "scale"]


def _ticks(handle: Any, kt: Any) -> float:
    """Decisions made for `demo` so far, of any kind: one per autoscaler tick."""
    kinds = ("scale_up", "scale_down", "hold", "stabilizing", "blocked", "no_metrics")
    labels = {"namespace": kt.NS, "name": "demo"}
    samples = (
        handle.metrics.registry.get_sample_value(
            "kvasir_operator_autoscaler_decisions_total", {**labels, "kind": k}
        )
        for k in kinds
    )
    return sum(sample or 0.0 for sample in samples)


async def _start(start_operator: Any, port: int) -> Any:
    return await start_operator(
        metrics_port=port, router_metrics_port=port, autoscaler_poll_seconds=0.1, scrape_timeout_seconds=0.5
    )


async def test_an_activation_write_wakes_a_deployment_at_zero(cluster, start_operator, kt, fake_pods) -> None:
    port, pods = fake_pods
    await _start(start_operator, port)
    pods["demo-3"].text = router_exposition()
    await cluster.create(kt.PODS, router_pod(kt, pods["demo-3"].ip))
    await cluster.create(kt.LLMD, zero(kt, replicas=0))
    await cluster.wait(lambda: _replicas(cluster, kt, kt.DEPLOYMENTS) == 0, what="a Deployment at zero")
    idle = await cluster.wait(lambda: _condition(cluster, kt, "ScaledToZero"), what="ScaledToZero")
    assert (idle["status"], idle["reason"]) == ("True", "Idle")
    # The router's children: the hold as flags, and a Role to wake this deployment only.
    args = cluster.get(kt.DEPLOYMENTS, "demo-router")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert (
        args[args.index("--hold-timeout") + 1] == "120" and args[args.index("--max-held-requests") + 1] == "7"
    )
    wake = cluster.get(kt.ROLES, "demo-router")["rules"][-1]
    assert wake["resources"] == ["llmdeployments/scale"] and wake["resourceNames"] == ["demo"]
    assert sorted(wake["verbs"]) == ["get", "patch"]

    # The router's activation, as it sends it: spec.replicas 1 on the scale subresource.
    before = len(cluster.requests())
    await cluster.patch(kt.LLMD, "demo", {"spec": {"replicas": 1}}, sub="scale")
    await cluster.wait(lambda: _replicas(cluster, kt, kt.DEPLOYMENTS) == 1, what="one replica back")
    after = cluster.requests()[before:]
    activation = next(i for i, r in enumerate(after) if r.subresource == "scale")
    deployment_write = next(
        i for i, r in enumerate(after) if r.resource == kt.DEPLOYMENTS and r.method in {"PUT", "PATCH"}
    )
    assert activation < deployment_write  # the Deployment follows the activation, from its event
    waking = await cluster.wait(
        lambda: (
            _condition(cluster, kt, "ScaledToZero").get("status") == "False"
            and _condition(cluster, kt, "ScaledToZero")
        ),
        what="ScaledToZero False",
    )
    assert waking["reason"] == "Activating"  # no pod is ready yet
    # The autoscaler honours the wake: the replica stays while the idle clock runs from the wake,
    # and a request held at the router while at zero would have woken it too.
    assert all(r.data["spec"]["replicas"] != 0 for r in _scale_writes(cluster, kt))


async def test_back_to_zero_after_the_idle_time(cluster, start_operator, kt, fake_pods) -> None:
    port, pods = fake_pods
    handle = await _start(start_operator, port)
    pods["demo-3"].text = router_exposition(routed=5)
    await cluster.create(kt.PODS, router_pod(kt, pods["demo-3"].ip))
    pods["demo-0"].text = kt.exposition(kv=0.0, running=0)
    await cluster.create(kt.PODS, kt.pod_object("demo-0", pods["demo-0"].ip))
    await cluster.create(kt.LLMD, zero(kt, replicas=1))
    await cluster.wait(lambda: _replicas(cluster, kt, kt.LLMD) == 0, what="scaled to zero")
    down = _scale_writes(cluster, kt)[-1]
    assert down.data["spec"]["replicas"] == 0
    # One write on the object the tick read (resourceVersion), so an activation racing it wins.
    assert "resourceVersion" in (down.data.get("metadata") or {}) or not cluster.get(kt.LLMD, "demo")[
        "metadata"
    ].get("resourceVersion")
    await cluster.wait(lambda: _replicas(cluster, kt, kt.DEPLOYMENTS) == 0, what="the Deployment at zero")
    await cluster.wait(
        lambda: _condition(cluster, kt, "ScaledToZero").get("reason") == "Idle", what="ScaledToZero Idle"
    )
    assert len(_scale_writes(cluster, kt)) == 1  # one step, 1 -> 0

    # Converged at zero: ticks go on, and nothing is written (no status, no scale, no children).
    def writes() -> list[Any]:
        return [r for r in cluster.requests(agent="kvasir-operator") if r.method != "GET"]

    # The ReplicaSet's part (no controller runs here): the pod goes; a tick records the empty set.
    await cluster.delete(kt.PODS, "demo-0")
    # A tick is counted before it writes: the third tick from here starts after the second, the
    # first to see the pod gone, has finished its write.
    settled = _ticks(handle, kt) + 3
    await cluster.wait(lambda: _ticks(handle, kt) >= settled, what="ticks after the pod went")
    ticks, before = _ticks(handle, kt), len(writes())
    await cluster.wait(lambda: _ticks(handle, kt) >= ticks + 3, what="three ticks at zero")
    assert len(writes()) == before, [(r.method, r.url.path) for r in writes()[before:]]
    # At zero, a request held at the router wakes it even if the router's own write were lost.
    pods["demo-3"].text = router_exposition(held=1, routed=5)
    await cluster.wait(lambda: _replicas(cluster, kt, kt.LLMD) == 1, what="woken by a held request")


async def test_a_request_every_tick_keeps_one_replica(cluster, start_operator, kt, fake_pods) -> None:
    port, pods = fake_pods
    handle = await _start(start_operator, port)
    routed = 0

    async def metrics(_: web.Request) -> web.Response:
        # A request routed between every two scrapes: never idle, whatever the timing.
        nonlocal routed
        routed += 1
        return web.Response(text=router_exposition(routed=routed), content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.20", port).start()
    try:
        await cluster.create(kt.PODS, router_pod(kt, "127.0.0.20"))
        pods["demo-0"].text = kt.exposition(kv=0.0, running=0)
        await cluster.create(kt.PODS, kt.pod_object("demo-0", pods["demo-0"].ip))
        await cluster.create(kt.LLMD, zero(kt, replicas=1))

        # Ticks are at least intervalSeconds (1 s) apart: 3 x IDLE ticks span over twice the idle time.
        await cluster.wait(lambda: _ticks(handle, kt) >= 3 * IDLE, what="ticks spanning twice the idle time")
        assert routed >= 3 * IDLE
        assert _replicas(cluster, kt, kt.LLMD) == 1
        assert not _scale_writes(cluster, kt)
        # False: a replica is asked for (the emulator runs no Deployment controller to make it ready).
        assert _condition(cluster, kt, "ScaledToZero")["status"] == "False"
    finally:
        await runner.cleanup()
