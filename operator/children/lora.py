"""Pure builders for LoRA adapters in the pods: the ConfigMap `<name>-lora` holding the declared
set, and what the pod template gains with `spec.lora` (flags, the ConfigMap's volume, one
read-only volume per claim adapters live on).

The template depends on the adapters only through the claims and the largest rank (rounded up to
a slot size), never on the list itself: adding or removing an adapter on a claim already mounted
changes only the ConfigMap, so no pod restarts. The runtime reads the mounted file at start
(`--lora-modules-file`) and turns ready only when every adapter in it is loaded; the operator
loads and unloads adapters on the pods already running (operator/lora_sync.py)."""

from __future__ import annotations

import json
from typing import Any

from kvasir.operator import naming
from kvasir.operator.api.lora import CLAIMS_DIR, LORA_ROOT, LoraAdapter, claims, slot_rank
from kvasir.operator.api.spec import LLMDeploymentSpec

MODULES_DIR = "/etc/kvasir/lora"
MODULES_KEY = "adapters.json"
MODULES_FILE = f"{MODULES_DIR}/{MODULES_KEY}"
ALIASES_KEY = "aliases.json"


def lora_config_map_name(name: str) -> str:
    return f"{name}-lora"


def lora_enabled(spec: LLMDeploymentSpec) -> bool:
    return bool(spec.lora)


def modules_json(adapters: tuple[LoraAdapter, ...]) -> str:
    """The declared set as the runtime's --lora-modules-file reads it: a JSON list of
    `{"name", "path"}` objects (vLLM's --lora-modules JSON items), paths inside the pod or
    hf://ORG/NAME as declared (with `revision` when one is)."""
    return json.dumps([adapter_item(adapter) for adapter in adapters], indent=1) + "\n"


def adapter_item(adapter: LoraAdapter) -> dict[str, str]:
    """One adapter as the runtime takes it: a --lora-modules JSON item, and (as lora_name,
    lora_path, revision) the body of POST /v1/load_lora_adapter."""
    item = {"name": adapter.name, "path": adapter.pod_path}
    if adapter.revision is not None:
        item["revision"] = adapter.revision
    return item


def aliases_json(spec: LLMDeploymentSpec) -> str:
    """spec.loraAliases as the router's --lora-aliases reads it: {alias: {adapter: weight}}."""
    aliases = {
        alias.name: {target.adapter: target.weight for target in alias.targets} for alias in spec.lora_aliases
    }
    return json.dumps(aliases, separators=(",", ":"), sort_keys=True)


def build_lora_config_map(name: str, namespace: str, spec: LLMDeploymentSpec) -> dict[str, Any]:
    """The ConfigMap the pods mount: the adapters to load before turning ready."""
    labels = naming.common_labels(name, spec.runtime.image)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": lora_config_map_name(name), "namespace": namespace, "labels": labels},
        "data": {MODULES_KEY: modules_json(spec.lora), ALIASES_KEY: aliases_json(spec) + "\n"},
    }


def lora_args(spec: LLMDeploymentSpec) -> list[str]:
    """The `kvasir serve` flags of spec.lora (none without adapters)."""
    if not lora_enabled(spec):
        return []
    return [
        "--enable-lora",
        "--max-loras",
        str(spec.runtime.max_loras),
        "--max-lora-rank",
        str(slot_rank(spec.lora)),
        "--lora-root",
        LORA_ROOT,
        "--lora-modules-file",
        MODULES_FILE,
    ]


def lora_volumes(name: str, spec: LLMDeploymentSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, volumeMounts): the ConfigMap, and each claim read-only under the adapter root
    (the container runtime makes the mount points, read-only root filesystem or not)."""
    if not lora_enabled(spec):
        return [], []
    config_map = {"name": lora_config_map_name(name), "items": [{"key": MODULES_KEY, "path": MODULES_KEY}]}
    volumes: list[dict[str, Any]] = [{"name": "lora-modules", "configMap": config_map}]
    mounts: list[dict[str, Any]] = [{"name": "lora-modules", "mountPath": MODULES_DIR, "readOnly": True}]
    for index, claim in enumerate(claims(spec.lora)):
        volume = f"lora-claim-{index}"
        volumes.append({"name": volume, "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
        mounts.append({"name": volume, "mountPath": f"{CLAIMS_DIR}/{claim}", "readOnly": True})
    return volumes, mounts
