"""spec.parallelism through the real kopf loop against kmock's emulator: a multi-node spec runs as a
LeaderWorkerSet only where its CRD is served, and says so in Degraded where it is not (creating
nothing for the group, leaving an earlier Deployment serving); the CRD installed or removed while
the operator runs is followed; switching between one node and several deletes the other kind;
status counts groups, from their pods; the autoscaler's /scale reaches the LeaderWorkerSet."""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.asyncio

POLL = 0.1  # discovery_seconds, scaled down
MULTI_NODE = {"resources": {"gpus": 8}, "parallelism": {"tensor": 16, "nodes": 2}}
ONE_NODE = {"resources": {"gpus": 2}, "parallelism": None}


def _condition(obj: dict[str, Any] | None, kind: str) -> dict[str, Any]:
    for cond in (obj or {}).get("status", {}).get("conditions") or []:
        if cond["type"] == kind:
            return dict(cond)
    return {}


async def _parent_where(cluster: Any, kt: Any, check: Any, what: str) -> dict[str, Any]:
    def found() -> Any:
        parent = cluster.get(kt.LLMD, "demo")
        return parent if parent is not None and parent.get("status") and check(parent) else None

    result: dict[str, Any] = await cluster.wait(found, what=what)
    return result


def _group_pod(kt: Any, group: int, worker: int, ip: str) -> dict[str, Any]:
    """A pod of group `group` as LeaderWorkerSet makes it: the template's labels and its own."""
    pod = kt.pod_object(f"demo-{group}" + (f"-{worker}" if worker else ""), ip)
    pod["metadata"]["labels"].update(
        {
            "app.kubernetes.io/managed-by": "kvasir-operator",
            "leaderworkerset.sigs.k8s.io/group-index": str(group),
            "leaderworkerset.sigs.k8s.io/worker-index": str(worker),
        }
    )
    return dict(pod)


async def test_without_the_crd_the_condition_says_so_and_nothing_is_half_built(
    cluster, start_operator, kt
) -> None:
    await start_operator(discovery_seconds=POLL)
    await cluster.create(kt.LLMD, kt.llmd("demo", **MULTI_NODE))
    parent = await _parent_where(
        cluster, kt, lambda p: _condition(p, "Degraded").get("status") == "True", "Degraded"
    )
    degraded = _condition(parent, "Degraded")
    assert degraded["reason"] == "LeaderWorkerSetUnavailable"
    assert "leaderworkersets.leaderworkerset.x-k8s.io/v1" in degraded["message"]
    assert cluster.get(kt.DEPLOYMENTS, "demo") is None
    assert not [r for r in cluster.requests(agent="kvasir-operator") if r.resource == kt.LEADER_WORKER_SETS]

    # LeaderWorkerSet installed afterwards: discovery notices, the group is made, Degraded clears.
    kt.declare_leader_worker_sets(cluster.kmock)
    lws = await cluster.wait(lambda: cluster.get(kt.LEADER_WORKER_SETS, "demo"), what="the LeaderWorkerSet")
    assert lws["metadata"]["ownerReferences"][0]["uid"] == "uid-demo"
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    await _parent_where(
        cluster, kt, lambda p: _condition(p, "Degraded").get("status") == "False", "Degraded cleared"
    )


@pytest.mark.leader_worker_sets
async def test_switching_nodes_replaces_the_child_kind_and_status_counts_groups(
    cluster, start_operator, kt
) -> None:
    await start_operator(discovery_seconds=POLL)
    await cluster.create(kt.LLMD, kt.llmd("demo", resources={"gpus": 2}))
    deployment = await cluster.wait(lambda: cluster.get(kt.DEPLOYMENTS, "demo"), what="the Deployment")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--tensor-parallel-size") + 1] == "2"

    # One node to two: the LeaderWorkerSet replaces the Deployment; the Service selects leaders.
    await cluster.patch(kt.LLMD, "demo", {"metadata": {"generation": 2}, "spec": MULTI_NODE})
    await cluster.wait(lambda: cluster.get(kt.LEADER_WORKER_SETS, "demo"), what="the LeaderWorkerSet")
    await cluster.wait(lambda: cluster.get(kt.DEPLOYMENTS, "demo") is None, what="the Deployment deleted")
    service = cluster.get(kt.SERVICES, "demo")
    assert service["spec"]["selector"]["leaderworkerset.sigs.k8s.io/worker-index"] == "0"

    # One group whose two pods are Ready: one ready replica (the pods' events bring it to status).
    for worker in (0, 1):
        await cluster.create(kt.PODS, _group_pod(kt, 0, worker, f"10.0.0.{worker + 1}"))
    parent = await _parent_where(
        cluster,
        kt,
        lambda p: p["status"].get("readyReplicas") == 1 and p["status"].get("observedGeneration") == 2,
        "one ready group",
    )
    assert parent["status"]["selector"].endswith("leaderworkerset.sigs.k8s.io/worker-index=0")

    # kubectl scale (or the autoscaler) writes the LLMDeployment's replicas: the groups follow.
    await cluster.patch(kt.LLMD, "demo", {"spec": {"replicas": 3}})
    await cluster.wait(
        lambda: cluster.get(kt.LEADER_WORKER_SETS, "demo")["spec"]["replicas"] == 3, what="3 groups"
    )

    # Back to one node: the Deployment returns, the LeaderWorkerSet goes.
    await cluster.patch(kt.LLMD, "demo", {"metadata": {"generation": 3}, "spec": ONE_NODE})
    await cluster.wait(lambda: cluster.get(kt.DEPLOYMENTS, "demo"), what="the Deployment again")
    await cluster.wait(lambda: cluster.get(kt.LEADER_WORKER_SETS, "demo") is None, what="the LWS deleted")


async def test_a_deployment_keeps_serving_while_the_group_cannot_be_made(cluster, start_operator, kt) -> None:
    await start_operator(discovery_seconds=POLL)
    await cluster.create(kt.LLMD, kt.llmd("demo"))
    await cluster.wait(lambda: cluster.get(kt.DEPLOYMENTS, "demo"), what="the Deployment")
    await cluster.patch(kt.LLMD, "demo", {"metadata": {"generation": 2}, "spec": MULTI_NODE})
    parent = await _parent_where(
        cluster,
        kt,
        lambda p: _condition(p, "Degraded").get("reason") == "LeaderWorkerSetUnavailable",
        "LeaderWorkerSetUnavailable",
    )
    assert parent["status"]["phase"] == "Degraded"
    assert cluster.get(kt.DEPLOYMENTS, "demo") is not None
    assert not cluster.writes(kt.DEPLOYMENTS)[1:]  # created once, never rewritten for the group
