"""Scale from zero through the LLMDeployment's scale subresource (issue 38): the router reads the
scale, writes replicas 1 only when it read 0 and only over the version it read, and a router
holding a request wakes a deployment at zero and sends the request to its first pod. Against a
stand-in API server on a real socket (tests/router/fake_api.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import aiohttp
import httpx
import pytest

from kvasir.router.config import RouterConfig
from kvasir.router.discovery import KubernetesPods
from kvasir.router.kube import KubeApi
from kvasir.router.scale import Activation, ScaleFromZero
from kvasir.router.server import RouterApp
from tests.router.fake_api import PODS, SCALE, FakeApi
from tests.router.stub_backend import TIMEOUT, StubBackend, serve_app


def _wait(condition: Callable[[], object], timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def _activate(api: FakeApi, tmp_path: Path) -> Activation:
    token = tmp_path / "token"
    token.write_text("tok\n")
    with serve_app(api) as server:

        async def ask() -> Activation:
            async with aiohttp.ClientSession() as session:
                kube = KubeApi(server.url, "team-a", token, False)
                return await ScaleFromZero(session, kube, "demo").activate()

        return asyncio.run(ask())


def test_at_zero_the_router_reads_the_scale_then_patches_it_over_the_version_it_read(tmp_path: Path) -> None:
    api = FakeApi(replicas=0, version=7)
    assert _activate(api, tmp_path) is Activation.SCALED
    assert api.seen == [
        ("GET", SCALE, None),
        ("PATCH", SCALE, {"metadata": {"resourceVersion": "7"}, "spec": {"replicas": 1}}),
    ]
    assert api.replicas == 1


def test_a_deployment_not_at_zero_is_left_alone(tmp_path: Path) -> None:
    api = FakeApi(replicas=2)
    assert _activate(api, tmp_path) is Activation.NOT_AT_ZERO
    assert [method for method, _, _ in api.seen] == ["GET"]
    assert api.replicas == 2


def test_a_concurrent_writer_wins(tmp_path: Path) -> None:
    """Someone scales to 3 between the router's read and its write: the API server's 409 leaves
    their 3 in place."""
    api = FakeApi(replicas=0, conflict_next_patch=True)
    assert _activate(api, tmp_path) is Activation.CONFLICT
    assert api.replicas == 3


def test_a_router_without_the_scale_permission_is_told_so(tmp_path: Path) -> None:
    api = FakeApi(replicas=0, forbidden=True)
    assert _activate(api, tmp_path) is Activation.FORBIDDEN
    assert [method for method, _, _ in api.seen] == ["GET"]


def test_an_unreachable_api_is_a_failed_activation_not_an_error(tmp_path: Path) -> None:
    async def ask() -> Activation:
        async with aiohttp.ClientSession() as session:
            kube = KubeApi("http://127.0.0.1:9", "team-a", tmp_path / "none", False)
            return await ScaleFromZero(session, kube, "demo").activate()

    assert asyncio.run(ask()) is Activation.FAILED


def _router(api_url: str, backend_port: int, tmp_path: Path, **config: object) -> RouterApp:
    settings: dict[str, object] = {
        "deployment": "demo",
        "namespace": "team-a",
        "backend_port": backend_port,
        "discovery_interval": 60,  # only the hold's own listings (every 0.5 s) find the pod
        **config,
    }

    def discovery(session: aiohttp.ClientSession) -> KubernetesPods:
        return KubernetesPods(
            session,
            "demo",
            "team-a",
            backend_port,
            api_url=api_url,
            token_file=tmp_path / "none",
            ca_file=None,
        )

    return RouterApp(RouterConfig(**settings), discovery)  # type: ignore[arg-type]


def test_a_held_request_wakes_the_deployment_and_goes_to_its_first_pod(tmp_path: Path) -> None:
    stub, api = StubBackend("pod"), FakeApi(replicas=0)
    with serve_app(stub) as backend, serve_app(api) as server:
        app = _router(server.url, int(backend.url.rsplit(":", 1)[1]), tmp_path)
        with serve_app(app, lifespan="on", kill=False) as router, ThreadPoolExecutor(1) as threads:
            # No pod, yet ready: the router must stay in its Service to receive the waking request.
            assert httpx.get(f"{router.url}/ready", timeout=TIMEOUT).status_code == 200
            assert not [m for m, path, _ in api.seen if path == SCALE]  # nothing asked before a request
            held = threads.submit(
                httpx.post,
                f"{router.url}/v1/completions",
                json={"model": "m", "prompt": "x"},
                timeout=TIMEOUT,
            )
            _wait(lambda: api.replicas == 1)
            calls = [method for method, path, _ in api.seen if path == SCALE]
            assert calls == ["GET", "PATCH"]
            assert app.hold is not None and len(app.hold) == 1 and not held.done()
            api.pods_start.set()  # the pod turns Ready
            reply = held.result(TIMEOUT)
            assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == "pod"
            metrics = httpx.get(f"{router.url}/metrics", timeout=TIMEOUT).text
            assert "kvasir_router_activations_total 1.0" in metrics
            assert 'kvasir_router_held_total{outcome="released"} 1.0' in metrics
            assert [path for _, path, _ in api.seen].count(SCALE) == 2  # asked once: a replica came
            assert PODS in [path for _, path, _ in api.seen]


@pytest.mark.parametrize("max_held, ready", [(100, 200), (0, 503)])
def test_the_routers_readiness_at_zero_pods(tmp_path: Path, max_held: int, ready: int) -> None:
    """Holding: ready at zero pods (it takes requests and wakes the model); not holding: not ready
    (as before: it could only answer 503)."""
    api = FakeApi(replicas=0)
    with serve_app(api) as server:
        app = _router(server.url, 8000, tmp_path, max_held_requests=max_held)
        with serve_app(app, lifespan="on", kill=False) as router:
            assert httpx.get(f"{router.url}/ready", timeout=TIMEOUT).status_code == ready
            assert httpx.get(f"{router.url}/health", timeout=TIMEOUT).status_code == 200
