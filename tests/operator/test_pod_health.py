"""Why pods are not becoming ready, read from pods shaped as a real API server returns them."""

from __future__ import annotations

from typing import Any

from kvasir.operator.pod_health import pod_problem

# The scheduler's message for a pod asking for a GPU no node has (kube-scheduler 1.36 wording).
NO_GPU = (
    "0/1 nodes are available: 1 Insufficient nvidia.com/gpu. preemption: 0/1 nodes are available: "
    "1 No preemption victims found for incoming pod."
)
NO_CLAIM = 'persistentvolumeclaim "models" not found. preemption: 0/1 nodes are available: 1 Preemption is not helpful for scheduling.'


def _pod(
    name: str,
    *,
    scheduled: dict[str, Any] | None = None,
    waiting: dict[str, Any] | None = None,
    deleting: bool = False,
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": "ns"}
    if deleting:
        meta["deletionTimestamp"] = "2026-11-25T10:00:00Z"
    status: dict[str, Any] = {"phase": "Pending", "conditions": []}
    if scheduled is not None:
        status["conditions"].append({"type": "PodScheduled", **scheduled})
    if waiting is not None:
        status["containerStatuses"] = [
            {"name": "kvasir", "ready": False, "restartCount": 0, "state": {"waiting": waiting}}
        ]
    return {"metadata": meta, "status": status}


def test_healthy_or_starting_pods_are_no_problem() -> None:
    scheduled = {"status": "True"}
    assert pod_problem([]) is None
    assert pod_problem([_pod("a", scheduled=scheduled, waiting={"reason": "ContainerCreating"})]) is None


def test_the_schedulers_reason_is_reported() -> None:
    unschedulable = {"status": "False", "reason": "Unschedulable", "message": NO_GPU}
    problem = pod_problem([_pod("a", scheduled={"status": "True"}), _pod("b", scheduled=unschedulable)])
    assert problem is not None and problem.reason == "Unschedulable"
    assert problem.message == f"1 of 2 pods cannot be scheduled: {NO_GPU}"
    claim = {"status": "False", "reason": "Unschedulable", "message": NO_CLAIM}
    only = pod_problem([_pod("a", scheduled=claim)])
    assert only is not None and only.message == f"the pod cannot be scheduled: {NO_CLAIM}"


def test_a_stuck_container_is_reported_with_the_kubelets_message() -> None:
    waiting = {"reason": "CreateContainerConfigError", "message": 'secret "hf" not found'}
    problem = pod_problem([_pod("m-5d9c-x2", scheduled={"status": "True"}, waiting=waiting)])
    assert problem is not None and problem.reason == "CreateContainerConfigError"
    assert problem.message == 'pod m-5d9c-x2: container kvasir: secret "hf" not found'
    pull = pod_problem(
        [_pod("p", waiting={"reason": "ImagePullBackOff", "message": "Back-off pulling image"})]
    )
    assert pull is not None and pull.reason == "ImagePullBackOff"


def test_pods_being_deleted_do_not_count() -> None:
    unschedulable = {"status": "False", "reason": "Unschedulable", "message": NO_GPU}
    assert pod_problem([_pod("old", scheduled=unschedulable, deleting=True)]) is None
