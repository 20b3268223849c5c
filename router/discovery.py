"""Where the backends come from: a static list, or the Ready pods of one LLMDeployment.

The Kubernetes source lists the deployment's pods (the operator's selector labels) with the pod's
service account, in-cluster: Ready and not terminating pods with an IP become
`http://<podIP>:<port>`. It lists every `discovery_interval` seconds; a failed listing keeps the
last known backends (an API server hiccup must not empty the router)."""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import quote

import aiohttp

from kvasir.operator import naming
from kvasir.operator.autoscaler.pods import pod_view

logger = logging.getLogger(__name__)

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")


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
        if namespace is None:
            namespace_file = SERVICE_ACCOUNT / "namespace"
            if not namespace_file.exists():
                raise ValueError("--namespace is needed outside a pod (no service account namespace file)")
            namespace = namespace_file.read_text().strip()
        if api_url is None:
            host, api_port = (
                os.environ.get("KUBERNETES_SERVICE_HOST"),
                os.environ.get("KUBERNETES_SERVICE_PORT"),
            )
            if not host or not api_port:
                raise ValueError(
                    "--deployment needs the Kubernetes API: run in a pod (KUBERNETES_SERVICE_HOST)"
                )
            api_url = f"https://[{host}]:{api_port}" if ":" in host else f"https://{host}:{api_port}"
        selector = ",".join(f"{k}={v}" for k, v in naming.selector_labels(name).items())
        self._url = f"{api_url}/api/v1/namespaces/{quote(namespace)}/pods?labelSelector={quote(selector)}"
        self._token_file = token_file
        self._ssl: ssl.SSLContext | bool = (
            ssl.create_default_context(cafile=str(ca_file)) if ca_file and ca_file.exists() else True
        )

    async def backends(self) -> Sequence[str] | None:
        headers = {}
        if self._token_file.exists():  # re-read each time: projected tokens rotate
            headers["Authorization"] = f"Bearer {self._token_file.read_text().strip()}"
        try:
            async with self._session.get(
                self._url, headers=headers, ssl=self._ssl, timeout=aiohttp.ClientTimeout(total=10)
            ) as response:
                if response.status != 200:
                    logger.warning("listing pods: %s %s", response.status, (await response.text())[:200])
                    return None
                return ready_pod_urls(await response.json(), self._port)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            logger.warning("listing pods failed: %s", exc)
            return None
