"""The router's access to the Kubernetes API, in-cluster: the API server's address, the pod's
service-account token (re-read for every call: projected tokens rotate) and the cluster's CA.

Shared by the pod listing (discovery.py) and the scale-from-zero activation (scale.py)."""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass
from pathlib import Path

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")


@dataclass(frozen=True)
class KubeApi:
    url: str  # https://host:port, no trailing slash
    namespace: str
    token_file: Path
    ssl: ssl.SSLContext | bool

    @classmethod
    def in_cluster(
        cls,
        namespace: str | None,
        *,
        api_url: str | None = None,
        token_file: Path = SERVICE_ACCOUNT / "token",
        ca_file: Path | None = SERVICE_ACCOUNT / "ca.crt",
    ) -> KubeApi:
        """The API as the pod sees it; `namespace` None: the pod's own. ValueError outside a pod
        unless `api_url` and `namespace` are given."""
        if namespace is None:
            namespace_file = SERVICE_ACCOUNT / "namespace"
            if not namespace_file.exists():
                raise ValueError("--namespace is needed outside a pod (no service account namespace file)")
            namespace = namespace_file.read_text().strip()
        if api_url is None:
            host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT")
            if not host or not port:
                raise ValueError(
                    "--deployment needs the Kubernetes API: run in a pod (KUBERNETES_SERVICE_HOST)"
                )
            api_url = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
        context: ssl.SSLContext | bool = (
            ssl.create_default_context(cafile=str(ca_file)) if ca_file and ca_file.exists() else True
        )
        return cls(api_url.rstrip("/"), namespace, token_file, context)

    def headers(self) -> dict[str, str]:
        """The Authorization header with the current token (none when the pod has no token)."""
        if not self.token_file.exists():
            return {}
        return {"Authorization": f"Bearer {self.token_file.read_text().strip()}"}
