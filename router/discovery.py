"""Where the backends come from: a static list, or the Ready pods of one LLMDeployment.

The Kubernetes source lists the deployment's pods (the operator's selector labels) with the pod's
service account, in-cluster: Ready and not terminating pods with an IP become
`http://<podIP>:<port>`. It lists every `discovery_interval` seconds; a failed listing keeps the
last known backends (an API server hiccup must not empty the router)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import quote

import aiohttp

from kvasir.operator import naming
from kvasir.operator.autoscaler.pods import pod_view
from kvasir.router.kube import SERVICE_ACCOUNT, KubeApi

logger = logging.getLogger(__name__)


class Discovery(Protocol):
    async def backends(self) -> Sequence[str] | None:
        """The backends now, or None when they cannot be known this time (keep the last ones)."""
        ...


class StaticBackends:
    def __init__(self, urls: Sequence[str]) -> None:
        self._urls = list(urls)

    async def backends(self) -> Sequence[str]:
        return self._urls


def ready_pod_urls(pod_list: dict[str, Any], port: int) -> list[str]:
    """`http://IP:port` of each Ready, non-terminating pod with an IP in a PodList that serves
    requests (a Deployment's pod or a group's leader)."""
    urls = []
    for pod in pod_list.get("items") or []:
        view = pod_view(pod)
        # A multi-node group's workers serve nothing: only its leader is a backend.
        if view.ready and not view.deleting and view.ip and view.serves:
            host = f"[{view.ip}]" if ":" in view.ip else view.ip
            urls.append(f"http://{host}:{port}")
    return sorted(urls)


class KubernetesPods:
    """The Ready pods of LLMDeployment `name` in `namespace`, from the API server."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        name: str,
        namespace: str | None,
        port: int,
        *,
        api_url: str | None = None,
        token_file: Path = SERVICE_ACCOUNT / "token",
        ca_file: Path | None = SERVICE_ACCOUNT / "ca.crt",
    ) -> None:
        self._session = session
        self._port = port
        self.api = KubeApi.in_cluster(namespace, api_url=api_url, token_file=token_file, ca_file=ca_file)
        selector = ",".join(f"{k}={v}" for k, v in naming.selector_labels(name).items())
        self._url = f"{self.api.url}/api/v1/namespaces/{quote(self.api.namespace)}/pods?labelSelector={quote(selector)}"

    async def backends(self) -> Sequence[str] | None:
        try:
            async with self._session.get(
                self._url,
                headers=self.api.headers(),
                ssl=self.api.ssl,
                timeout=aiohttp.ClientTimeout(total=10),
            ) as response:
                if response.status != 200:
                    logger.warning("listing pods: %s %s", response.status, (await response.text())[:200])
                    return None
                return ready_pod_urls(await response.json(), self._port)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            logger.warning("listing pods failed: %s", exc)
            return None
