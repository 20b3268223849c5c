"""Why an LLMDeployment's pods are not becoming ready, read from the pods themselves: the
scheduler's verdict (`PodScheduled=False`, e.g. no free GPU or a missing PersistentVolumeClaim)
and the kubelet's (a container waiting on an image pull, a missing Secret, a crash loop).

The Deployment's own status says only that replicas are unavailable, and its progress deadline
is long (model downloads take a while), so without this a pod that can never start would look
like a model still loading for the whole deadline. Pure: pod dicts in, a Problem or None out."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from kvasir.operator.status import Problem

# Container waiting reasons that need someone to act; others (ContainerCreating, PodInitializing)
# are the normal way to Ready.
STUCK_WAITING_REASONS = frozenset(
    {
        "ErrImagePull",
        "ImagePullBackOff",
        "InvalidImageName",
        "ErrImageNeverPull",
        "CreateContainerConfigError",
        "CreateContainerError",
        "RunContainerError",
        "CrashLoopBackOff",
    }
)


def _condition(pod: Mapping[str, Any], kind: str) -> Mapping[str, Any]:
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == kind:
            return cond
    return {}


def _unschedulable(pod: Mapping[str, Any]) -> str | None:
    """The scheduler's message when it found no node for this pod."""
    scheduled = _condition(pod, "PodScheduled")
    if scheduled.get("status") == "False" and scheduled.get("reason") == "Unschedulable":
        return str(scheduled.get("message") or "no node fits the pod")
    return None


def _stuck_container(pod: Mapping[str, Any]) -> tuple[str, str] | None:
    """(reason, message) of the first container that waits for something that will not pass."""
    status = pod.get("status") or {}
    for container in (status.get("initContainerStatuses") or []) + (status.get("containerStatuses") or []):
        waiting = (container.get("state") or {}).get("waiting") or {}
        reason = waiting.get("reason")
        if reason in STUCK_WAITING_REASONS:
            message = waiting.get("message") or reason
            return str(reason), f"container {container.get('name')}: {message}"
    return None


def pod_problem(pods: Iterable[Mapping[str, Any]]) -> Problem | None:
    """The problem keeping pods from Ready, if any: scheduling first (it comes first), then the
    containers. Pods being deleted do not count."""
    live = [p for p in pods if not (p.get("metadata") or {}).get("deletionTimestamp")]
    unschedulable = [(p, message) for p in live if (message := _unschedulable(p)) is not None]
    if unschedulable:
        pod, message = unschedulable[0]
        count = f"{len(unschedulable)} of {len(live)} pods" if len(live) > 1 else "the pod"
        return Problem("Unschedulable", f"{count} cannot be scheduled: {message}")
    for pod in live:
        stuck = _stuck_container(pod)
        if stuck is not None:
            reason, message = stuck
            return Problem(reason, f"pod {(pod.get('metadata') or {}).get('name')}: {message}")
    return None
