"""Backends from the Kubernetes API: the Ready, non-terminating pods of one LLMDeployment, read
from a stand-in API server on a real socket."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import aiohttp

from kvasir.router.discovery import KubernetesPods, ready_pod_urls
from tests.router.stub_backend import serve_app


def _pod(name: str, ip: str | None, ready: bool, deleting: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "creationTimestamp": "2026-01-01T00:00:00Z"}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:01:00Z"
    status: dict[str, Any] = {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    if ip:
        status["podIP"] = ip
    return {"metadata": meta, "status": status}


PODS = {
    "kind": "PodList",
    "items": [
        _pod("ready", "10.0.0.2", True),
        _pod("starting", "10.0.0.3", False),
        _pod("terminating", "10.0.0.4", True, deleting=True),
        _pod("no-ip", None, True),
        _pod("v6", "fd00::5", True),
    ],
}


def test_only_ready_running_pods_with_an_ip_are_backends() -> None:
    assert ready_pod_urls(PODS, 8000) == ["http://10.0.0.2:8000", "http://[fd00::5]:8000"]


def test_a_groups_workers_are_never_backends() -> None:
    """A multi-node group is one replica: only its leader (worker-index 0) serves."""
    leader, worker = _pod("big-0", "10.0.1.1", True), _pod("big-0-1", "10.0.1.2", True)
    leader["metadata"]["labels"] = {"leaderworkerset.sigs.k8s.io/worker-index": "0"}
    worker["metadata"]["labels"] = {"leaderworkerset.sigs.k8s.io/worker-index": "1"}
    assert ready_pod_urls({"items": [leader, worker]}, 8000) == ["http://10.0.1.1:8000"]


class _ApiServer:
    def __init__(self) -> None:
        self.seen: list[tuple[str, str, str]] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        self.seen.append((scope["path"], scope["query_string"].decode(), headers.get("authorization", "")))
        body = json.dumps(PODS).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": body})


def test_the_pods_are_listed_with_the_deployments_selector_and_the_service_account_token(
    tmp_path: Path,
) -> None:
    token = tmp_path / "token"
    token.write_text("tok-1\n")
    api = _ApiServer()
    with serve_app(api) as server:

        async def listing() -> Any:
            async with aiohttp.ClientSession() as session:
                pods = KubernetesPods(
                    session, "demo", "team-a", 8000, api_url=server.url, token_file=token, ca_file=None
                )
                return await pods.backends()

        assert asyncio.run(listing()) == ["http://10.0.0.2:8000", "http://[fd00::5]:8000"]
    path, query, auth = api.seen[0]
    assert path == "/api/v1/namespaces/team-a/pods"
    assert parse_qs(query) == {
        "labelSelector": ["app.kubernetes.io/name=kvasir,app.kubernetes.io/instance=demo"]
    }
    assert auth == "Bearer tok-1"


def test_a_failed_listing_keeps_the_last_backends(tmp_path: Path) -> None:
    async def listing() -> Any:
        async with aiohttp.ClientSession() as session:
            pods = KubernetesPods(
                session,
                "demo",
                "team-a",
                8000,
                api_url="http://127.0.0.1:9",
                token_file=tmp_path / "none",
                ca_file=None,
            )
            return await pods.backends()

    assert asyncio.run(listing()) is None  # None: the router keeps what it had
