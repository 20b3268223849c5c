"""spec.lora through the real kopf loop against kmock's emulator: the operator writes the
`<name>-lora` ConfigMap the pods read at start, loads the declared adapters on every ready pod
(small aiohttp stand-ins for `kvasir serve` on loopback addresses, with its adapter endpoints and
API key), unloads removed ones, never changes the pod template when only the adapters change,
reports each adapter's ready replicas in status.lora, and says why an adapter failed to load."""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import pytest_asyncio
from aiohttp import web

pytestmark = pytest.mark.asyncio

KEY = "s3cret"


@dataclass
class FakeRuntime:
    """One pod's `kvasir serve`, reduced to its adapter API (vLLM's answers)."""

    ip: str
    adapters: dict[str, str] = field(default_factory=dict)  # name -> root (the directory's last part)
    refuse: dict[str, str] = field(default_factory=dict)  # name -> the 400 message a load gets
    key: str | None = KEY  # the API key it requires (None: open)
    unauthorized: int = 0
    runner: web.AppRunner | None = None

    def app(self) -> web.Application:
        async def models(request: web.Request) -> web.Response:
            if self.key is not None and request.headers.get("Authorization") != f"Bearer {self.key}":
                self.unauthorized += 1
                return web.json_response({"error": {"message": "Incorrect API key provided."}}, status=401)
            cards = [{"id": "base", "parent": None, "root": "base"}]
            cards += [{"id": n, "parent": "base", "root": r} for n, r in sorted(self.adapters.items())]
            return web.json_response({"object": "list", "data": cards})

        async def load(request: web.Request) -> web.Response:
            body = await request.json()
            name = body["lora_name"]
            if name in self.refuse:
                return web.json_response({"error": {"message": self.refuse[name]}}, status=400)
            if name in self.adapters and not body.get("load_inplace"):
                return web.json_response({"error": {"message": "already loaded"}}, status=400)
            self.adapters[name] = body["lora_path"].rstrip("/").rsplit("/", 1)[-1]
            return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

        async def unload(request: web.Request) -> web.Response:
            name = (await request.json())["lora_name"]
            if self.adapters.pop(name, None) is None:
                return web.json_response({"error": {"message": "not found"}}, status=404)
            return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

        app = web.Application()
        app.router.add_get("/v1/models", models)
        app.router.add_post("/v1/load_lora_adapter", load)
        app.router.add_post("/v1/unload_lora_adapter", unload)
        return app


@pytest_asyncio.fixture
async def runtimes(kt: Any) -> AsyncIterator[tuple[int, dict[str, FakeRuntime]]]:
    port = kt._free_port()
    pods = {f"demo-lora-{i}": FakeRuntime(ip=f"127.0.0.{40 + i}") for i in range(2)}
    for pod in pods.values():
        pod.runner = web.AppRunner(pod.app())
        await pod.runner.setup()
        await web.TCPSite(pod.runner, pod.ip, port).start()
    yield port, pods
    for pod in pods.values():
        assert pod.runner is not None
        await pod.runner.cleanup()


def _pod(kt: Any, name: str, ip: str, port: int) -> dict[str, Any]:
    """A ready pod of the deployment, declaring its serving port as the operator's template does."""
    pod: dict[str, Any] = kt.pod_object(name, ip)
    pod["metadata"]["labels"]["app.kubernetes.io/managed-by"] = "kvasir-operator"
    pod["spec"] = {"containers": [{"name": "kvasir", "ports": [{"name": "http", "containerPort": port}]}]}
    return pod


def _adapters(*names: str) -> list[dict[str, Any]]:
    return [{"name": name, "source": f"pvc://adapters/{name}", "rank": 8} for name in names]


def _lora_status(cluster: Any, kt: Any) -> dict[str, int]:
    parent = cluster.get(kt.LLMD, "demo") or {}
    return {a["name"]: a["readyReplicas"] for a in (parent.get("status") or {}).get("lora") or []}


def _degraded(cluster: Any, kt: Any) -> dict[str, Any]:
    parent = cluster.get(kt.LLMD, "demo") or {}
    for cond in (parent.get("status") or {}).get("conditions") or []:
        if cond["type"] == "Degraded":
            return dict(cond)
    return {}


async def test_adapters_are_loaded_on_ready_pods_without_a_rollout(
    cluster, start_operator, kt, runtimes
) -> None:
    port, pods = runtimes
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "api", "namespace": kt.NS},
        "data": {"api-key": base64.b64encode(KEY.encode()).decode()},
    }
    await cluster.create(kt.SECRETS, secret)
    await start_operator()
    spec = {"replicas": 2, "server": {"apiKeySecretRef": {"name": "api"}}, "lora": _adapters("sql", "chat")}
    await cluster.create(kt.LLMD, kt.llmd("demo", **spec))
    deployment = await cluster.wait(lambda: cluster.get(kt.DEPLOYMENTS, "demo"), what="the Deployment")
    template = deployment["spec"]["template"]
    args = template["spec"]["containers"][0]["args"]
    assert args[args.index("--max-lora-rank") + 1] == "16"
    assert args[args.index("--lora-modules-file") + 1] == "/etc/kvasir/lora/adapters.json"
    config_map = cluster.get(kt.CONFIG_MAPS, "demo-lora")
    assert config_map is not None
    assert json.loads(config_map["data"]["adapters.json"]) == [
        {"name": "sql", "path": "/adapters/claims/adapters/sql"},
        {"name": "chat", "path": "/adapters/claims/adapters/chat"},
    ]
    for name, pod in pods.items():
        await cluster.create(kt.PODS, _pod(kt, name, pod.ip, port))
    await cluster.wait(
        lambda: all(set(p.adapters) == {"sql", "chat"} for p in pods.values()), what="adapters on every pod"
    )
    await cluster.wait(lambda: _lora_status(cluster, kt) == {"sql": 2, "chat": 2}, what="status.lora")
    assert all(pod.unauthorized == 0 for pod in pods.values())

    # A new adapter on the same claim, one removed: the ConfigMap changes, the pod template does not.
    writes = cluster.versions(kt.DEPLOYMENTS, "demo")
    await cluster.patch(
        kt.LLMD, "demo", {"metadata": {"generation": 2}, "spec": {"lora": _adapters("chat", "sql-v2")}}
    )
    await cluster.wait(
        lambda: all(set(p.adapters) == {"chat", "sql-v2"} for p in pods.values()),
        what="the new set on every pod",
    )
    await cluster.wait(lambda: _lora_status(cluster, kt) == {"chat": 2, "sql-v2": 2}, what="status.lora")
    live = cluster.get(kt.DEPLOYMENTS, "demo")
    assert live is not None and live["spec"]["template"] == template
    assert cluster.versions(kt.DEPLOYMENTS, "demo") == writes
    data = (cluster.get(kt.CONFIG_MAPS, "demo-lora") or {})["data"]["adapters.json"]
    assert [item["name"] for item in json.loads(data)] == ["chat", "sql-v2"]


async def test_an_adapter_a_pod_refuses_is_reported_and_the_other_pod_still_serves_it(
    cluster, start_operator, kt, runtimes
) -> None:
    port, pods = runtimes
    first, second = pods.values()
    first.key = second.key = None  # no spec.server.apiKeySecretRef
    second.refuse["bad"] = "The LoRA adapter 'bad' cannot be served: r 64 is above --max-lora-rank 16"
    await start_operator()
    await cluster.create(kt.LLMD, kt.llmd("demo", replicas=2, lora=_adapters("bad")))
    await cluster.wait(lambda: cluster.get(kt.DEPLOYMENTS, "demo"), what="the Deployment")
    for name, pod in pods.items():
        await cluster.create(kt.PODS, _pod(kt, name, pod.ip, port))
    await cluster.wait(lambda: "bad" in first.adapters, what="the adapter on the pod that takes it")
    condition = await cluster.wait(
        lambda: (c := _degraded(cluster, kt)).get("reason") == "AdapterLoadFailed" and c, what="Degraded"
    )
    assert "r 64 is above --max-lora-rank 16" in condition["message"]
    assert "demo-lora-1" in condition["message"]
    await cluster.wait(lambda: _lora_status(cluster, kt) == {"bad": 1}, what="one ready replica")
    events = [e for e in cluster.kmock.objects.values() if (e.raw or {}).get("kind") == "Event"]
    assert any((e.raw or {}).get("reason") == "AdapterLoadFailed" for e in events)
    # Fixed on the pod: the next reconcile (retried with backoff) loads it, and the problem clears.
    second.refuse.clear()
    await cluster.wait(lambda: _lora_status(cluster, kt) == {"bad": 2}, what="both replicas")
    await cluster.wait(lambda: _degraded(cluster, kt).get("status") == "False", what="Degraded cleared")
