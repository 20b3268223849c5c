"""From `kubectl apply` of an LLMDeployment to its first answered request on the real node, by
phase. The pod is watched by polling the API every 0.25 s (the moment Ready is first seen); the
scheduler's Event marks the binding (microseconds), the kubelet's says whether the image was
already present; the runtime's own `ready:` log line (the CRI log's nanosecond timestamps, the
same host clock) splits the container's time into process start-up and model load."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from tests.e2e.control_plane import ControlPlane
from tests.e2e.real_node import traffic

POLL = 0.25  # seconds between looks at the pod
# The runtime's line once it serves: "... ready: serving NAME (...) 25.3s after the process started (process 4.2s, ...)"
READY_LINE = re.compile(r"ready: serving .* ([\d.]+)s after the process started \((?P<phases>[^)]*)\)")


@dataclass
class StartupTimeline:
    """Seconds after the apply at which each step was first seen, and the runtime's phases."""

    scheduled: float = 0.0
    image_event: str = ""  # the kubelet's Pulled message
    running: float = 0.0  # the container's state became running
    process_started: float = 0.0  # from the runtime's log: when its process started
    model_ready: float = 0.0  # from the runtime's log: when it logged `ready:`
    pod_ready: float = 0.0  # the kubelet's readiness probe passed (Ready condition)
    first_answer: float = 0.0  # first 200 through the Service
    runtime_phases: dict[str, float] = field(default_factory=dict)

    def phases(self) -> dict[str, float]:
        """Consecutive phases that add up to `first_answer`."""
        imports = self.runtime_phases.get("process", 0.0)
        return {
            "operator, controllers, scheduler (apply to pod bound)": self.scheduled,
            "sandbox, image check, container start": self.process_started - self.scheduled,
            "runtime start-up (Python imports)": imports,
            "model load (files, weights, KV cache, engine, warm-up)": self.model_ready
            - self.process_started
            - imports,
            "readiness probe (ready to Pod Ready)": self.pod_ready - self.model_ready,
            "first answer through the Service": self.first_answer - self.pod_ready,
        }


def _ready(pod: dict[str, Any]) -> bool:
    conditions = pod.get("status", {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def _running(pod: dict[str, Any]) -> bool:
    statuses = pod.get("status", {}).get("containerStatuses") or []
    return bool(statuses) and all("running" in (s.get("state") or {}) for s in statuses)


def _rfc3339(stamp: str) -> float:
    """Epoch seconds of a UTC RFC 3339 time with any number of fraction digits."""
    whole, _, fraction = stamp.rstrip("Z").partition(".")
    seconds = datetime.fromisoformat(whole + "+00:00").timestamp()
    return seconds + float(f"0.{fraction or 0}")


def _cri_time(line: str) -> float:
    """The epoch seconds of a CRI log line ("2026-11-28T13:25:48.072909343Z stderr F ...")."""
    return _rfc3339(line.split(" ", 1)[0])


def ready_line(log_files: list[Path]) -> tuple[float, float, dict[str, float]] | None:
    """(epoch of the `ready:` line, seconds since the process started, phases) from a container's
    CRI log files, or None before the runtime logged it."""
    for path in log_files:
        for line in path.read_text(errors="replace").splitlines():
            found = READY_LINE.search(line)
            if found:
                phases = {}
                for part in found.group("phases").split(", "):
                    name, _, seconds = part.rpartition(" ")
                    phases[name] = float(seconds.rstrip("s"))
                return _cri_time(line), float(found.group(1)), phases
    return None


def measure(
    plane: ControlPlane,
    namespace: str,
    selector: str,
    applied_at: float,
    service_url: str,
    log_files: Any,
    timeout: float,
) -> StartupTimeline:
    """Watch the first pod matching `selector` from `applied_at` (time.time() of the apply) until a
    request through `service_url` is answered. `log_files(pod_name)` lists its CRI log files."""
    timeline = StartupTimeline()
    deadline = time.monotonic() + timeout
    url = f"{plane.server}/api/v1/namespaces/{namespace}/pods"
    pod: dict[str, Any] = {}
    with httpx.Client(verify=plane.access.ssl_context(), headers=plane.access.headers(), timeout=10) as api:
        while not timeline.pod_ready:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the pod was not Ready within {timeout:.0f}s; last seen: {pod.get('status')}"
                )
            items = api.get(url, params={"labelSelector": selector}).json().get("items") or []
            now = time.time() - applied_at
            if items:
                pod = items[0]
                if not timeline.scheduled and pod.get("spec", {}).get("nodeName"):
                    timeline.scheduled = now
                if not timeline.running and _running(pod):
                    timeline.running = now
                if _ready(pod):
                    timeline.pod_ready = now
            time.sleep(POLL)
        while True:
            try:
                if traffic.chat(service_url, timeout=30).status_code == 200:
                    timeline.first_answer = time.time() - applied_at
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"no answer through {service_url} within {timeout:.0f}s")
            time.sleep(POLL)
        name = pod["metadata"]["name"]
        events = api.get(
            f"{plane.server}/apis/events.k8s.io/v1/namespaces/{namespace}/events",
            params={"fieldSelector": f"regarding.name={name}"},
        ).json()
    for event in events.get("items") or []:
        if event.get("reason") == "Pulled":
            timeline.image_event = event.get("note", "")
        # The scheduler writes events.k8s.io Events with a microsecond eventTime: a better mark
        # than the moment the poll saw the binding.
        if event.get("reason") == "Scheduled" and event.get("eventTime"):
            timeline.scheduled = _rfc3339(event["eventTime"]) - applied_at
    found = ready_line(log_files(name))
    if found is None:
        raise AssertionError(f"the runtime of {name} never logged its `ready:` line")
    ready_epoch, since_start, timeline.runtime_phases = found
    timeline.model_ready = ready_epoch - applied_at
    timeline.process_started = timeline.model_ready - since_start
    return timeline
