"""Scale to zero on a real control plane. An LLMDeployment with `minReplicas: 0` sits at zero
(ScaledToZero True); the router's activation, sent as the router sends it (GET the scale
subresource, PATCH replicas 1 with its resourceVersion, under the router's own ServiceAccount
and the Role the operator wrote for it), brings the Deployment to one replica. The time from
the PATCH to the operator's write of the Deployment is read off the API server's audit log and
printed (the goal: within 1 s). A write with a stale resourceVersion, as the autoscaler's
scale-down would be after a wake, is refused with 409. And an idle deployment goes back to zero:
the operator scrapes its model pod and its router pod (small /metrics servers on the addresses
the node agent gave them, reporting no request) and scales it to zero after idleSeconds."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.e2e.control_plane import ControlPlane, KubectlError
from tests.e2e.kvasir_release import REPO, Release, condition, status_where
from tests.e2e.node_agent import NodeAgent
from tests.e2e.polling import wait_for

MINIMAL = REPO / "crds" / "samples" / "minimal.yaml"

pytestmark = pytest.mark.slow


def _at_zero(namespace: str, replicas: int = 0, idle: int = 60) -> dict[str, Any]:
    manifest: dict[str, Any] = yaml.safe_load(MINIMAL.read_text())
    manifest["metadata"]["namespace"] = namespace
    manifest["spec"].update(
        replicas=replicas,
        resources={"gpus": 0, "cpu": "1", "memory": "2Gi"},
        routing={"mode": "kvasir"},
        autoscaling={
            "minReplicas": 0,
            "maxReplicas": 2,
            "windows": {"intervalSeconds": 2},
            "scaleToZero": {"idleSeconds": idle, "holdSeconds": 120, "maxHeld": 10},
        },
    )
    return manifest


def _time(event: dict[str, Any]) -> float:
    return datetime.fromisoformat(event["stageTimestamp"].replace("Z", "+00:00")).timestamp()


def test_the_routers_activation_wakes_a_deployment_at_zero(
    control_plane: ControlPlane, release: Release, node_agent: NodeAgent, namespace: str, tmp_path: Path
) -> None:
    control_plane.kubectl("apply", "-f", "-", stdin=json.dumps(_at_zero(namespace)))
    status_where(
        control_plane,
        release,
        namespace,
        "smollm2",
        "ScaledToZero True",
        lambda obj: condition(obj, "ScaledToZero").get("reason") == "Idle",
    )

    def deployment() -> dict[str, Any] | None:
        found = control_plane.kubectl(
            "get", "deployment", "smollm2", "-n", namespace, "-o", "json", check=False
        )
        return json.loads(found.stdout) if found.returncode == 0 else None

    assert wait_for(deployment, "the model's Deployment", 60)["spec"]["replicas"] == 0
    role = wait_for(
        lambda: control_plane.kubectl_json("get", "role", "smollm2-router", "-n", namespace),
        "the router's Role",
        60,
    )
    assert {"resources": ["llmdeployments/scale"], "resourceNames": ["smollm2"]}.items() <= role["rules"][
        -1
    ].items()

    # The router's activation, under the router's own ServiceAccount.
    router = control_plane.service_account_kubeconfig(
        namespace, "smollm2-router", tmp_path / "router.kubeconfig"
    )
    scale = json.loads(
        control_plane.kubectl(
            "get", "--raw", f"/apis/inference.kvasir.dev/v1alpha1/namespaces/{namespace}/llmdeployments/smollm2/scale",
            kubeconfig=router,
        ).stdout
    )  # fmt: skip
    assert scale["spec"].get("replicas", 0) == 0
    stale = scale["metadata"]["resourceVersion"]
    wake = {"metadata": {"resourceVersion": stale}, "spec": {"replicas": 1}}
    control_plane.kubectl(
        "patch", "llmd", "smollm2", "-n", namespace, "--subresource=scale", "--type=merge", "-p", json.dumps(wake),
        kubeconfig=router,
    )  # fmt: skip
    # The router may not touch any other deployment's scale.
    other = control_plane.kubectl(
        "auth", "can-i", "patch", "llmdeployments/other", "--subresource=scale", "-n", namespace,
        kubeconfig=router, check=False,
    )  # fmt: skip
    assert other.stdout.strip() == "no"

    woken = wait_for(lambda: (d := deployment()) and d["spec"]["replicas"] == 1 and d, "one replica", 60)
    assert woken["spec"]["replicas"] == 1
    status_where(
        control_plane,
        release,
        namespace,
        "smollm2",
        "ScaledToZero False",
        lambda obj: condition(obj, "ScaledToZero").get("status") == "False",
    )

    # From the activation to the operator's write of the Deployment, on the API server's clock.
    events = control_plane.audit_events()
    patch = next(
        e
        for e in events
        if e["verb"] == "patch"
        and (e.get("objectRef") or {}).get("subresource") == "scale"
        and e["objectRef"].get("namespace") == namespace
        and e["user"]["username"].endswith(":smollm2-router")
    )
    written = [
        e
        for e in release.operator_requests()
        if e["verb"] in {"update", "patch"}
        and (e.get("objectRef") or {}).get("resource") == "deployments"
        and e["objectRef"].get("name") == "smollm2"
        and e["objectRef"].get("namespace") == namespace
        and not e["objectRef"].get("subresource")
        and _time(e) >= _time(patch)
    ]
    assert written, "the operator did not write the Deployment after the activation"
    seconds = _time(written[0]) - _time(patch)
    print(f"\nscale to zero: activation PATCH -> Deployment replicas 1 written in {seconds * 1000:.0f} ms")

    # The autoscaler's scale-down carries the resourceVersion it read: one read before the wake loses.
    down = {"metadata": {"resourceVersion": stale}, "spec": {"replicas": 0}}
    with pytest.raises(KubectlError) as refused:
        control_plane.kubectl(
            "patch", "llmd", "smollm2", "-n", namespace, "--subresource=scale", "--type=merge", "-p",
            json.dumps(down),
        )  # fmt: skip
    assert "the object has been modified" in str(refused.value) or "Conflict" in str(refused.value)
    assert deployment()["spec"]["replicas"] == 1  # type: ignore[index]


def _serve(ip: str, port: int, text: str | Callable[[], str]) -> ThreadingHTTPServer:
    """A /metrics page on the pod's address, as its process would serve it (`text` may be a
    function, called on every scrape)."""

    class Metrics(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = (text() if callable(text) else text).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: Any) -> None:
            pass

    server = ThreadingHTTPServer((ip, port), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


IDLE_RUNTIME = "\n".join(
    [
        "# TYPE kvasir_requests_running gauge",
        'kvasir_requests_running{model_name="m"} 0',
        "# TYPE kvasir_requests_waiting gauge",
        'kvasir_requests_waiting{model_name="m"} 0',
        "# TYPE kvasir_kv_cache_usage_ratio gauge",
        'kvasir_kv_cache_usage_ratio{model_name="m"} 0',
        "",
    ]
)


def _router(routed: int) -> str:
    return "\n".join(
        [
            "# TYPE kvasir_router_held_requests gauge",
            "kvasir_router_held_requests 0",
            "# TYPE kvasir_router_decisions counter",
            f'kvasir_router_decisions_total{{reason="load"}} {routed}',
            "",
        ]
    )


IDLE_ROUTER = _router(3)


def _pod_addresses(control_plane: ControlPlane, namespace: str) -> tuple[str, str]:
    """The model pod's and the router pod's addresses, once both are Ready."""

    def ready_ip(selector: str) -> str | None:
        pods = control_plane.kubectl_json("get", "pods", "-n", namespace, "-l", selector)["items"]
        ready = [
            p for p in pods if condition(p, "Ready").get("status") == "True" and p["status"].get("podIP")
        ]
        return ready[0]["status"]["podIP"] if ready else None

    model = wait_for(
        lambda: ready_ip(f"{MODEL_PODS},app.kubernetes.io/instance=smollm2"), "the model pod", 120
    )
    router = wait_for(
        lambda: ready_ip(f"{ROUTER_PODS},app.kubernetes.io/instance=smollm2"), "the router pod", 120
    )
    return model, router


MODEL_PODS, ROUTER_PODS = "app.kubernetes.io/name=kvasir", "app.kubernetes.io/name=kvasir-router"


def test_an_idle_deployment_goes_back_to_zero(
    control_plane: ControlPlane, release: Release, node_agent: NodeAgent, namespace: str
) -> None:
    idle = 6
    control_plane.kubectl("apply", "-f", "-", stdin=json.dumps(_at_zero(namespace, replicas=1, idle=idle)))

    def ready_ip(selector: str) -> str | None:
        pods = control_plane.kubectl_json("get", "pods", "-n", namespace, "-l", selector)["items"]
        ready = [
            p for p in pods if condition(p, "Ready").get("status") == "True" and p["status"].get("podIP")
        ]
        return ready[0]["status"]["podIP"] if ready else None

    model = wait_for(
        lambda: ready_ip("app.kubernetes.io/name=kvasir,app.kubernetes.io/instance=smollm2"),
        "the model pod",
        120,
    )
    router = wait_for(
        lambda: ready_ip("app.kubernetes.io/name=kvasir-router,app.kubernetes.io/instance=smollm2"),
        "the router pod",
        120,
    )
    servers = [_serve(model, 8000, IDLE_RUNTIME), _serve(router, 8080, IDLE_ROUTER)]
    started = time.monotonic()
    try:
        status_where(
            control_plane,
            release,
            namespace,
            "smollm2",
            "scaled to zero after the idle time",
            lambda obj: (
                obj["spec"].get("replicas") == 0 and condition(obj, "ScaledToZero").get("reason") == "Idle"
            ),
            timeout=180,
        )
        took = time.monotonic() - started
        print(
            f"\nscale to zero: back to 0 {took:.1f} s after both pods reported no request (idleSeconds {idle})"
        )
        assert took >= idle  # never before a whole idle time
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()
    downs = [
        e
        for e in release.operator_requests()
        if e["verb"] == "patch"
        and (e.get("objectRef") or {}).get("subresource") == "scale"
        and e["objectRef"].get("namespace") == namespace
    ]
    assert len(downs) == 1  # one write, 1 -> 0


def test_a_request_every_half_idle_time_keeps_one_replica(
    control_plane: ControlPlane, release: Release, node_agent: NodeAgent, namespace: str
) -> None:
    idle, interval = 6, 2
    control_plane.kubectl("apply", "-f", "-", stdin=json.dumps(_at_zero(namespace, replicas=1, idle=idle)))
    model, router = _pod_addresses(control_plane, namespace)
    lock = threading.Lock()
    routed, scrapes, last = 0, 0, time.monotonic()

    def every_half_idle_time() -> str:
        # One more routed request whenever half the idle time has passed since the last one.
        nonlocal routed, scrapes, last
        with lock:
            scrapes += 1
            if time.monotonic() - last >= idle / 2:
                routed, last = routed + 1, time.monotonic()
            return _router(routed)

    servers = [_serve(model, 8000, IDLE_RUNTIME), _serve(router, 8080, every_half_idle_time)]
    try:
        # Ticks (one scrape each) are at least intervalSeconds apart: 3 x idle / interval + 1
        # scrapes span three idle times.
        wait_for(lambda: scrapes >= 3 * idle // interval + 1, "ticks spanning three idle times", 180)
        assert routed >= 3  # about one every other tick
        obj = control_plane.kubectl_json("get", "llmd", "smollm2", "-n", namespace)
        assert obj["spec"]["replicas"] == 1
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()
    downs = [
        e
        for e in release.operator_requests()
        if e["verb"] == "patch"
        and (e.get("objectRef") or {}).get("subresource") == "scale"
        and e["objectRef"].get("namespace") == namespace
    ]
    assert downs == []  # never scaled to zero
