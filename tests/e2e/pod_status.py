"""Pure builders of the pod status a kubelet reports: container states and the pod's conditions."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from tests.e2e.node_objects import now


def _digest(*parts: str) -> str:
    return hashlib.sha256("/".join(parts).encode()).hexdigest()


def image_id(image: str) -> str:
    """A stable `repository@sha256:...` for an image reference, as a runtime reports after a pull."""
    if "@" in image:
        return image
    last = image.rsplit("/", 1)[-1]
    repository = image.rsplit(":", 1)[0] if ":" in last else image
    return f"{repository}@sha256:{_digest(image)}"


@dataclass
class Container:
    """What the agent knows of one container; `status()` renders it as a ContainerStatus."""

    name: str
    image: str
    state: str = "waiting"  # waiting | running | terminated
    reason: str = "ContainerCreating"
    message: str | None = None
    started_at: str | None = None
    ready: bool = False
    started: bool = False
    restart_count: int = 0
    terminated: dict[str, Any] | None = None
    last_terminated: dict[str, Any] | None = None

    def run(self, started: bool) -> None:
        self.state, self.reason, self.message = "running", "", None
        self.started_at, self.started, self.ready = now(), started, False

    def wait(self, reason: str, message: str | None = None) -> None:
        self.state, self.reason, self.message = "waiting", reason, message
        self.ready = self.started = False

    def exit(self, exit_code: int, pod_uid: str) -> None:
        """The process ended with `exit_code` (128 + the signal's number for a signal, as runtimes say)."""
        self.state, self.ready, self.started = "terminated", False, False
        self.terminated = {
            "exitCode": exit_code,
            "reason": "Completed" if exit_code == 0 else "Error",
            "startedAt": self.started_at,
            "finishedAt": now(),
            "containerID": self.container_id(pod_uid),
        }

    def back_off(self, message: str) -> None:
        """Between an exit and the restart: the exit becomes lastState and counts as a restart."""
        self.last_terminated, self.terminated = self.terminated, None
        self.restart_count += 1
        self.wait("CrashLoopBackOff", message)

    def container_id(self, pod_uid: str) -> str:
        return f"containerd://{_digest(pod_uid, self.name, str(self.restart_count))}"

    def status(self, pod_uid: str) -> dict[str, Any]:
        state: dict[str, Any]
        if self.state == "running":
            state = {"running": {"startedAt": self.started_at}}
        elif self.state == "terminated":
            state = {"terminated": self.terminated}
        else:
            state = {
                "waiting": {"reason": self.reason, **({"message": self.message} if self.message else {})}
            }
        status: dict[str, Any] = {
            "name": self.name,
            "image": self.image,
            "imageID": image_id(self.image) if self.state != "waiting" or self.restart_count else "",
            "state": state,
            "lastState": {"terminated": self.last_terminated} if self.last_terminated else {},
            "ready": self.ready,
            "started": self.started,
            "restartCount": self.restart_count,
        }
        if self.state != "waiting" or self.restart_count:
            status["containerID"] = self.container_id(pod_uid)
        return status


@dataclass
class Conditions:
    """The pod's conditions, keeping each one's lastTransitionTime until its status changes."""

    _since: dict[str, tuple[str, str]] = field(default_factory=dict)

    def render(self, values: dict[str, bool]) -> list[dict[str, Any]]:
        rendered = []
        for kind, value in values.items():
            status = "True" if value else "False"
            previous = self._since.get(kind)
            if previous is None or previous[0] != status:
                self._since[kind] = (status, now())
            condition: dict[str, Any] = {
                "type": kind,
                "status": status,
                "lastProbeTime": None,
                "lastTransitionTime": self._since[kind][1],
            }
            if not value and kind in ("ContainersReady", "Ready"):
                condition["reason"] = "ContainersNotReady"
            rendered.append(condition)
        return rendered


def pod_status(
    pod: dict[str, Any],
    phase: str,
    ip: str,
    host_ip: str,
    start_time: str,
    containers: list[Container],
    conditions: Conditions,
) -> dict[str, Any]:
    """The whole `.status` of a pod on this node; init containers, which the agent does not run,
    are reported completed."""
    uid = pod["metadata"]["uid"]
    ready = all(container.ready for container in containers)
    status: dict[str, Any] = {
        "phase": phase,
        "hostIP": host_ip,
        "hostIPs": [{"ip": host_ip}],
        "podIP": ip,
        "podIPs": [{"ip": ip}],
        "startTime": start_time,
        "conditions": conditions.render(
            {
                "PodReadyToStartContainers": True,
                "Initialized": True,
                "ContainersReady": ready,
                "Ready": ready,
                "PodScheduled": True,
            }
        ),
        "containerStatuses": [container.status(uid) for container in containers],
    }
    init = pod["spec"].get("initContainers") or []
    if init:
        done = []
        for spec in init:
            container = Container(spec["name"], spec.get("image", ""), started_at=start_time)
            container.exit(0, uid)
            done.append(container.status(uid))
        status["initContainerStatuses"] = done
    return status
