"""Fixtures for the operator tests: the CRD and samples, and a kmock Kubernetes emulator with the
real kopf operator loop running against it (in this event loop, no threads, no cluster)."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime
import importlib.util
import pathlib
import socket
import sys
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
import yaml
from aiohttp import web

from tests.operator import kmock_membership

kmock_membership.install()

REPO = pathlib.Path(__file__).resolve().parents[2]
CRD_PATH = REPO / "crds" / "llmdeployments.inference.kvasir.dev.yaml"
SAMPLES = sorted((REPO / "crds" / "samples").glob("*.yaml"))

LLMD = "inference.kvasir.dev/v1alpha1/llmdeployments"
DEPLOYMENTS = "apps/v1/deployments"
SERVICES = "v1/services"
PDBS = "policy/v1/poddisruptionbudgets"
MONITORS = "monitoring.coreos.com/v1/servicemonitors"
SECRETS = "v1/secrets"
EVENTS = "v1/events"
LEASES = "coordination.k8s.io/v1/leases"
PODS = "v1/pods"
SERVICE_ACCOUNTS = "v1/serviceaccounts"
ROLES = "rbac.authorization.k8s.io/v1/roles"
ROLE_BINDINGS = "rbac.authorization.k8s.io/v1/rolebindings"
INFERENCE_POOLS = "inference.networking.k8s.io/v1/inferencepools"
CONFIG_MAPS = "v1/configmaps"
LEADER_WORKER_SETS = "leaderworkerset.x-k8s.io/v1/leaderworkersets"
CHILDREN = (DEPLOYMENTS, SERVICES, PDBS)
NS = "team-a"
TEST_AGENT = "kvasir-tests"
# Every wait in these tests is event-driven and bounded; the bound is only a hang guard. 15 s was
# missed with two busy loops beside the suite (the RBAC test waiting for a RoleBinding): a loaded
# 2-core machine can take that long to run a reconcile, so the guard is 120 s.
TIMEOUT = 120.0


@pytest.fixture(scope="session")
def crd() -> dict[str, Any]:
    return yaml.safe_load(CRD_PATH.read_text())


@pytest.fixture(scope="session")
def samples() -> dict[str, dict[str, Any]]:
    return {path.stem: yaml.safe_load(path.read_text()) for path in SAMPLES}


def llmd(name: str = "demo", generation: int = 1, **spec: Any) -> dict[str, Any]:
    """An LLMDeployment as the API server would store it (uid and generation set)."""
    body_spec: dict[str, Any] = {"model": {"source": "hf://HuggingFaceTB/SmolLM2-135M-Instruct"}}
    body_spec.update(spec)
    return {
        "apiVersion": "inference.kvasir.dev/v1alpha1",
        "kind": "LLMDeployment",
        "metadata": {
            "name": name,
            "namespace": NS,
            "uid": f"uid-{name}",
            "generation": generation,
            # kmock stores no resourceVersion of its own; kopf's JSON patches test for one.
            "resourceVersion": "1",
        },
        "spec": body_spec,
    }


def _path(resource: str, namespace: str | None, name: str | None = None, sub: str | None = None) -> str:
    parts = resource.split("/")
    group, version, plural = ("", *parts) if len(parts) == 2 else parts
    path = f"/apis/{group}/{version}" if group else f"/api/{version}"
    if namespace:
        path += f"/namespaces/{namespace}"
    path += f"/{plural}"
    if name:
        path += f"/{name}"
    if sub:
        path += f"/{sub}"
    return path


def _load(name: str) -> Any:
    # Test modules cannot import each other under pytest's importlib mode: load helpers by path.
    spec = importlib.util.spec_from_file_location(
        f"kvasir_tests_{name}", pathlib.Path(__file__).with_name(f"{name}.py")
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


apiserver = _load("apiserver")
# The CRD as kube-apiserver checks it (when written) and applies it (defaults, schema, CEL rules).
crd_semantics = _load("crd_semantics")
crd_schema = crd_semantics.crd_schema
apply_defaults = crd_semantics.apply_defaults
validate_cr = crd_semantics.validate_cr


@dataclass
class Cluster:
    """The emulator plus helpers: test-side writes go through HTTP so watchers see them."""

    kmock: Any
    session: aiohttp.ClientSession
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    server: dict[str, int] = field(default_factory=dict)  # the API-server layer's counters

    @property
    def url(self) -> str:
        return str(self.kmock.url).rstrip("/")

    async def _send(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
        async with self.session.request(method, self.url + path, json=body) as response:
            data = await response.json(content_type=None)
            assert response.status < 400, (method, path, response.status, data)
            return data if isinstance(data, dict) else {}

    async def create(self, resource: str, body: dict[str, Any]) -> dict[str, Any]:
        namespace = body["metadata"].get("namespace")
        return await self._send("POST", _path(resource, namespace), body)

    async def patch(
        self, resource: str, name: str, body: dict[str, Any], sub: str | None = None, namespace: str = NS
    ) -> dict[str, Any]:
        return await self._send("PATCH", _path(resource, namespace, name, sub), body)

    async def put(
        self, resource: str, name: str, body: dict[str, Any], namespace: str = NS
    ) -> dict[str, Any]:
        return await self._send("PUT", _path(resource, namespace, name), body)

    async def delete(self, resource: str, name: str, namespace: str = NS) -> None:
        await self._send("DELETE", _path(resource, namespace, name))

    def get(self, resource: str, name: str, namespace: str | None = NS) -> dict[str, Any] | None:
        """The stored object (no HTTP request), or None if absent or deleted."""
        try:
            obj = self.kmock.objects[resource, namespace, name]
        except KeyError:
            return None
        return None if obj.deleted else copy.deepcopy(obj.raw)

    def versions(self, resource: str, name: str, namespace: str = NS) -> int:
        """How many times the object was written (creations, updates, patches, deletions)."""
        try:
            history = list(self.kmock.objects[resource, namespace, name].history)
        except KeyError:
            return 0
        if resource not in apiserver.CHILD_KINDS:
            return len(history)
        # Children: each write leaves one server-assigned resourceVersion (kmock's raw copy of a
        # POST or PATCH, before the API-server layer normalises it, carries none or the old one).
        stored = {(v.raw.get("metadata") or {}).get("resourceVersion") for v in history if v is not None}
        return len(stored - {None}) + sum(1 for v in history if v is None)

    def names(self, resource: str, namespace: str = NS) -> list[str]:
        return sorted(
            key[2]
            for key, obj in self.kmock.objects.items()
            if key[0] == resource and key[1] == namespace and not obj.deleted
        )

    def requests(self, *, agent: str | None = None) -> list[Any]:
        """Every request the emulator served, optionally only those from one User-Agent prefix."""
        found = list(self.kmock)
        if agent is not None:
            found = [r for r in found if r.headers.get("User-Agent", "").startswith(agent)]
        return found

    def writes(self, resource: str, agent: str = "kvasir-operator") -> list[Any]:
        """The operator's own mutating requests to one resource (any subresource)."""
        return [
            r
            for r in self.requests(agent=agent)
            if r.method in {"POST", "PATCH", "PUT", "DELETE"} and r.resource == resource
        ]

    async def wait(self, predicate: Callable[[], Any], timeout: float = TIMEOUT, what: str = "") -> Any:
        """Wait (event-driven: woken by every request the emulator serves) until predicate() is truthy."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            self.changed.clear()
            value = predicate()
            if value:
                return value
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
            # Re-check at least every 0.5 s: state can change without a request (a direct store edit).
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.changed.wait(), timeout=min(remaining, 0.5))


def _declare_resources(
    kmock: Any, *, monitoring: bool, inference_pools: bool = False, leader_worker_sets: bool = False
) -> None:
    import kmock as kmock_lib

    verbs = {"get", "list", "watch", "create", "patch", "update", "delete"}

    def declare(
        resource: str, kind: str, subresources: set[str] | None = None, namespaced: bool = True
    ) -> None:
        kmock.resources[resource] = kmock_lib.ResourceInfo(
            kind=kind, namespaced=namespaced, verbs=verbs, subresources=subresources or set()
        )

    # Every real cluster serves these two; kopf's discovery waits for them before it watches anything.
    declare("v1/namespaces", "Namespace", namespaced=False)
    declare("apiextensions.k8s.io/v1/customresourcedefinitions", "CustomResourceDefinition", namespaced=False)

    declare(LLMD, "LLMDeployment", {"status", "scale"})
    declare(DEPLOYMENTS, "Deployment", {"status", "scale"})
    declare(SERVICES, "Service", {"status"})
    declare(PDBS, "PodDisruptionBudget", {"status"})
    declare(SECRETS, "Secret")
    declare(EVENTS, "Event")
    declare(LEASES, "Lease")
    declare(PODS, "Pod", {"status"})
    declare(SERVICE_ACCOUNTS, "ServiceAccount")
    declare(ROLES, "Role")
    declare(ROLE_BINDINGS, "RoleBinding")
    declare(CONFIG_MAPS, "ConfigMap")
    if monitoring:
        declare(MONITORS, "ServiceMonitor")
    if inference_pools:
        declare(INFERENCE_POOLS, "InferencePool")
    if leader_worker_sets:
        declare_leader_worker_sets(kmock)


def declare_leader_worker_sets(kmock: Any) -> None:
    """What installing the LeaderWorkerSet CRD does to discovery (also while the operator runs)."""
    import kmock as kmock_lib

    kmock.resources[LEADER_WORKER_SETS] = kmock_lib.ResourceInfo(
        kind="LeaderWorkerSet",
        namespaced=True,
        verbs={"get", "list", "watch", "create", "patch", "update", "delete"},
        subresources={"status", "scale"},
    )


@pytest_asyncio.fixture
async def cluster(kmock: Any, request: pytest.FixtureRequest) -> AsyncIterator[Cluster]:
    """A kmock KubernetesEmulator declaring the resources the operator uses."""
    monitoring = bool(request.node.get_closest_marker("monitoring"))
    inference_pools = bool(request.node.get_closest_marker("inference_pools"))
    leader_worker_sets = bool(request.node.get_closest_marker("leader_worker_sets"))
    _declare_resources(
        kmock, monitoring=monitoring, inference_pools=inference_pools, leader_worker_sets=leader_worker_sets
    )
    async with aiohttp.ClientSession(headers={"User-Agent": TEST_AGENT}) as session:
        cluster = Cluster(kmock=kmock, session=session)

        def notify() -> None:
            cluster.changed.set()
            # "Matched, but nothing to answer": kmock goes on to its emulator behaviour.
            raise NotImplementedError

        kmock << notify
        # Real API-server semantics for the children (PUT, resourceVersion, defaults, quantities).
        cluster.server = apiserver.install(kmock)
        yield cluster


@dataclass
class OperatorHandle:
    """One operator running in its own thread and event loop, as a separate process would.

    (In-loop would not do: on exit, kopf cancels every task created after it started, which
    includes pytest-asyncio's fixture finalizers and kmock's connection handlers.)"""

    metrics: Any
    state: Any
    thread: threading.Thread | None = None
    loop: asyncio.AbstractEventLoop | None = None
    task: asyncio.Task[None] | None = None
    stop_event: asyncio.Event | None = None
    ready: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None

    @property
    def alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    async def _join(self) -> None:
        assert self.thread is not None
        await asyncio.to_thread(self.thread.join, TIMEOUT)
        assert not self.thread.is_alive(), "the operator did not stop in time"

    async def stop(self) -> None:
        """Graceful stop (what SIGTERM does)."""
        if self.alive and self.loop is not None and self.stop_event is not None:
            self.loop.call_soon_threadsafe(self.stop_event.set)
        await self._join()

    async def crash(self) -> None:
        """Abrupt end in the middle of whatever it is doing (no graceful shutdown of handlers)."""
        if self.alive and self.loop is not None and self.task is not None:
            self.loop.call_soon_threadsafe(self.task.cancel)
        await self._join()


@pytest_asyncio.fixture
async def start_operator(cluster: Cluster) -> AsyncIterator[Callable[..., Any]]:
    """A factory starting the real operator (kopf loop included) against the emulator."""
    import kopf

    from kvasir.operator.handlers import HandlerConfig
    from kvasir.operator.metrics import OperatorMetrics
    from kvasir.operator.runner import OperatorConfig, OperatorState, run_operator

    handles: list[OperatorHandle] = []

    def login(**_: Any) -> kopf.ConnectionInfo:
        return kopf.ConnectionInfo(server=cluster.url)

    base = OperatorConfig(
        handlers=HandlerConfig(
            login=login,
            retry_base_seconds=0.05,
            retry_max_seconds=0.5,
            resync_seconds=None,
            # kmock never bumps resourceVersion, so kopf would wait the whole timeout after each patch.
            consistency_timeout_seconds=0.05,
        ),
        namespaces=(),
        http_port=None,
        apply_backoff_seconds=0.02,
    )

    async def start(wait_ready: bool = True, **overrides: Any) -> OperatorHandle:
        handlers = overrides.pop("handlers", {})
        config = replace(base, handlers=replace(base.handlers, **handlers), **overrides)
        handle = OperatorHandle(metrics=OperatorMetrics(), state=OperatorState())

        async def main() -> None:
            handle.task = asyncio.current_task()  # type: ignore[assignment]
            handle.stop_event, ready = asyncio.Event(), asyncio.Event()
            relay = asyncio.ensure_future(_relay_ready(ready, handle.ready))
            try:
                await run_operator(
                    config, stop=handle.stop_event, ready=ready, metrics=handle.metrics, state=handle.state
                )
            finally:
                relay.cancel()

        def target() -> None:
            handle.loop = asyncio.new_event_loop()
            try:
                handle.loop.run_until_complete(main())
            except BaseException as exc:  # surfaced to the test through handle.error
                handle.error = exc
            finally:
                handle.loop.close()

        handle.thread = threading.Thread(target=target, name="kvasir-operator", daemon=True)
        handles.append(handle)
        handle.thread.start()
        if wait_ready:
            await asyncio.to_thread(handle.ready.wait, TIMEOUT)
            if handle.error is not None:
                raise handle.error
            assert handle.ready.is_set(), "the operator did not become ready"
        return handle

    yield start
    for handle in handles:
        await handle.stop()


async def _relay_ready(source: asyncio.Event, target: threading.Event) -> None:
    await source.wait()
    target.set()


# --- Runtime pods for the autoscaler: /metrics endpoints on loopback addresses. ---


def exposition(kv: float, waiting: int = 0, running: int = 4) -> str:
    """A Kvasir runtime's /metrics, reduced to what the autoscaler reads."""
    return "\n".join(
        [
            "# TYPE kvasir_requests_running gauge",
            f'kvasir_requests_running{{model_name="m"}} {running}',
            "# TYPE kvasir_requests_waiting gauge",
            f'kvasir_requests_waiting{{model_name="m"}} {waiting}',
            "# TYPE kvasir_kv_cache_usage_ratio gauge",
            f'kvasir_kv_cache_usage_ratio{{model_name="m"}} {kv}',
            "",
        ]
    )


@dataclass
class FakePod:
    """One pod's metrics endpoint on its own loopback address."""

    ip: str
    text: str = field(default_factory=lambda: exposition(0.5))
    delay: float = 0.0
    runner: web.AppRunner | None = None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest_asyncio.fixture
async def fake_pods() -> AsyncIterator[tuple[int, dict[str, FakePod]]]:
    port = _free_port()
    pods = {f"demo-{i}": FakePod(ip=f"127.0.0.{10 + i}") for i in range(4)}

    def handler(pod: FakePod) -> Any:
        async def metrics(_: web.Request) -> web.Response:
            if pod.delay:
                await asyncio.sleep(pod.delay)
            return web.Response(text=pod.text, content_type="text/plain")

        return metrics

    for pod in pods.values():
        app = web.Application()
        app.router.add_get("/metrics", handler(pod))
        pod.runner = web.AppRunner(app)
        await pod.runner.setup()
        await web.TCPSite(pod.runner, pod.ip, port).start()
    yield port, pods
    for pod in pods.values():
        assert pod.runner is not None
        await pod.runner.cleanup()


def pod_object(name: str, ip: str, ready: bool = True, instance: str = "demo") -> dict[str, Any]:
    now = datetime.datetime.now(datetime.timezone.utc)
    created = (now - datetime.timedelta(seconds=90)).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": NS,
            "labels": {"app.kubernetes.io/name": "kvasir", "app.kubernetes.io/instance": instance},
            "creationTimestamp": created,
        },
        "status": {
            "podIP": ip,
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True" if ready else "False",
                    "lastTransitionTime": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
                }
            ],
        },
    }


def pytest_configure(config: pytest.Config) -> None:
    # Local to these tests: the emulator also serves the Prometheus Operator's ServiceMonitor CRD.
    config.addinivalue_line("markers", "monitoring: the emulated cluster has monitoring.coreos.com")
    config.addinivalue_line(
        "markers", "inference_pools: the emulated cluster has inference.networking.k8s.io"
    )
    config.addinivalue_line(
        "markers", "leader_worker_sets: the emulated cluster has leaderworkerset.x-k8s.io"
    )


@pytest.fixture(scope="session")
def kt() -> Any:
    """This module's constants and helpers (`kt.LLMD`, `kt.llmd(...)`): test modules cannot import
    conftest under pytest's importlib mode, so they receive it as a fixture."""
    return sys.modules[__name__]
