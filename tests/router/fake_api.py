"""A stand-in for the Kubernetes API server, for the router's scale-from-zero tests: one
LLMDeployment's scale subresource (GET, merge PATCH with a resourceVersion precondition, as the
real server checks it) and its pods (one Ready pod per replica once `pods_start` allows)."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from typing import Any

from tests.router.stub_backend import read_body

SCALE = "/apis/inference.kvasir.dev/v1alpha1/namespaces/team-a/llmdeployments/demo/scale"
PODS = "/api/v1/namespaces/team-a/pods"


@dataclass
class FakeApi:
    replicas: int = 0
    version: int = 7
    pod_ip: str = "127.0.0.1"
    conflict_next_patch: bool = False  # someone else writes between the router's read and its patch
    forbidden: bool = False  # the router's Role grants nothing on the scale (403, as RBAC answers)
    pods_start: threading.Event = field(default_factory=threading.Event)  # replicas become Ready pods
    seen: list[tuple[str, str, Any]] = field(default_factory=list)  # method, path, parsed body

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = await read_body(receive)
        method, path = scope["method"], scope["path"]
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        self.seen.append((method, path, json.loads(body) if body else headers.get("content-type")))
        if path == SCALE and self.forbidden:
            await _answer(send, 403, {"kind": "Status", "code": 403, "reason": "Forbidden"})
        elif path == SCALE and method == "GET":
            await _answer(send, 200, self._scale())
        elif path == SCALE and method == "PATCH":
            await self._patch(send, json.loads(body), headers.get("content-type", ""))
        elif path == PODS and method == "GET":
            ready = self.pods_start.is_set()
            pods = [_pod(f"demo-{i}", self.pod_ip) for i in range(self.replicas if ready else 0)]
            await _answer(send, 200, {"kind": "PodList", "items": pods})
        else:
            await _answer(send, 404, {"kind": "Status", "code": 404})

    def _scale(self) -> dict[str, Any]:
        spec = {"replicas": self.replicas} if self.replicas else {}  # omitted at 0, as the real server does
        return {
            "kind": "Scale",
            "apiVersion": "autoscaling/v1",
            "metadata": {"name": "demo", "namespace": "team-a", "resourceVersion": str(self.version)},
            "spec": spec,
            "status": {"replicas": self.replicas},
        }

    async def _patch(self, send: Any, patch: dict[str, Any], content_type: str) -> None:
        if content_type != "application/merge-patch+json":
            await _answer(send, 415, {"kind": "Status", "code": 415})
            return
        if self.conflict_next_patch:
            self.conflict_next_patch = False
            self.replicas, self.version = 3, self.version + 1
        wanted = patch.get("metadata", {}).get("resourceVersion")
        if wanted is not None and wanted != str(self.version):
            await _answer(send, 409, {"kind": "Status", "code": 409, "reason": "Conflict"})
            return
        self.replicas, self.version = patch["spec"]["replicas"], self.version + 1
        await _answer(send, 200, self._scale())


def _pod(name: str, ip: str) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "creationTimestamp": "2026-01-01T00:00:00Z"},
        "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]},
    }


async def _answer(send: Any, status: int, document: dict[str, Any]) -> None:
    body = json.dumps(document).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
