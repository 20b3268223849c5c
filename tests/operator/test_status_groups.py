"""Status of a multi-node LLMDeployment: its LeaderWorkerSet's groups are its replicas, a group is
ready when all its pods are, and the scale selector counts leaders only."""

from __future__ import annotations

from typing import Any

from kvasir.operator import naming
from kvasir.operator.api.spec import parse_spec
from kvasir.operator.status import Observation, compute_status, ready_groups

SPEC = parse_spec(
    {
        "model": {"source": "pvc://weights"},
        "replicas": 2,
        "resources": {"gpus": 8},
        "parallelism": {"tensor": 16, "nodes": 2},
    }
)


def _pod(group: int, worker: int, ready: bool = True, deleting: bool = False) -> dict[str, Any]:
    labels = {naming.LWS_GROUP_INDEX_LABEL: str(group), naming.LWS_WORKER_INDEX_LABEL: str(worker)}
    meta: dict[str, Any] = {"name": f"big-{group}-{worker}", "labels": labels}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    condition = {"type": "Ready", "status": "True" if ready else "False"}
    return {"metadata": meta, "status": {"conditions": [condition]}}


def _lws(replicas: int, ready: int, updated: int) -> dict[str, Any]:
    return {
        "kind": "LeaderWorkerSet",
        "metadata": {"generation": 1},
        "spec": {"replicas": 2, "leaderWorkerTemplate": {"size": 2}},
        "status": {"replicas": replicas, "readyReplicas": ready, "updatedReplicas": updated},
    }


def _conditions(status: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def test_a_group_is_ready_when_every_pod_of_it_is() -> None:
    pods = [_pod(0, 0), _pod(0, 1), _pod(1, 0), _pod(1, 1, ready=False)]
    assert ready_groups(pods, 2) == 1
    assert ready_groups([*pods[:3], _pod(1, 1)], 2) == 2
    assert ready_groups([_pod(0, 0), _pod(0, 1, deleting=True)], 2) == 0
    assert ready_groups([{"metadata": {"labels": {}}, "status": {}}], 1) == 0


def test_groups_are_the_replicas_and_readiness_comes_from_the_pods() -> None:
    # The LWS controller has not counted the last pod yet; the pods (watched) already say it.
    pods = (_pod(0, 0), _pod(0, 1), _pod(1, 0), _pod(1, 1))
    status = compute_status(Observation("big", "ns", 1, SPEC, _lws(2, 1, 2), pods=pods))
    assert (status["replicas"], status["readyReplicas"], status["desiredReplicas"]) == (2, 2, 2)
    assert status["phase"] == "Running"
    assert _conditions(status)["Available"] == ("True", "ReplicasReady")
    available = next(c for c in status["conditions"] if c["type"] == "Available")
    assert available["message"] == "2/2 replicas ready (groups of 2 pods)"
    # The scale subresource's selector: an HPA counts one pod per group, the leader.
    assert status["selector"] == naming.selector_string(
        naming.selector_labels("big") | {naming.LWS_WORKER_INDEX_LABEL: "0"}
    )


def test_half_a_group_serves_nothing() -> None:
    pods = (_pod(0, 0), _pod(0, 1, ready=False))
    status = compute_status(Observation("big", "ns", 1, SPEC, _lws(2, 0, 2), pods=pods))
    assert status["readyReplicas"] == 0 and status["phase"] == "Pending"


def test_a_missing_leader_worker_set_is_named() -> None:
    status = compute_status(Observation("big", "ns", 1, SPEC, None))
    assert _conditions(status)["Available"] == ("False", "LeaderWorkerSetMissing")
