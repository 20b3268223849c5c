"""What a Kvasir pod's first container becomes as a local process: which Kvasir command it runs
(`serve` or `operator`), its argument list adapted to a loopback "pod", and its environment resolved
as a kubelet resolves it (literal values, field references, Secret and ConfigMap keys)."""

from __future__ import annotations

import base64
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

# Reads one object (kind "secrets" or "configmaps", name) of the pod's namespace; None if absent.
Reader = Callable[[str, str], Awaitable[dict[str, Any] | None]]

# Variables of the test run that must not leak into a "pod": above all the admin KUBECONFIG.
NOT_INHERITED = ("KUBECONFIG", "KUBEBUILDER_ASSETS")


class ConfigError(Exception):
    """The container cannot be configured (a kubelet's CreateContainerConfigError); the message is
    the kubelet's."""


def kvasir_role(pod: dict[str, Any]) -> str | None:
    """`serve` for the runtime's pods (command kvasir, args serve ...), `operator` for the chart's
    operator pods (the image's entrypoint is kvasir; args operator ...); None for anything else."""
    containers = pod["spec"].get("containers") or []
    if not containers:
        return None
    command, args = containers[0].get("command"), containers[0].get("args") or []
    if command == ["kvasir"] and args[:1] == ["serve"]:
        return "serve"
    if command in (None, ["kvasir"]) and args[:1] == ["operator"]:
        return "operator"
    return None


def kvasir_executable() -> list[str]:
    """This environment's `kvasir` (the console script beside the running Python)."""
    script = Path(sys.executable).with_name("kvasir")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "kvasir.cli"]


def _with_embedded_model(args: list[str]) -> list[str]:
    """Hub ids cannot be downloaded here: the bundled model stands in for whatever the pod names."""
    out: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
            continue
        if arg == "--model":
            out += ["--model", "embedded"]
            skip = True
        elif arg.startswith("--model="):
            out.append("--model=embedded")
        else:
            out.append(arg)
    return out


def command_for(role: str, container: dict[str, Any], ip: str) -> list[str]:
    """The process's argument list: the container's args, listening on the pod's address only."""
    args = list(container.get("args") or [])
    if role == "serve":
        return [*kvasir_executable(), *_with_embedded_model(args), "--host", ip]
    return [*kvasir_executable(), *args, f"--http-host={ip}"]


def _field(pod: dict[str, Any], path: str, ip: str) -> str:
    metadata, spec = pod["metadata"], pod["spec"]
    values = {
        "metadata.name": metadata["name"],
        "metadata.namespace": metadata["namespace"],
        "metadata.uid": metadata.get("uid", ""),
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", "default"),
        "status.podIP": ip,
        "status.podIPs": ip,
    }
    if path in values:
        return str(values[path])
    for prefix, source in (("metadata.labels", "labels"), ("metadata.annotations", "annotations")):
        if path.startswith(f"{prefix}['") and path.endswith("']"):
            return str((metadata.get(source) or {}).get(path[len(prefix) + 2 : -2], ""))
    raise ConfigError(f"unsupported fieldRef {path!r}")


async def _key(read: Reader, namespace: str, kind: str, ref: dict[str, Any]) -> str | None:
    """A key of a Secret or ConfigMap, or None where the reference is optional and missing."""
    label = "secret" if kind == "secrets" else "configmap"
    title = "Secret" if kind == "secrets" else "ConfigMap"
    name, key, optional = ref.get("name", ""), ref["key"], bool(ref.get("optional"))
    obj = await read(kind, name)
    if obj is None:
        if optional:
            return None
        raise ConfigError(f'{label} "{name}" not found')
    if kind == "secrets":
        data = {k: base64.b64decode(v).decode() for k, v in (obj.get("data") or {}).items()}
    else:
        data = dict(obj.get("data") or {})
    if key not in data:
        if optional:
            return None
        raise ConfigError(f"couldn't find key {key} in {title} {namespace}/{name}")
    return str(data[key])


async def resolve_env(
    pod: dict[str, Any], container: dict[str, Any], ip: str, read: Reader
) -> dict[str, str]:
    """The environment of the container's process: this run's environment (less the admin's
    credentials) plus the container's `env`. `$(VAR)` references and `envFrom` are not expanded
    (no Kvasir manifest uses them). ConfigError as a kubelet reports it for a missing Secret/key."""
    env = {name: value for name, value in os.environ.items() if name not in NOT_INHERITED}
    namespace = pod["metadata"]["namespace"]
    for entry in container.get("env") or []:
        name, source = entry["name"], entry.get("valueFrom")
        value: str | None
        if source is None:
            value = str(entry.get("value", ""))
        elif "fieldRef" in source:
            value = _field(pod, source["fieldRef"]["fieldPath"], ip)
        elif "secretKeyRef" in source:
            value = await _key(read, namespace, "secrets", source["secretKeyRef"])
        elif "configMapKeyRef" in source:
            value = await _key(read, namespace, "configmaps", source["configMapKeyRef"])
        else:
            value = None  # resourceFieldRef: no Kvasir manifest uses it
        if value is not None:
            env[name] = value
    return env
