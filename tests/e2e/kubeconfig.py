"""Kubeconfig files for the end-to-end tests: read the access a kubeconfig grants (server, CA, token
or client certificate) for clients that are not kubectl, and write token kubeconfigs."""

from __future__ import annotations

import base64
import os
import ssl
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml


@dataclass(frozen=True)
class Access:
    """What one kubeconfig context grants: where the API server is, how to trust it, who we are."""

    server: str
    ca_pem: bytes | None
    insecure: bool
    token: str | None
    client_cert_pem: bytes | None
    client_key_pem: bytes | None

    def ssl_context(self) -> ssl.SSLContext:
        """A TLS context that trusts the cluster's CA and presents the client certificate, if any."""
        context = ssl.create_default_context(cadata=self.ca_pem.decode() if self.ca_pem else None)
        if self.insecure:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        if self.client_cert_pem and self.client_key_pem:
            # The ssl module loads a certificate chain only from files.
            with tempfile.TemporaryDirectory() as scratch:
                cert, key = Path(scratch, "client.crt"), Path(scratch, "client.key")
                cert.write_bytes(self.client_cert_pem)
                key.write_bytes(self.client_key_pem)
                context.load_cert_chain(cert, key)
        return context

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}


def _named(config: dict[str, Any], section: str, name: str) -> dict[str, Any]:
    for entry in config.get(section) or []:
        if entry.get("name") == name:
            return dict(entry.get(section[:-1]) or {})
    raise ValueError(f"kubeconfig has no {section[:-1]} named {name!r}")


def _data(entry: dict[str, Any], key: str, base: Path) -> bytes | None:
    """`key-data` (base64) or `key` (a file, relative to the kubeconfig's folder), as kubectl reads them."""
    if entry.get(f"{key}-data"):
        return base64.b64decode(entry[f"{key}-data"])
    if entry.get(key):
        return (base / os.path.expanduser(entry[key])).read_bytes()
    return None


def read_access(kubeconfig: Path) -> Access:
    """The access of the current context of `kubeconfig`; exec plugins and auth providers are refused
    (they need credentials this suite does not handle)."""
    config = yaml.safe_load(kubeconfig.read_text()) or {}
    context = _named(config, "contexts", config.get("current-context") or "")
    cluster = _named(config, "clusters", context["cluster"])
    user = _named(config, "users", context["user"])
    if "exec" in user or "auth-provider" in user:
        raise ValueError(f"{kubeconfig}: exec plugins and auth providers are not supported here")
    base = kubeconfig.resolve().parent
    token = user.get("token")
    if not token and user.get("tokenFile"):
        token = (base / user["tokenFile"]).read_text().strip()
    return Access(
        server=str(cluster["server"]).rstrip("/"),
        ca_pem=_data(cluster, "certificate-authority", base),
        insecure=bool(cluster.get("insecure-skip-tls-verify")),
        token=token,
        client_cert_pem=_data(user, "client-certificate", base),
        client_key_pem=_data(user, "client-key", base),
    )


def write_token_kubeconfig(path: Path, access: Access, token: str, user: str) -> Path:
    """Write a single-context kubeconfig for `access`'s cluster that authenticates with `token`."""
    cluster: dict[str, Any] = {"server": access.server}
    if access.ca_pem:
        cluster["certificate-authority-data"] = base64.b64encode(access.ca_pem).decode()
    if access.insecure:
        cluster["insecure-skip-tls-verify"] = True
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "e2e", "cluster": cluster}],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": user, "context": {"cluster": "e2e", "user": user}}],
        "current-context": user,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    path.chmod(0o600)  # it holds a credential
    return path
