"""The autoscaler with multi-node groups (real kopf loop, kmock API server): a group is one
replica. Only its leader is scraped and counted, and the replica count it writes to the
LLMDeployment's /scale reaches the LeaderWorkerSet as a number of groups."""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = [pytest.mark.asyncio, pytest.mark.leader_worker_sets]

GROUP = {"resources": {"gpus": 8}, "parallelism": {"tensor": 16, "nodes": 2}}


def _group_pod(kt: Any, name: str, ip: str, worker: int) -> dict[str, Any]:
    pod = kt.pod_object(name, ip)
    pod["metadata"]["labels"].update(
        {
            "leaderworkerset.sigs.k8s.io/group-index": "0",
            "leaderworkerset.sigs.k8s.io/worker-index": str(worker),
        }
    )
    return dict(pod)


async def test_only_leaders_are_scraped_and_groups_are_scaled(cluster, start_operator, kt, fake_pods) -> None:
    port, pods = fake_pods
    await start_operator(metrics_port=port, autoscaler_poll_seconds=0.1, scrape_timeout_seconds=0.5)
    await cluster.create(kt.PODS, _group_pod(kt, "demo-0", pods["demo-0"].ip, worker=0))
    await cluster.create(kt.PODS, _group_pod(kt, "demo-0-1", pods["demo-1"].ip, worker=1))
    pods["demo-0"].text = kt.exposition(kv=1.0, waiting=2)
    # Were the worker scraped, the mean KV usage would be 0.5 and two replicas would report.
    pods["demo-1"].text = kt.exposition(kv=0.0, waiting=0, running=0)
    policy = {
        "minReplicas": 1,
        "maxReplicas": 4,
        "windows": {"intervalSeconds": 1, "scaleDownSeconds": 0, "metricsSeconds": 10},
    }
    await cluster.create(kt.LLMD, kt.llmd("demo", replicas=1, autoscaling=policy, **GROUP))

    def signals() -> Any:
        status = (cluster.get(kt.LLMD, "demo") or {}).get("status") or {}
        found = (status.get("autoscaling") or {}).get("signals") or {}
        return found if found.get("kvCacheUsage") is not None else None

    seen = await cluster.wait(signals, what="the autoscaler's signals")
    assert seen["readyReplicas"] == 1 and seen["reportingReplicas"] == 1
    assert seen["kvCacheUsage"] == 1.0
    await cluster.wait(lambda: cluster.get(kt.LLMD, "demo")["spec"]["replicas"] >= 2, what="a scale-up")
    await cluster.wait(
        lambda: (cluster.get(kt.LEADER_WORKER_SETS, "demo") or {}).get("spec", {}).get("replicas", 0) >= 2,
        what="the LeaderWorkerSet's groups",
    )
