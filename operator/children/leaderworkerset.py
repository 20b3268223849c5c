"""The LeaderWorkerSet (leaderworkerset.x-k8s.io/v1) of a multi-node LLMDeployment: one group of
`spec.parallelism.nodes` pods per replica, created, scaled, rolled and restarted as a unit. Pure:
spec in, manifest dict out. It replaces the Deployment when spec.parallelism.nodes is above 1.

The group's leader is the replica's one serving pod (the Service, the router, the InferencePool,
the autoscaler and status select it by LWS's worker-index label); the workers run the same
command with --headless at their own node rank: only their ranks, and /health and /ready for their
probes."""

from __future__ import annotations

import copy
from typing import Any

from kvasir.operator import naming
from kvasir.operator.api.spec import LLMDeploymentSpec
from kvasir.operator.children.deployment import pod_template
from kvasir.operator.children.parallel import worker_args

LWS_GROUP = "leaderworkerset.x-k8s.io"
LWS_VERSION = "v1"
# One rank that dies leaves the others blocked in a collective: recreate the whole group (all or
# nothing), as vLLM's and KServe's multi-node deployments do, instead of restarting one pod.
RESTART_POLICY = "RecreateGroupOnPodRestart"


def _worker_template(leader: dict[str, Any], spec: LLMDeploymentSpec) -> dict[str, Any]:
    """The leader's template with the worker's args. Its probes stay: a headless node answers
    /health (503 once one of its ranks or the leader is gone; it exits right after) and /ready
    (once its ranks are loaded) on the same port. No scrape annotations: it has no /metrics."""
    worker = copy.deepcopy(leader)
    worker["metadata"].pop("annotations", None)
    for container in worker["spec"]["containers"]:
        container["args"] = worker_args(spec, container["args"])
    return worker


def build_leader_worker_set(name: str, namespace: str, spec: LLMDeploymentSpec) -> dict[str, Any]:
    """`spec.desired_replicas` groups of `spec.nodes_per_replica` pods; same name as the parent."""
    leader = pod_template(name, spec)
    return {
        "apiVersion": f"{LWS_GROUP}/{LWS_VERSION}",
        "kind": "LeaderWorkerSet",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": naming.common_labels(name, spec.runtime.image),
        },
        "spec": {
            # The scale subresource's count is groups: one replica of the LLMDeployment each.
            "replicas": spec.desired_replicas,
            "leaderWorkerTemplate": {
                "size": spec.nodes_per_replica,
                "restartPolicy": RESTART_POLICY,
                "leaderTemplate": leader,
                "workerTemplate": _worker_template(leader, spec),
            },
            # Groups are replaced one by one, the same budget as the Deployment's rollout.
            "rolloutStrategy": {
                "type": "RollingUpdate",
                "rollingUpdateConfiguration": {
                    "maxUnavailable": spec.rollout.max_unavailable,
                    "maxSurge": spec.rollout.max_surge,
                },
            },
            # Workers start with the leader, not after it is Ready: the leader cannot be ready
            # before its workers have joined.
            "startupPolicy": "LeaderCreated",
        },
    }
