"""Keeping the LoRA adapters of spec.lora loaded on every ready pod, without restarting any.

Each reconcile (a spec change, a pod turning ready, the resync) asks every ready pod, concurrently
and each within a timeout, what it serves (`GET /v1/models`: the adapters are the cards with a
`parent`), then loads what is declared and missing (`POST /v1/load_lora_adapter`) and unloads what
is loaded and no longer declared (`POST /v1/unload_lora_adapter`), with the API key of
spec.server.apiKeySecretRef. A pod that is slow, unreachable or refuses never holds up the others,
and a second run finds nothing to do (idempotent). What each pod then serves gives status.lora."""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kvasir.operator import naming
from kvasir.operator.api.lora import LoraAdapter
from kvasir.operator.api.spec import LLMDeploymentSpec
from kvasir.operator.autoscaler.pods import pod_view
from kvasir.operator.children.lora import adapter_item
from kvasir.operator.kube import KubeClient, resource_path

MAX_MESSAGE_CHARS = 300


@dataclass(frozen=True)
class Plan:
    """What one pod needs: adapters to load (replacing those whose directory changed) and unload."""

    load: tuple[LoraAdapter, ...] = ()
    replace: tuple[LoraAdapter, ...] = ()
    unload: tuple[str, ...] = ()


def plan(declared: Sequence[LoraAdapter], loaded: Mapping[str, str]) -> Plan:
    """`loaded` maps each adapter a pod serves to its card's `root` (the directory's last part, or a
    hub adapter's `org/name[@revision]`): a different one means the declared source changed."""
    wanted = {adapter.name for adapter in declared}
    load = tuple(adapter for adapter in declared if adapter.name not in loaded)
    replace = tuple(
        adapter
        for adapter in declared
        if adapter.name in loaded and loaded[adapter.name] != adapter.served_root
    )
    unload = tuple(sorted(name for name in loaded if name not in wanted))
    return Plan(load, replace, unload)


@dataclass
class PodResult:
    """One pod after a sync: the adapters it serves (None: it could not be asked) and what failed."""

    pod: str
    serving: set[str] | None = None
    failures: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class LoraReport:
    """The deployment's adapters across its ready pods."""

    ready_replicas: dict[str, int]  # adapter -> ready pods serving it
    failures: tuple[str, ...]  # "adapter x on pod p: <the runtime's message>"
    unreachable: tuple[str, ...]  # ready pods whose /v1/models did not answer

    def status(self, declared: Iterable[LoraAdapter]) -> list[dict[str, Any]]:
        """status.lora: each declared adapter with its ready replicas."""
        return [{"name": a.name, "readyReplicas": self.ready_replicas.get(a.name, 0)} for a in declared]


def _pod_port(pod: Mapping[str, Any]) -> int:
    """The runtime's port as the pod declares it (its `http` container port)."""
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == naming.RUNTIME_PORT_NAME and port.get("containerPort"):
                return int(port["containerPort"])
    return naming.RUNTIME_PORT


async def read_api_key(client: KubeClient, namespace: str, spec: LLMDeploymentSpec) -> str | None:
    """The API key the pods require (spec.server.apiKeySecretRef), or None."""
    ref = spec.server.api_key_secret
    if ref is None:
        return None
    secret = await client.get(resource_path("", "v1", "secrets", namespace, ref.name)) or {}
    if ref.key in (secret.get("stringData") or {}):
        return str(secret["stringData"][ref.key])
    try:
        return base64.b64decode((secret.get("data") or {}).get(ref.key) or "").decode()
    except (binascii.Error, UnicodeDecodeError):
        return None


def _message(status: int, text: str) -> str:
    """The runtime's error message (OpenAI shape) or the answer's text, shortened."""
    try:
        message = json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = text
    return f"{status}: {str(message).strip()[:MAX_MESSAGE_CHARS]}"


class LoraSync:
    """Brings every ready pod to the declared adapter set; `sync` is one pass over one deployment."""

    def __init__(self, *, timeout: float = 10.0, load_timeout: float = 120.0, concurrency: int = 8) -> None:
        self.timeout = timeout  # /v1/models and unloads (an unload waits for requests in flight)
        self.load_timeout = load_timeout  # a load reads and checks the adapter's files
        self.concurrency = concurrency  # pods worked on at once

    async def sync(
        self, adapters: Sequence[LoraAdapter], pods: Sequence[Mapping[str, Any]], api_key: str | None
    ) -> LoraReport:
        # A group's workers hold no adapters of their own: the leader loads them for its group.
        ready = [pod for pod in pods if (view := pod_view(pod)).ready and view.ip and view.serves]
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        limit = asyncio.Semaphore(self.concurrency)
        async with aiohttp.ClientSession(headers=headers) as session:

            async def one(pod: Mapping[str, Any]) -> PodResult:
                async with limit:
                    return await self._sync_pod(session, pod, adapters)

            results = await asyncio.gather(*(one(pod) for pod in ready))
        counts: dict[str, int] = {}
        for result in results:
            for adapter in result.serving or ():
                counts[adapter] = counts.get(adapter, 0) + 1
        return LoraReport(
            counts,
            tuple(failure for result in results for failure in result.failures),
            tuple(result.pod for result in results if result.serving is None),
        )

    async def _sync_pod(
        self, session: aiohttp.ClientSession, pod: Mapping[str, Any], adapters: Sequence[LoraAdapter]
    ) -> PodResult:
        view = pod_view(pod)
        result = PodResult(view.name)
        base = f"http://{view.ip}:{_pod_port(pod)}"
        try:
            loaded = await self._loaded(session, base)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            result.failures.append(f"pod {view.name}: /v1/models did not answer ({type(exc).__name__})")
            return result
        todo = plan(adapters, loaded)
        serving = set(loaded)
        for name in todo.unload:
            error = await self._post(
                session, f"{base}/v1/unload_lora_adapter", {"lora_name": name}, self.timeout
            )
            if error is None:
                serving.discard(name)
            else:
                result.failures.append(f"adapter {name} not unloaded from pod {view.name}: {error}")
        for adapter, inplace in [*((a, False) for a in todo.load), *((a, True) for a in todo.replace)]:
            item = adapter_item(adapter)
            body = {
                "lora_name": item.pop("name"),
                "lora_path": item.pop("path"),
                **item,
                "load_inplace": inplace,
            }
            error = await self._post(session, f"{base}/v1/load_lora_adapter", body, self.load_timeout)
            if error is None:
                serving.add(adapter.name)
            else:
                if inplace:
                    serving.discard(adapter.name)  # it serves old files: not the declared adapter
                result.failures.append(f"adapter {adapter.name} failed to load on pod {view.name}: {error}")
        result.serving = serving
        return result

    async def _loaded(self, session: aiohttp.ClientSession, base: str) -> dict[str, str]:
        """The adapters a pod serves, each with its card's `root`."""
        timeout = aiohttp.ClientTimeout(total=self.timeout)
        async with session.get(f"{base}/v1/models", timeout=timeout) as response:
            if response.status != 200:
                raise ValueError(f"/v1/models answered {response.status}")
            cards = (await response.json(content_type=None)).get("data") or []
        return {
            str(card["id"]): str(card.get("root") or "")
            for card in cards
            if isinstance(card, dict) and card.get("parent") and card.get("id")
        }

    async def _post(
        self, session: aiohttp.ClientSession, url: str, body: dict[str, Any], timeout: float
    ) -> str | None:
        """None on success, else why it failed."""
        try:
            async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=timeout)) as response:
                if response.status == 200:
                    return None
                return _message(response.status, await response.text())
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            return f"no answer ({type(exc).__name__})"
